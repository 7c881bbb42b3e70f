"""The rank grid and every process group, as one explicit object.

Ranks are laid out with Megatron-Core's order string ``tp-cp-ep-dp-pp``: TP has stride 1
(so a TP group is consecutive ranks inside one node) and PP the largest stride.  The
arithmetic (``RankGrid``) is pure Python so ``--dry-run`` and the planner can use it
without any process group; ``ParallelState`` adds the torch.distributed handles.
Importing this module imports no torch (``megalite plan`` reads the grid; see
tests/unit/test_planner_cli.py): the functions that use torch.distributed import it.

Run ``python -m megalite.parallel_state --world-size 16 --tp 2 --cp 2 --pp 2`` to see
which ranks share each group.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, List, Optional

from megalite.config.parallel_dims import ParallelDims

ORDER = "tp-cp-ep-dp-pp"

# group name -> (grid, token of the dimensions it spans)
GROUP_TOKENS = {
    "tp": ("dense", "tp"),
    "cp": ("dense", "cp"),
    "dp": ("dense", "dp"),
    "pp": ("dense", "pp"),
    "dp-cp": ("dense", "dp-cp"),
    "tp-cp": ("dense", "tp-cp"),
    "mp": ("dense", "tp-pp"),          # model-parallel group (grad-norm reduction)
    "tp-dp-cp": ("dense", "tp-dp-cp"),
    "ep": ("expert", "ep"),
    "expert-tp": ("expert", "tp"),
    "expert-dp": ("expert", "dp"),
    "tp-ep": ("expert", "tp-ep"),      # expert tensor x expert parallel
    "expert-mp": ("expert", "tp-ep-pp"),   # expert model-parallel (expert grad-norm reduction)
}

# Hybrid sharding (``--num-distributed-optimizer-instances`` R > 1, Megatron's name): each
# data-parallel group (dp-cp, expert-dp) is cut into R contiguous *shard* groups -- the
# distributed optimizer's / FSDP2's instances, neighbouring ranks so their all-gathers and
# reduce-scatters stay inside a node -- and *replicate* groups across them (the same
# position in every instance: one all-reduce of the reduced shard per step).  With R = 1
# the shard group is the data-parallel group itself and the replicate group one rank.
HYBRID_GROUPS = {"dp-cp-shard": ("dp-cp", "shard"), "dp-cp-replicate": ("dp-cp", "replicate"),
                 "expert-dp-shard": ("expert-dp", "shard"),
                 "expert-dp-replicate": ("expert-dp", "replicate")}



def shard_group_names(grid: str, instances: int) -> tuple:
    """(shard group, replicate group or None) over which the distributed optimizer's buffers
    / FSDP2's mesh of ``grid`` ("dense" or "expert") shard: the data-parallel group itself,
    or with ``instances`` > 1 one instance of it and the other instances."""
    base = "dp-cp" if grid == "dense" else "expert-dp"
    return (base, None) if instances == 1 else (f"{base}-shard", f"{base}-replicate")


# torch DeviceMesh dimensions per grid, slowest-varying first (ORDER reversed, minus the
# dimension the grid fixes to 1); each name is also the name of this dimension's group.
MESH_DIMS = {"dense": ("pp", "dp", "cp", "tp"), "expert": ("pp", "expert-dp", "ep", "expert-tp")}


def hybrid_split(members: List[int], instances: int, part: str) -> List[List[int]]:
    """A data-parallel group's ``instances`` contiguous shard groups (``part="shard"``), or
    its replicate groups: the j-th member of every shard group (Megatron-Core's intra- and
    inter-instance groups of ``--num-distributed-optimizer-instances``)."""
    size = len(members) // instances
    shards = [members[i * size:(i + 1) * size] for i in range(instances)]
    return shards if part == "shard" else [list(col) for col in zip(*shards)]


def _prefix_product(values, start=1):
    out = [start]
    for v in values:
        start *= v
        out.append(start)
    return out


def _decompose(index, shape):
    """Mixed-radix digits of ``index`` with the first dimension varying fastest."""
    digits = []
    for size in shape:
        digits.append(index % size)
        index //= size
    return digits


def orthogonal_groups(sizes: List[int], mask: List[bool]) -> List[List[int]]:
    """All groups that vary the masked dimensions while the others stay fixed.

    ``sizes`` are in order-string order (stride 1 first).  Groups are listed with the
    first unmasked dimension varying fastest, members with the first masked dimension
    varying fastest -- the same enumeration as Megatron-Core's RankGenerator.
    """
    strides = _prefix_product(sizes)[:-1]
    masked = [(s, d) for s, d, m in zip(sizes, strides, mask) if m]
    unmasked = [(s, d) for s, d, m in zip(sizes, strides, mask) if not m]
    group_size = _prefix_product([s for s, _ in masked])[-1]
    num_groups = _prefix_product([s for s, _ in unmasked])[-1]
    groups = []
    for g in range(num_groups):
        base = sum(i * d for i, (_, d) in zip(_decompose(g, [s for s, _ in unmasked]), unmasked))
        groups.append([base + sum(i * d for i, (_, d) in
                                  zip(_decompose(r, [s for s, _ in masked]), masked))
                       for r in range(group_size)])
    return groups


class RankGrid:
    """Pure-Python rank arithmetic for the dense and the expert grid of one ``ParallelDims``
    (``RankGrid(dims)``; ``RankGrid(world_size, tp=2, ...)`` builds the dims from sizes).
    ``pipeline_vshape``: the schedule's second chunk runs back up the ranks (DualPipeV,
    ``pipeline_parallel/split.py``), so the first and the last stage are both pp rank 0."""

    def __init__(self, world_size, pipeline_vshape: bool = False, **sizes):
        self.pipeline_vshape = pipeline_vshape
        dims = world_size if isinstance(world_size, ParallelDims) else \
            ParallelDims(world=world_size, **sizes)
        problem = dims.problem()
        if problem:
            raise ValueError(problem)
        self.parallel_dims = dims
        self.world_size, self.vpp, self.dp_instances = dims.world, dims.vpp, dims.dp_instances
        self.dims = {grid: dims.grid_sizes(grid) for grid in ("dense", "expert")}
        self._cache: Dict[str, List[List[int]]] = {}

    def size(self, name: str) -> int:
        return len(self.groups(name)[0])

    def groups(self, name: str) -> List[List[int]]:
        if name not in self._cache:
            if name == "embedding":       # the first and the last stage's ranks
                self._cache[name] = [sorted({g[0], g[0 if self.pipeline_vshape else -1]})
                                     for g in self.groups("pp")]
            elif name in HYBRID_GROUPS:
                base, part = HYBRID_GROUPS[name]
                self._cache[name] = [
                    grp for g in self.groups(base)
                    for grp in hybrid_split(g, self.dp_instances, part)]
            else:
                grid, token = GROUP_TOKENS[name]
                order = ORDER.split("-")
                sizes = [self.dims[grid][d] for d in order]
                wanted = token.split("-")
                self._cache[name] = orthogonal_groups(sizes, [d in wanted for d in order])
        return self._cache[name]

    def group_of(self, name: str, rank: int) -> List[int]:
        for g in self.groups(name):
            if rank in g:
                return g
        raise KeyError(rank)

    def coords(self, rank: int) -> Dict[str, int]:
        """Position of ``rank`` in every group (its index inside the group)."""
        return {name: self.group_of(name, rank).index(rank) for name in GROUP_TOKENS}

    def describe(self) -> str:
        d, e = self.dims["dense"], self.dims["expert"]
        lines = [f"world {self.world_size}: TP={d['tp']} CP={d['cp']} DP={d['dp']} PP={d['pp']}"
                 f" | expert grid: ETP={e['tp']} EP={e['ep']} EDP={e['dp']} PP={e['pp']}"
                 f" | order {ORDER}"]
        hybrid = list(HYBRID_GROUPS) if self.dp_instances > 1 else []
        for name in [*GROUP_TOKENS, "embedding", *hybrid]:
            groups = self.groups(name)
            shown = " ".join(str(g).replace(" ", "") for g in groups[:16])
            more = f" ... (+{len(groups) - 16})" if len(groups) > 16 else ""
            lines.append(f"  {name:<10} size {len(groups[0]):<4} {shown}{more}")
        return "\n".join(lines)

    def mesh_ranks(self, grid: str = "dense"):
        """``(dim_names, ranks)``: the grid as a nested list of ranks of shape
        ``[size(d) for d in dim_names]`` (``MESH_DIMS``), as ``DeviceMesh`` takes it.
        Varying one index gives that dimension's group."""
        dims = self.dims[grid]
        names = MESH_DIMS[grid]
        shape = [dims[n.replace("expert-", "")] for n in names]
        strides = _prefix_product(shape[::-1])[:-1][::-1]    # last name has stride 1

        def build(level: int, base: int):
            if level == len(shape):
                return base
            return [build(level + 1, base + i * strides[level]) for i in range(shape[level])]
        return names, build(0, 0)

    @classmethod
    def from_config(cls, cfg) -> "RankGrid":
        return cls(ParallelDims.from_config(cfg), pipeline_vshape=cfg.parallel.pipeline_vshape)


