"""A run's model FLOPs per iteration (no recompute counted, as MFU is defined) and the
peak FLOP/s of its device.

The FLOP model and the GPU datasheet table are the planner's (``megalite.planner.flops``,
``megalite.planner.hardware``: pure Python, no torch), so the planner's predicted MFU and
a run's measured MFU share one definition.  Only the CPU probe lives here: it times torch.
"""
from __future__ import annotations

import time

import torch

from megalite.planner.flops import forward_flops_per_token
from megalite.planner.hardware import UNKNOWN_GPU, datasheet_peak_flops


def flops_per_token(cfg) -> float:
    """Training FLOPs per token: 3 x forward (backward = 2 x forward), GQA/SwiGLU/MoE aware,
    with the output layer at the vocabulary padded for this run's TP."""
    m = cfg.model
    return 3.0 * forward_flops_per_token(m, m.seq_length, cfg.padded_vocab_size)


def flops_per_iteration(cfg) -> float:
    return flops_per_token(cfg) * cfg.training.global_batch_size * cfg.model.seq_length


_CPU_PEAK = None


def device_peak_flops(device: str) -> tuple[float, str]:
    """(peak FLOP/s, where the number comes from) for one device of this run."""
    global _CPU_PEAK

    if device == "cuda":
        peak, key = datasheet_peak_flops(torch.cuda.get_device_name())
        return peak, (f"{key} bf16 datasheet" if key else f"unknown GPU, {UNKNOWN_GPU} assumed")
    if _CPU_PEAK is None:  # fp32 GEMMs timed on this process's threads: the best of 5 probes
        a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))  # global RNG untouched
        torch.mm(a, a)
        reps, best = 10, float("inf")
        for _ in range(5):      # a probe run while the machine is busy must not set the peak
            t0 = time.perf_counter()
            for _ in range(reps):
                torch.mm(a, a)
            best = min(best, time.perf_counter() - t0)
        _CPU_PEAK = reps * 2 * 512 ** 3 / best
    return _CPU_PEAK, "measured fp32 GEMM, best of 5"


def model_flops_utilization(achieved_per_device: float, peak: float) -> float:
    """MFU in [0, 1]: a measured peak below what a step achieved (a probe slowed by a busy
    machine) is no peak, so the figure is capped at 100%."""
    return min(achieved_per_device / peak, 1.0) if peak > 0 else 0.0
