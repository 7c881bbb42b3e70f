"""Modifications of the attention scores before the mask and softmax: one registry entry
each, read by every place that depends on it.

An entry says what it does to the scores (``apply``: elementwise on the scaled scores, so
it composes with any mask that follows), its derivative (``grad``: the block kernels of ring
CP rebuild the scores in backward and chain it into FlashAttention's score gradient, so the
ring runs every entry), what backward keeps for it (the activation-memory model's extra
score-sized tensors), and which attention implementations cannot run it
(each becomes a refusal of the rule engine, megalite/cli/features.py, with the reason
given here; SDPA's kernels are ruled out by the field's own domain check, ``kernel_check``).
The local core attention (``transformer/attention.py``) applies every active entry and so
runs its unfused kernel; so does all-to-all CP attention (``context_parallel/a2a.py``), which
holds the whole sequence of its heads; ring CP (``context_parallel/block_attention.py``)
applies ``apply`` to each block's scores and ``grad`` in backward.  So a new score
modification is an entry here and its field in ``config/model.py`` (``check=kernel_check(FIELD)``); docs/extending.md measured it.

Importing this module does not import torch (the rule engine and the planner read it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

# The implementations a score modification may be refused by: feature names of the rule
# engine, with what they are, in words.
IMPLEMENTATIONS = {"te": "Transformer Engine layers", "cp-p2p": "ring attention (CP)",
                   "cp-a2a": "all-to-all attention (CP)"}


@dataclass(frozen=True)
class ScoreMod:
    field: str                   # the ModelConfig field that turns it on (its value: the knob)
    summary: str
    apply: Callable              # (scaled scores, value) -> scores, before the mask
    grad: Callable               # (modified scores, value) -> d modified / d scores
    saved_scores: int            # extra score-sized tensors backward keeps (per head, s x s)
    refused_by: Tuple[str, ...]  # IMPLEMENTATIONS that cannot run it

    @property
    def flag(self) -> str:
        """The field's flag (config fields are spelled --field-name)."""
        return "--" + self.field.replace("_", "-")


def _softcap(scores, cap):
    """Gemma 2: cap * tanh(scores / cap), smooth and bounded by +-cap (the mask follows the
    cap: tanh(-inf) would be -1)."""
    return scores.div(cap).tanh().mul(cap)


def _softcap_grad(capped, cap):
    """d/ds cap * tanh(s / cap) = 1 - tanh^2, from the capped scores themselves."""
    return 1 - (capped / cap) ** 2


SCORE_MODS: Dict[str, ScoreMod] = {m.field: m for m in (
    ScoreMod("attn_logit_softcapping", "scores -> cap * tanh(scores / cap) (Gemma 2)",
             _softcap, _softcap_grad, saved_scores=1, refused_by=("te",)),
)}


def active(model_cfg) -> List[Tuple[ScoreMod, float]]:
    """(entry, value) of every score modification ``model_cfg`` turns on, in table order."""
    return [(m, getattr(model_cfg, m.field)) for m in SCORE_MODS.values()
            if getattr(model_cfg, m.field, None) is not None]


def apply_all(scores, mods: List[Tuple[ScoreMod, float]]):
    for mod, value in mods:
        scores = mod.apply(scores, value)
    return scores


def apply_all_with_grad(scores, mods: List[Tuple[ScoreMod, float]]):
    """(modified scores, d modified / d scores or None): the chain rule over the entries."""
    grad = None
    for mod, value in mods:
        scores = mod.apply(scores, value)
        g = mod.grad(scores, value)
        grad = g if grad is None else grad * g
    return scores, grad


def refusal_reason(mod: ScoreMod, implementation: str) -> str:
    return (f"{mod.flag} with {IMPLEMENTATIONS[implementation]}: its attention kernel cannot "
            f"modify the scores before the softmax ({mod.summary}); drop it or use the local "
            "unfused core attention")


def kernel_check(field: str) -> Callable:
    """The field's domain check: SDPA's kernels (``--attention-backend flash`` / ``fused``)
    take no score modification."""
    def problem(value, cfg):
        """only with the unfused core attention (--attention-backend auto, unfused or local)"""
        backend = cfg.model.attention_backend
        if value is not None and backend in ("flash", "fused"):
            return (f"{SCORE_MODS[field].flag}: SDPA's kernels (--attention-backend {backend}) "
                    "cannot modify the scores before the softmax; use --attention-backend "
                    "unfused (or auto)")
        return None
    problem.invalid = []
    return problem
