"""What an elastic run's spares do (``--elastic``).

Which world a layout trains at, and so which ranks are spares, is the command line's
re-layout rule (``megalite.cli.elastic_fit``), applied at every (re)start.  A spare does not
join the process group.  It waits on the trainers' store until rank 0 releases it after
training, then exits 0; when the trainers fail, the launcher stops it with them, and at the
next re-formation it is an ordinary rank again.
"""
from __future__ import annotations

import os
import time
from datetime import timedelta

import torch.distributed as dist

from megalite.cli.elastic_fit import restart_attempt

SPARES_RELEASED_KEY = "megalite/spares/released"


def _store(timeout: timedelta):
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           is_master=False, timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore(f"megalite/attempt_{restart_attempt()}", client)


def wait_as_spare(rank: int, trained_world: int) -> int:
    """Block until rank 0 releases the spares after training; exit status 0.  When the
    trainers' store goes away without a release, the trainers failed: the launcher restarts
    every rank, spares included, at the re-formation (or stops them), so wait for that --
    exiting here would tell this node's launcher that the job is done."""
    print(f"> rank {rank}: spare (the layout trains on ranks 0-{trained_world - 1}); waiting",
          flush=True)
    try:
        store = _store(timedelta(days=365))      # a wait ends by the key or the store's loss
        store.wait([SPARES_RELEASED_KEY])
        return 0
    except Exception:  # noqa: BLE001  (the store is gone: the trainers failed)
        pass
    launcher = os.getppid()
    while os.getppid() == launcher:              # until stopped, or the launcher is gone
        time.sleep(1.0)
    return 1


def release_spares(cfg, rank: int) -> None:
    """Rank 0 of the trainers, when training ended: the spares may leave."""
    if rank != 0 or (cfg.launched_world_size or cfg.world_size) <= cfg.world_size:
        return
    try:
        _store(timedelta(seconds=30)).set(SPARES_RELEASED_KEY, "1")
    except Exception:  # noqa: BLE001  (the spares also leave when the store goes away)
        pass
