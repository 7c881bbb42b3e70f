"""Attention sinks (``--softmax-type``, Megatron's field): a logit per head that joins the
softmax denominator and no value, so a query may attend "nowhere".

    vanilla     softmax(s)_j = e^s_j / sum_k e^s_k
    off-by-one  e^s_j / (1 + sum_k e^s_k)            (the sink logit is 0)
    learnable   e^s_j / (e^sink_h + sum_k e^s_k)     (gpt-oss: ``self_attn.sinks``)

The sink is a key with score ``sink_h`` and value 0; what the attentions do with it is in
``transformer/attention_sinks.py``.  SDPA's kernels have no such key, so the local core
attention runs its unfused kernel with sinks, as with a score modification.
Importing this module does not import torch (the rule engine and the planner read it).
"""
from __future__ import annotations

from typing import Optional

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def sinks_on(model_cfg) -> bool:
    """Whether the softmax has a sink term (off-by-one or learnable)."""
    return getattr(model_cfg, "softmax_type", "vanilla") != "vanilla"


def learned_sinks(model_cfg) -> bool:
    """Whether the sink is a parameter (``softmax_offset`` [heads], split over TP)."""
    return getattr(model_cfg, "softmax_type", "vanilla") == "learnable"


def sinks_kernel_problem(value, cfg) -> Optional[str]:
    """only with the unfused core attention (--attention-backend auto, unfused or local) or TE"""
    backend = cfg.model.attention_backend
    te = cfg.model.transformer_impl == "transformer_engine"
    if value not in (None, "vanilla") and backend in ("flash", "fused") and not te:
        return (f"--softmax-type {value}: SDPA's kernels (--attention-backend {backend}) have "
                "no sink term in the softmax; use --attention-backend unfused (or auto)")
    return None


sinks_kernel_problem.invalid = []
