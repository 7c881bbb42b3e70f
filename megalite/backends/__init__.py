"""Which implementation builds the hot layers (linears, norms, core attention).

``get_layer_spec(impl)`` returns a ``LayerSpec``: the submodule tree of a transformer
layer (``transformer/spec.py``) plus the two modules around the layers.  The transformer
modules only ever build submodules through it, so a Transformer Engine spec (fused
norm+linear slots, TE core attention) can replace the local one without touching them.
Nothing here imports transformer_engine unless that backend is asked for.
"""
from __future__ import annotations

import dataclasses

from megalite.context_parallel import core_attention_class
from megalite.context_parallel.delta_state import ContextParallelGatedDeltaNet
from megalite.transformer.spec import LayerSpec  # noqa: F401  (re-exported)
from megalite.backends.local import local_spec
from megalite.backends.transformer_engine import te_spec
from megalite.tensor_parallel.layers import (ColumnParallelLinear, DuplicatedLinear)
from megalite.transformer.mla import MLASelfAttention
from megalite.transformer.norms import IdentityNorm, build_latent_norm, build_norm
from megalite.transformer.spec import MLASelfAttentionSubmodules, ModuleSpec


def get_layer_spec(impl: str = "local", model_cfg=None, *, cp_comm_type: str = "p2p",
                   amax_group=None) -> LayerSpec:
    """``local`` | ``transformer_engine`` | ``auto`` (here: local; a training run resolves
    ``auto`` first, ``selection.resolve_backend_config``).  The TE spec needs ``model_cfg``
    (norm kind, MoE, FP8 settings); ``amax_group`` is the process group FP8 reduces its
    amax over (TP x DP x CP)."""
    if impl in ("local", "auto"):
        return local_spec()
    if impl == "transformer_engine":
        if model_cfg is None:
            raise ValueError("the transformer_engine layer spec needs the model config")

        return te_spec(model_cfg, cp_comm_type=cp_comm_type, amax_group=amax_group)
    raise ValueError(f"unknown --transformer-impl '{impl}'")


def layer_spec_kwargs(impl: str, cfg, state) -> dict:
    """What ``get_layer_spec(impl, ...)`` needs beyond the name: nothing for the local spec;
    the model config, CP comm type and FP8 amax group (TP x DP x CP) for TE's."""
    if impl != "transformer_engine":
        return {}
    amax = state.groups.get("tp-dp-cp")
    return dict(model_cfg=cfg.model, cp_comm_type=cfg.parallel.cp_comm_type,
                amax_group=getattr(amax, "handle", None))


def multi_latent_attention_spec(spec: LayerSpec) -> LayerSpec:
    """``spec`` with Multi-Latent Attention in the self-attention slot
    (``--multi-latent-attention``): the backend's core attention and output projection are
    kept, the q/kv projections are the local parallel linears (duplicated down projections,
    column-parallel up projections), the latent norms the backend's norm.  A backend that
    fused the input norm into ``linear_qkv`` (TE) gets the norm back in its own slot: MLA has
    no single linear to fuse it into."""
    layer = spec.layer.submodules
    attn = layer.self_attention
    mla = ModuleSpec(MLASelfAttention, params=dict(attn.params),
                     submodules=MLASelfAttentionSubmodules(
                         linear_q_proj=ColumnParallelLinear, linear_q_down_proj=DuplicatedLinear,
                         linear_q_up_proj=ColumnParallelLinear,
                         linear_kv_down_proj=DuplicatedLinear,
                         linear_kv_up_proj=ColumnParallelLinear,
                         core_attention=attn.submodules.core_attention,
                         linear_proj=attn.submodules.linear_proj,
                         q_layernorm=build_latent_norm, kv_layernorm=build_latent_norm))
    norm = build_norm if layer.input_layernorm is IdentityNorm else layer.input_layernorm
    layer = dataclasses.replace(layer, self_attention=mla, input_layernorm=norm)
    return dataclasses.replace(spec, layer=dataclasses.replace(spec.layer, submodules=layer))


def context_parallel_spec(spec: LayerSpec, cp_comm_type: str) -> LayerSpec:
    """``spec`` with context-parallel core attention in the core-attention slot (ring
    attention for ``--cp-comm-type p2p``, Ulysses all-to-all for ``a2a``); every other slot
    and every parameter name unchanged.  GPTModel applies it when CP > 1."""
    layer = spec.layer.submodules
    attn = layer.self_attention
    current = attn.submodules.core_attention
    if getattr(getattr(current, "module", current), "handles_context_parallel", False):
        return spec     # TE's DotProductAttention runs its own CP (set_context_parallel_group)
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(
        attn.submodules, core_attention=core_attention_class(cp_comm_type)))
    layer = dataclasses.replace(layer, self_attention=attn)
    if layer.linear_attention is not None:     # Gated DeltaNet: the state walks the CP ranks
        layer = dataclasses.replace(layer, linear_attention=dataclasses.replace(
            layer.linear_attention, module=ContextParallelGatedDeltaNet))
    return dataclasses.replace(spec, layer=dataclasses.replace(spec.layer, submodules=layer))
