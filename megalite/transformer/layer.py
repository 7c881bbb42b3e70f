"""One pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x)).

Kept deliberately flat: ``input_layernorm``, ``self_attention`` (whose ``core_attention``
is a submodule), ``pre_mlp_layernorm`` and ``mlp`` are the units a recompute policy wraps.
Dropout after attention and MLP uses the default generator: replicated across TP without
sequence parallelism, and inside the block's model-parallel RNG fork with it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.transformer.attention import SelfAttention
from megalite.transformer.mlp import MLP


class TransformerLayer(nn.Module):
    def __init__(self, model_cfg, tp_group, spec, *, layer_number: int, sequence_parallel: bool,
                 rng_tracker=None, device=None, dtype=None):
        super().__init__()
        h = model_cfg.hidden_size
        sp = sequence_parallel and tp_group.size > 1
        kw = dict(device=device, dtype=dtype)
        self.layer_number = layer_number
        self.hidden_dropout = model_cfg.hidden_dropout
        self.input_layernorm = spec.norm(model_cfg, h, sp, **kw)
        self.self_attention = SelfAttention(model_cfg, tp_group, spec, sequence_parallel=sp,
                                            layer_number=layer_number, rng_tracker=rng_tracker,
                                            **kw)
        self.pre_mlp_layernorm = spec.norm(model_cfg, h, sp, **kw)
        self.mlp = MLP(model_cfg, tp_group, spec, sequence_parallel=sp, **kw)

    def _dropout(self, x):
        if self.training and self.hidden_dropout > 0:
            return F.dropout(x, self.hidden_dropout, training=True)
        return x

    def forward(self, hidden: torch.Tensor, rotary=None) -> torch.Tensor:
        hidden = hidden + self._dropout(self.self_attention(self.input_layernorm(hidden), rotary))
        return hidden + self._dropout(self.mlp(self.pre_mlp_layernorm(hidden)))
