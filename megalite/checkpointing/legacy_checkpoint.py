"""Resume from a pre-DCP megalite checkpoint (``mp_rank_*/model.pt`` + ``optim/rank_*.pt``).

Weights reshard to any TP/PP (``model_io``); optimizer and RNG state load at the same
layout only.  The values go through the training state's parts (``train_state.py``), as a
DCP load does: the files only say where each part's values are.  Every file is read with
``torch.load(weights_only=True)``: a crafted pickle fails to load instead of running.  Save
again to move the run to the DCP format.
"""
from __future__ import annotations

import os

import torch

from megalite.checkpointing.model_io import iteration_dir, load_model_shards, read_metadata
from megalite.config.parallel_dims import ParallelDims


def load_legacy_checkpoint(ts, ckpt, root: str, iteration: int) -> None:
    """Restore the parts of ``ts`` (a ``TrainState``) from the legacy checkpoint at
    ``iteration`` of ``root``; ``ckpt``: the ``CheckpointConfig`` (which parts load)."""
    model = ts.part("model")
    targets = model.load_targets()          # views of the parameters: filled in place
    load_model_shards(root, model.model_chunks, None, model.state, iteration)
    model.load_state_dict(targets)          # the strategy's fp32 masters follow the weights
    meta = read_metadata(root, iteration)
    extra = meta.get("extra") or {}
    if ts.part("moe_expert_bias") is not None:
        ts.part("moe_expert_bias").load_state_dict(extra.get("moe_expert_bias", {}))
    if ckpt.finetune:
        return
    batch = ts.description["args"]["training"]["global_batch_size"]
    ts.part("data").load_state_dict({"iteration": iteration, "consumed_train_samples":
                                     extra.get("consumed_samples", iteration * batch)})
    if ckpt.no_load_optim and ckpt.no_load_rng:
        return
    rank, layout = ts.parallel.rank, ts.description["layout"]
    path = os.path.join(iteration_dir(root, iteration), "optim", f"rank_{rank:05d}.pt")
    same = ParallelDims.normalize_metadata(extra.get("layout")) == \
        ParallelDims.normalize_metadata(layout)
    if not same or not os.path.isfile(path):
        if rank == 0:
            print(f"> optimizer and RNG state of the legacy checkpoint not loaded: its layout "
                  f"{extra.get('layout')} differs from this run's {layout}",
                  flush=True)
        return
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"{path}: refused to load ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    if not ckpt.no_load_optim:   # the optimizer's own state dict: the same layout only
        ts.part("optimizer").optimizer.load_state_dict(blob["optimizer"])
    if not ckpt.no_load_rng:
        rng = ts.part("rng")
        rng.load_state_dict(_rng_values(blob["rng"], rng.coords()))


def _rng_values(saved: dict, coords: dict) -> dict:
    """The legacy RNG blob ({"cpu", "cuda", "trackers": [per chunk]}) as the RNG part's
    state of one source rank at this rank's coordinates (the layout matched)."""
    out = {"ranks": [coords], "rank0.cpu": saved["cpu"]}
    if "cuda" in saved:
        out["rank0.cuda"] = saved["cuda"]
    for c, states in enumerate(saved["trackers"]):
        for name, per_device in states.items():
            for dev, t in per_device.items():
                out[f"rank0.tracker{c}.{name}.{dev}"] = t
    return out
