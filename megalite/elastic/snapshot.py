"""In-memory peer snapshots (``--snapshot-interval N``): each rank's training state in its
node's shared memory, plus a replica on another node, taken in the background.

Why: with disk checkpoints every few hundred iterations, a lost node throws away that many
iterations on every rank.  A snapshot every iteration costs one copy of the state on the
training thread (the clone, so that the next step cannot change it); the rest runs in a
background thread while the next iteration trains, on a gloo group of its own
(``ParallelState.background_group("snapshot")``), so its messages never interleave with
training's:

1. the state, serialized once, goes to a file of this node's snapshot folder
   (``snapshot_dir()``: host shared memory, which outlives the worker process), written
   atomically (tmp + rename);
2. the same bytes go to this rank's *buddy*: the rank with the same local index on the next
   node, which stores them in its own node's folder.  A node that dies takes its own files
   with it; the buddies' replicas are what restore its shards
   (``megalite.elastic.snapshot_restore``).

Each holder keeps the snapshots of the last three snapshot iterations: when a rank takes
snapshot S+1, every rank has finished S-1 (the training collectives of the iterations in
between order them), so S-1 is complete everywhere, whatever a kill during S or S+1 leaves.

File names say everything a restart needs to pick a complete set without opening them:
``snap-<run fingerprint>-it<iteration>-<generation>-r<rank>-of<world>.<own|replica>.pt``.
The generation is a token drawn at the first snapshot of a process group, so a world that
re-formed and reached the same iteration is never mixed with the one before it.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from megalite import comm
from megalite.checkpointing import checkpoint, train_state
from megalite.parallel_state import Group

FILE_RE = re.compile(r"^snap-(?P<fp>[0-9a-f]{10})-it(?P<it>\d{9})-(?P<gen>[0-9a-f]{8})"
                     r"-r(?P<rank>\d{5})-of(?P<world>\d{5})\.(?P<kind>own|replica)\.pt$")
KEEP = 3                    # snapshot iterations kept per holder (see the module docstring)
STALL_ENV = "MEGALITE_TEST_SNAPSHOT_STALL"      # "ITERATION:SECONDS": a test hook (below)


def snapshot_interval(cfg) -> int:
    """``--snapshot-interval``, or its default: every iteration for ``--elastic``, else off."""
    n = cfg.checkpoint.snapshot_interval
    if n is None:
        return 1 if cfg.parallel.elastic else 0
    return n


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def snapshot_dir() -> str:
    """This node's snapshot folder: ``MEGALITE_SNAPSHOT_DIR``, else host shared memory
    keyed by the job (SLURM job id, else torchrun's run id) and the node."""
    explicit = os.environ.get("MEGALITE_SNAPSHOT_DIR")
    if explicit:
        return os.path.abspath(explicit)
    run = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or "local"
    return os.path.join("/dev/shm", "megalite-snapshots", re.sub(r"[^\w.-]", "_", run),
                        node_name())


def holder_identity() -> str:
    """Who holds a folder's files: ranks that share it (same node, same folder) hold the
    same files; two agents on one machine with folders of their own are two holders."""
    return f"{node_name()}:{os.path.realpath(snapshot_dir())}"


def run_fingerprint(cfg) -> str:
    """Snapshots of another run (other model, data, seed or batch) never restore this one."""
    what = {"model": repr(cfg.model), "seed": cfg.training.seed,
            "gbs": cfg.training.global_batch_size, "data": repr(cfg.data)}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:10]


def file_name(fp: str, iteration: int, gen: str, rank: int, world: int, kind: str) -> str:
    return f"snap-{fp}-it{iteration:09d}-{gen}-r{rank:05d}-of{world:05d}.{kind}.pt"


def parse_name(name: str) -> Optional[dict]:
    m = FILE_RE.match(name)
    if not m:
        return None
    d = m.groupdict()
    return {"fp": d["fp"], "iteration": int(d["it"]), "gen": d["gen"], "rank": int(d["rank"]),
            "world": int(d["world"]), "kind": d["kind"], "name": name}


def list_snapshots(folder: str, fp: Optional[str] = None) -> List[dict]:
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    out = [p for p in map(parse_name, names) if p is not None]
    return [p for p in out if fp is None or p["fp"] == fp]


def atomic_write(path: str, data) -> None:
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "wb") as f:
        f.write(data)
    _test_stall(path)
    os.replace(tmp, path)


