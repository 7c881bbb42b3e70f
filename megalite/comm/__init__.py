"""Every torch.distributed collective and p2p call goes through here.

Two reasons: gloo and NCCL differ (gloo has no AVG reduction and no bf16 reductions on
CPU), and counting bytes per (group, op) in one place lets tests and benchmarks check
communication volume against theory (TP: 4 all-reduces per layer per micro-batch, ...).

Accounting convention: ``elements`` is the size of the *full* logical tensor of the
collective -- the all-reduced tensor, the gathered output, the reduce-scattered input,
the all-to-all input, the p2p message -- so that an all-reduce counts the same as the
reduce-scatter + all-gather that implement it.  Calls on a group of size 1 are skipped
and not counted.

Every call is also noted in the flight recorder (``megalite.comm.flight_recorder``: op, group,
shapes, times, call site) so that a hang can say which rank is missing and where it was.
Under the pre-launch check (``megalite.diagnostics.collective_check``) the recorder is a tracer
(``recorder.fake``): calls are recorded and not sent, and outputs hold what they would if
every member had this rank's input.

The run's first user error travels through the job's store, not a collective
(``comm.user_errors``, re-exported here).
"""
from __future__ import annotations

import time
import inspect
import sys
from collections import defaultdict
from contextlib import contextmanager
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megalite.comm import flight_recorder as fr
from megalite.comm import overlap as paired
from megalite.comm.user_errors import (publish_user_error,  # noqa: F401  (re-exported)
                                       published_user_error, stop_watching_user_errors,
                                       watch_user_errors)
from megalite.parallel_state import Group


class CommCounter:
    """calls / elements / bytes per (group name, op)."""

    def __init__(self):
        self.enabled = True
        self.reset()

    def reset(self):
        self.table = defaultdict(lambda: {"calls": 0, "elements": 0, "bytes": 0})

    def add(self, group: str, op: str, tensor: torch.Tensor):
        if self.enabled:
            row = self.table[(group, op)]
            row["calls"] += 1
            row["elements"] += tensor.numel()
            row["bytes"] += tensor.numel() * tensor.element_size()

    def get(self, group: str, op: str) -> dict:
        return dict(self.table.get((group, op), {"calls": 0, "elements": 0, "bytes": 0}))

    def total_bytes(self, group: Optional[str] = None) -> int:
        return sum(r["bytes"] for (g, _), r in self.table.items() if group in (None, g))

    def snapshot(self) -> dict:
        return {f"{g}/{op}": dict(r) for (g, op), r in sorted(self.table.items())}


counter = CommCounter()


class CommError(RuntimeError):
    """A collective or p2p call that failed or timed out, naming the group, op and peers."""


@contextmanager
def _named_failure(op: str, group: Optional[Group], peers: Sequence[int] = (), entry=None):
    """Re-raise a backend error (timeout, peer gone) as one ``CommError`` line that says
    which group, op and peer(s) -- gloo's own message names none of them -- after the flight
    recorder has written this rank's dump (``entry``: the op that failed)."""
    try:
        yield
    except CommError:
        raise
    except (RuntimeError, dist.DistError) as exc:
        me = dist.get_rank() if dist.is_initialized() else 0
        name = group.name if group is not None else "world"
        members = group.ranks if group is not None else "all"
        who = f"peer rank(s) {list(peers)}" if peers else f"ranks {members}"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        error = CommError(f"rank {me}: {op} on group '{name}' with {who} failed: {first}")
        fr.recorder.fail(entry, error)
        raise error from exc


def world_group(handle=None) -> Group:
    """The whole world as a ``Group``: the default process group, or ``handle`` (a group
    of its own over every rank); one rank when no process group exists."""
    n, me = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    return Group("world", list(range(n)), handle, me)


def _world(group: Optional[Group]) -> Group:
    """``group``, or the default group as a ``Group`` (for the recorder)."""
    return group if group is not None else world_group()


