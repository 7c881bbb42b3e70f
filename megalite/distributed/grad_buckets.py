"""Gradient buckets whose reduction overlaps backward (``--overlap-grad-reduce``).

Why buckets: one collective per parameter is latency-bound, one for the whole model can
only start after the last gradient exists.  Parameters are grouped, in reverse order of
construction (roughly the order backward produces their gradients), into buckets of about
``--ddp-bucket-size`` elements per (DP group, dtype); each bucket's gradients live in one
contiguous buffer, so its reduction is a single all-reduce (DDP) or reduce-scatter
(distributed optimizer) -- a plain sum over the bucket's DP group, as the loss-reduction
policy says (``transformer/loss_reduction.py``: the loss is already over the global token
count, so nothing divides by the DP size).

When to launch: a bucket is ready once every parameter in it has received its *last*
gradient accumulation of the step.  How many accumulations a parameter receives per step
(micro-batches x uses per backward, the pipeline schedule's W passes, ...) is learnt from
the first step, which reduces everything after backward as the non-overlapped path does;
from the second step on, the post-accumulate hook that sees a parameter's last accumulation
launches the bucket asynchronously (``comm.Pending``), and ``finish`` only waits.  Under PP
this is after the stage's last backward.  A parameter that accumulates after its bucket
was launched would make the reduction wrong: that raises instead.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Callable, Dict, List, Optional

import torch

DEFAULT_BUCKET_ELEMENTS = 40_000_000        # Megatron-Core: max(40M, 1M x DP)


def bucket_size(cfg, dp_size: int) -> int:
    """Elements per bucket: ``--ddp-bucket-size`` or Megatron-Core's default."""
    given = cfg.parallel.ddp_bucket_size
    return given if given else max(DEFAULT_BUCKET_ELEMENTS, 1_000_000 * dp_size)


def split_into_buckets(params: List[torch.nn.Parameter], keys: List[tuple],
                       size: int) -> List[tuple]:
    """``[(key, [params])]``: params of one key, in reverse order, cut into runs of at least
    ``size`` elements (the last run of a key may be smaller)."""
    open_: Dict[tuple, list] = {}
    out: List[tuple] = []
    for p, key in reversed(list(zip(params, keys))):
        run = open_.setdefault(key, [])
        run.append(p)
        if sum(q.numel() for q in run) >= size:
            out.append((key, run))
            open_[key] = []
    out += [(key, run) for key, run in open_.items() if run]
    return out


class Bucket:
    """One bucket: its parameters and how to start its reduction (``launch() -> Pending``)."""

    def __init__(self, index: int, params, launch: Callable, deferred: bool = False,
                 on_done: Optional[Callable] = None):
        self.index, self.params, self._launch = index, list(params), launch
        self.deferred = deferred       # reduced after the model-parallel sums (tied embeddings)
        self.on_done = on_done         # after the reduction (ZeRO-2: free the full buffer)
        self.pending = None
        self.waiting = 0               # parameters still expecting an accumulation this step
        self.t_launch = self.t_done = None

    def launch(self) -> None:
        self.t_launch = time.time()
        self.pending = self._launch()

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
            self.t_done = time.time()
            if self.on_done is not None:
                self.on_done()


class OverlapScheduler:
    """Counts gradient accumulations per parameter and launches each bucket when its last
    one arrives (module docstring).  ``max_in_flight``: waiting for older buckets as new
    ones launch bounds how many full-size gradient buckets a ZeRO-2 run keeps alive."""

    def __init__(self, buckets: List[Bucket], names: Dict[int, str], max_in_flight=None):
        self.buckets, self.names = buckets, names
        self.max_in_flight = max_in_flight
        self.bucket_of = {id(p): b for b in buckets for p in b.params}
        self.expected: Optional[Dict[int, int]] = None     # learnt in the first step
        self.seen: Counter = Counter()
        self.in_flight: List[Bucket] = []
        self.trace: List[dict] = []        # last step's bucket timings (timeline tooling)
        self.t_step = self.t_backward_end = None

    def start_step(self) -> None:
        self.seen.clear()
        self.in_flight = []
        self.t_step, self.t_backward_end = time.time(), None
        for b in self.buckets:
            b.pending, b.t_launch, b.t_done = None, None, None
            if self.expected is not None:
                b.waiting = sum(1 for p in b.params if self.expected.get(id(p), 0) > 0)

    def on_accumulated(self, p) -> None:
        """Each parameter's post-accumulate-grad hook (the strategy lists it in
        ``grad_hooks``, after the hook that moves the gradient into its bucket)."""
        self.seen[id(p)] += 1
        self.t_backward_end = time.time()
        if self.expected is None:
            return
        b = self.bucket_of[id(p)]
        want = self.expected.get(id(p), 0)
        if self.seen[id(p)] > want or b.t_launch is not None:
            raise RuntimeError(
                f"--overlap-grad-reduce: '{self.names.get(id(p), '?')}' accumulated a gradient "
                f"after its bucket's reduction started ({self.seen[id(p)]} accumulations this "
                f"step, {want} in the first): reduction would miss it")
        if self.seen[id(p)] == want:
            b.waiting -= 1
            if b.waiting == 0 and not b.deferred:
                self._launch(b)

    def _launch(self, b: Bucket) -> None:
        b.launch()
        self.in_flight.append(b)
        if self.max_in_flight is not None:
            while len(self.in_flight) > self.max_in_flight:
                self.in_flight.pop(0).wait()

    def finish(self, between: Optional[Callable] = None) -> None:
        """Launch what is not launched yet (the first step: everything), wait for all, call
        ``between()`` (the model-parallel reductions), then reduce the deferred buckets."""
        for b in self.buckets:
            if b.t_launch is None and not b.deferred:
                self._launch(b)
        for b in self.buckets:
            if not b.deferred:
                b.wait()
        if between is not None:
            between()
        for b in self.buckets:
            if b.deferred:
                b.launch()
                b.wait()
        if self.expected is None:
            self.expected = dict(self.seen)
        # wall-clock times, as the pipeline executor's events (timeline.records_from_buckets)
        self.trace = [{"bucket": b.index, "elements": sum(p.numel() for p in b.params),
                       "launch": b.t_launch, "done": b.t_done, "deferred": b.deferred}
                      for b in self.buckets]
