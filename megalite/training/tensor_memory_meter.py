"""Peak of live CPU tensor bytes, from torch's allocator, per marked window (one training step).

Why: on CPU the process's resident high-water mark cannot show a ZeRO stage's savings -- the
interpreter and torch take hundreds of MiB, the model is built whole before it is sharded,
and glibc keeps freed pages.  What the planner predicts is the bytes of live tensors.  torch's
CPU allocator reports every allocation and free (pointer, size) to the profiler when it runs
with ``profile_memory``; summing those in time order gives the live bytes at every moment,
so the peak inside a window (forward + backward + grad sync + optimizer step) is exact for
everything allocated on the metered thread: parameters, gradient buffers, activations,
autograd temporaries, reduce-scatter inputs, FSDP2's all-gathered parameters, optimizer
temporaries.

What it does not see: allocations made before the meter started (start it before the model
is built to count everything), and allocations made on other threads (gloo's worker threads
flatten coalesced collectives there).  A block allocated here whose last reference gloo's
worker thread drops (a collective's temporary or input) has no free event: it ends at its
last use by an op (the profiler records each op's input storages) -- known to be dead
because its address was handed out again, or because no Python object holds it when the
meter stops; ``stale_frees`` counts these.

Cost: the profiler records every op while it runs (a few microseconds each); meter only the
steps you need.  On CUDA use ``torch.cuda.max_memory_allocated`` instead.
"""
from __future__ import annotations

import atexit
import bisect
import contextlib
import gc
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch._C._profiler import (ProfilerActivity, ProfilerConfig, ProfilerState,
                                _EventType, _ExperimentalConfig)
from torch.autograd import _disable_profiler, _enable_profiler, _prepare_profiler

MARK = "megalite.memory_window."


@dataclass
class WindowPeak:
    """One marked window: live bytes when it began and ended, and the most in between."""
    name: str
    start_bytes: int
    end_bytes: int
    peak_bytes: int


@dataclass
class MeterResult:
    windows: Dict[str, WindowPeak] = field(default_factory=dict)
    stale_frees: int = 0      # blocks whose free happened on another thread (address reused)
    events: int = 0