def _fake_fill(op: str, out: torch.Tensor, inp: Optional[torch.Tensor], group: Group,
               reduce: str = "sum") -> None:
    """Under the tracer, give a real-valued ``out`` the value the op would have if every
    member held this rank's ``inp`` (sizes derived from gathered counts stay consistent);
    meta tensors carry no values."""
    if out is None or out.is_meta or (inp is not None and inp.is_meta):
        return
    with torch.no_grad():
        if op == "all_reduce" and reduce == "sum":
            out.mul_(group.size)
        elif op == "all_gather":
            out.view(group.size, *inp.shape).copy_(inp.unsqueeze(0).expand(group.size,
                                                                            *inp.shape))
        elif op == "reduce_scatter":
            out.copy_(inp.view(group.size, *out.shape)[group.rank] * group.size)
        elif op == "all_to_all":
            if out.shape == inp.shape:
                out.copy_(inp)
            else:
                out.zero_()
        elif op == "recv":
            out.zero_()


SKIP, FAKE, REAL = "skip", "fake", "real"


def _note(op: str, group: Group, tensor: Optional[torch.Tensor] = None,
          counted: Optional[torch.Tensor] = None, waiting: bool = True):
    """What every call does first: the test hook, byte counting (of ``counted``) and the
    flight recorder.  Returns (entry, SKIP | FAKE | REAL): skip the call, or only record it
    (the pre-launch tracer), or run it."""
    rec = fr.recorder
    if rec.faults is not None and rec.skip(op, group):
        return None, SKIP
    if counted is not None:
        counter.add(group.name, op, counted)
    return rec.begin(op, group, tensor, waiting), FAKE if rec.fake else REAL


def _faked(entry, op: str, out, inp, group: Group, reduce: str = "sum"):
    _fake_fill(op, out, inp, group, reduce)
    fr.recorder.end(entry)
    return out


@contextmanager
def counting(enabled: bool = True):
    """Temporarily switch byte counting on or off (e.g. around a warm-up)."""
    old, counter.enabled = counter.enabled, enabled
    try:
        yield counter
    finally:
        counter.enabled = old


def _is_gloo(group: Group) -> bool:
    return dist.get_backend(group.handle) == "gloo"


def _needs_fp32(group: Group, tensor: torch.Tensor) -> bool:
    return tensor.dtype in (torch.bfloat16, torch.float16) and _is_gloo(group)


