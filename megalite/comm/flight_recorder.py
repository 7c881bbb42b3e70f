"""Each rank's flight recorder: its last N collectives and p2p ops, with megalite's call sites.

Why our own: torch 2.13's recorder (``TORCH_FR_BUFFER_SIZE``, ``_dump_fr_trace``) on a gloo
group records collectives but no p2p op, never marks an entry started or completed, names
groups by number with empty rank lists, knows no call site beyond a Python stack, and nothing
writes it out when a gloo collective times out (docs/troubleshooting.md, "Reading a hang
diagnosis", has the details).  Every megalite collective goes through ``megalite.comm``, which calls
``begin`` / ``end`` here, so this one sees every op with the group's ranks and the site.

Call sites cost no stack walk: ``site`` is a thread-local that the loop writes (iteration and
phase), the schedules write (the step: F / B / W / comm, micro-batch, chunk) and the layers
push frames onto (``module_site("layer 3", "attention")``).  Autograd functions that
communicate in backward capture ``site.where`` in forward and restore it (``restored_site``).

A rank writes its buffer (``dump``) as ``rank00003.json`` in the dump folder on a failed or
timed-out collective, on SIGUSR2 and when the watchdog sees no op complete for
``--hang-watchdog-seconds``; ``megalite.diagnostics.hang_diagnosis`` reads the folder.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from typing import List, Optional

import torch

DEFAULT_CAPACITY = 10000       # entries per rank (--flight-recorder-size)
DUMP_VERSION = 1
KEPT_ITERATIONS = 3            # the current iteration and the two before it, in a dump
FAULT_ENV = "MEGALITE_FAULT_INJECT"   # test hook: "skip:rank=5,iteration=3,group=pp,op=send"


class Site(threading.local):
    """Where this thread's code is, in megalite's terms."""

    def __init__(self):
        self.iteration = 0         # training iteration being run (1-based), 0 before the first
        self.phase = "setup"       # loop phase: forward-backward, grad sync, optimizer, eval ...
        self.step = None           # schedule step: a pipeline simulator.Op, or a string
        self.where = ()            # module frames, outermost first ("layer 3", "attention")


site = Site()


# inside a graph being compiled nothing is recorded -- no side effect, no graph break
compiling = torch.compiler.is_compiling


class module_site:
    """``with module_site("layer 3", "mlp"):`` -- frames pushed for the ops inside."""
    __slots__ = ("frames", "saved")

    def __init__(self, *frames: str):
        self.frames = frames

    def __enter__(self):
        if not compiling():
            self.saved = site.where
            site.where = self.saved + self.frames

    def __exit__(self, *exc):
        if not compiling():
            site.where = self.saved


def captured_where() -> tuple:
    """The module frames now, for an autograd function to restore in its backward."""
    return () if compiling() else site.where


class restored_site:
    """Put back module frames captured in forward (``captured_where``) during backward."""
    __slots__ = ("where", "saved")

    def __init__(self, where: tuple):
        self.where = where

    def __enter__(self):
        if not compiling():
            self.saved = site.where
            site.where = self.where

    def __exit__(self, *exc):
        if not compiling():
            site.where = self.saved


def step_text(step) -> str:
    """A schedule step as the diagnosis prints it: 'F mb 2 chunk 1', 'comm[act1>1|grad0<1]'."""
    if step is None:
        return ""
    kind = getattr(step, "kind", None)
    if kind is None or kind == "comm":
        return str(step)
    return f"{kind} mb {step.mb}" + (f" chunk {step.chunk}" if step.chunk else "")


class GroupInfo:
    """One process group as the recorder names it: ``tp[0,1]``; counts its collectives."""
    __slots__ = ("label", "kind", "ranks", "torch_name", "seq", "p2p")

    def __init__(self, name: str, ranks, handle):
        self.kind, self.ranks = name, tuple(ranks)
        self.torch_name = getattr(handle, "group_name", None) if handle is not None else None
        self.label = f"{name}[{ranks_text(self.ranks)}]"
        self.seq = 0               # collectives issued on this group by this rank
        self.p2p = {}              # ("send"|"recv", peer) -> messages posted


def ranks_text(ranks) -> str:
    """0-7 for a contiguous run, else the list (a group label must name its members)."""
    ranks = list(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


class Entry:
    """One op.  ``parts`` for a p2p batch: [("send"|"recv", peer, shape, message no., key)]."""
    __slots__ = ("seq", "op", "group", "shapes", "dtype", "t0", "t1", "iteration", "phase",
                 "step", "where", "waiting", "error", "parts")

    def __init__(self, seq, op, group, shapes, dtype, iteration, phase, step, where,
                 waiting, parts=None):
        self.seq, self.op, self.group, self.shapes, self.dtype = seq, op, group, shapes, dtype
        self.t0, self.t1 = time.time(), None
        self.iteration, self.phase, self.step, self.where = iteration, phase, step, where
        self.waiting, self.error, self.parts = waiting, None, parts

    def to_json(self) -> dict:
        out = {"seq": self.seq, "op": self.op, "group": self.group.label,
               "shapes": [list(s) for s in self.shapes],
               "dtype": str(self.dtype).replace("torch.", "") if self.dtype else None,
               "t0": self.t0, "t1": self.t1, "it": self.iteration, "phase": self.phase,
               "step": step_text(self.step), "where": " ".join(self.where)}
        if self.parts is not None:
            out["parts"] = [[kind, peer, list(shape), n, key] for kind, peer, shape, n, key
                            in self.parts]
        if self.error:
            out["error"] = self.error
        if self.waiting and self.t1 is None:
            out["waiting"] = True
        return out


class Fault:
    """A test hook (``MEGALITE_FAULT_INJECT``): rank ``rank`` skips -- or stops itself with
    SIGSTOP just before -- the ``nth`` op ``op`` on a group of kind ``group`` in iteration
    ``iteration`` (and, with ``phase=``, in that loop phase).  ``op`` send / recv match
    one message of a pipeline exchange."""

    def __init__(self, text: str):
        action, _, rest = text.partition(":")
        kv = dict(item.split("=", 1) for item in rest.split(",") if item)
        if action not in ("skip", "stop") or not {"rank", "iteration", "group", "op"} <= set(kv):
            raise ValueError(f"{FAULT_ENV}: expected 'skip|stop:rank=R,iteration=I,group=G,"
                             f"op=OP[,nth=N][,phase=P]', got '{text}'")
        self.action, self.group, self.op = action, kv["group"], kv["op"]
        self.rank, self.iteration = int(kv["rank"]), int(kv["iteration"])
        self.phase = kv.get("phase")
        self.nth, self.seen, self.done = int(kv.get("nth", 1)), 0, False

    def hits(self, rank: int, op: str, kind: str) -> bool:
        if self.done or rank != self.rank or op != self.op or kind != self.group or \
                site.iteration != self.iteration or \
                (self.phase is not None and site.phase != self.phase):
            return False
        self.seen += 1
        self.done = self.seen == self.nth
        return self.done


def parse_faults(text: Optional[str]) -> Optional[List[Fault]]:
    return [Fault(t) for t in text.split(";") if t.strip()] if text else None


class FlightRecorder:
    """The ring buffer of one rank; ``capacity`` None keeps everything (the pre-launch
    trace), 0 switches recording off (faults still apply)."""
    fake = False       # the pre-launch tracer records without communicating

    def __init__(self, capacity: Optional[int] = DEFAULT_CAPACITY, rank: int = 0,
                 faults: Optional[List[Fault]] = None):
        self.capacity, self.rank = capacity, rank
        self.enabled = capacity != 0
        self.entries = deque(maxlen=capacity) if self.enabled else deque(maxlen=1)
        self.groups = {}           # (name, id(handle), first rank) -> GroupInfo
        self.faults = faults
        self.started = self.completed = 0
        self.last_progress = time.time()
        self.dump_dir: Optional[str] = None
        self.meta: dict = {}       # run id, grid, peers: written into every dump
        self.dumps = 0
        self.box = None            # the op in flight, for a fatal signal (hang_dumps.FatalRecord)
        self.outstanding = []      # (entry, torch Work) of ops others wait on (``issued``)

    # -- recording (megalite.comm) ----------------------------------------------------------------
    def group(self, group) -> GroupInfo:
        key = (group.name, id(group.handle), group.ranks[0])
        info = self.groups.get(key)
        if info is None:
            info = self.groups[key] = GroupInfo(group.name, group.ranks, group.handle)
        return info

    def skip(self, op: str, group) -> bool:
        """Apply the test hooks to a collective: True when this call is to be skipped."""
        for f in self.faults or ():
            if f.hits(self.rank, op, group.name):
                if f.action == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                    return False
                return True
        return False

    def begin(self, op: str, group, tensor=None, waiting: bool = True) -> Optional[Entry]:
        """Note a collective on ``group`` (``tensor``: its shape and dtype are recorded)."""
        if not self.enabled or compiling():
            return None
        info = self.group(group)
        info.seq += 1
        s = site
        shapes = () if tensor is None else (tuple(tensor.shape),)
        e = Entry(info.seq, op, info, shapes, None if tensor is None else tensor.dtype,
                  s.iteration, s.phase, s.step, s.where, waiting)
        self.entries.append(e)
        self.started += 1
        if self.box is not None:
            self.box.note(e)
        return e

    def begin_p2p(self, group, sends, recvs, keys=None) -> Optional[Entry]:
        """Note a batch of sends ``(tensor, peer)`` and receives; ``keys``: the schedule's
        message names (sends first), so both ends of a message can be matched by name."""
        if not self.enabled or compiling():
            return None
        info = self.group(group)
        parts, i = [], 0
        for kind, pairs in (("send", sends), ("recv", recvs)):
            for tensor, peer in pairs:
                n = info.p2p[(kind, peer)] = info.p2p.get((kind, peer), 0) + 1
                parts.append((kind, peer, tuple(tensor.shape), n,
                              None if keys is None else str(keys[i])))
                i += 1
        s = site
        dtype = (sends or recvs)[0][0].dtype
        e = Entry(0, "p2p", info, (), dtype, s.iteration, s.phase, s.step, s.where, True,
                  parts)
        self.entries.append(e)
        self.started += 1
        if self.box is not None:
            self.box.note(e)
        return e

    def filter_p2p(self, group, sends, recvs, keys=None):
        """The test hooks on a p2p batch: drop (or stop before) single messages; returns
        the kept sends, receives and their keys (aligned, sends first)."""
        kept_sends, kept_recvs, kept_keys, i = [], [], [], 0
        for kind, pairs, kept in (("send", sends, kept_sends), ("recv", recvs, kept_recvs)):
            for pair in pairs:
                if not self.skip(kind, group):
                    kept.append(pair)
                    if keys is not None:
                        kept_keys.append(keys[i])
                i += 1
        return kept_sends, kept_recvs, kept_keys if keys is not None else None

    def issued(self, e: Optional[Entry], work) -> None:
        """An op someone else waits on (FSDP2's, through torch's ``Work``): it counts as
        pending until ``work`` reports completion, checked at the next such op and at a dump."""
        if e is not None:
            self.outstanding.append((e, work))
            self.settle()

    def settle(self) -> None:
        """End the outstanding ops whose work has completed; the others wait."""
        still = []
        for e, work in self.outstanding:
            try:                       # a failed work is "completed" with an exception
                done = work.is_completed() and work.exception() is None
            except RuntimeError:
                done = False
            if done:
                self.end(e)
            else:
                e.waiting = True
                still.append((e, work))
        self.outstanding = still

    def end(self, e: Optional[Entry]) -> None:
        if e is not None:
            e.t1 = self.last_progress = time.time()
            self.completed += 1

    def fail(self, e: Optional[Entry], exc: BaseException) -> None:
        """The op ``e`` raised: keep it in flight (it never completed) and dump."""
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if e is not None:
            e.error = text[:300]
        self.dump(f"CommError: {text[:300]}")

    # -- dumps ------------------------------------------------------------------------------
    def snapshot(self, reason: str) -> dict:
        """The dump: every op of the current and the ``KEPT_ITERATIONS - 1`` iterations before
        it still in the ring (what the diagnosis compares), the groups' counts, and who this
        rank is.  Two whole iterations before the current one are kept because a rank that
        dropped an op and went on has a whole iteration that departs from the one before."""
        self.settle()
        entries = list(self.entries)          # atomic under the GIL
        first = entries[-1].iteration - (KEPT_ITERATIONS - 1) if entries else 0
        # the oldest iteration kept is whole when the ring also holds an older op or never
        # wrapped
        whole = bool(entries) and (entries[0].iteration < first or
                                   self.started <= len(entries))
        if entries:
            entries = [e for e in entries if e.iteration >= first]
        groups = {g.label: {"kind": g.kind, "ranks": list(g.ranks), "torch": g.torch_name,
                            "seq": g.seq, "p2p": {f"{k}:{p}": n for (k, p), n in g.p2p.items()}}
                  for g in list(self.groups.values())}
        out = {"version": DUMP_VERSION, "rank": self.rank, "reason": reason, "time": time.time(),
               "pid": os.getpid(), "host": socket.gethostname(), "capacity": self.capacity,
               "started": self.started, "completed": self.completed,
               "previous_iteration_whole": whole,   # the oldest iteration kept is whole
               "last_progress": self.last_progress,   # site is per thread: the newest op's
               "iteration": entries[-1].iteration if entries else 0,
               **self.meta, "groups": groups, "entries": [e.to_json() for e in entries]}
        torch_trace = torch_flight_recorder_json()
        if torch_trace is not None:
            out["torch_fr"] = torch_trace
        return out

    def dump(self, reason: str) -> Optional[str]:
        """Write this rank's buffer (atomically, replacing an earlier dump); its path."""
        if not self.enabled or not self.dump_dir:
            return None
        try:
            os.makedirs(self.dump_dir, exist_ok=True)
            path = os.path.join(self.dump_dir, dump_name(self.rank))
            tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"   # two threads may dump
            with open(tmp, "w") as f:
                json.dump(self.snapshot(reason), f)
            os.replace(tmp, path)
        except OSError as exc:          # a dump must never turn into a second failure
            print(f"[rank {self.rank}] flight recorder: cannot write a dump in "
                  f"{self.dump_dir}: {exc}", file=sys.stderr, flush=True)
            return None
        self.dumps += 1
        return path


