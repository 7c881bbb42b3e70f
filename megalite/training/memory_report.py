"""Start-up memory report: the planner's prediction for this exact layout next to the peak
measured in the first steps.

Why: a layout that the planner says fits but that measures 30% more is a bug in one of the
two, and it is cheapest to see at the start.  The prediction is
``planner.step_peak.predict_step_peak`` for this run's config and the reporting rank (its
ZeRO stage from the flags: ``--use-distributed-optimizer`` 1, with ``--overlap-grad-reduce``
2, ``--use-torch-fsdp2`` 3): weights, gradients and optimizer states live at the step's
peak, the activations, and the peak phase's temporaries.

The measured peak is per step: on CPU the peak of live tensor bytes from torch's allocator
(``training.tensor_memory_meter``, started before the model is built, stopped after the
report), on CUDA the allocator's ``max_memory_allocated``.  The report follows the second
step (or the first, if the run has one): the first step has no optimizer state until its
end, and a ZeRO-2 run's first step reduces every bucket after backward; both step peaks are
in the record.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Optional

import torch

from megalite.planner.step_peak import predict_step_peak
from megalite.training.tensor_memory_meter import TensorMemoryMeter

PARTS = ("weights", "grads", "optimizer", "activations", "transient", "total")
METERED_STEPS = 2


def predicted_memory(cfg, rank: int) -> dict:
    """Predicted bytes of ``rank`` at a step's peak: weights, grads, optimizer states,
    activations, the peak phase's temporaries, total; and the phase."""
    pred = predict_step_peak(cfg, rank)
    out = {k: int(pred[k]) for k in PARTS}
    out["peak_phase"] = pred["peak_phase"]
    return out


def memory_record(cfg, rank: int, measured_peak: int, iteration: int,
                  step_peaks: Optional[Dict[int, int]] = None, source: str = "") -> dict:
    """The metrics-file line (``split`` = "memory", so loss readers skip it)."""
    rec = {"split": "memory", "iteration": iteration, "rank": rank,
           "predicted_bytes": predicted_memory(cfg, rank), "measured_peak_bytes": measured_peak,
           "measured_by": source}
    if step_peaks:
        rec["step_peak_bytes"] = {str(k): v for k, v in step_peaks.items()}
    return rec


def format_memory_report(record: dict) -> str:
    p = record["predicted_bytes"]
    mib = 2 ** 20
    parts = " + ".join(f"{k} {p[k] / mib:.1f}" for k in PARTS[:-1])
    measured = record["measured_peak_bytes"]
    ratio = f" (measured / predicted {measured / p['total']:.3f})" if p["total"] else ""
    return (f"> memory (rank {record['rank']}): predicted peak ({p.get('peak_phase', '')}) "
            f"{parts} = {p['total'] / mib:.1f} MiB; measured peak of iteration "
            f"{record['iteration']} ({record.get('measured_by', '')}): {measured / mib:.1f} MiB"
            f"{ratio}")


class MemoryReporter:
    """Measures the peak of the first ``METERED_STEPS`` steps and logs the report once.

    Start it before the model is built (``start``) so that on CPU every live tensor is
    counted; without a start, CPU falls back to the process's resident high-water mark."""

    def __init__(self, device: str):
        self.device = device
        self.meter = None
        self.step_peaks: Dict[int, int] = {}
        self.metered = 0            # steps run under ``step``
        self.done = False

    def start(self) -> "MemoryReporter":
        if self.device == "cpu":
            if not torch.autograd._profiler_enabled():     # a user's profiler wins
                self.meter = TensorMemoryMeter().start()
        return self

    @contextlib.contextmanager
    def step(self, iteration: int):
        if self.done:
            yield
            return
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ctx = self.meter.window(str(iteration)) if self.meter is not None else \
            contextlib.nullcontext()
        with ctx:
            yield
        self.metered += 1
        if self.device == "cuda":
            self.step_peaks[iteration] = int(torch.cuda.max_memory_allocated())

    def after_step(self, logger, cfg, rank: int, iteration: int, last: bool,
                   fallback_peak: int, quiesce=None) -> None:
        """Log the report after the ``METERED_STEPS``-th step (or the last one).

        ``quiesce``: called just before the CPU meter stops, to join the threads that run
        torch ops beside training (an ``--async-save`` write, a peer snapshot): the
        profiler's global state goes away when it stops, and an op recorded on another
        thread at that moment crashes the process (SIGSEGV)."""
        if self.done or not (last or self.metered >= METERED_STEPS):
            return
        source = "cuda allocator" if self.device == "cuda" else "resident high-water mark"
        if self.meter is not None:
            if quiesce is not None:
                quiesce()
            result = self.meter.stop()
            self.meter = None
            self.step_peaks = {int(k): w.peak_bytes for k, w in result.windows.items()}
            source = "tensor meter"
        peak = self.step_peaks.get(iteration, fallback_peak)
        logger.log_memory(memory_record(cfg, rank, peak, iteration, self.step_peaks, source))
        self.done = True

    def close(self, failed: bool = False) -> None:
        """Stop the meter, unread, if the run ended before the report.  After a failure it
        is left to the meter's exit handler: stopping the profiler takes seconds, and every
        rank is being ended -- a peer's SIGTERM must not cut this rank's error report."""
        if self.meter is not None and not failed:
            self.meter.discard()
            self.meter = None
