"""The interim (pre-DCP) sharded model format -- still read -- and model-only loading of
either format.

Layout::

    DIR/latest_checkpointed_iteration.txt
    DIR/iter_0000100/metadata.json                  model config, tp, pp, iteration, extra
    DIR/iter_0000100/mp_rank_{tp:02d}_{pp:03d}/model.pt
        {"model": {global name: local shard}, "meta": {global name: split rule}}
    DIR/iter_0000100/mp_rank_{tp:02d}_{pp:03d}/extra.pt   (optional, caller's dict)

Every shard file carries the split rule of each tensor (``ParamSpec.to_meta_dict``: the
TP split in the keys of the original ``ParamMeta``), so a checkpoint can be unsharded
without building a model and reloaded at any TP/PP (``load_model_shards`` reshards on the
fly, and reads DCP training checkpoints too; ``full_state_dict_from_checkpoint`` gives the
full tensors of either format, which the converter reads).  Vocabulary tensors are unsharded
to the logical (unpadded) vocabulary and re-padded for the target TP.  Nothing but
``save_model_shards`` (kept so the legacy readers stay tested) writes this format: the
converter writes the training format (``checkpointing.checkpoint.save_model_checkpoint``).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from megalite import comm
from megalite.checkpointing.sharding import unshard_tensors
from megalite.torch_classes import is_dtensor
from megalite.param_spec import ParamSpec, group_coords, param_table
from megalite.state_format.dcp_format import ChunkedTensor, load_chunked
from megalite.state_format.sharded_state import model_sharded_state_dict
from megalite.moe.moe_layer import expert_bias_key, moe_layers
from megalite.moe.moe_layer import expert_bias_entries
from megalite.state_format.dcp_format import load_full, saved_tensors

LATEST = "latest_checkpointed_iteration.txt"
FORMAT = "megalite-model-shards-v1"


def iteration_dir(directory: str, iteration: int) -> str:
    return os.path.join(directory, f"iter_{iteration:07d}")


def shard_dir(directory: str, iteration: int, tp_rank: int, pp_rank: int) -> str:
    return os.path.join(iteration_dir(directory, iteration), f"mp_rank_{tp_rank:02d}_{pp_rank:03d}")


def _chunks(model_chunks) -> List[nn.Module]:
    return [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)


def _named(chunks: List[nn.Module]):
    """(canonical name, param, spec) from each chunk's parameter table."""
    for chunk in chunks:
        yield from param_table(chunk).named(chunk)


def local_shards(model_chunks, whole: Optional[Dict[str, torch.Tensor]] = None
                 ) -> Tuple[Dict[str, torch.Tensor], Dict[str, dict]]:
    """This rank's shards and split rules, keyed by global name (tied copies once);
    tensors in ``whole`` (expert parameters gathered by ``gather_expert_params``) are
    written whole, with no split."""
    tensors, metas = {}, {}
    whole = whole or {}
    for name, p, spec in _named(_chunks(model_chunks)):
        if name in whole:
            tensors[name] = whole[name]
            metas[name] = ParamSpec(tuple(whole[name].shape)).to_meta_dict()
        elif name not in tensors:      # FSDP2: the TP-local tensor (collective over DP)
            full = p.full_tensor() if is_dtensor(p) else p
            tensors[name] = full.detach().cpu().clone()
            metas[name] = spec.to_meta_dict()
    return tensors, metas


def gather_expert_params(model_chunks, state) -> Dict[str, torch.Tensor]:
    """Full tensors of the parameters split over the expert grid (EP x expert-TP), gathered
    over the tp-ep group on every rank: the shard files are per (tp, pp) rank, so an expert
    tensor must be whole in them (it then reloads at any EP / expert-TP).  Collective."""
    named = [(n, p, s) for n, p, s in _named(_chunks(model_chunks))
             if s.expert and s.splits]
    if not named:
        return {}
    group = state["tp-ep"]
    coords = group_coords(state)
    mine = {g: coords[g] for g in ("ep", "expert-tp")}
    members = comm.all_gather_object(mine, group)
    out = {}
    for name, p, spec in named:
        local = p.detach().contiguous()
        buf = local.new_empty((group.size * local.shape[0], *local.shape[1:]))
        comm.all_gather_into_tensor(buf, local, group)
        out[name] = spec.unshard(list(zip(members, buf.cpu().chunk(group.size))))
    return out


