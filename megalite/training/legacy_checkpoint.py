"""Resume from a pre-DCP megalite checkpoint (``mp_rank_*/model.pt`` + ``optim/rank_*.pt``).

Weights reshard to any TP/PP (``model_io``); optimizer and RNG state load at the same
layout only.  Every file is read with ``torch.load(weights_only=True)``: a crafted pickle
fails to load instead of running.  Save again to move the run to the DCP format.
"""
from __future__ import annotations

import os

import torch

from megalite.checkpointing.model_io import iteration_dir, load_model_shards, read_metadata
from megalite.config.parallel_dims import ParallelDims


def load_legacy_checkpoint(trainer, root: str, iteration: int, layout: dict) -> None:
    """``layout``: this run's layout (optimizer and RNG state load only when it matches)."""
    cfg, state = trainer.cfg, trainer.state
    from megalite.moe.moe_layer import load_expert_bias_state

    load_model_shards(root, trainer.model_chunks, cfg, state, iteration)
    trainer.optimizer.reload_model_params()
    extra = read_metadata(root, iteration).get("extra") or {}
    load_expert_bias_state(trainer.model_chunks, extra.get("moe_expert_bias", {}))
    if cfg.checkpoint.finetune:
        return
    trainer.iteration = iteration
    trainer.consumed_samples = extra.get("consumed_samples",
                                         iteration * cfg.training.global_batch_size)
    if cfg.checkpoint.no_load_optim and cfg.checkpoint.no_load_rng:
        return
    path = os.path.join(iteration_dir(root, iteration), "optim", f"rank_{state.rank:05d}.pt")
    same = ParallelDims.normalize_metadata(extra.get("layout")) == \
        ParallelDims.normalize_metadata(layout)
    if not same or not os.path.isfile(path):
        if state.rank == 0:
            print(f"> optimizer and RNG state of the legacy checkpoint not loaded: its layout "
                  f"{extra.get('layout')} differs from this run's {layout}",
                  flush=True)
        return
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"{path}: refused to load ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    if not cfg.checkpoint.no_load_optim:
        trainer.optimizer.load_state_dict(blob["optimizer"])
    if not cfg.checkpoint.no_load_rng:
        rng = blob["rng"]
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and trainer.device == "cuda":
            torch.cuda.set_rng_state(rng["cuda"])
        for chunk, states in zip(trainer.model_chunks, rng["trackers"]):
            chunk.rng_tracker.set_states(states)
