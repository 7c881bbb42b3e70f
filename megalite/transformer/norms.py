"""LayerNorm and RMSNorm whose parameters know about sequence parallelism.

With sequence parallelism a norm runs on this rank's sequence shard, so its (replicated)
weight only sees part of the tokens: their ``ParamSpec`` names the sequence-split group
("tp") and ``allreduce_sequence_parallel_grads`` sums their grads over it.

``--apply-layernorm-1p`` (Megatron's ``layernorm_zero_centered_gamma``): the weight is
stored as ``w - 1`` (initialised to 0) and applied as ``1 + w``, so weight decay pulls the
scale towards 1 rather than 0 (norm weights are 1-D: no decay unless a rule says so) and
fp16/bf16 keep more precision near 1.  Megatron's local LayerNorm and TE's LayerNorm and
RMSNorm support it; both norms here do.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.param_spec import ParamSpec, make_param

SEQUENCE_PARALLEL_GROUP = "tp"    # dense layers split the sequence over the TP group


def _norm_spec(hidden_size: int, init: tuple, sequence_parallel: bool) -> ParamSpec:
    return ParamSpec((hidden_size,), init=init,
                     sequence_parallel=SEQUENCE_PARALLEL_GROUP if sequence_parallel else None)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * w, computed in fp32 (Llama); ``zero_centered_gamma``:
    * (1 + w)."""

    def __init__(self, hidden_size: int, eps: float, sequence_parallel: bool = False,
                 device=None, dtype=None, zero_centered_gamma: bool = False):
        super().__init__()
        self.eps, self.shape = eps, (hidden_size,)
        self.zero_centered_gamma = zero_centered_gamma
        init = ("zeros",) if zero_centered_gamma else ("ones",)
        make_param(self, "weight", _norm_spec(hidden_size, init, sequence_parallel), {},
                   device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, weight, self.eps)
        y = F.rms_norm(x.float(), self.shape, None, self.eps)
        return weight * y.to(x.dtype)


class LayerNorm(nn.Module):
    """(x - mean) / std * w + b; ``zero_centered_gamma``: * (1 + w) + b."""

    def __init__(self, hidden_size: int, eps: float, sequence_parallel: bool = False,
                 device=None, dtype=None, zero_centered_gamma: bool = False):
        super().__init__()
        self.eps, self.shape = eps, (hidden_size,)
        self.zero_centered_gamma = zero_centered_gamma
        kw = dict(device=device, dtype=dtype)
        init = ("zeros",) if zero_centered_gamma else ("ones",)
        make_param(self, "weight", _norm_spec(hidden_size, init, sequence_parallel), {}, **kw)
        make_param(self, "bias", _norm_spec(hidden_size, ("zeros",), sequence_parallel), {}, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        return F.layer_norm(x, self.shape, weight, self.bias, self.eps)


def build_norm(model_cfg, hidden_size: int, sequence_parallel: bool, device=None, dtype=None,
               eps=None):
    """The norm chosen by ``--normalization`` (zero-centred with ``--apply-layernorm-1p``),
    with ``--norm-epsilon`` unless ``eps`` is given."""
    klass = {"RMSNorm": RMSNorm, "LayerNorm": LayerNorm}[model_cfg.normalization]
    return klass(hidden_size, model_cfg.norm_epsilon if eps is None else eps,
                 sequence_parallel, device=device, dtype=dtype,
                 zero_centered_gamma=model_cfg.apply_layernorm_1p)


def build_latent_norm(model_cfg, hidden_size: int, sequence_parallel: bool, device=None,
                      dtype=None):
    """Multi-Latent Attention's q / kv latent norm: ``build_norm`` with its own epsilon
    (``--mla-latent-norm-epsilon``, default ``--norm-epsilon``), since DeepSeek-V3 in
    transformers keeps 1e-6 there whatever the other norms use."""
    return build_norm(model_cfg, hidden_size, sequence_parallel, device, dtype,
                      eps=model_cfg.mla_latent_norm_epsilon)


def build_qk_norm(model_cfg, head_dim: int, heads_split: bool, device=None, dtype=None):
    """``--qk-layernorm``: the norm over one head's q (or k), a weight of ``head_dim`` shared
    by every head.  With TP each rank normalizes only its own heads, so the replicated
    weight's gradient is partial on every rank: ``heads_split`` (TP > 1) names the TP group
    in its ``ParamSpec`` (the field SP norms use), and the grad sync sums it over TP
    (Megatron sums ``q_layernorm``/``k_layernorm`` grads over TP likewise)."""
    return build_norm(model_cfg, head_dim, heads_split, device=device, dtype=dtype)


class IdentityNorm(nn.Module):
    """The norm slot of a layer whose next linear applies the norm itself (a fused
    norm+linear slot, TE's ``LayerNormLinear``); takes a norm's arguments, holds nothing."""

    def __init__(self, model_cfg=None, hidden_size: int = 0, sequence_parallel: bool = False,
                 device=None, dtype=None):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x