@dataclass
class Group:
    """One process group as this rank sees it."""
    name: str
    ranks: List[int]
    handle: object = None  # torch ProcessGroup; None when the group is this rank alone
    global_rank: int = 0

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        return self.ranks.index(self.global_rank)


# Process groups keyed by member ranks, shared by every ParallelState of this process so
# that rebuilding a state (tests, restarts) reuses handles instead of opening new ones.
_HANDLE_CACHE: Dict[tuple, object] = {}


@dataclass
class ParallelState:
    """This rank's view of the grid: a ``Group`` per dimension plus pipeline position."""
    grid: RankGrid
    rank: int
    groups: Dict[str, Group] = field(default_factory=dict)
    virtual_pipeline_rank: int = 0
    meshes: Dict[tuple, object] = field(default_factory=dict, repr=False)
    timeout: object = None           # every group's timeout (--distributed-timeout-minutes)

    @classmethod
    def build(cls, grid: RankGrid, rank: int, create_groups: bool = True,
              timeout=None) -> "ParallelState":
        """Create every group.  All ranks must call this with the same grid.  ``timeout``
        (a timedelta, from ``--distributed-timeout-minutes``) applies to every group, not
        just the world: torch's default for a new group would be 30 minutes."""
        state = cls(grid=grid, rank=rank, timeout=timeout)
        for name in [*GROUP_TOKENS, "embedding", *HYBRID_GROUPS]:
            for ranks in grid.groups(name):
                handle = None
                if create_groups and len(ranks) > 1:
                    handle = _new_group(ranks, timeout)  # collective over the world
                if rank in ranks:
                    state.groups[name] = Group(name, ranks, handle, rank)
        return state

    def __getitem__(self, name: str) -> Group:
        return self.groups[name]

    def world_group(self) -> Group:
        """Every rank, on the default process group (collectives that must reach every
        shard and every pipeline stage: the fp16 overflow check, the precision probe)."""
        return Group("world", list(range(self.grid.world_size)), None, self.rank)

    def background_group(self, purpose: str = "async-save") -> Group:
        """A gloo group over the whole world of its own, for collectives run on another
        thread (``--async-save`` writes, the peer snapshots' replicas) that must never
        interleave with training's -- nor with another purpose's thread.  Collective on
        first use (every rank calls it); then cached per process and purpose."""
        ranks = list(range(self.grid.world_size))
        name = "background" if purpose == "async-save" else f"background-{purpose}"
        return Group(name, ranks, _new_group(ranks, self.timeout, backend="gloo",
                                             purpose=purpose), self.rank)

    # -- convenience queries ----------------------------------------------------------
    def size(self, name: str) -> int:
        return self.groups[name].size

    def local_rank(self, name: str) -> int:
        return self.groups[name].rank

    @property
    def tp(self) -> Group:
        return self.groups["tp"]

    @property
    def pp(self) -> Group:
        return self.groups["pp"]

    @property
    def dp(self) -> Group:
        return self.groups["dp"]

    @property
    def cp(self) -> Group:
        return self.groups["cp"]

    @property
    def vpp_size(self) -> int:
        return self.grid.vpp

    def is_first_stage(self, ignore_virtual: bool = False) -> bool:
        if not ignore_virtual and self.vpp_size > 1 and self.virtual_pipeline_rank != 0:
            return False
        return self.pp.rank == 0

    def is_last_stage(self, ignore_virtual: bool = False) -> bool:
        if self.grid.pipeline_vshape:     # the V's last block: rank 0's chunk 1
            return self.pp.rank == 0 and (ignore_virtual or self.virtual_pipeline_rank == 1)
        if not ignore_virtual and self.vpp_size > 1 and \
                self.virtual_pipeline_rank != self.vpp_size - 1:
            return False
        return self.pp.rank == self.pp.size - 1

    def device_mesh(self, device_type: str = "cpu", grid: str = "dense"):
        """A ``torch.distributed.device_mesh.DeviceMesh`` over the same rank layout, with
        dimensions named by ``MESH_DIMS[grid]`` (FSDP2 and DCP take a mesh, not our groups).
        Collective on first use (torch creates the mesh's own groups); cached per state."""
        import torch  # start-up time: torch-free module (docstring)
        import torch.distributed as dist  # start-up time: torch-free module (docstring)
        # start-up time: torch-free module (docstring)
        from torch.distributed.device_mesh import DeviceMesh

        if not dist.is_initialized():
            raise RuntimeError("device_mesh needs torch.distributed to be initialised")
        key = (device_type, grid)
        if key not in self.meshes:
            names, ranks = self.grid.mesh_ranks(grid)
            self.meshes[key] = DeviceMesh(device_type, torch.tensor(ranks), mesh_dim_names=names)
        return self.meshes[key]


