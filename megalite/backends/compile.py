"""``--compile``: torch.compile each transformer layer in place.

Per layer (not the whole model) because the layers are the unit everything else works on:
pipeline stages hold whole layers, recompute wraps parts of one, and every layer has the
same shapes, so one compiled graph is reused L times.  ``nn.Module.compile`` compiles in
place: parameter names, the ``ParamTable`` and checkpoints are unchanged.  On CUDA inductor
fuses the elementwise work around the GEMMs (norm, RoPE, SwiGLU, residual adds); on CPU the
flag works too but is off by default, so CPU runs are unchanged.
"""
from __future__ import annotations

from typing import Optional

from torch import nn


def transformer_layers(chunk: nn.Module) -> list:
    decoder = getattr(chunk, "decoder", None)
    layers = getattr(decoder, "layers", None)
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers or [])


def compile_layers(chunk: nn.Module, backend: Optional[str] = None, **options) -> int:
    """Compile every transformer layer of ``chunk`` in place; returns how many."""
    layers = transformer_layers(chunk)
    for layer in layers:
        if backend is None:
            layer.compile(**options)
        else:
            layer.compile(backend=backend, **options)
    return len(layers)
