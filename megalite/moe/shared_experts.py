"""The shared expert: a dense MLP every token goes through beside the routed experts
(Megatron's ``SharedExpertMLP``; Qwen2-MoE, DeepSeek-V2/V3), of hidden size
``--moe-shared-expert-intermediate-size`` and split over attention TP like any MLP.

With ``--moe-shared-expert-gate`` (Qwen2-MoE's ``shared_expert_gate``) its output is scaled
per token by ``sigmoid(x . w)``, ``w`` a learned [1, hidden] ``gate_weight``.  The gate reads
the same (sequence-parallel) hidden states as the layer, so under SP each TP rank sees other
tokens and the gate's gradient is summed over TP, as the router's is (parameter-spec flag).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from megalite.param_spec import ParamSpec, make_param
from megalite.transformer.mlp import MLP
from megalite.transformer.spec import ModuleSpec


class SharedExpertMLP(MLP):
    """``model_cfg`` is the layer's config; the MLP is built at the shared-expert size."""

    def __init__(self, model_cfg, comm_groups, *, submodules, sequence_parallel: bool,
                 layer_number: int = 0, device=None, dtype=None):
        m = model_cfg
        shared = dataclasses.replace(m, ffn_hidden_size=m.moe_shared_expert_intermediate_size)
        super().__init__(shared, comm_groups, submodules=submodules, sequence_parallel=sequence_parallel,
                         layer_number=layer_number, device=device, dtype=dtype)
        self.gated = bool(m.moe_shared_expert_gate)
        if self.gated:
            sp = comm_groups.tp.name if sequence_parallel and comm_groups.tp.size > 1 else None
            make_param(self, "gate_weight", ParamSpec((1, m.hidden_size),
                                                      init=("normal", m.init_method_std),
                                                      sequence_parallel=sp), {},
                       device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.gated:
            out = out * torch.sigmoid(F.linear(x, self.gate_weight))
        return out


def shared_expert_spec(mlp: ModuleSpec) -> ModuleSpec:
    """The MoE block's ``shared_experts`` slot from a backend's dense-MLP spec (same linears)."""
    return ModuleSpec(SharedExpertMLP, params=mlp.params, submodules=mlp.submodules)
