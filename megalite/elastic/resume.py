"""Where a (re)started run takes its state from: ``resume_source(cfg)``, one function.

Today the answer is a disk checkpoint:

- a relaunch of the same run -- torchrun restarting its workers
  (``TORCHELASTIC_RESTART_COUNT`` > 0), SLURM requeueing the job (``SLURM_RESTART_COUNT`` > 0),
  or any start of an ``--elastic`` run (a re-formation after a lost or added node does not
  count as a torchrun restart) -- continues from the newest complete checkpoint in
  ``--save``: the run's own progress, loaded whole (``--finetune`` / ``--no-load-*`` were
  about the first start's ``--load``);
- otherwise ``--load`` as given;
- otherwise nothing: a fresh start.

The in-memory peer snapshots of issue 27 (item 2) extend this function: a newer snapshot
held by the survivors (and the replicas of a lost node's shards) beats the disk checkpoint.
``load_resume_state`` is the one place that acts on the answer.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ResumeSource:
    kind: str           # "disk" (a checkpoint folder); snapshots will add their own kind
    path: str
    own_run: bool       # this run's own progress: load all of it
    reason: str         # for the log line


def relaunch_reason(cfg) -> Optional[str]:
    """Why this start continues an earlier attempt of the same run, or None."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    requeue = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    if restart:
        return f"torchrun restart {restart}"
    if requeue:
        return f"SLURM requeue {requeue}"
    if cfg.parallel.elastic:
        return "an --elastic run continues its --save folder"
    return None


def _has_checkpoint(root: Optional[str]) -> bool:
    from megalite.checkpointing import manifest as mf

    return bool(root) and os.path.isdir(root) and (
        os.path.isfile(os.path.join(root, mf.MARKER)) or bool(mf.saved_iterations(root)))


def resume_source(cfg) -> Optional[ResumeSource]:
    """The state this start begins from (module docstring), or None for a fresh start."""
    c = cfg.checkpoint
    why = relaunch_reason(cfg)
    if why and _has_checkpoint(c.save):
        return ResumeSource("disk", c.save, own_run=True, reason=why)
    if c.load:
        return ResumeSource("disk", c.load, own_run=False, reason="--load")
    return None


def load_resume_state(trainer, source: ResumeSource) -> None:
    """Bring ``trainer`` to ``source``'s state (called from ``Trainer.setup``)."""
    from megalite.training.checkpoint import load_training_checkpoint

    if source.kind != "disk":
        raise ValueError(f"unknown resume source kind {source.kind!r}")
    if not source.own_run:
        load_training_checkpoint(trainer)
        return
    given = trainer.cfg
    c = dataclasses.replace(given.checkpoint, load=source.path, finetune=False,
                            no_load_optim=False, no_load_rng=False, ckpt_step=None)
    trainer.cfg = dataclasses.replace(given, checkpoint=c)
    if trainer.state.rank == 0:
        print(f"> resuming ({source.reason}) from the newest checkpoint in {source.path}",
              flush=True)
    try:
        load_training_checkpoint(trainer)
    finally:
        trainer.cfg = given
