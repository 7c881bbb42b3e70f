"""This rank's routed experts as one grouped MLP (Megatron's ``GroupedMLP``).

All experts of a layer are two parameters with an expert dimension:
``linear_fc1.weight`` [E, 2F (SwiGLU [gate; up]) or F, h] and ``linear_fc2.weight``
[E, h, F].  The expert dimension is split over EP (which experts this rank holds) and F
over expert-TP (column-parallel fc1 with SwiGLU's two blocks, row-parallel fc2), both
recorded in the parameter-spec table with ``expert=True`` -- so initialization (the full
[E, ...] tensor drawn from the name, then sliced), grad sync over expert-DP, the expert
grad norm and checkpoints follow without anything expert-specific in those places.

``forward(x, tokens_per_expert)``: ``x`` holds the rows of each local expert one after
the other; the GEMMs run per expert (a loop over the local experts, never over tokens).
With expert-TP the output is this shard's partial sum (the dispatcher reduces it).
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F
from torch import nn

from megalite.param_spec import ParamSpec, Split, make_param


class GroupedMLP(nn.Module):
    def __init__(self, model_cfg, comm_groups, *, device=None, dtype=None):
        super().__init__()
        m = model_cfg
        E, h, ffn = m.num_experts, m.hidden_size, m.resolved_moe_ffn_hidden_size()
        ep, etp = comm_groups.ep, comm_groups.expert_tp
        self.swiglu = m.swiglu
        sizes = {"ep": ep.size, "expert-tp": etp.size}
        kw = dict(device=device, dtype=dtype)
        blocks = 2 if m.swiglu else 1
        self.linear_fc1 = nn.Module()
        make_param(self.linear_fc1, "weight", ParamSpec(
            (E, blocks * ffn, h), (Split(0, "ep"), Split(1, "expert-tp", blocks)),
            init=("normal", m.init_method_std), expert=True), sizes, **kw)
        self.linear_fc2 = nn.Module()
        make_param(self.linear_fc2, "weight", ParamSpec(
            (E, h, ffn), (Split(0, "ep"), Split(2, "expert-tp")),
            init=("normal", m.init_method_std / (2.0 * m.num_layers) ** 0.5), expert=True),
            sizes, **kw)

    def forward(self, x: torch.Tensor, tokens_per_expert: List[int]) -> torch.Tensor:
        w1, w2 = self.linear_fc1.weight, self.linear_fc2.weight
        outs = []
        for e, rows in enumerate(x.split(tokens_per_expert)):
            y = rows.matmul(w1[e].t())
            if self.swiglu:
                gate, up = y.chunk(2, dim=-1)
                y = F.silu(gate) * up
            else:
                y = F.gelu(y)
            outs.append(y.matmul(w2[e].t()))
        return torch.cat(outs) if outs else x.new_zeros((0, w2.shape[1]))
