"""A logit per head in the softmax denominator, in the core attentions: the kind of
attention variant whose entries say ``denominator`` (config/attention_variants.py).

The term is one more key per head, score ``z_h`` for every query, value 0: the softmax
denominator gains ``e^z_h`` and the output nothing.  So

  * the unfused kernel appends it as a last score column and drops its probability after
    the softmax (``softmax_with_denominator``), which is how Hugging Face computes it;
  * attention that merges blocks by their log-sum-exp (ring CP) folds it in once, after
    the last block (``fold``): lse' = log(e^lse + e^z), out' = out e^(lse - lse');
    backward's FlashAttention formulas then hold unchanged with the final lse' and out'
    (the key has value 0), and the term's own gradient is
    d z_h = -sum_rows e^(z_h - lse') rowsum(dout * out')   (``denominator_grad``);
  * all-to-all CP takes this rank's block of the heads' logits.

The logits are ``core_attention.softmax_offset`` [heads / TP] (Megatron's name): a
parameter split over TP with the heads ("learned") or zeros ("constant", a buffer outside
the state dict).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megalite.config.attention_variants import denominator_logit
from megalite.param_spec import ParamSpec, Split, make_param


def build_denominator_logits(module: nn.Module, model_cfg, comm_groups) -> None:
    """``module.softmax_offset``: a parameter [heads / TP] (learned), zeros (constant) or
    None (no variant adds a denominator term)."""
    heads = model_cfg.num_attention_heads
    kind = denominator_logit(model_cfg)
    if kind == "learned":
        make_param(module, "softmax_offset", ParamSpec(
            (heads,), (Split(0, "tp"),), init=("normal", model_cfg.init_method_std)),
            {"tp": comm_groups.tp.size})
    elif kind == "constant":
        module.register_buffer("softmax_offset", torch.zeros(heads // comm_groups.tp.size),
                               persistent=False)
    else:
        module.softmax_offset = None


def learned_logits_spec(model_cfg, tp_group) -> Optional[ParamSpec]:
    """The learned logits' ``ParamSpec`` (split over ``tp_group`` with the heads) for a
    backend that holds them itself (TE), or None."""
    if denominator_logit(model_cfg) != "learned":
        return None
    return ParamSpec((model_cfg.num_attention_heads,), (Split(0, tp_group.name),),
                     init=("normal", model_cfg.init_method_std))


def softmax_with_denominator(scores: torch.Tensor, logits: torch.Tensor, batch: int,
                             groups: int, rows: int, s: int) -> torch.Tensor:
    """Softmax probabilities [b*g, r*s, sk] of the unfused kernel's ``scores`` with each
    head's logit in the denominator (heads j = g*r + i stacked per group, as there)."""
    col = logits.to(scores.dtype).view(1, groups, rows, 1, 1).expand(batch, groups, rows, s, 1)
    probs = torch.softmax(torch.cat([scores, col.reshape(batch * groups, rows * s, 1)], -1), -1)
    return probs[..., :-1]


def fold(out: torch.Tensor, lse: torch.Tensor, logits: Optional[torch.Tensor]):
    """(out', lse') of block-merged attention (out [b, h, s, dv] normalized over the keys,
    lse [b, h, s]) with the logits joined to the denominator; unchanged without them."""
    if logits is None:
        return out, lse
    new = torch.logaddexp(lse, logits.to(lse.dtype).view(1, -1, 1))
    return out * torch.exp(lse - new).unsqueeze(-1).to(out.dtype), new


def denominator_grad(logits: torch.Tensor, lse: torch.Tensor,
                     delta: torch.Tensor) -> torch.Tensor:
    """d logits [h] from the final lse [b, h, s] and delta = rowsum(dout * out) [b, h, s]."""
    p_extra = torch.exp(logits.to(lse.dtype).view(1, -1, 1) - lse)
    return -(p_extra * delta).sum(dim=(0, 2)).to(logits.dtype)
