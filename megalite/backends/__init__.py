"""Which implementation builds the hot layers (linears, norms, core attention).

``get_layer_spec(impl)`` returns a ``LayerSpec``; the transformer modules only ever build
layers through it, so a Transformer Engine spec can replace the local one without
touching them.  Nothing here imports transformer_engine unless that backend is asked for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class LayerSpec:
    column_parallel_linear: Callable  # (in, out, *, tp_group, bias, sequence_parallel, ...)
    row_parallel_linear: Callable     # (in, out, *, tp_group, bias, input_is_parallel, ...)
    norm: Callable                    # (model_cfg, hidden, sequence_parallel, device, dtype)
    core_attention: Callable          # (model_cfg, rng_tracker, layer_number)


def get_layer_spec(impl: str = "local") -> LayerSpec:
    """``local`` | ``transformer_engine`` | ``auto`` (local until a TE spec exists)."""
    if impl in ("local", "auto"):
        from megalite.backends.local import local_spec

        return local_spec()
    if impl == "transformer_engine":
        raise NotImplementedError("--transformer-impl transformer_engine is not available yet; "
                                  "use --transformer-impl local")
    raise ValueError(f"unknown --transformer-impl '{impl}'")
