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
from megalite.transformer.spec import LayerSpec  # noqa: F401  (re-exported)


def get_layer_spec(impl: str = "local") -> LayerSpec:
    """``local`` | ``transformer_engine`` | ``auto`` (local until a TE spec exists)."""
    if impl in ("local", "auto"):
        from megalite.backends.local import local_spec

        return local_spec()
    if impl == "transformer_engine":
        raise NotImplementedError("--transformer-impl transformer_engine is not available yet; "
                                  "use --transformer-impl local")
    raise ValueError(f"unknown --transformer-impl '{impl}'")


def context_parallel_spec(spec: LayerSpec, cp_comm_type: str) -> LayerSpec:
    """``spec`` with context-parallel core attention in the core-attention slot (ring
    attention for ``--cp-comm-type p2p``, Ulysses all-to-all for ``a2a``); every other slot
    and every parameter name unchanged.  GPTModel applies it when CP > 1."""
    layer = spec.layer.submodules
    attn = layer.self_attention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(
        attn.submodules, core_attention=core_attention_class(cp_comm_type)))
    layer = dataclasses.replace(layer, self_attention=attn)
    return dataclasses.replace(spec, layer=dataclasses.replace(spec.layer, submodules=layer))
