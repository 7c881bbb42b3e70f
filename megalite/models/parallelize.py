"""The parallelize phase: what happens to a rank's model chunks after they are built.

``GPTModel(...)`` only builds structure (tensor-parallel layers are constructed sharded,
Megatron style). Training policy is applied afterwards, in torchtitan's order:

1. TP structure: attach the rank's tensor-parallel RNG tracker to every module that draws
   dropout in a TP region (one tracker shared by all chunks of a rank, seeded per stage);
2. activation recomputation (``--recompute-*``), which captures that tracker;
3. ``--compile``: each transformer layer compiled in place (``backends/compile.py``;
   FSDP2 wraps later, in its strategy);
4. initialisation: every parameter drawn as its full tensor from a generator seeded by
   (seed, canonical name), then sliced -- so the order of the steps above cannot change it.
"""
from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

from megalite.tensor_parallel.random import model_parallel_tracker
from megalite.transformer.recompute import configure_layer_recompute, configure_recompute

STAGE_SEED_OFFSET = 100   # tracker seed = seed + 100 * pp rank (Megatron's per-stage offset)


def stage_rng_tracker(cfg, state):
    """The tensor-parallel RNG tracker of this rank (shared by its virtual stages)."""
    return model_parallel_tracker(cfg.training.seed + STAGE_SEED_OFFSET * state.pp.rank,
                                  state.tp.rank)


def apply_rng_tracker(chunk: nn.Module, tracker) -> None:
    """Every module that forks the TP tracker for dropout exposes ``rng_tracker``."""
    for module in chunk.modules():
        if hasattr(module, "rng_tracker"):
            module.rng_tracker = tracker


def apply_recompute(chunk: nn.Module, training_cfg) -> None:
    configure_recompute(chunk.decoder, training_cfg)
    if getattr(chunk, "mtp", None) is not None:     # the MTP modules' transformer layers
        configure_layer_recompute([layer.transformer_layer for layer in chunk.mtp.layers],
                                  training_cfg, chunk.decoder.rng_tracker)


def is_meta(chunk: nn.Module) -> bool:
    return any(p.is_meta for p in chunk.parameters())


def parallelize_model(chunks: Sequence[nn.Module], cfg, state, *, rng_tracker=None,
                      init_weights: bool = True) -> list:
    """Apply TP structure -> recompute -> init to ``chunks`` in place; returns them.

    ``rng_tracker`` defaults to ``stage_rng_tracker``; chunks on the meta device are left
    uninitialised (allocate them first)."""
    tracker = rng_tracker if rng_tracker is not None else stage_rng_tracker(cfg, state)
    for chunk in chunks:
        apply_rng_tracker(chunk, tracker)
    for chunk in chunks:
        apply_recompute(chunk, cfg.training)
    if getattr(cfg.training, "compile", False):      # --compile: each layer, in place
        from megalite.backends.compile import compile_layers

        for chunk in chunks:
            compile_layers(chunk)
    if init_weights:
        for chunk in chunks:
            if not is_meta(chunk):
                chunk.initialize(cfg.training.seed)
    return list(chunks)