def _atomic_save(obj, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _write_metadata(directory: str, iteration: int, model_cfg: dict, tp: int, pp: int,
                    extra: Optional[dict] = None) -> None:
    os.makedirs(iteration_dir(directory, iteration), exist_ok=True)
    meta = {"format": FORMAT, "iteration": iteration, "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp, "model": model_cfg}
    if extra is not None:
        try:
            meta["extra"] = json.loads(json.dumps(extra))
        except (TypeError, ValueError):
            pass  # not JSON: only in the per-rank extra.pt files
    with open(os.path.join(iteration_dir(directory, iteration), "metadata.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
    with open(os.path.join(directory, LATEST), "w") as f:
        f.write(str(iteration))


def save_model_shards(directory: str, iteration: int, model_chunks, cfg, state,
                      extra: Optional[dict] = None) -> None:
    """Write this rank's shards (DP rank 0 and CP rank 0 only); collective over the world.

    ``extra`` is stored per (tp, pp) rank in ``extra.pt`` (see ``load_extra``) and, when it
    is JSON-serializable, global rank 0's copy also goes into metadata.json["extra"].
    """
    whole = gather_expert_params(model_chunks, state)
    fsdp = any(is_dtensor(p) for c in _chunks(model_chunks) for p in c.parameters())
    gathered = local_shards(model_chunks, whole) if fsdp else None  # every DP rank gathers
    if state["dp"].rank == 0 and state["cp"].rank == 0:
        path = shard_dir(directory, iteration, state.tp.rank, state.pp.rank)
        os.makedirs(path, exist_ok=True)
        tensors, metas = gathered or local_shards(model_chunks, whole)
        _atomic_save({"model": tensors, "meta": metas}, os.path.join(path, "model.pt"))
        if extra is not None:
            _atomic_save(extra, os.path.join(path, "extra.pt"))
    comm.barrier()
    if state.rank == 0:  # latest marker only once every shard is on disk
        _write_metadata(directory, iteration, dataclasses.asdict(cfg.model), state.tp.size,
                        state.pp.size, extra)
    comm.barrier()


def read_metadata(directory: str, iteration: Optional[int] = None) -> dict:
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory '{directory}' does not exist")
    if iteration is None:
        latest = os.path.join(directory, LATEST)
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"'{directory}' has no {LATEST}: not a megalite checkpoint")
        with open(latest) as f:
            iteration = int(f.read().strip())
    path = os.path.join(iteration_dir(directory, iteration), "metadata.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"missing {path}")
    with open(path) as f:
        meta = json.load(f)
    model = meta.get("model")
    if isinstance(model, dict) and model.get("transformer_impl") == "transformer_engine":
        # the weights are backend-neutral (backends/te_names.py): a tool that rebuilds the
        # model from this metadata (generate, convert, HF export) picks its own backend
        model["transformer_impl"] = "auto"
    return meta


class _Reader:
    """Lazy, memory-mapped access to every shard file of one saved iteration."""

    def __init__(self, directory: str, iteration: Optional[int] = None):
        self.meta = read_metadata(directory, iteration)
        self.iteration = self.meta["iteration"]
        self.tp = self.meta["tensor_model_parallel_size"]
        self.pp = self.meta["pipeline_model_parallel_size"]
        self.dir = directory
        self._files: Dict[tuple, dict] = {}
        self.stage_of: Dict[str, int] = {}
        for pp_rank in range(self.pp):  # tied copies live on two stages: keep the first
            for name in self.file(0, pp_rank)["model"]:
                self.stage_of.setdefault(name, pp_rank)

    def file(self, tp_rank: int, pp_rank: int) -> dict:
        key = (tp_rank, pp_rank)
        if key not in self._files:
            path = os.path.join(shard_dir(self.dir, self.iteration, tp_rank, pp_rank), "model.pt")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"missing shard file {path}")
            self._files[key] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        return self._files[key]

    def names(self) -> List[str]:
        return list(self.stage_of)

    def saved_spec(self, name: str) -> ParamSpec:
        return ParamSpec.from_meta_dict(self.file(0, self.stage_of[name])["meta"][name])

    def full(self, name: str) -> torch.Tensor:
        stage, spec = self.stage_of[name], self.saved_spec(name)
        if not spec.splits:
            return self.file(0, stage)["model"][name].clone()
        return unshard_tensors([self.file(t, stage)["model"][name] for t in range(self.tp)], spec)

    def shard(self, name: str, spec: ParamSpec, coords) -> torch.Tensor:
        """This rank's local tensor of ``name`` for ``spec`` at group coordinates
        ``coords``: read directly when the file's split is the same, else resharded."""
        saved = self.saved_spec(name)
        if saved.full_shape != spec.full_shape:
            raise ValueError(f"checkpoint tensor '{name}' has full shape {saved.full_shape}, "
                             f"the model expects {spec.full_shape}")
        tp_only = all(g == "tp" for g in spec.split_groups)
        if saved.same_split(spec) and tp_only and (not spec.splits or self.tp == coords["tp"][1]):
            return self.file(coords["tp"][0] if spec.splits else 0,
                             self.stage_of[name])["model"][name]
        return spec.shard(self.full(name), coords)


DCP_FORMAT = "megalite-dcp-v1"     # training checkpoints (megalite/checkpointing/checkpoint.py)


def is_dcp(meta: dict) -> bool:
    return meta.get("format") == DCP_FORMAT


@torch.no_grad()
def load_model_shards(directory: str, model_chunks, cfg, state,
                      iteration: Optional[int] = None, strict: bool = True) -> int:
    """Fill ``model_chunks`` from a checkpoint saved at any TP/PP; returns its iteration.
    Reads both this interim format and DCP training checkpoints (weights only)."""
    meta = read_metadata(directory, iteration)
    if is_dcp(meta):
        sd = {k: ChunkedTensor(v.global_shape, v.chunks)
              for k, v in model_sharded_state_dict(_chunks(model_chunks), state).items()}
        grid = getattr(state, "grid", None)
        load_chunked(sd, iteration_dir(directory, meta["iteration"]),
                     single=grid is None or grid.world_size == 1)
        return meta["iteration"]
    reader = _Reader(directory, iteration)
    coords = group_coords(state)
    missing = []
    for name, p, spec in _named(_chunks(model_chunks)):
        if name not in reader.stage_of:
            missing.append(name)
            continue
        value = reader.shard(name, spec, coords)
        if is_dtensor(p):     # FSDP2: keep this rank's dim-0 piece (no communication)
            # start-up time: torch.distributed's DCP/DTensor/FSDP packages, ~0.5 s
            from torch.distributed.tensor import distribute_tensor
            value = distribute_tensor(value.to(p.dtype), p.device_mesh, p.placements,
                                      src_data_rank=None)
        p.copy_(value)
    if missing and strict:
        raise KeyError(f"checkpoint '{directory}' lacks {len(missing)} parameters, e.g. "
                       f"{missing[:3]}")
    return reader.iteration


def load_extra(directory: str, state, iteration: Optional[int] = None) -> Optional[dict]:
    """The ``extra`` dict this (tp, pp) rank saved, or None."""
    it = read_metadata(directory, iteration)["iteration"]
    path = os.path.join(shard_dir(directory, it, state.tp.rank, state.pp.rank), "extra.pt")
    return torch.load(path, map_location="cpu", weights_only=False) \
        if os.path.isfile(path) else None


@torch.no_grad()
def load_full_state_dict(model_chunks, full_sd: Dict[str, torch.Tensor], state,
                         strict: bool = True) -> None:
    """Copy full (unpadded) tensors into this rank's chunks (``state``: its ParallelState;
    each parameter's spec says which of its groups split it)."""
    coords = group_coords(state)
    missing = []
    for name, p, spec in _named(_chunks(model_chunks)):
        if name not in full_sd:
            missing.append(name)
            continue
        p.copy_(spec.shard(full_sd[name], coords))
    for chunk in _chunks(model_chunks):      # router buffers (MoE expert bias) by their name
        num_layers = chunk.model_cfg.num_layers
        for n, layer in moe_layers([chunk]).items():
            key = expert_bias_key(n, num_layers)
            if layer.router.expert_bias is not None and key in full_sd:
                layer.router.expert_bias.copy_(full_sd[key])
    if missing and strict:
        raise KeyError(f"state dict lacks {len(missing)} parameters, e.g. {missing[:3]}")


def full_state_dict_from_checkpoint(directory: str, iteration: Optional[int] = None
                                    ) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """(model config dict, {global name: full unpadded tensor}); single process."""
    meta = read_metadata(directory, iteration)
    bias = (meta.get("extra") or {}).get("moe_expert_bias")   # router buffers, by layer
    if is_dcp(meta):
        it_dir = iteration_dir(directory, meta["iteration"])
        keys = [k for k in saved_tensors(it_dir) if k.startswith("model.")]
        full = {k[len("model."):]: v for k, v in load_full(it_dir, keys).items()}
    else:
        reader = _Reader(directory, iteration)
        full = {name: reader.full(name) for name in reader.names()}
    full.update(expert_bias_entries(bias, meta["model"]["num_layers"]))
    return meta["model"], full