def all_reduce(tensor: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce; ``op`` is sum, avg or max."""
    if group.size == 1:
        return tensor
    entry, mode = _note("all_reduce", group, tensor, tensor)
    if mode is SKIP:
        return tensor
    if mode is FAKE:
        return _faked(entry, "all_reduce", tensor, None, group, op)
    work = tensor.float() if _needs_fp32(group, tensor) else tensor
    reduce_op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM,
                 "max": dist.ReduceOp.MAX}[op]
    with _named_failure("all_reduce", group, entry=entry):
        dist.all_reduce(work, op=reduce_op, group=group.handle)
    fr.recorder.end(entry)
    if op == "avg":
        work.div_(group.size)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


class Pending:
    """An asynchronous collective in flight: ``wait()`` blocks until it is done and returns
    its output (after any copy back from gloo's fp32 staging buffer)."""

    def __init__(self, output: torch.Tensor, work=None, finish=None, op: str = "",
                 group: Optional[Group] = None, entry=None):
        self.output, self._work, self._finish = output, work, finish
        self._op, self._group, self._entry = op, group, entry

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            if self._entry is not None:
                self._entry.waiting = True
            with _named_failure(self._op, self._group, entry=self._entry):
                self._work.wait()
            fr.recorder.end(self._entry)
            self._work = None
        if self._finish is not None:
            self._finish()
            self._finish = None
        return self.output


def all_reduce_async(tensor: torch.Tensor, group: Group) -> "Pending":
    """Start an in-place sum of ``tensor`` over ``group``; ``wait()`` on the result before
    reading it (the overlapped gradient buckets, ``distributed.grad_buckets``)."""
    if group.size == 1:
        return Pending(tensor)
    entry, mode = _note("all_reduce", group, tensor, tensor, waiting=False)
    if mode is not REAL:
        return Pending(tensor if mode is SKIP else
                       _faked(entry, "all_reduce", tensor, None, group))
    work = tensor.float() if _needs_fp32(group, tensor) else tensor
    with _named_failure("all_reduce", group, entry=entry):
        handle = dist.all_reduce(work, op=dist.ReduceOp.SUM, group=group.handle, async_op=True)
    return Pending(tensor, handle, (lambda: tensor.copy_(work)) if work is not tensor else None,
                   op="all_reduce", group=group, entry=entry)


def all_reduce_coalesced(tensors: List[torch.Tensor], group: Group,
                         bucket_elements: int = 40_000_000) -> None:
    """Sum many tensors in place with a few flat all-reduces (dtype-homogeneous buckets of at
    most ``bucket_elements``, so a large model never needs one giant temporary)."""
    if group.size == 1 or not tensors:
        return
    bucket: List[torch.Tensor] = []

    def flush():
        if bucket:
            flat = _flatten_dense_tensors(bucket)
            all_reduce(flat, group)
            for t, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                t.copy_(synced)
            bucket.clear()

    size = 0
    for t in tensors:
        if bucket and (t.dtype != bucket[0].dtype or size + t.numel() > bucket_elements):
            flush()
            size = 0
        bucket.append(t)
        size += t.numel()
    flush()


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: Group,
                           async_op: bool = False):
    """Concatenate every rank's ``input`` along dim 0 into ``output``.

    ``async_op``: return a ``Pending`` at once (wait() -> ``output``) so the caller can
    compute while the collective runs; one outstanding collective per group at a time."""
    if group.size == 1:
        output.copy_(input)
        return Pending(output) if async_op else output
    entry, mode = _note("all_gather", group, input, output, waiting=not async_op)
    if mode is not REAL:
        if mode is FAKE:
            _faked(entry, "all_gather", output, input, group)
        return Pending(output) if async_op else output
    with _named_failure("all_gather", group, entry=entry):
        work = dist.all_gather_into_tensor(output, input.contiguous(), group=group.handle,
                                           async_op=async_op)
    if async_op:
        return Pending(output, work, op="all_gather", group=group, entry=entry)
    fr.recorder.end(entry)
    return output


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group: Group,
                          async_op: bool = False):
    """Sum ``input`` over ranks; this rank keeps its dim-0 slice in ``output``.

    ``async_op`` as for ``all_gather_into_tensor``."""
    if group.size == 1:
        output.copy_(input)
        return Pending(output) if async_op else output
    entry, mode = _note("reduce_scatter", group, input, input, waiting=not async_op)
    if mode is not REAL:
        if mode is FAKE:
            _faked(entry, "reduce_scatter", output, input, group)
        return Pending(output) if async_op else output
    finish = None
    with _named_failure("reduce_scatter", group, entry=entry):
        if _needs_fp32(group, input):
            out32 = output.float()
            work = dist.reduce_scatter_tensor(out32, input.float().contiguous(),
                                              group=group.handle, async_op=async_op)

            def finish():
                output.copy_(out32)
        else:
            work = dist.reduce_scatter_tensor(output, input.contiguous(), group=group.handle,
                                              async_op=async_op)
    if async_op:
        return Pending(output, work, finish, op="reduce_scatter", group=group, entry=entry)
    fr.recorder.end(entry)
    if finish is not None:
        finish()
    return output


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, group: Group,
                      output_split_sizes: Optional[List[int]] = None,
                      input_split_sizes: Optional[List[int]] = None,
                      overlap: bool = False):
    """``overlap``: inside one half of an overlapped F&B pair (``comm.overlap``), issue it
    asynchronously and let the other half compute until this one's data is needed."""
    if group.size == 1:
        output.copy_(input)
        return output
    overlap = overlap and paired.may_switch()
    entry, mode = _note("all_to_all", group, input, input, waiting=not overlap)
    if mode is not REAL:
        return output if mode is SKIP else _faked(entry, "all_to_all", output, input, group)
    t0 = time.perf_counter()
    with _named_failure("all_to_all", group, entry=entry):
        if overlap:
            work = dist.all_to_all_single(output, input.contiguous(), output_split_sizes,
                                          input_split_sizes, group=group.handle,
                                          async_op=True)
            paired.switch_while(work, entry)
        else:
            dist.all_to_all_single(output, input.contiguous(), output_split_sizes,
                                   input_split_sizes, group=group.handle)
            paired.note_blocking(time.perf_counter() - t0)
    fr.recorder.end(entry)
    return output


