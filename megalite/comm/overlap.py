"""Overlapped F&B: two halves of a paired pipeline step (the forward of one micro-batch, the
backward of another) run as two cooperative threads that hand a baton to each other at
every overlappable collective (the MoE dispatch / combine all-to-alls).

``run_pair(first, second)`` runs ``first()`` and ``second()``.  Only the baton holder runs
Python; at an overlappable collective the holder *issues* it asynchronously
(gloo/NCCL async work: the transfer proceeds on the backend's own threads / stream),
passes the baton to the other half, and when the baton comes back it waits for its own
collective -- so one micro-batch's all-to-all is in flight while the other computes, and
the wait is only what the other half's compute did not cover (``exposed_s``).

Why threads with a baton, not generators or free-running threads:

* The yield points sit deep inside ``nn.Module.forward`` and inside autograd's backward
  (``_AllToAll.backward``), where a Python generator cannot yield; a thread can block
  there.  On CPU the autograd engine runs a backward on the thread that called it, so the
  backward half's all-to-all backward runs on that half's thread.
* Free-running threads would issue collectives in an order that depends on timing; ranks
  of a group must issue theirs in the same order.  With the baton the order is fixed by
  the program: first's collectives up to its first switch, then second's up to its
  first, and so on -- the same on every rank of an EP group, because those ranks run the
  same chunk, the same pair and the same layers.  Blocking collectives (TP all-reduces,
  the counts all-gather) run while their thread holds the baton, so they are ordered too.
* Only one half touches module state at a time, so the two halves do not race on
  Python-side state.  What is per half is thread-local: grad mode (copied from the caller),
  the flight recorder's call site, the extra-loss collection
  (``transformer/extra_losses.py``), torch's saved-tensor hooks (recompute).
* The autograd graphs of the two halves are disjoint (different micro-batches), so a
  backward running while the other half's forward is half-built is safe.

A switch is refused while the thread is inside an autograd backward *and* recomputing a
forward (activation recompute, ``torch.utils.checkpoint``): the recomputation forks and
restores the RNG states, and the other half drawing dropout masks meanwhile would corrupt
both.  The caller says which of its calls may switch (``moe/comm_ops.py``).

On GPUs the same structure holds with the collective on its own stream (NCCL async work);
that path is not exercised on the CPU CI.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Optional

import torch

from megalite.comm import flight_recorder as fr

_local = threading.local()
_exposed_lock = threading.Lock()
# this process, cumulative: time blocked in all-to-alls, hand-overs between paired halves
# (benchmarks and tests read and reset them)
stats = {"all_to_all_s": 0.0, "switches": 0}


def note_blocking(seconds: float) -> None:
    """An all-to-all's wall time that nothing overlapped (blocking, or the wait after a
    switch): what ``benchmarks/moe_pipeline_overlap.py`` reports as exposed."""
    with _exposed_lock:
        stats["all_to_all_s"] += seconds


class _Pair:
    def __init__(self):
        self.cond = threading.Condition()
        self.turn = 0
        self.done = [False, False]
        self.errors = [None, None]
        self.switches = 0
        self.exposed_s = 0.0   # time halves waited for their collective after a switch


def current() -> Optional[tuple]:
    """(pair, index) when this thread is one half of a paired step, else None."""
    return getattr(_local, "half", None)


def _wait_turn(pair: _Pair, me: int) -> None:
    with pair.cond:
        pair.cond.wait_for(lambda: pair.turn == me)


def _give(pair: _Pair, me: int, finished: bool = False) -> None:
    with pair.cond:
        if finished:
            pair.done[me] = True
        other = 1 - me
        if not pair.done[other]:
            pair.turn = other
            pair.cond.notify_all()


def switch_while(work, entry=None) -> None:
    """Called by ``megalite.comm`` right after issuing ``work`` asynchronously: let the
    other half run (if it is still running), then wait for ``work``.  Outside a pair it
    is a plain ``work.wait()``.  ``entry``: the flight recorder's, marked waiting only from
    the wait on (a hang dump then tells an in-flight all-to-all from a blocked one)."""
    half = current()
    if half is None:
        t0 = time.perf_counter()
        work.wait()
        note_blocking(time.perf_counter() - t0)
        return
    pair, me = half
    if not pair.done[1 - me]:
        pair.switches += 1
        stats["switches"] += 1
        _give(pair, me)
        _wait_turn(pair, me)
    if entry is not None:
        entry.waiting = True
    t0 = time.perf_counter()
    work.wait()
    waited = time.perf_counter() - t0
    pair.exposed_s += waited
    note_blocking(waited)


def may_switch() -> bool:
    """True when a collective issued now may hand the baton over: inside a pair, and not
    recomputing a forward during backward (module docstring)."""
    return current() is not None and not getattr(_local, "no_switch", 0)


class no_switch:
    """``with no_switch():`` -- collectives inside block (activation recompute)."""

    def __enter__(self):
        _local.no_switch = getattr(_local, "no_switch", 0) + 1

    def __exit__(self, *exc):
        _local.no_switch -= 1


class _Worker:
    """A long-lived thread that runs one half at a time: a fresh thread per pair would
    pay autograd's per-thread start-up on every backward (~2 ms each on CPU)."""

    def __init__(self, index: int):
        self.jobs = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=f"paired-half-{index}",
                                       daemon=True)
        self.thread.start()

    def _loop(self):
        while True:
            job, done = self.jobs.get()
            try:
                job()
            finally:
                done.set()


_workers = []


def run_pair(first: Callable[[], None], second: Callable[[], None]) -> _Pair:
    """Run the two halves of a paired step, interleaved at their overlappable collectives;
    returns the pair's record (switches, exposed wait).  An exception in either half is
    re-raised here after both ended (the other half is let run to its end so no rank is
    left with a collective half issued)."""
    pair = _Pair()
    grad = torch.is_grad_enabled()
    where = (fr.site.iteration, fr.site.phase, fr.site.step)

    def body(me: int, fn):
        _local.half = (pair, me)
        fr.site.iteration, fr.site.phase, fr.site.step = where
        try:
            _wait_turn(pair, me)
            with torch.set_grad_enabled(grad):
                fn()
        except BaseException as exc:      # re-raised by the caller
            pair.errors[me] = exc
        finally:
            _local.half = None
            _give(pair, me, finished=True)

    while len(_workers) < 2:
        _workers.append(_Worker(len(_workers)))
    done = [threading.Event(), threading.Event()]
    for me, fn in enumerate((first, second)):
        _workers[me].jobs.put((lambda me=me, fn=fn: body(me, fn), done[me]))
    for event in done:
        event.wait()
    for exc in pair.errors:
        if exc is not None:
            raise exc
    return pair
