"""The pure-PyTorch layer spec (works on CPU/gloo and CUDA/NCCL).

``local_spec()`` keeps every norm in its own slot, so parameter names are Megatron's
(``input_layernorm.weight``, ``self_attention.linear_qkv.weight``, ...).
``fuse_norms(spec, model_cfg)`` expresses the fused layout TE uses: identity norms in the
layer and ``NormColumnParallelLinear`` in ``linear_qkv`` / ``linear_fc1``.  The linears
keep their names (so their name-seeded init is unchanged); each norm moves under its
linear (``linear_qkv.layer_norm.weight``), as TE's ``layer_norm_weight`` does.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch

from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.transformer.attention import DotProductAttention, SelfAttention
from megalite.transformer.gated_delta_net import GatedDeltaNet
from megalite.transformer.layer import TransformerLayer
from megalite.transformer.mlp import MLP
from megalite.transformer.norms import IdentityNorm, build_norm, build_qk_norm
from megalite.moe.experts import GroupedMLP
from megalite.moe.moe_layer import MoELayer
from megalite.moe.router import TopKRouter
from megalite.moe.shared_experts import shared_expert_spec
from megalite.transformer.spec import (AttnMaskType, LayerSpec, MLPSubmodules, MoESubmodules,
                                       ModuleSpec, SelfAttentionSubmodules,
                                       TransformerLayerSubmodules)
from megalite.transformer.spec import GatedDeltaNetSubmodules


def local_spec() -> LayerSpec:
    attention = ModuleSpec(SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                           submodules=SelfAttentionSubmodules(
                               linear_qkv=ColumnParallelLinear,
                               core_attention=DotProductAttention,
                               linear_proj=RowParallelLinear,
                               q_layernorm=build_qk_norm, k_layernorm=build_qk_norm))
    mlp = ModuleSpec(MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                   linear_fc2=RowParallelLinear))
    moe = ModuleSpec(MoELayer, submodules=MoESubmodules(router=TopKRouter, experts=GroupedMLP,
                                                        shared_experts=shared_expert_spec(mlp)))
    linear = ModuleSpec(GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        linear_qkvz=ColumnParallelLinear, linear_ba=ColumnParallelLinear,
        linear_out=RowParallelLinear))
    layer = ModuleSpec(TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=build_norm, self_attention=attention, pre_mlp_layernorm=build_norm,
        mlp=mlp, moe_mlp=moe, linear_attention=linear))
    return LayerSpec(layer=layer, norm=build_norm, column_parallel_linear=ColumnParallelLinear)


class NormColumnParallelLinear(ColumnParallelLinear):
    """norm(x) then the column-parallel linear, in one slot (TE's LayerNormColumnParallelLinear).

    ``norm``: (hidden, sequence_parallel, device=, dtype=) -> module.  With sequence
    parallelism the norm runs on this rank's sequence shard before the linear's gather,
    exactly as the unfused pair does.
    """

    def __init__(self, input_size: int, output_size: int, *, norm: Callable,
                 sequence_parallel: bool = False, device=None, dtype=None, **kwargs):
        super().__init__(input_size, output_size, sequence_parallel=sequence_parallel,
                         device=device, dtype=dtype, **kwargs)
        self.layer_norm = norm(input_size, sequence_parallel, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, weight=None) -> torch.Tensor:
        return super().forward(self.layer_norm(x), weight)


def fuse_norms(spec: LayerSpec, model_cfg) -> LayerSpec:
    """``spec`` with each pre-linear norm applied by the following linear slot, which
    becomes ``NormColumnParallelLinear`` (the norm's own slot becomes ``IdentityNorm``)."""
    layer = spec.layer.submodules
    attn, mlp = layer.self_attention, layer.mlp
    if model_cfg.num_experts:   # an MoE layer keeps its own pre-MLP norm (as Megatron's TE spec)
        raise NotImplementedError("fused norm+linear slots with MoE layers: the MoE block has no "
                                  "linear to fuse the pre-MLP norm into")

    def fused(norm):
        return ModuleSpec(NormColumnParallelLinear,
                          params={"norm": functools.partial(norm, model_cfg)})

    attn = dataclasses.replace(attn, submodules=dataclasses.replace(
        attn.submodules, linear_qkv=fused(layer.input_layernorm)))
    mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(
        mlp.submodules, linear_fc1=fused(layer.pre_mlp_layernorm)))
    layer = dataclasses.replace(layer, input_layernorm=IdentityNorm, self_attention=attn,
                                pre_mlp_layernorm=IdentityNorm, mlp=mlp)
    return dataclasses.replace(spec, layer=dataclasses.replace(spec.layer, submodules=layer))