def broadcast(tensor: torch.Tensor, src: int, group: Group) -> torch.Tensor:
    """Broadcast from global rank ``src``."""
    if group.size == 1:
        return tensor
    entry, mode = _note("broadcast", group, tensor, tensor)
    if mode is SKIP:
        return tensor
    if mode is REAL:
        with _named_failure("broadcast", group, [src], entry=entry):
            dist.broadcast(tensor, src=src, group=group.handle)
    fr.recorder.end(entry)
    return tensor


def broadcast_object(obj, src: int, group: Group):
    """``obj`` (picklable, from trusted peers only) from global rank ``src`` to every rank."""
    if group.size == 1:
        return obj
    entry, mode = _note("broadcast_object", group)
    if mode is not REAL:
        fr.recorder.end(entry)
        return obj
    box = [obj]
    with _named_failure("broadcast_object", group, [src], entry=entry):
        dist.broadcast_object_list(box, src=src, group=group.handle)
    fr.recorder.end(entry)
    return box[0]


def all_gather_object(obj, group: Group) -> list:
    if group.size == 1:
        return [obj]
    entry, mode = _note("all_gather_object", group)
    if mode is not REAL:
        fr.recorder.end(entry)
        return [obj] * group.size
    out = [None] * group.size
    with _named_failure("all_gather_object", group, entry=entry):
        dist.all_gather_object(out, obj, group=group.handle)
    fr.recorder.end(entry)
    return out


def barrier(group: Optional[Group] = None):
    """``group`` None: the whole world (the default process group)."""
    rec = fr.recorder
    if group is None:
        if rec.fake or not (dist.is_initialized() and dist.get_world_size() > 1):
            return
        group = _world(None)
    elif group.size == 1:
        return
    entry, mode = _note("barrier", group)
    if mode is REAL:
        with _named_failure("barrier", group, entry=entry):
            dist.barrier(group=group.handle)
    rec.end(entry)


def batch_send_recv(sends: Sequence[tuple], recvs: Sequence[tuple], group: Group,
                    keys: Optional[Sequence] = None):
    """Post sends ``(tensor, dst)`` and receives ``(tensor, src)`` together and wait.

    Posting both directions at once is what keeps two neighbouring pipeline stages from
    deadlocking when each sends before it receives.  Ranks are global.  ``keys``: a name
    per message (sends first) for the flight recorder, e.g. the pipeline's ``Msg``.
    """
    batch_send_recv_async(sends, recvs, group, keys).wait()


class PendingP2P:
    """Point-to-point transfers in flight: ``wait()`` blocks until every one is done."""

    def __init__(self, works, ops=(), desc: str = "", group: Optional[Group] = None,
                 peers: Sequence[int] = (), entry=None):
        self._works = list(works)
        self._ops = ops   # keeps the (possibly copied) message buffers alive until wait()
        self._desc, self._group, self._peers = desc, group, list(peers)
        self._entry = entry

    def wait(self) -> None:
        if self._works:
            with _named_failure(self._desc, self._group, self._peers, self._entry):
                for work in self._works:
                    work.wait()
            fr.recorder.end(self._entry)
        self._works, self._ops = [], ()


