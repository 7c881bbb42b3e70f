"""Bytes of Adam's state under Megatron's precision-aware optimizer, and the flags' rules.

Megatron's ``--use-precision-aware-optimizer`` hands the optimizer to Transformer Engine's
FusedAdam, which stores the moments in ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` and the
master weights in ``--main-params-dtype``; without it every one of them must stay fp32
(megatron/core/optimizer/optimizer_config.py, ``__post_init__``, commit d98e8a64dd).  When
FusedAdam owns an fp32 master of a bf16 weight it keeps only the 16 low bits the weight does
not hold (``store_param_remainders``, on by default from TE 2.1; transformer_engine/pytorch/
optimizers/fused_adam.py): 2 bytes, not 4.  It owns the master unless an FP8 recipe other
than delayed scaling runs with an fp32 master (Megatron-Core then keeps it, so FP8 primary
weights can be re-cast: ``use_precision_aware_optimizer_no_fp8_or_ds_fp8``), and a weight
that is only quantized (``--fp8-param-gather`` / ``--fp4-param-gather``) has no bf16 copy to
share bits with.
"""
from __future__ import annotations

from typing import Optional, Tuple

from megalite.config import ConfigError

STATE_DTYPES = ("fp32", "fp16", "bf16", "fp8")      # Megatron's --exp-avg(-sq)-dtype choices
MASTER_DTYPES = ("fp32", "fp16")                     # its --main-params-dtype choices
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
# FP8 recipes whose runs keep Megatron-Core's own fp32 master (not FusedAdam's)
MCORE_MASTER_RECIPES = ("tensorwise", "blockwise", "mxfp8")


def adam_state_bytes(precision_aware: bool, exp_avg: str = "fp32", exp_avg_sq: str = "fp32",
                     main_params: str = "fp32", low_precision: Optional[str] = None,
                     quantized_weights: bool = False,
                     fp32_training: bool = False,
                     cpu_offload: bool = False) -> Tuple[Tuple[int, int], int]:
    """((exp_avg, exp_avg_sq) bytes, master bytes) per parameter; a one-line ConfigError
    naming the flag when a dtype is set without ``--use-precision-aware-optimizer``.
    ``cpu_offload`` (--optimizer-cpu-offload): Megatron's hybrid optimizer, torch's Adam on
    both devices, fp32 state and a whole fp32 master (planner/host_offload.py)."""
    for flag, value, choices in (("--exp-avg-dtype", exp_avg, STATE_DTYPES),
                                 ("--exp-avg-sq-dtype", exp_avg_sq, STATE_DTYPES),
                                 ("--main-params-dtype", main_params, MASTER_DTYPES)):
        if value not in choices:
            raise ConfigError(f"{flag}: unknown dtype '{value}'; choose from "
                              f"{', '.join(choices)}")
        if value != "fp32" and not precision_aware:
            raise ConfigError(f"{flag} {value} needs --use-precision-aware-optimizer (without "
                              f"it Megatron keeps the optimizer state fp32); add it")
    moments = (DTYPE_BYTES[exp_avg], DTYPE_BYTES[exp_avg_sq])
    master = DTYPE_BYTES[main_params]
    te_owns_master = main_params != "fp32" or low_precision not in MCORE_MASTER_RECIPES
    if (precision_aware and te_owns_master and not cpu_offload and main_params == "fp32" and not fp32_training
            and not quantized_weights):
        master = 2                                   # the fp32 master's low 16 bits
    return moments, master
