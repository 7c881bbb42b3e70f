"""Start-up memory report: the planner's prediction for this exact layout next to the peak
measured after the first step.

Why: a layout that the planner says fits but that measures 30% more is a bug in one of the
two, and it is cheapest to see at iteration 1.  The prediction is
``planner.memory.predict_rank_memory`` for this run's config and the reporting rank (its
ZeRO stage from the flags: ``--use-distributed-optimizer`` 1, with ``--overlap-grad-reduce``
2, ``--use-torch-fsdp2`` 3).  The measured peak is the CUDA allocator's, or on CPU the
process's resident high-water mark, which also holds the interpreter and torch (hundreds of
MiB): compare the two on GPU, or compare differences between layouts on CPU
(``benchmarks/dp_memory.py``).
"""
from __future__ import annotations

from megalite.planner.memory import predict_rank_memory

PARTS = ("weights", "grads", "optimizer", "activations", "total")


def predicted_memory(cfg, rank: int) -> dict:
    """Predicted bytes of ``rank``: weights, grads, optimizer states, activations, total."""
    pred = predict_rank_memory(cfg, rank)
    return {k: int(pred[k]) for k in PARTS}


def memory_record(cfg, rank: int, measured_peak: int, iteration: int) -> dict:
    """The metrics-file line (``split`` = "memory", so loss readers skip it)."""
    return {"split": "memory", "iteration": iteration, "rank": rank,
            "predicted_bytes": predicted_memory(cfg, rank), "measured_peak_bytes": measured_peak}


def format_memory_report(record: dict) -> str:
    p = record["predicted_bytes"]
    mib = 2 ** 20
    parts = " + ".join(f"{k} {p[k] / mib:.1f}" for k in PARTS[:-1])
    return (f"> memory (rank {record['rank']}): predicted {parts} = {p['total'] / mib:.1f} MiB; "
            f"measured peak after iteration {record['iteration']}: "
            f"{record['measured_peak_bytes'] / mib:.1f} MiB")