def _test_stall(path: str) -> None:
    """Test hook ``MEGALITE_TEST_SNAPSHOT_STALL=ITERATION:SECONDS``: the write of that
    iteration's snapshot waits before its rename, so a test can kill a node mid-snapshot
    (in the first attempt only: a restarted worker that re-takes it does not wait)."""
    spec = os.environ.get(STALL_ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0"):
        return                                   # the first attempt only
    it, _, seconds = spec.partition(":")
    m = FILE_RE.match(os.path.basename(path))
    if m and int(m.group("it")) == int(it):
        time.sleep(float(seconds or 60))


def serialize(sd: dict, meta: dict, iteration: int, rank: int, world: int) -> bytes:
    """One rank's snapshot as bytes: every chunk it holds (writer or replica) at its global
    offsets, and the run's metadata as JSON (read back with ``weights_only=True``)."""
    tensors = {k: {"shape": list(v.global_shape), "writer": bool(v.writer),
                   "chunks": [(list(o), t.detach().cpu()) for o, t in v.chunks]}
               for k, v in sd.items()}
    buf = io.BytesIO()
    torch.save({"version": 1, "iteration": iteration, "rank": rank, "world": world,
                "meta": json.dumps(meta, default=str), "tensors": tensors}, buf)
    return buf.getvalue()


def read_snapshot(path: str) -> dict:
    payload = torch.load(path, map_location="cpu", weights_only=True)
    payload["meta"] = json.loads(payload["meta"])
    return payload


@dataclass
class SnapshotStats:
    """What snapshots cost, for the log: the stall on the training thread and the time
    the background thread took, of the snapshots since the last report."""
    stall_s: List[float] = field(default_factory=list)
    background_s: List[float] = field(default_factory=list)
    bytes: int = 0

    def report(self) -> Optional[str]:
        if not self.stall_s or not self.background_s:   # the first still being written
            return None
        n = len(self.stall_s)
        bg = sum(self.background_s) / max(len(self.background_s), 1)
        line = (f"{n} snapshot(s) of {self.bytes / 2**20:.1f} MiB per rank: stall "
                f"{1000 * sum(self.stall_s) / n:.1f} ms per snapshot on the training thread, "
                f"{1000 * bg:.1f} ms in the background")
        self.stall_s.clear()
        self.background_s.clear()
        return line


class Snapshotter:
    """Takes this rank's snapshots (``maybe_take`` after every optimizer step)."""

    def __init__(self, trainer, interval: int):
        self.trainer, self.interval = trainer, interval
        self.folder = snapshot_dir()
        self.fp = run_fingerprint(trainer.cfg)
        self.group: Optional[Group] = None
        self.gen = ""
        self.buddy, self.sources = None, []   # whom this rank sends to / keeps replicas of
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None
        self.taken: List[int] = []            # snapshot iterations of this generation
        self.written: Dict[int, List[str]] = {}   # iteration -> files this rank wrote
        self.stats = SnapshotStats()
        self.lines: List[str] = []            # said once, by the logger

    # -- set-up (collective, on the training thread, at the first snapshot) --------------
    def _setup(self) -> None:
        state = self.trainer.state
        world = state.grid.world_size
        os.makedirs(self.folder, exist_ok=True)
        if world == 1:
            self.gen = uuid.uuid4().hex[:8]
        else:
            self.group = state.background_group("snapshot")
            everyone = comm.all_gather_object(holder_identity(), self.group)
            self.gen = comm.broadcast_object(uuid.uuid4().hex[:8], 0, self.group)
            self.buddy, self.sources = buddies(everyone, state.rank)
        if self.buddy is None:
            self.lines.append(f"> snapshot: every {self.interval} iteration(s) into "
                              f"{self.folder}; one node only: no replica on another node "
                              "(a lost node's snapshots are lost with it)")
        else:
            self.lines.append(f"> snapshot: every {self.interval} iteration(s) into each "
                              f"node's {self.folder}; rank {state.rank}'s replica goes to "
                              f"rank {self.buddy} on another node")

    def maybe_take(self) -> Optional[float]:
        """After the optimizer step: a snapshot when the iteration is due; the seconds the
        training thread stalled, or None."""
        it = self.trainer.iteration
        if not self.interval or it % self.interval:
            return None
        started = time.perf_counter()
        self.wait()                              # the previous one first
        if self.group is None and not self.gen:
            self._setup()
        self._prune()
        sd, meta = checkpoint.capture_training_state(train_state.training_state(self.trainer),
                                                     every_rank_meta=True)
        staged = {k: type(v)(v.global_shape, [(o, t.detach().clone()) for o, t in v.chunks],
                             v.writer) for k, v in sd.items()}
        rank, world = self.trainer.state.rank, self.trainer.state.grid.world_size
        self.taken.append(it)
        self.thread = threading.Thread(target=self._background, daemon=True,
                                       args=(staged, meta, it, rank, world),
                                       name="megalite-snapshot")
        self.thread.start()
        stall = time.perf_counter() - started
        self.stats.stall_s.append(stall)
        return stall

    def _background(self, sd, meta, it, rank, world) -> None:
        try:
            started = time.perf_counter()
            blob = serialize(sd, meta, it, rank, world)
            del sd
            self.stats.bytes = len(blob)
            own = os.path.join(self.folder, file_name(self.fp, it, self.gen, rank, world, "own"))
            atomic_write(own, blob)
            files = [own]
            if self.buddy is not None:
                got = exchange(blob, self.buddy, self.sources, self.group)
                for src, replica in zip(self.sources, got):
                    rep = os.path.join(self.folder, file_name(self.fp, it, self.gen, src,
                                                              world, "replica"))
                    atomic_write(rep, memoryview(replica.numpy()))
                    files.append(rep)
            self.written[it] = files
            self.stats.background_s.append(time.perf_counter() - started)
        except BaseException as exc:  # noqa: BLE001  (handed to the training thread)
            self.error = exc

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def _prune(self) -> None:
        """Before snapshot S+1: drop what this rank wrote before S-1; once this generation
        has a complete snapshot (its first, two snapshots back), the local-first rank of
        each folder drops the files of earlier generations and worlds."""
        keep = set(self.taken[-(KEEP - 1):])
        for it in [i for i in self.written if i not in keep]:
            for path in self.written.pop(it):
                _remove(path)
        if len(self.taken) == KEEP - 1 and self._first_in_folder():
            for p in list_snapshots(self.folder):
                if p["gen"] != self.gen:
                    _remove(os.path.join(self.folder, p["name"]))

    def _first_in_folder(self) -> bool:
        return os.environ.get("LOCAL_RANK", "0") in ("", "0")

    def close(self, completed: bool) -> None:
        """At the end of training: wait for the last snapshot; after a completed run the
        files are no longer needed (this rank's own and the replicas it received)."""
        try:
            self.wait()
        finally:
            if completed:
                for files in self.written.values():
                    for path in files:
                        _remove(path)
                self.written.clear()


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def buddies(identities: List[str], rank: int) -> Tuple[Optional[int], List[int]]:
    """(rank this rank's replica goes to, ranks whose replicas this rank keeps): every rank
    sends to the rank with the same local index on the next node (nodes in order of first
    rank; on a node with fewer ranks the index wraps around), so each state has one copy on
    another node.  Nodes of unequal size (a world cut to the largest fitting part) leave
    some ranks keeping two replicas and some none.  (None, []) on a single node."""
    nodes: Dict[str, List[int]] = {}
    for r, ident in enumerate(identities):
        nodes.setdefault(ident, []).append(r)
    order = list(nodes)
    if len(order) < 2:
        return None, []

    def buddy_of(r: int) -> int:
        here = identities[r]
        nxt = nodes[order[(order.index(here) + 1) % len(order)]]
        return nxt[nodes[here].index(r) % len(nxt)]

    return buddy_of(rank), [r for r in range(len(identities)) if buddy_of(r) == rank]


def exchange(blob: bytes, dst: int, srcs: List[int], group: Group) -> List[torch.Tensor]:
    """Send ``blob`` to ``dst`` and receive each of ``srcs``' (sizes first), on ``group``."""
    n_out = torch.tensor([len(blob)], dtype=torch.int64)
    n_in = [torch.zeros(1, dtype=torch.int64) for _ in srcs]
    comm.batch_send_recv([(n_out, dst)], list(zip(n_in, srcs)), group)
    out = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    got = [torch.empty(int(n.item()), dtype=torch.uint8) for n in n_in]
    comm.batch_send_recv([(out, dst)], list(zip(got, srcs)), group)
    return got
