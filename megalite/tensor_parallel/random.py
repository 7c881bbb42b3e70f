"""Random state for tensor parallelism: a forkable RNG tracker and name-seeded init.

Dropout must agree across TP ranks where activations are replicated (the default
generator, seeded the same on every TP rank) and differ where they are split over TP
(attention heads; sequence shards with sequence parallelism).  ``RNGStatesTracker``
keeps extra generator states and swaps one in for a region (``fork``), for the CPU
generator and, when CUDA is available, the current CUDA generator.

``init_parameters`` draws every parameter as its FULL tensor from a generator seeded by
``crc32("{seed}:{global name}")`` and keeps this rank's chunk(s) as its ``ParamSpec`` says
(whatever groups split it), so the initial model is identical whatever TP, PP or
virtual-stage layout holds it.  A parameter already sharded further by FSDP2 (a DTensor)
gets its piece of that local tensor.
"""
from __future__ import annotations

import contextlib
import zlib
from typing import Dict, Iterable, Tuple

import torch
from torch import nn

from megalite.param_spec import Coords, ParamSpec

MODEL_PARALLEL_RNG = "model-parallel-rng"
TP_SEED_OFFSET = 2718  # Megatron's offset: tp seed = seed + 2718 + tp_rank


def _cuda_on() -> bool:
    return torch.cuda.is_available()


class RNGStatesTracker:
    """Named generator states that can be swapped in for a region of code."""

    def __init__(self):
        self.states: Dict[str, dict] = {}
        self._active = set()

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state '{name}' already exists")
        state = {"cpu": torch.Generator().manual_seed(seed).get_state()}
        if _cuda_on():
            orig = torch.cuda.get_rng_state()
            torch.cuda.manual_seed(seed)
            state["cuda"] = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(orig)
        self.states[name] = state

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the body on ``name``'s generator state; re-entrant for the same name."""
        if name in self._active:
            yield
            return
        if name not in self.states:
            raise KeyError(f"RNG state '{name}' was never added")
        saved = {"cpu": torch.get_rng_state()}
        torch.set_rng_state(self.states[name]["cpu"])
        if "cuda" in self.states[name]:
            saved["cuda"] = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(self.states[name]["cuda"])
        self._active.add(name)
        try:
            yield
        finally:
            self._active.discard(name)
            self.states[name]["cpu"] = torch.get_rng_state()
            torch.set_rng_state(saved["cpu"])
            if "cuda" in saved:
                self.states[name]["cuda"] = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(saved["cuda"])

    def get_states(self) -> Dict[str, dict]:
        """Copies of every state (for checkpoints and activation recomputation)."""
        return {n: {k: v.clone() for k, v in s.items()} for n, s in self.states.items()}

    def set_states(self, states: Dict[str, dict]) -> None:
        self.states = {n: {k: v.clone() for k, v in s.items()} for n, s in states.items()}


class NoTracker:
    """The tracker of a module no parallelize step has attached one to (a bare chunk built
    by a tool or a test): forking is a no-op and it holds no states."""

    def fork(self, name: str = MODEL_PARALLEL_RNG):
        return contextlib.nullcontext()

    def get_states(self) -> Dict[str, dict]:
        return {}

    def set_states(self, states: Dict[str, dict]) -> None:
        if states:
            raise ValueError("no RNG tracker is attached to restore these states into")


NO_TRACKER = NoTracker()


class DrawsFromTracker:
    """Mixin of a module whose dropout draws from the rank's tensor-parallel RNG tracker.

    No constructor takes the tracker: the parallelize step attaches the rank's tracker to
    every such module (``attach_rng_tracker``); until then ``rng_tracker`` is
    ``NO_TRACKER``."""
    rng_tracker = NO_TRACKER


class AttachedTracker:
    """For a library that keeps the tracker object it is handed at construction (TE's
    ``DotProductAttention`` calls ``get_rng_state_tracker()`` once and binds its ``fork``):
    forwards to whatever tracker the parallelize step attaches to ``owner`` afterwards."""

    def __init__(self, owner: DrawsFromTracker):
        self.owner = owner

    def fork(self, *name):
        return self.owner.rng_tracker.fork(*name)

    def get_states(self):
        return self.owner.rng_tracker.get_states()

    def set_states(self, states):
        self.owner.rng_tracker.set_states(states)


def attach_rng_tracker(module: nn.Module, tracker) -> None:
    """Point every ``DrawsFromTracker`` module under ``module`` (itself included) at
    ``tracker`` -- the one tracker a rank's chunks share."""
    for m in module.modules():
        if isinstance(m, DrawsFromTracker):
            m.rng_tracker = tracker


def model_parallel_tracker(seed: int, tp_rank: int) -> RNGStatesTracker:
    """A tracker whose model-parallel state differs per TP rank (seed + 2718 + tp_rank)."""
    tracker = RNGStatesTracker()
    tracker.add(MODEL_PARALLEL_RNG, seed + TP_SEED_OFFSET + tp_rank)
    return tracker


def name_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}:{name}".encode())


def full_init_tensor(init: tuple, shape, seed: int, name: str) -> torch.Tensor:
    """The full logical tensor a parameter named ``name`` starts from (fp32, CPU)."""
    kind = init[0]
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "ones":
        return torch.ones(shape)
    if kind == "normal":
        gen = torch.Generator().manual_seed(name_seed(seed, name))
        return torch.empty(shape).normal_(0.0, init[1], generator=gen)
    if kind == "log_uniform":   # log of U(lo, hi): Gated DeltaNet's A_log
        gen = torch.Generator().manual_seed(name_seed(seed, name))
        return torch.empty(shape).uniform_(init[1], init[2], generator=gen).log_()
    raise ValueError(f"unknown init {init!r} for {name}")


@torch.no_grad()
def init_parameters(named: Iterable[Tuple[str, nn.Parameter, ParamSpec]], seed: int,
                    coords: Coords) -> None:
    """Fill each ``(canonical name, param, spec)`` with its chunk(s) of the name-seeded full
    tensor; ``coords`` = ``{group: (rank, size)}`` (``param_spec.group_coords(state)``)."""
    for name, p, spec in named:
        if spec.init is None:
            continue
        full = full_init_tensor(spec.init, spec.full_shape, seed, name)
        copy_into_param(p, spec.shard(full, coords))


def copy_into_param(p: torch.Tensor, local: torch.Tensor) -> None:
    """``p.copy_(local)``; when ``p`` is a DTensor (FSDP2), each rank keeps its placement's
    piece of ``local`` (identical on every rank of the mesh, so no communication)."""
    if hasattr(p, "device_mesh") and hasattr(p, "placements"):
        # start-up time: torch.distributed's DCP/DTensor/FSDP packages, ~0.5 s
        from torch.distributed.tensor import distribute_tensor   # loaded by FSDP2 already
        local = distribute_tensor(local.to(device=p.device, dtype=p.dtype), p.device_mesh,
                                  p.placements, src_data_rank=None)
    p.copy_(local)
