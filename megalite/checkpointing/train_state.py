"""The training state as a composition of DCP ``Stateful`` parts, each kept by its owner.

Why: a checkpoint (``checkpointing/checkpoint.py``) and an in-memory snapshot hold the same
state; neither should know how an optimizer lays out its moments or where a tracker keeps
its generators.  Each owner says it once, as ``state_dict()`` / ``load_state_dict()``
(``torch.distributed.checkpoint.stateful.Stateful``), tensors as ``ChunkedTensor``s (global
shape + this rank's chunks at global offsets, so DCP reshards them); ``TrainState``
composes them in load order:

==================  ===================================================  ======================
part                what it holds                                        owner
==================  ===================================================  ======================
model               weights of this rank's model chunks                  ``sharded_state.ModelState``
moe_expert_bias     routers' expert biases (JSON)                        ``moe_layer.ExpertBiasState``
data                iteration, samples consumed per split                ``data.position.DataPosition``
schedule            the LR/WD schedule's lag (fp16 skipped steps)        ``lr_schedule.SchedulePosition``
grad_scaler         the fp16 loss scaler                                 ``grad_scaler.*GradScaler``
optimizer           moments, fp32 masters, step (plain / dist. / FSDP2)  ``optimizer_state.OptimizerState``
rng                 CPU/CUDA generators and trackers, per rank           ``rng_state.RNGState``
==================  ===================================================  ======================

Loading is DCP's two phases: ``load_targets`` (the tensors a source fills in place, chosen
from what it holds) then ``load_state_dict``.  ``METADATA_PLACES`` is the on-disk format of
the parts' JSON values (``metadata.json``): where each sits, so checkpoints of every
earlier version and ``tools/checkpoint/convert.py`` outputs keep loading.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch.distributed as dist

if TYPE_CHECKING:   # the package costs ~0.5 s of start-up; the protocol is two methods
    from torch.distributed.checkpoint.stateful import Stateful

from megalite import comm
from megalite.state_format.dcp_format import ChunkedTensor
from megalite.checkpointing.model_io import DCP_FORMAT as FORMAT
from megalite.state_format.sharded_state import ModelState
from megalite.distributed.replicas import check_replicas
from megalite.errors import CheckpointError
from megalite.moe.moe_layer import ExpertBiasState
from megalite.tensor_parallel.rng_state import RNGState

# (part, key or None for the part's whole state) -> its places in metadata.json; a save
# writes every place, a load reads the first one present.
METADATA_PLACES: Dict[Tuple[str, Optional[str]], Tuple[Tuple[str, ...], ...]] = {
    ("data", "iteration"): (("iteration",),),
    ("data", "consumed_train_samples"): (("consumed_samples",), ("extra", "consumed_samples")),
    ("data", "consumed_valid_samples"): (("extra", "consumed_valid_samples"),),
    ("data", "consumed_test_samples"): (("extra", "consumed_test_samples"),),
    ("schedule", "skipped_samples"): (("extra", "loop_state", "skipped_samples"),),
    ("schedule", "skipped_iterations"): (("extra", "loop_state", "skipped_iterations"),),
    ("grad_scaler", None): (("extra", "loop_state", "grad_scaler"),),
    ("moe_expert_bias", None): (("extra", "moe_expert_bias"),),
    ("optimizer", "step"): (("optimizer_step",),),
    ("rng", "ranks"): (("rng_ranks",),),
}


class TrainState:
    """``parts``: (name, Stateful) in load order.  ``state_dict()`` is {name: the part's
    state}, as DCP nests Statefuls; ``tensors`` / ``values`` split it for the format.

    What a checkpointer needs beside the parts comes with them, so it never reaches into
    the loop: ``parallel`` (the ``ParallelState``: rank, world, background group),
    ``description`` (metadata.json's record of the run: ``run_description``) and
    ``before_save`` (run before the state is read: parameter gathers in flight finish,
    replicated copies are checked)."""

    def __init__(self, parts: Sequence[Tuple[str, Stateful]], parallel=None,
                 description: Optional[dict] = None,
                 before_save: Optional[Callable[[], None]] = None, trains: bool = True):
        self.parts: List[Tuple[str, Stateful]] = list(parts)
        for name, part in self.parts:
            if not (callable(getattr(part, "state_dict", None)) and
                    callable(getattr(part, "load_state_dict", None))):
                raise TypeError(f"training-state part '{name}' is not a DCP Stateful")
        self.parallel, self.description = parallel, description or {}
        self.before_save = before_save or (lambda: None)
        self.trains = trains      # False: evaluation only (--skip-train), no optimizer to load

    def names(self) -> List[str]:
        return [n for n, _ in self.parts]

    def part(self, name: str) -> Optional[Stateful]:
        return dict(self.parts).get(name)

    def subset(self, names: Iterable[str]) -> "TrainState":
        keep = set(names)
        return TrainState([(n, p) for n, p in self.parts if n in keep], self.parallel,
                          self.description, self.before_save)

    def state_dict(self) -> Dict[str, dict]:
        return {name: part.state_dict() for name, part in self.parts}

    def load_state_dict(self, sd: Dict[str, dict]) -> None:
        for name, part in self.parts:
            if name in sd:
                part.load_state_dict(sd[name])

    def load_targets(self, saved: dict, values: Dict[str, dict]) -> Dict[str, dict]:
        """{part: {key: ChunkedTensor}} to fill from a source holding ``saved`` ({flat key:
        DCP tensor metadata}); a part without ``load_targets`` is JSON only."""
        out = {}
        for name, part in self.parts:
            if hasattr(part, "load_targets"):
                mine = {k[len(name) + 1:]: v for k, v in saved.items()
                        if k.startswith(name + ".")}
                out[name] = part.load_targets(mine, values.get(name, {}))
        return out


def tensors_of(sd: Dict[str, dict]) -> Dict[str, ChunkedTensor]:
    """The flat DCP state dict of a composed state: ``<part>.<key>`` -> tensor."""
    return {f"{name}.{k}": v for name, part in sd.items() if isinstance(part, dict)
            for k, v in part.items() if isinstance(v, ChunkedTensor)}


def to_metadata(sd: Dict[str, dict]) -> dict:
    """The parts' JSON values placed as ``METADATA_PLACES`` says (nested dict)."""
    meta: dict = {}
    for (name, key), places in METADATA_PLACES.items():
        if name not in sd:
            continue
        value = sd[name] if key is None else sd[name].get(key)
        for place in places:
            node = meta
            for step in place[:-1]:
                node = node.setdefault(step, {})
            node[place[-1]] = value
    return meta


def from_metadata(meta: dict) -> Dict[str, dict]:
    """{part: JSON values} of a checkpoint's metadata; absent places stay absent (each part
    knows its defaults), a whole-part value that is null or empty is skipped."""
    out: Dict[str, dict] = {}
    for (name, key), places in METADATA_PLACES.items():
        for place in places:
            node = meta
            for step in place:
                node = node.get(step) if isinstance(node, dict) else None
            if node is not None:
                break
        if key is None:
            if node:
                out[name] = node
        elif node is not None:
            out.setdefault(name, {})[key] = node
    return out


def merge(meta: dict, more: dict) -> dict:
    """``meta`` with ``more``'s entries added, nested dicts merged."""
    for k, v in more.items():
        if isinstance(v, dict) and isinstance(meta.get(k), dict):
            merge(meta[k], v)
        else:
            meta[k] = v
    return meta


def check_against(targets: Dict[str, dict], saved: dict, where: str) -> None:
    """Every target the source must hold is there, in its global shape."""
    for key, obj in tensors_of(targets).items():
        if key in saved and tuple(saved[key].size) != tuple(obj.size()):
            raise CheckpointError(f"{os.path.join(where, '.metadata')}: '{key}' has shape "
                                  f"{tuple(saved[key].size)}, this run expects "
                                  f"{tuple(obj.size())} (a different model, which no layout "
                                  f"change can reshard)")
    missing = [f"model.{k}" for k in targets.get("model", {}) if f"model.{k}" not in saved]
    if missing:
        raise CheckpointError(f"{os.path.join(where, '.metadata')}: lacks {len(missing)} "
                              f"model tensors, e.g. {missing[:3]} (a checkpoint of another "
                              "model); load the checkpoint of this model")


def single_process(state) -> bool:
    """A one-rank run (tests run those inside a larger process group): no collectives."""
    return state.grid.world_size == 1 or not dist.is_initialized()


def world_gather(obj, state) -> list:
    """Every rank's ``obj`` (collective over the world; ``[obj]`` in a one-rank run)."""
    return [obj] if single_process(state) else comm.all_gather_object(obj, state.world_group())


def run_layout(cfg) -> dict:
    """metadata.json's ``layout``: the run's ``ParallelDims`` sizes (expert-TP included;
    ``ParallelDims.normalize_metadata`` reads older entries without it) and precision."""
    out = {**cfg.parallel_dims.to_metadata(), "bf16": cfg.optimizer.bf16}
    if cfg.parallel.use_distributed_optimizer:
        out["distributed_optimizer"] = True
    return out


def run_description(cfg) -> dict:
    """What metadata.json says about the run (JSON only; readers of the interim format
    find ``model``, the TP/PP sizes and ``extra`` where they always were).  The parts' own
    values are added by the checkpointer's capture."""
    d = cfg.data
    tokenizer = {"tokenizer_type": d.tokenizer_type,
                 "tokenizer_model": os.path.abspath(d.tokenizer_model)
                 if d.tokenizer_model else None, "vocab_size": cfg.model.vocab_size}
    return {"format": FORMAT, "optimizer_step": None, "rng_ranks": [],
            "layout": run_layout(cfg),
            "tensor_model_parallel_size": cfg.parallel.tp,
            "pipeline_model_parallel_size": cfg.parallel.pp,
            "model": dataclasses.asdict(cfg.model),
            "extra": {"layout": run_layout(cfg), "tokenizer": tokenizer,
                      "loop_state": {"grad_scaler": None}},
            "args": json.loads(json.dumps(dataclasses.asdict(cfg), default=str))}


def training_state(trainer) -> TrainState:
    """The composition of ``trainer``'s parts (module docstring), in load order: the
    weights first (the masters follow them), the optimizer after (its masters win); with
    the run's description and the save preparation the checkpointer takes along."""
    chunks, state, strategy = trainer.model_chunks, trainer.state, trainer.strategy

    def before_save():
        strategy.wait_param_gathers()         # --overlap-param-gather: gathers in flight
        check_replicas(chunks, state)         # never write drifted copies to disk
    parts: List[Tuple[str, Stateful]] = [
        ("model", ModelState(chunks, state, on_load=strategy.reload_model_params))]
    if trainer.cfg.model.moe_router_enable_expert_bias:
        parts.append(("moe_expert_bias", ExpertBiasState(chunks, state)))
    parts += [("data", trainer.position), ("schedule", trainer.schedule_position)]
    if strategy.grad_scaler is not None:
        parts.append(("grad_scaler", strategy.grad_scaler))
    parts += [("optimizer", strategy.state_part(chunks)),
              ("rng", RNGState(chunks, state, trainer.device,
                               lambda obj: world_gather(obj, state)))]
    return TrainState(parts, state, run_description(trainer.cfg), before_save,
                      trains=not trainer.cfg.training.skip_train)
