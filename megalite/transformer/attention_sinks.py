"""Attention sinks in the core attentions (``--softmax-type``,
config/attention_variants.py).

A sink is one more key per head, score ``sink_h`` for every query, value 0: the softmax
denominator gains ``e^sink_h`` and the output nothing.  So

  * the unfused kernel appends the sink as a last score column and drops its probability
    after the softmax (``sink_column``), which is how Hugging Face's gpt-oss computes it;
  * attention that merges blocks by their log-sum-exp (ring CP) folds the sink in once,
    after the last block (``fold``): lse' = log(e^lse + e^sink), out' = out e^(lse - lse');
    backward's FlashAttention formulas then hold unchanged with the final lse' and out'
    (the sink is a key with value 0), and the sink's own gradient is
    d sink_h = -sum_rows e^(sink_h - lse') rowsum(dout * out')   (``sink_grad``).

The learnable sink is ``core_attention.softmax_offset`` [heads], Megatron's name, split
over TP with the heads (all-to-all CP takes its block of them).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megalite.config.attention_variants import learned_sinks, sinks_on
from megalite.param_spec import ParamSpec, Split, make_param


def build_softmax_offset(module: nn.Module, model_cfg, comm_groups) -> None:
    """``module.softmax_offset``: a parameter [heads / TP] (learnable), zeros (off-by-one,
    a buffer outside the state dict) or None (vanilla)."""
    heads = model_cfg.num_attention_heads
    if learned_sinks(model_cfg):
        make_param(module, "softmax_offset", ParamSpec(
            (heads,), (Split(0, "tp"),), init=("normal", model_cfg.init_method_std)),
            {"tp": comm_groups.tp.size})
    elif sinks_on(model_cfg):
        module.register_buffer("softmax_offset", torch.zeros(heads // comm_groups.tp.size),
                               persistent=False)
    else:
        module.softmax_offset = None


def sink_column(scores: torch.Tensor, sinks: torch.Tensor, batch: int, groups: int,
                rows: int, s: int) -> torch.Tensor:
    """Softmax probabilities [b*g, r*s, sk] of the unfused kernel's ``scores`` with each
    head's sink in the denominator (heads j = g*r + i stacked per group, as there)."""
    col = sinks.to(scores.dtype).view(1, groups, rows, 1, 1).expand(batch, groups, rows, s, 1)
    probs = torch.softmax(torch.cat([scores, col.reshape(batch * groups, rows * s, 1)], -1), -1)
    return probs[..., :-1]


def fold(out: torch.Tensor, lse: torch.Tensor, sinks: Optional[torch.Tensor]):
    """(out', lse') of block-merged attention (out [b, h, s, dv] normalized over the keys,
    lse [b, h, s]) with the sink joined to the denominator; unchanged without sinks."""
    if sinks is None:
        return out, lse
    new = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
    return out * torch.exp(lse - new).unsqueeze(-1).to(out.dtype), new


def sink_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """d sink [h] from the final lse [b, h, s] and delta = rowsum(dout * out) [b, h, s]."""
    p_sink = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse)
    return -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)