def dump_name(rank: int) -> str:
    return f"rank{rank:05d}.json"


BOX_BYTES = 400                # the line that holds the op in flight, in the fatal record


class InFlight:
    """The fatal record's second line, memory-mapped: the op this rank began last, written
    at each op (a few microseconds) because a process aborted from C++ runs no Python
    afterwards; the mapped page reaches the file when the process dies.  Fields are
    separated by tabs (``hang_folder.parse_in_flight`` reads them): seq, op, group
    label, iteration, phase, step, module frames, shapes, dtype, p2p parts."""
    __slots__ = ("map", "at")

    def __init__(self, mapped, at: int):
        self.map, self.at = mapped, at

    def note(self, e: Entry) -> None:
        parts = "" if e.parts is None else ";".join(
            f"{kind},{peer},{'x'.join(map(str, shape))},{n},{key or ''}"
            for kind, peer, shape, n, key in e.parts)
        text = (f"{e.seq}\t{e.op}\t{e.group.label}\t{e.iteration}\t{e.phase}\t"
                f"{step_text(e.step)}\t{' '.join(e.where)}\t"
                f"{'/'.join('x'.join(map(str, s)) for s in e.shapes)}\t{e.dtype}\t{parts}"
                ).encode("utf-8", "replace")[:BOX_BYTES]
        self.map[self.at:self.at + BOX_BYTES] = text.ljust(BOX_BYTES)


