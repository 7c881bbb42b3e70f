"""The cost model's calibrated constants, the published rows each was fitted on, and the
procedure that fits them (so the fit is reproducible and checked by a test).

Rule (issue 29): an efficiency constant is fitted on at most a third of the published rows
(planner/published_runs.py); every other row is held out, and benchmarks/
planner_vs_published.py reports the error on the two groups separately.  Everything else
in the model is a datasheet figure, a measured kernel ceiling (hardware.py, kernels.py) or
a count.  ``published.fit_constants()`` refits them (tests/unit/test_planner_published.py
checks it returns the values written here).
"""
from __future__ import annotations

# Fraction of the measured kernel ceilings (matmul MAMF, attention kernels) a whole
# training step sustains: clocks under a full node's power draw, launch gaps, L2 and HBM
# contention between overlapping kernels, and the kernel libraries of the run's time (the
# ceilings were measured with 2025 software).  One per GPU generation; H200 and B200 use
# H100's.
SUSTAINED_A100 = 0.7733
SUSTAINED_H100 = 0.8059
# HBM passes over a layer's saved activations per forward + backward for memory-bound
# work (norms, activation functions, residual adds, RoPE, dropout, softmax without flash):
# with fused kernels, and with eager PyTorch (one kernel per elementwise op).
FUSED_PASSES = 4.959
EAGER_PASSES = 12.56
# torchtitan's H100s run at a 500 W power limit (its benchmark page): their sustained clock
# relative to the 700 W parts the kernel tables were measured on.
H100_500W_CLOCK = 0.8128

# Which published rows (planner/published_runs.py) fit which constant, in fitting order.
# 5 of the 28 rows; every other row is held out.  The A100 pair fits two constants
# together (the small model weighs the memory-bound passes, the large one the GEMMs).
CALIBRATION_ROWS = {
    ("SUSTAINED_A100", "FUSED_PASSES"): ("gpt-1t", "gpt-1.7b"),
    ("SUSTAINED_H100",): ("bridge-llama3-70b",),
    ("H100_500W_CLOCK",): ("titan-8b-8gpu-compile",),
    ("EAGER_PASSES",): ("titan-8b-8gpu-fsdp",),
    # Blackwell: 1 of GB200's 9 rows (B200: none of its 2); Blackwell Ultra: 2 of GB300's 9
    # (B300: none of its 3) -- the dense FP8 8B rows, then NVFP4's 405B.
    ("SUSTAINED_B200",): ("bridge25-8b-gb200",),
    ("SUSTAINED_B300",): ("bridge25-8b-gb300",),
    ("NVFP4_GEMM",): ("bridge26-405b-gb300-nvfp4",),
}

CONSTANTS = ("SUSTAINED_A100", "SUSTAINED_H100", "FUSED_PASSES", "EAGER_PASSES",
             "H100_500W_CLOCK", "SUSTAINED_B200", "SUSTAINED_B300", "NVFP4_GEMM")


# Blackwell (B200, GB200) and Blackwell Ultra (B300, GB300): one constant per chip, its
# parts at other clocks and power share it.
SUSTAINED_B200 = 0.6843
SUSTAINED_B300 = 0.8518
# NVFP4's GEMMs (TE NVFP4BlockScaling) as a multiple of the FP8 GEMM ceiling (kernels.
# low_precision_rate says why not a share of the FP4 peak): no FP4 kernel measurement is
# published, and the recipe's GEMMs are the two-level-scaled, Hadamard-transformed ones.
NVFP4_GEMM = 1.739
# Seconds of Adam on the host per offloaded parameter of one rank (Megatron's hybrid
# optimizer, planner/host_offload.py): fitted on one measurement, Megatron-Bridge's
# Qwen3-30B-A3B at 100% offload without overlap (published_offload.fit_cpu_adam(); the other
# fractions, the overlapped row and NeMo-RL's single-GPU runs are held out:
# benchmarks/optimizer_offload_vs_published.py).  Per rank, not per host: the 8-ranks-a-host
# fit predicts the one-rank host of NeMo-RL, so the host's memory bandwidth is not what
# bounds it.
CPU_ADAM_SECONDS_PER_PARAM = 1.522e-9
_GENERATION = {"A100": "A100", "B200": "B200", "GB200": "B200", "B300": "B300",
               "GB300": "B300"}


def sustained_key(family: str) -> str:
    """The SUSTAINED_ constant of a GPU family (H100's for Hopper and custom GPUs)."""
    return f"SUSTAINED_{_GENERATION.get(family, 'H100')}"


def sustained(family: str) -> float:
    return globals()[sustained_key(family)]


def calibration_row_names() -> tuple:
    return tuple(n for rows in CALIBRATION_ROWS.values() for n in rows)
