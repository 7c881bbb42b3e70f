"""Which implementation builds the hot layers (linears, norms, core attention).

``get_layer_spec(impl)`` returns a ``LayerSpec``: the submodule tree of a transformer
layer (``transformer/spec.py``) plus the two modules around the layers.  The transformer
modules only ever build submodules through it, so a Transformer Engine spec (fused
norm+linear slots, TE core attention) can replace the local one without touching them.
Nothing here imports transformer_engine unless that backend is asked for.
"""
from __future__ import annotations

from megalite.transformer.spec import LayerSpec  # noqa: F401  (re-exported)


def get_layer_spec(impl: str = "local", cp_comm_type: str = None) -> LayerSpec:
    """``local`` | ``transformer_engine`` | ``auto`` (local until a TE spec exists).

    ``cp_comm_type`` (``p2p`` | ``a2a``, given when CP > 1) puts context-parallel core
    attention in the core-attention slot."""
    if impl in ("local", "auto"):
        from megalite.backends.local import context_parallel_spec, local_spec

        spec = local_spec()
        return context_parallel_spec(spec, cp_comm_type) if cp_comm_type else spec
    if impl == "transformer_engine":
        raise NotImplementedError("--transformer-impl transformer_engine is not available yet; "
                                  "use --transformer-impl local")
    raise ValueError(f"unknown --transformer-impl '{impl}'")
