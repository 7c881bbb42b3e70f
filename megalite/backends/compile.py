"""``--compile``: torch.compile each transformer layer in place.

Per layer (not the whole model) because the layers are the unit everything else works on:
pipeline stages hold whole layers, recompute wraps parts of one, and every layer has the
same shapes, so one compiled graph is reused L times.  ``nn.Module.compile`` compiles in
place: parameter names, the ``ParamTable`` and checkpoints are unchanged.  On CUDA inductor
fuses the elementwise work around the GEMMs (norm, RoPE, SwiGLU, residual adds); on CPU the
flag works too but is off by default, so CPU runs are unchanged.
"""
from __future__ import annotations

import os
from typing import Optional

from torch import nn
import torch._functorch.config as functorch_config


def transformer_layers(chunk: nn.Module) -> list:
    decoder = getattr(chunk, "decoder", None)
    layers = getattr(decoder, "layers", None)
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers or [])


def inductor_cache_per_cpu_capability() -> Optional[str]:
    """Give each ``ATEN_CPU_CAPABILITY`` its own inductor cache directory; returns it (None
    when the variable is unset or the user chose a cache directory).

    Why: torch 2.13's inductor cache is not keyed on that variable.  A CPU kernel compiled
    under one setting is reloaded under another and computes garbage: errors of 1e27-1e36
    were measured, with "double free or corruption" crashes the other way round.  Checking
    a run under ``ATEN_CPU_CAPABILITY=avx2`` after a default run is how this project tests
    its other CPU kinds, so the directories are kept apart."""
    # start-up time: torch._inductor takes ~3 s to import; only --compile with inductor needs it
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    default = os.path.abspath(default_cache_dir())
    if not capability or (chosen and os.path.abspath(chosen) != default):
        return None            # torch itself writes its default into the variable: not chosen
    path = os.path.join(default, f"aten_cpu_capability_{capability}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


BACKEND = "inductor"   # what --compile compiles with (tests swap in aot_eager: no codegen)


def compile_layers(chunk: nn.Module, backend: Optional[str] = None,
                   retains_graph: bool = False, **options) -> int:
    """Compile every transformer layer of ``chunk`` in place (with ``backend``, default
    ``BACKEND``); returns how many.  ``retains_graph``: the schedule runs a layer's backward
    in two passes over one graph (zero bubble's B then W, ``retain_graph=True``), which
    AOTAutograd's donated buffers forbid, so they are turned off."""
    if retains_graph:
        functorch_config.donated_buffer = False
    backend = backend or BACKEND
    if backend == "inductor":
        inductor_cache_per_cpu_capability()
    layers = transformer_layers(chunk)
    for layer in layers:
        layer.compile(backend=backend, **options)
    return len(layers)
