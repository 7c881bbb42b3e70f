"""Save / resume a training run: model shards (any-layout reload) + optimizer + position.

Model weights use ``megalite.checkpointing.model_io`` (per-rank shards keyed by global
parameter names, reloadable at another TP/PP).  Optimizer state is per rank and only
reloads at the same layout; at another layout it is skipped with a message (as with
``--no-load-optim``).
"""
from __future__ import annotations

import os

import torch

from megalite import comm
from megalite.checkpointing.model_io import (load_model_shards, read_metadata,
                                             save_model_shards)
from megalite.distributed.replicas import check_replicas
from megalite.moe.moe_layer import expert_bias_state, load_expert_bias_state


def _iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _layout(trainer) -> dict:
    p = trainer.cfg.parallel
    out = {"tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep, "world_size": trainer.cfg.world_size,
           "vpp": trainer.state.vpp_size, "bf16": trainer.cfg.optimizer.bf16}
    if p.use_distributed_optimizer:     # sharded optimizer state: another layout entirely
        out["distributed_optimizer"] = True
    return out


def save_training_checkpoint(trainer) -> str:
    cfg, state = trainer.cfg, trainer.state
    trainer.strategy.wait_param_gathers()         # --overlap-param-gather: gathers in flight
    check_replicas(trainer.model_chunks, state)   # never write drifted copies to disk
    root = cfg.checkpoint.save
    d = cfg.data
    extra = {"consumed_samples": trainer.consumed_samples, "layout": _layout(trainer),
             "tokenizer": {"tokenizer_type": d.tokenizer_type,
                           "tokenizer_model": os.path.abspath(d.tokenizer_model)
                           if d.tokenizer_model else None,
                           "vocab_size": cfg.model.vocab_size}}
    if cfg.model.moe_router_enable_expert_bias:   # a buffer, not a parameter: kept here
        extra["moe_expert_bias"] = expert_bias_state(trainer.model_chunks, state)
    save_model_shards(root, trainer.iteration, trainer.model_chunks, cfg, state, extra)
    path = os.path.join(_iter_dir(root, trainer.iteration), "optim", f"rank_{state.rank:05d}.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"optimizer": trainer.optimizer.state_dict(), "rng": _rng_states(trainer)}, path)
    comm.barrier()
    return path


def load_training_checkpoint(trainer) -> None:
    cfg, state = trainer.cfg, trainer.state
    root = cfg.checkpoint.load
    iteration = load_model_shards(root, trainer.model_chunks, cfg, state)
    trainer.optimizer.reload_model_params()    # fp32 masters follow the loaded weights
    meta = read_metadata(root, iteration)
    extra = meta.get("extra", {})
    load_expert_bias_state(trainer.model_chunks, extra.get("moe_expert_bias", {}))
    if cfg.checkpoint.finetune:
        return
    trainer.iteration = iteration
    trainer.consumed_samples = extra.get("consumed_samples", iteration *
                                         cfg.training.global_batch_size)
    same_layout = extra.get("layout") == _layout(trainer)
    path = os.path.join(_iter_dir(root, iteration), "optim", f"rank_{state.rank:05d}.pt")
    if cfg.checkpoint.no_load_optim and cfg.checkpoint.no_load_rng:
        return
    if not same_layout or not os.path.isfile(path):
        if state.rank == 0:
            print(f"> optimizer and RNG state not loaded: checkpoint layout {extra.get('layout')} "
                  f"differs from this run's {_layout(trainer)} (weights were resharded)", flush=True)
        return
    blob = torch.load(path, map_location="cpu", weights_only=False)
    if not cfg.checkpoint.no_load_optim:
        trainer.optimizer.load_state_dict(blob["optimizer"])
    if not cfg.checkpoint.no_load_rng:
        _set_rng_states(trainer, blob["rng"])


def _rng_states(trainer) -> dict:
    """Every generator a resumed run must continue: the default CPU (and CUDA) generator and
    each model chunk's tracker (dropout inside tensor-parallel regions draws from those)."""
    out = {"cpu": torch.get_rng_state(),
           "trackers": [c.rng_tracker.get_states() for c in trainer.model_chunks]}
    if trainer.device == "cuda":
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_states(trainer, rng) -> None:
    if isinstance(rng, torch.Tensor):   # checkpoints written before the trackers were saved
        torch.set_rng_state(rng)
        return
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and trainer.device == "cuda":
        torch.cuda.set_rng_state(rng["cuda"])
    for chunk, states in zip(trainer.model_chunks, rng["trackers"]):
        chunk.rng_tracker.set_states(states)