_DEDICATED: Dict[tuple, object] = {}
_LOCAL: Dict[int, object] = {}


def dedicated_group(state: "ParallelState", name: str) -> Group:
    """This rank's ``name`` group on communicators of its own, shared with no other group
    of the same ranks (``_new_group`` shares one per rank set): FSDP2's meshes run on these,
    so megalite.comm can tell their traffic apart by communicator.  A one-rank group gets a local
    communicator (created by its rank alone).  Collective over the world on first use per
    (name, layout): every rank must ask for the same names in the same order."""
    import torch.distributed as dist  # start-up time: torch-free module (docstring)

    mine = None
    for ranks in state.grid.groups(name):
        key = (name, tuple(ranks), state.timeout)
        if len(ranks) > 1 and key not in _DEDICATED:
            _DEDICATED[key] = dist.new_group(ranks, timeout=state.timeout)
        if state.rank in ranks:
            if len(ranks) == 1 and state.rank not in _LOCAL:
                _LOCAL[state.rank] = dist.new_group(ranks, use_local_synchronization=True)
            handle = _DEDICATED[key] if len(ranks) > 1 else _LOCAL[state.rank]
            mine = Group(name, ranks, handle, state.rank)
    return mine


def _new_group(ranks: List[int], timeout=None, backend=None, purpose: str = ""):
    import torch.distributed as dist  # start-up time: torch-free module (docstring)

    key = (tuple(ranks), timeout, backend, purpose)
    if key not in _HANDLE_CACHE:
        _HANDLE_CACHE[key] = dist.new_group(ranks, timeout=timeout, backend=backend)
    return _HANDLE_CACHE[key]


