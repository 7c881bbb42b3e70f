"""``--qk-layernorm-scope projection``: the q/k norm of OLMo 2, an RMSNorm over each token's
whole q projection (every head) and whole k projection, with one weight entry per channel
(``heads * head_dim`` for q, ``groups * head_dim`` for k), instead of Qwen3's norm over each
head with one shared ``head_dim`` weight.

Under tensor parallelism a rank holds only its query groups, so the weights are split over
TP like the heads (contiguous chunks: megalite's head order is Hugging Face's) and the mean
square of a token spans the shards: each rank sums the squares of its channels, the sums are
all-reduced over TP (``tensor_parallel.mappings``: an all-reduce forward, and backward,
since every rank's output depends on every rank's channels), and divided by the full width.
Applied to the fused qkv output before it is split into heads, so both q/k/v layouts of
``SelfAttention`` read normalized q and k.
"""
from __future__ import annotations

import torch
from torch import nn

from megalite.param_spec import ParamSpec, make_param
from megalite.tensor_parallel.mappings import copy_to_tp_region, reduce_from_tp_region


class ProjectionRMSNorm(nn.Module):
    """x / sqrt(mean over the full projection of x^2 + eps) * w, in fp32; ``x``'s last dim
    is this rank's ``width / tp`` channels.  ``zero_centered_gamma``: * (1 + w)."""

    def __init__(self, width: int, eps: float, tp_group, zero_centered_gamma: bool = False,
                 device=None, dtype=None):
        super().__init__()
        self.width, self.eps, self.tp_group = width, eps, tp_group
        self.zero_centered_gamma = zero_centered_gamma
        init = ("zeros",) if zero_centered_gamma else ("ones",)
        make_param(self, "weight", ParamSpec.split((width,), 0, tp_group.name, init=init),
                   {tp_group.name: tp_group.size}, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        squares = y.pow(2).sum(-1, keepdim=True)
        squares = reduce_from_tp_region(copy_to_tp_region(squares, self.tp_group),
                                        self.tp_group)
        y = y * torch.rsqrt(squares / self.width + self.eps)
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        return (weight * y).to(x.dtype)


def build_projection_qk_norms(model_cfg, tp_group, device=None, dtype=None):
    """The (q, k) projection norms of one attention layer."""
    d = model_cfg.resolved_kv_channels()
    return tuple(ProjectionRMSNorm(n * d, model_cfg.norm_epsilon, tp_group,
                                   model_cfg.apply_layernorm_1p, device=device, dtype=dtype)
                 for n in (model_cfg.num_attention_heads, model_cfg.resolved_query_groups()))


def norm_qkv_projection(qkv: torch.Tensor, q_norm: ProjectionRMSNorm,
                        k_norm: ProjectionRMSNorm, groups: int, heads_per_group: int,
                        head_dim: int) -> torch.Tensor:
    """The fused qkv output [s, b, groups * (r + 2) * d] with its q and k parts normalized
    over their whole (local) projections; v unchanged."""
    s, b = qkv.shape[:2]
    r, d = heads_per_group, head_dim
    q, k, v = qkv.view(s, b, groups, r + 2, d).split([r, 1, 1], dim=3)
    q = q_norm(q.reshape(s, b, groups * r * d)).view(s, b, groups, r, d)
    k = k_norm(k.reshape(s, b, groups * d)).view(s, b, groups, 1, d)
    return torch.cat([q, k, v], dim=3).view(s, b, -1)
