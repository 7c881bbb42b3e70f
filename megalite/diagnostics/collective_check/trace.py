"""Trace one rank's collective program: its real training step, on meta tensors, with
megalite.comm recording instead of communicating.

``trace_rank(cfg, rank)`` builds that rank's ``ParallelState`` without process groups, its
model chunks on the meta device (the model family's own builder), its data-parallel
strategy and optimizer, and runs ``Trainer.train_step`` on mock batches under
``MetaValues`` (``meta_values.py``).  Every call that reaches ``megalite.comm`` is noted by a
``TraceRecorder`` -- the flight recorder with no size limit and ``fake`` set -- so the
program is what the training loop, the schedules and the layers really issue, call site
included.  The test hook ``MEGALITE_FAULT_INJECT`` applies here as in a run.
"""
from __future__ import annotations

import os
import dataclasses
from dataclasses import dataclass
from typing import List

import torch

from megalite.comm import flight_recorder as fr
from megalite.diagnostics.collective_check.meta_values import MetaValues
from megalite.data.gpt_dataset import MockGPTDataset
from megalite.distributed.data_parallel import build_data_parallel
from megalite.models.gpt_step import GPT_FAMILY
from megalite.models.parallelize import attach_data_parallel
from megalite.optimizer import LRScheduler
from megalite.parallel_state import ParallelState, RankGrid


class TraceRecorder(fr.FlightRecorder):
    fake = True

    def __init__(self, rank: int):
        super().__init__(capacity=None, rank=rank,
                         faults=fr.parse_faults(os.environ.get(fr.FAULT_ENV)))


@dataclass
class Op:
    """One collective or p2p batch of a rank's program, in group-relative terms."""
    kind: str                 # group kind: tp, pp, dp-cp, ...
    group: tuple              # member ranks
    op: str                   # all_reduce, all_gather, ..., p2p
    seq: int
    shapes: tuple
    dtype: str
    site: str
    parts: tuple = ()         # p2p: (send|recv, peer's index in the group, shape, message
                              #       no. (per peer and direction), message key)
    phase: str = ""           # the loop's phase (part of ``site``)

    def signature(self) -> tuple:
        """What every member of the group must agree on (an all-to-all's routed rows, its
        first dimension, may differ)."""
        shapes = tuple(s[1:] for s in self.shapes) if self.op == "all_to_all" else self.shapes
        return (self.op, shapes, self.dtype)


def entry_to_op(e: fr.Entry) -> Op:
    site = ", ".join(x for x in (f"iteration {e.iteration}" if e.iteration else "", e.phase,
                                 fr.step_text(e.step), " ".join(e.where)) if x)
    ranks = e.group.ranks
    parts = tuple((kind, ranks.index(peer), shape, n, key)
                  for kind, peer, shape, n, key in e.parts or ())
    return Op(e.group.kind, ranks, e.op, e.seq, tuple(e.shapes),
              str(e.dtype).replace("torch.", "") if e.dtype is not None else "", site, parts,
              e.phase)


def _runnable(cfg):
    """A dry run needs neither --lr nor --train-iters; a step does (neither changes what
    is communicated)."""
    o, t = cfg.optimizer, cfg.training
    if o.lr is None:
        cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(o, lr=1e-4))
    if t.train_iters is None and t.train_samples is None:
        cfg = dataclasses.replace(cfg, training=dataclasses.replace(t, train_iters=1))
    return cfg


def trace_rank(cfg, trainer_class, rank: int, iteration: int = 1, family=None) -> List[Op]:
    """The ordered collectives and p2p batches rank ``rank`` issues in training iteration
    ``iteration`` of ``cfg`` (its world size and layout), computed without data.

    ``trainer_class`` is the training loop's ``Trainer`` (``training/loop.py``), whose real
    ``train_step`` is traced; the caller passes it because the loop sits above this package
    (the loop dumps hangs through ``diagnostics``).

    Every iteration issues the same program (same batch, same schedule), so only that one
    is run, from the position it starts at; a batch-size ramp changes the program from one
    iteration to the next, so with ``--rampup-batch-size`` iterations 1 .. ``iteration``
    are run."""
    family = family or GPT_FAMILY
    cfg = _runnable(cfg)
    state = ParallelState.build(RankGrid.from_config(cfg), rank, create_groups=False)
    rec = TraceRecorder(rank)
    saved = (fr.site.iteration, fr.site.phase, fr.site.step, fr.site.where)
    fr.site.iteration, fr.site.phase, fr.site.step, fr.site.where = 0, "setup", None, ()
    old = fr.install(rec)
    try:
        with torch.random.fork_rng(devices=[]), MetaValues():
            with torch.device("meta"):
                chunks = family.build_model_chunks(cfg, state, "meta")
            trainer = trainer_class(cfg, state, "meta", family)
            trainer.model_chunks = chunks
            trainer.strategy = attach_data_parallel(chunks,
                                                    build_data_parallel(chunks, cfg, state))
            # torch.optim's own arithmetic communicates nothing: skip it (meta has no fused
            # kernel, and it would be a third of the trace's time)
            trainer.optimizer.inner.step = lambda *a, **k: None
            t = cfg.training
            trainer.scheduler = LRScheduler.from_config(cfg, max(trainer.train_iters,
                                                                 iteration))
            first = 1 if trainer.batch_sizes.varies else iteration
            gbs = t.global_batch_size or t.micro_batch_size
            trainer.iteration = first - 1
            trainer.consumed_samples = (first - 1) * gbs     # no ramp when first > 1
            data = MockGPTDataset(trainer.consumed_samples + (iteration - first + 1) * gbs,
                                  cfg.model.seq_length, cfg.model.vocab_size, t.seed)
            batches = trainer.data_iterator(data, trainer.consumed_samples)
            for _ in range(first, iteration + 1):
                trainer.train_step(batches)
    finally:
        fr.install(old)
        fr.site.iteration, fr.site.phase, fr.site.step, fr.site.where = saved
    return [entry_to_op(e) for e in rec.entries]
