"""The feed-forward block: column-parallel fc1, activation, row-parallel fc2.

The activation is the registry's (``config/activations.py``); a gated one (SwiGLU)
makes fc1 one fused [gate; up] matmul whose weight has ``partition_blocks=2``, so each TP
rank holds [gate_r; up_r] and the activation needs no communication.  The two
linears are spec slots (``MLPSubmodules``); ``linear_fc1`` may apply the pre-MLP norm.
"""
from __future__ import annotations

import torch
from torch import nn

from megalite.config.activations import activation_of
from megalite.transformer.spec import build_module


class MLP(nn.Module):
    """Dense MLP.  ``layer_number`` is part of the MLP slot's contract (an MoE layer needs
    it for its statistics); the dense MLP only records it."""

    def __init__(self, model_cfg, comm_groups, *, submodules, sequence_parallel: bool,
                 layer_number: int = 0, device=None, dtype=None):
        super().__init__()
        m = model_cfg
        ffn = m.resolved_ffn_hidden_size()
        self.activation = activation_of(m)
        blocks = self.activation.fc1_blocks
        self.layer_number = layer_number
        kw = dict(tp_group=comm_groups.tp, bias=m.add_bias_linear,
                  sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.linear_fc1 = build_module(
            submodules.linear_fc1, m.hidden_size, blocks * ffn,
            init_std=m.init_method_std, partition_blocks=blocks, **kw)
        self.linear_fc2 = build_module(
            submodules.linear_fc2, ffn, m.hidden_size, input_is_parallel=True,
            init_std=m.init_method_std / (2.0 * m.num_layers) ** 0.5, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.activation.fn(self.linear_fc1(x)))