# -- process launch ------------------------------------------------------------------------

@dataclass
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int


def launch_env() -> LaunchEnv:
    """Rank/world/local rank from torchrun's variables, else SLURM's, else a single process."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                         int(env.get("SLURM_LOCALID", 0)))
    return LaunchEnv(0, 1, 0)


def pick_device_and_backend(device: str = "auto", backend: str = "auto"):
    """cuda + nccl when CUDA is present, otherwise cpu + gloo."""
    import torch  # start-up time: torch-free module (docstring)

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    return device, backend


def initialize(cfg) -> ParallelState:
    """Start torch.distributed (if needed) and build every group for ``cfg``."""
    import torch  # start-up time: torch-free module (docstring)
    import torch.distributed as dist  # start-up time: torch-free module (docstring)

    env = launch_env()
    device, backend = pick_device_and_backend(cfg.training.device, cfg.parallel.distributed_backend)
    if device == "cuda":
        torch.cuda.set_device(env.local_rank % max(torch.cuda.device_count(), 1))
    if not dist.is_initialized():
        timeout = timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
        if env.world_size == 1 and "MASTER_PORT" not in os.environ:
            # A lone process needs no rendezvous: an in-memory store avoids port clashes
            # with other runs on the same machine.
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0,
                                    world_size=1, timeout=timeout)
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
            store = _restart_store(timeout)
            # cfg's world: under --elastic the ranks beyond it are spares (elastic/relayout.py)
            dist.init_process_group(backend=backend, rank=env.rank, world_size=cfg.world_size,
                                    timeout=timeout, **({"store": store} if store else {}))
    grid = RankGrid.from_config(cfg)
    return ParallelState.build(grid, dist.get_rank(),
                               timeout=timedelta(minutes=cfg.parallel.distributed_timeout_minutes))


def _restart_store(timeout):
    """Under torchrun after a restart (``--max-restarts``), the agent's store still holds
    the previous attempt's keys, so gloo would try to connect to the dead workers' addresses;
    each attempt gets keys of its own.  None on the first attempt or outside torchrun."""
    import torch.distributed as dist  # start-up time: torch-free module (docstring)

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"megalite/attempt_{attempt}", store)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Print which ranks share each process group.")
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--tp", "--tensor-model-parallel-size", type=int, default=1)
    ap.add_argument("--pp", "--pipeline-model-parallel-size", type=int, default=1)
    ap.add_argument("--cp", "--context-parallel-size", type=int, default=1)
    ap.add_argument("--ep", "--expert-model-parallel-size", type=int, default=1)
    ap.add_argument("--etp", "--expert-tensor-parallel-size", type=int, default=None)
    a = ap.parse_args(argv)
    try:
        grid = RankGrid(a.world_size, tp=a.tp, pp=a.pp, cp=a.cp, ep=a.ep, etp=a.etp)
    except ValueError as exc:
        ap.exit(2, f"megalite: error: {exc}\n")
    print(grid.describe())


if __name__ == "__main__":
    main()


# ---- the groups a model's layers communicate over, as one bundle -------------------
# Layers receive this bundle instead of a bare TP group so that context-parallel attention
# (cp), experts (ep, expert_tp) and TE attention pick the group they need without new
# constructor arguments (Megatron-Core's ProcessGroupCollection).
@dataclass(frozen=True)
class ModelCommGroups:
    tp: Group          # attention / dense-MLP tensor parallelism (and sequence parallelism)
    cp: Group          # context parallelism: splits the sequence inside core attention
    ep: Group          # expert parallelism: which experts this rank holds
    expert_tp: Group   # tensor parallelism inside an expert (may differ from ``tp``)
    tp_ep: Optional[Group] = None   # expert-TP x EP (the allgather token dispatcher)

    @classmethod
    def from_parallel_state(cls, state: ParallelState) -> "ModelCommGroups":
        return cls(tp=state["tp"], cp=state["cp"], ep=state["ep"],
                   expert_tp=state["expert-tp"], tp_ep=state.groups.get("tp-ep"))


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. under taskset or a SLURM
    cgroup), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