def batch_send_recv_async(sends: Sequence[tuple], recvs: Sequence[tuple],
                          group: Group, keys: Optional[Sequence] = None) -> PendingP2P:
    """``batch_send_recv`` that returns at once, so the caller computes while the messages
    travel (ring attention overlaps the next K/V block with attention on the current one).
    The send tensors must stay unchanged and the receive tensors unread until ``wait()``."""
    rec = fr.recorder
    if rec.faults is not None:
        sends, recvs, keys = rec.filter_p2p(group, sends, recvs, keys)
    if not sends and not recvs:
        return PendingP2P([], [])
    entry = rec.begin_p2p(group, sends, recvs, keys)
    if rec.fake:
        for tensor, peer in sends:
            counter.add(group.name, "send", tensor)
        for tensor, peer in recvs:
            counter.add(group.name, "recv", tensor)
            _fake_fill("recv", tensor, None, group)
        rec.end(entry)
        return PendingP2P([], [])
    ops = []
    for tensor, peer in sends:
        counter.add(group.name, "send", tensor)
        ops.append(dist.P2POp(dist.isend, tensor.contiguous(), peer, group=group.handle))
    for tensor, peer in recvs:
        counter.add(group.name, "recv", tensor)
        ops.append(dist.P2POp(dist.irecv, tensor, peer, group=group.handle))
    if not ops:
        return PendingP2P([], ops)
    desc = " + ".join(([f"send to {[p for _, p in sends]}"] if sends else []) +
                      ([f"recv from {[p for _, p in recvs]}"] if recvs else []))
    peers = [p for _, p in (*sends, *recvs)]
    with _named_failure(desc, group, peers, entry):
        works = dist.batch_isend_irecv(ops)
    return PendingP2P(works, ops, desc, group, peers, entry)


# -- collectives torch itself issues on our groups (FSDP2) ---------------------------------
# FSDP2 calls torch.distributed directly; its all-gathers (output), reduce-scatters (input)
# and HSDP all-reduces are counted here, under the megalite name of the group they run on,
# with the convention above.  Only calls from outside this module are counted (megalite.comm's own
# go through the functions above and are counted there).
_EXTERNAL_GROUPS: dict = {}        # id(ProcessGroup) -> (ProcessGroup, name, size, Group)
_EXTERNAL_OPS = (("all_gather_single", "all_gather", "output_tensor"),
                 ("reduce_scatter_single", "reduce_scatter", "input"),
                 ("all_reduce", "all_reduce", "tensor"))


def count_external_group(process_group, name: str, size: int) -> None:
    """Count collectives that others (FSDP2) issue on ``process_group`` as ``name``, and note
    them in the flight recorder (as issued: torch waits on them itself).  The communicator
    must be one of its own (``parallel_state.dedicated_group``): one name each."""
    _install_external_hooks()
    if id(process_group) not in _EXTERNAL_GROUPS:
        ranks = dist.get_process_group_ranks(process_group) if size > 1 else [dist.get_rank()]
        # the recorder numbers ops per communicator: FSDP2's is not megalite's own group of
        # that name, so it has a name of its own there (and in the test hook): dp-cp(fsdp2)
        _EXTERNAL_GROUPS[id(process_group)] = (process_group, name, size,
                                               Group(f"{name}(fsdp2)", ranks, process_group,
                                                     dist.get_rank()))


def external_group_name(process_group) -> Optional[str]:
    entry = _EXTERNAL_GROUPS.get(id(process_group))
    return entry[1] if entry else None


def _install_external_hooks() -> None:
    if getattr(dist, "_megalite_counted", False):
        return
    for fn_name, op, tensor_arg in _EXTERNAL_OPS:
        original = getattr(dist, fn_name)
        signature = inspect.signature(original)

        def external_collective(*args, _original=original, _sig=signature, _op=op,
                                _arg=tensor_arg, **kwargs):
            entry = None
            if _EXTERNAL_GROUPS and sys._getframe(1).f_globals.get("__name__") != __name__:
                bound = _sig.bind(*args, **kwargs)
                entry = _EXTERNAL_GROUPS.get(id(bound.arguments.get("group")))
            if entry is None or entry[2] <= 1:
                return _original(*args, **kwargs)
            rec = fr.recorder
            if rec.faults is not None and rec.skip(_op, entry[3]):
                return None       # the test hook: FSDP2 waits only on a Work it got back
            counter.add(entry[1], _op, bound.arguments[_arg])
            noted = rec.begin(_op, entry[3], bound.arguments[_arg],
                              waiting=not bound.arguments.get("async_op", False))
            with _named_failure(_op, entry[3], entry=noted):
                work = _original(*args, **kwargs)
            if isinstance(work, dist.Work):
                rec.issued(noted, work)        # torch waits on it: pending until it completes
            else:
                rec.end(noted)
            return work
        setattr(dist, fn_name, external_collective)
    dist._megalite_counted = True
