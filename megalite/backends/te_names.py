"""Parameter names of the Transformer Engine backend <-> the local backend's.

TE fuses each pre-linear norm into the following linear (``LayerNormLinear``), so the norm's
weight lives in that linear as ``layer_norm_weight``.  Every other parameter has the same
name and the same local shape in both backends (TE's column/row linears hold the same
[out/tp, in] / [out, in/tp] shards as megalite's).  So the whole difference is four suffixes
per layer:

    decoder.layers.i.self_attention.linear_qkv.layer_norm_weight  <->  decoder.layers.i.input_layernorm.weight
    decoder.layers.i.self_attention.linear_qkv.layer_norm_bias    <->  decoder.layers.i.input_layernorm.bias
    decoder.layers.i.mlp.linear_fc1.layer_norm_weight             <->  decoder.layers.i.pre_mlp_layernorm.weight
    decoder.layers.i.mlp.linear_fc1.layer_norm_bias               <->  decoder.layers.i.pre_mlp_layernorm.bias

A TE model's canonical names (``ParamTable``) are the LOCAL names (``canonical_renames``), so
its name-seeded init, its checkpoints and the HF converter are the local backend's: a
checkpoint written by one backend loads into the other unchanged.  ``to_te_names`` /
``to_local_names`` convert a raw ``state_dict`` (FQNs) for tools that work outside megalite's
checkpoints; TE's ``*._extra_state`` entries (FP8 scaling metadata) have no local
counterpart and are dropped going to local names.  Pure string work: no torch, no TE.
"""
from __future__ import annotations

from typing import Dict, Iterable, Mapping, Optional, TypeVar

# (TE suffix, local suffix) within one transformer layer
LAYER_NAME_MAP = (
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
    # learned softmax denominator logits: TE's DotProductAttention holds them itself
    ("self_attention.core_attention.attention.softmax_offset",
     "self_attention.core_attention.softmax_offset"),
)
TE_EXTRA_STATE = "_extra_state"

V = TypeVar("V")


def _swap(name: str, pairs) -> str:
    for src, dst in pairs:
        if name == src or name.endswith("." + src):
            return name[: len(name) - len(src)] + dst
    return name


def te_to_local_name(name: str) -> str:
    """The local backend's name of TE parameter ``name`` (unchanged if not fused)."""
    return _swap(name, LAYER_NAME_MAP)


def local_to_te_name(name: str, fused_mlp_norm: bool = True) -> str:
    """The TE backend's name of local parameter ``name``.  ``fused_mlp_norm=False`` for MoE
    models, whose TE layers keep the pre-MLP norm in its own slot (no linear to fuse into)."""
    pairs = [(local, te) for te, local in LAYER_NAME_MAP
             if fused_mlp_norm or not local.startswith("pre_mlp_layernorm.")]
    return _swap(name, pairs)


def to_local_names(state_dict: Mapping[str, V]) -> Dict[str, V]:
    """A TE model's ``state_dict`` under local names (``_extra_state`` dropped)."""
    out = {}
    for k, v in state_dict.items():
        if k.rsplit(".", 1)[-1] == TE_EXTRA_STATE:
            continue
        out[te_to_local_name(k)] = v
    return out


def to_te_names(state_dict: Mapping[str, V], fused_mlp_norm: bool = True) -> Dict[str, V]:
    """A local model's ``state_dict`` under TE names (load with ``strict=False``: TE
    modules add ``_extra_state`` entries of their own)."""
    return {local_to_te_name(k, fused_mlp_norm): v for k, v in state_dict.items()}


def canonical_renames(fqns: Iterable[str]) -> Dict[str, str]:
    """{TE FQN: local canonical name} for the fused-norm parameters among ``fqns`` (what a
    model passes to ``ParamTable.from_module``); empty for a local model."""
    out = {}
    for fqn in fqns:
        local = te_to_local_name(fqn)
        if local != fqn:
            out[fqn] = local
    return out


def check_round_trip(names: Iterable[str], fused_mlp_norm: bool = True) -> Optional[str]:
    """None when local -> TE -> local is the identity on ``names`` and injective, else the
    first name that breaks it (for tests and the converter's sanity check)."""
    seen = {}
    for n in names:
        te = local_to_te_name(n, fused_mlp_norm)
        if te_to_local_name(te) != n:
            return n
        if te in seen:
            return n
        seen[te] = n
    return None
