"""Where a (re)started run takes its state from: ``resume_source(cfg)``, one function.

- a relaunch of the same run -- torchrun restarting its workers
  (``TORCHELASTIC_RESTART_COUNT`` > 0), SLURM requeueing the job (``SLURM_RESTART_COUNT`` > 0),
  or any start of an ``--elastic`` run (a re-formation after a lost or added node does not
  count as a torchrun restart) -- continues from the run's own newest state, loaded whole
  (``--finetune`` / ``--no-load-*`` were about the first start's ``--load``): the newest
  in-memory peer snapshot the survivors hold when snapshots are on
  (``--snapshot-interval``, ``megalite.elastic.snapshot``) and it is newer than the newest
  complete checkpoint in ``--save``; else that checkpoint;
- otherwise ``--load`` as given;
- otherwise nothing: a fresh start.

Finding a snapshot is collective (every rank lists its own node's folder): ``resume_source``
is called by every rank at set-up, after the process groups exist.  ``load_resume_state`` is
the one place that acts on the answer.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

from megalite.checkpointing import manifest as mf
from megalite.elastic import snapshot_restore
from megalite.elastic.snapshot import snapshot_dir, snapshot_interval
from megalite.elastic.snapshot_restore import restore_snapshot


@dataclass(frozen=True)
class ResumeSource:
    kind: str           # "disk" (a checkpoint folder) or "snapshot" (the peers' memory)
    path: str
    own_run: bool       # this run's own progress: load all of it
    reason: str         # for the log line
    snapshot: Optional[object] = None    # kind "snapshot": the SnapshotPlan


def relaunch_reason(cfg) -> Optional[str]:
    """Why this start continues an earlier attempt of the same run, or None."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    requeue = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    if restart:
        return f"torchrun restart {restart}"
    if requeue:
        return f"SLURM requeue {requeue}"
    if cfg.parallel.elastic:
        return "an --elastic run continues its own state"
    return None


def _has_checkpoint(root: Optional[str]) -> bool:
    return bool(root) and os.path.isdir(root) and (
        os.path.isfile(os.path.join(root, mf.MARKER)) or bool(mf.saved_iterations(root)))


def _snapshots_on(cfg) -> bool:
    return snapshot_interval(cfg) > 0


def _newest_disk_iteration(root: Optional[str]) -> int:
    """The newest complete checkpoint's iteration in ``--save`` (-1: none): a snapshot must
    be newer to be worth more."""
    if not root or not os.path.isdir(root):
        return -1
    it, _ = mf.read_marker(root)
    return -1 if it is None else int(it)


def resume_source(cfg) -> Optional[ResumeSource]:
    """The state this start begins from (module docstring), or None for a fresh start."""
    c = cfg.checkpoint
    why = relaunch_reason(cfg)
    if why and _snapshots_on(cfg):
        plan = snapshot_restore.find_snapshot(cfg, newer_than=_newest_disk_iteration(c.save))
        if plan is not None:
            return ResumeSource("snapshot", snapshot_dir(), own_run=True, reason=why,
                                snapshot=plan)
    if why and _has_checkpoint(c.save):
        return ResumeSource("disk", c.save, own_run=True, reason=why)
    if c.load:
        return ResumeSource("disk", c.load, own_run=False, reason="--load")
    return None


def load_resume_state(trainer, source: ResumeSource) -> None:
    """Bring ``trainer`` to ``source``'s state (called from ``Trainer.setup``)."""
    if source.kind not in ("disk", "snapshot"):
        raise ValueError(f"unknown resume source kind {source.kind!r}")
    if not source.own_run:
        trainer.load_checkpoint()
        return
    given = trainer.cfg
    c = dataclasses.replace(given.checkpoint, load=source.path, finetune=False,
                            no_load_optim=False, no_load_rng=False, ckpt_step=None)
    trainer.cfg = dataclasses.replace(given, checkpoint=c)
    if trainer.state.rank == 0:
        where = source.snapshot.describe() if source.kind == "snapshot" else \
            f"the newest checkpoint in {source.path}"
        print(f"> resuming ({source.reason}) from {where}", flush=True)
    try:
        if source.kind == "snapshot":
            restore_snapshot(trainer, source.snapshot)
        else:
            trainer.load_checkpoint()
    finally:
        trainer.cfg = given