@contextlib.contextmanager
def _quiet_stderr():
    """libkineto prints two lines ("profiler_start"/"profiler_stop") on every start/stop."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class TensorMemoryMeter:
    """``with TensorMemoryMeter() as meter: ... with meter.window("step"): ...`` then
    ``meter.result.windows["step"].peak_bytes``.  Bytes are relative to the meter's start
    (live tensors allocated before it are not counted)."""

    def __init__(self):
        self.result: Optional[MeterResult] = None
        self.active = False

    def start(self) -> "TensorMemoryMeter":
        if torch.autograd._profiler_enabled():
            raise RuntimeError("TensorMemoryMeter: another torch profiler is already running")
        # input shapes on: every op's inputs carry their storage pointers (block_lifetimes)
        cfg = ProfilerConfig(ProfilerState.KINETO, True, True, False, False, False,
                             _ExperimentalConfig())
        with _quiet_stderr():
            _prepare_profiler(cfg, {ProfilerActivity.CPU})
            _enable_profiler(cfg, {ProfilerActivity.CPU})
        self.active = True
        atexit.register(self.discard)     # a profiler left on at exit crashes the interpreter
        return self

    def stop(self) -> MeterResult:
        if not self.active:
            return self.result
        with _quiet_stderr():
            profile = _disable_profiler()
        self.active = False
        atexit.unregister(self.discard)
        self.result = summarize(profile.experimental_event_tree(), live_cpu_storages())
        return self.result

    def discard(self) -> None:
        """Stop without summarizing (costs about a second per few thousand recorded ops)."""
        if self.active:
            with _quiet_stderr():
                _disable_profiler()
            self.active = False
            atexit.unregister(self.discard)

    def window(self, name: str):
        """Mark a window (a ``record_function`` range) whose peak the result reports."""
        return torch.autograd.profiler.record_function(MARK + name)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _tensor_ptrs(inputs):
    for x in inputs:
        if isinstance(x, list):
            yield from _tensor_ptrs(x)
        elif getattr(x, "storage_data_ptr", None):
            yield x.storage_data_ptr


def _walk(roots):
    """CPU allocation events ``(time, ptr, bytes, end of the enclosing collective or None)``
    in time order; the marked windows ``(name, start, end)``; per storage pointer the end
    times of the ops that took it as an input; the pointers some collective (``c10d::`` op)
    took."""
    allocs, marks, uses, collective_inputs = [], [], {}, set()
    stack = [(e, None) for e in roots]
    while stack:
        e, collective_end = stack.pop()
        kind = e.typed[0]
        if kind == _EventType.Allocation:
            f = e.extra_fields
            if f.device.type == "cpu":
                allocs.append((e.start_time_ns, f.ptr, f.alloc_size, collective_end))
            continue
        if kind == _EventType.TorchOp:
            if e.name.startswith(MARK):
                marks.append((e.name[len(MARK):], e.start_time_ns, e.end_time_ns))
            else:
                ptrs = list(_tensor_ptrs(e.extra_fields.inputs))
                for ptr in ptrs:
                    uses.setdefault(ptr, []).append(e.end_time_ns)
                if collective_end is None and e.name.startswith("c10d::"):
                    collective_end = e.end_time_ns
                    collective_inputs.update(ptrs)
        stack.extend((c, collective_end) for c in e.children)
    allocs.sort(key=lambda a: a[0])
    return allocs, marks, uses, collective_inputs


def block_lifetimes(allocs, uses=None, collective_inputs=(), live_ptrs=None):
    """``(alloc time, free time or None, bytes)`` per block, and how many frees were unseen.

    A block whose free was not seen was freed by gloo's worker thread, which held it last: a
    collective's temporary (allocated inside a ``c10d::`` op) or one of its inputs.  It ends
    at its last use by an op (the collective, or a copy out of it) before its address was
    handed out again -- or, if the address never came back and no Python object holds the
    storage when the meter stops (``live_ptrs``), before the meter stopped.  Its exact free
    time does not matter: after its last use the caller only waits for gloo."""
    uses = uses or {}
    open_: Dict[int, list] = {}
    blocks: List[list] = []
    stale = 0

    def last_use(block, before):
        ends = [t for t in uses.get(block[4], ()) if block[0] <= t <= before]
        if block[3] is not None:
            ends.append(block[3])
        return max(ends, default=None)

    for t, ptr, size, in_collective in allocs:
        if size > 0:
            if ptr in open_:                    # freed unseen, address reused
                old = open_.pop(ptr)
                end = last_use(old, t)
                old[1] = t if end is None else end
                stale += 1
            block = [t, None, size, in_collective, ptr]
            open_[ptr] = block
            blocks.append(block)
        elif size < 0 and ptr in open_:
            open_.pop(ptr)[1] = t
    for ptr, block in open_.items():            # never freed while metered
        gloo_held = block[3] is not None or ptr in collective_inputs
        end = last_use(block, float("inf"))
        if gloo_held and live_ptrs is not None and ptr not in live_ptrs and end is not None:
            block[1] = end
            stale += 1
    return [(b[0], b[1], b[2]) for b in blocks], stale


def live_cpu_storages() -> set:
    """Data pointers of the CPU storages Python objects hold now (the meter's liveness check
    for blocks whose free it did not see)."""
    ptrs = set()
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):   # not isinstance: no __class__ look-ups
            try:
                if obj.device.type == "cpu":
                    ptrs.add(obj.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError, TypeError):
                pass                         # wrapper subclasses: their local tensor is listed
    return ptrs


def summarize(roots, live_ptrs=None) -> MeterResult:
    """Live bytes over time from the allocation events; peak per marked window."""
    allocs, marks, uses, collective_inputs = _walk(roots)
    lifetimes, stale = block_lifetimes(allocs, uses, collective_inputs, live_ptrs)
    deltas = [(t0, size) for t0, _, size in lifetimes]
    deltas += [(t1, -size) for _, t1, size in lifetimes if t1 is not None]
    deltas.sort(key=lambda d: (d[0], d[1]))     # at equal times, frees first
    times, totals, total = [], [], 0
    for t, delta in deltas:
        total += delta
        times.append(t)
        totals.append(total)
    out = MeterResult(stale_frees=stale, events=len(allocs))
    for name, t0, t1 in marks:
        i = bisect.bisect_left(times, t0)
        j = bisect.bisect_right(times, t1)
        before = totals[i - 1] if i > 0 else 0
        out.windows[name] = WindowPeak(name, before, totals[j - 1] if j > 0 else 0,
                                       max([before, *totals[i:j]]))
    return out