def fatal_name(rank: int) -> str:
    """The file a rank's fatal-signal handler (``faulthandler``) writes its last words to:
    a process the backend aborts from C++ (gloo's enforce failures, NCCL's async error
    handling) runs no Python, so it can leave no dump, only this."""
    return f"rank{rank:05d}.fatal.txt"


def torch_flight_recorder_json() -> Optional[dict]:
    """torch's own trace (NCCL keeps start/completion states there) when it is switched on
    (``TORCH_FR_BUFFER_SIZE`` / ``TORCH_NCCL_TRACE_BUFFER_SIZE`` > 0); None otherwise."""
    size = os.environ.get("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"))
    if not size or size == "0":
        return None
    try:
        # optional dependency: a torch built without distributed has no c10d trace
        import torch._C._distributed_c10d as c10d

        dump = getattr(c10d, "_dump_nccl_trace_json", None) or c10d._dump_fr_trace_json
        return json.loads(dump(includeCollectives=True, onlyActive=False))
    except Exception as exc:       # never let torch's recorder break ours
        return {"error": f"{type(exc).__name__}: {exc}"}


recorder = FlightRecorder(faults=parse_faults(os.environ.get(FAULT_ENV)))


def install(rec: FlightRecorder) -> FlightRecorder:
    """Make ``rec`` the recorder megalite.comm writes to (the pre-launch trace swaps in its own);
    returns the previous one."""
    global recorder
    old, recorder = recorder, rec
    return old
