"""The re-layout rule of an elastic run (``--elastic``), applied at every (re)start.

DP is recomputed from the world; the other sizes of the run's ``ParallelDims``
(config/parallel_dims.py: TP, PP, CP, EP, expert-TP) and the global batch stay,
so each DP rank runs more micro-batches when the world shrinks and fewer when it grows back:
the loss curve is the uninterrupted one (DESIGN.md section 3).  Expert-DP and the FSDP/HSDP
groups follow from the same grid.

When the world does not fit the layout (not a multiple of TP x CP x PP, a DP that does not
divide the global batch, an interleaved schedule short of micro-batches), the largest world
below it that fits trains and the remaining ranks wait as spares; one line says so.  What
"fits" means is validation's business (``megalite.cli.validation``): this module only asks it
about smaller worlds, so the rule is not written twice.

A spare does not join the process group.  It waits on the trainers' store until rank 0
releases it after training, then exits 0; when the trainers fail, the launcher stops it with
them, and at the next re-formation it is an ordinary rank again.
"""
from __future__ import annotations

import copy
import os
import time
from datetime import timedelta
from typing import Optional, Tuple

from megalite.errors import ConfigError

SPARES_RELEASED_KEY = "megalite/spares/released"


def _attempt() -> str:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"


def fits(cfg, world: int) -> Optional[str]:
    """None when ``cfg`` validates at ``world`` ranks, else validation's one-line reason."""
    from megalite.cli.validation import validate

    probe = copy.deepcopy(cfg)
    probe.world_size = world
    try:
        validate(probe)
    except ConfigError as exc:
        return str(exc)
    return None


def fit_world(cfg) -> Tuple[object, str]:
    """``(cfg at the world that trains, line)``: the launcher's world when the layout fits
    it, else the largest smaller world that does (the rest are spares).  Raises the
    launcher world's own ConfigError when no world fits."""
    world = cfg.world_size
    problem = fits(cfg, world)
    if problem is None:
        return cfg, layout_line(cfg, world)
    step = cfg.parallel_dims.world_step       # both grids tile the world
    for smaller in range(world - world % step, 0, -step):
        if smaller < world and fits(cfg, smaller) is None:
            fitted = copy.deepcopy(cfg)
            fitted.world_size = smaller
            spares = f"rank {smaller} waits as a spare" if world - smaller == 1 else \
                f"ranks {smaller}-{world - 1} wait as spares"
            return fitted, (f"> elastic: world {world} does not fit the layout ({problem}); "
                            f"the largest world that does, {smaller}, trains "
                            f"({describe(fitted)}) and {spares}")
    raise ConfigError(f"{problem} (--elastic: no smaller world fits this layout either; "
                      "raise the minimum number of nodes, --nnodes MIN:MAX)")


def describe(cfg) -> str:
    dims, t = cfg.parallel_dims, cfg.training
    return (f"{dims.describe()}, {t.global_batch_size // (t.micro_batch_size * dims.dp)} "
            f"micro-batches of "
            f"{t.micro_batch_size} per DP rank, global batch {t.global_batch_size}")


def layout_line(cfg, world: int) -> str:
    restart = _attempt()
    when = "start" if restart == "0" else f"restart {restart}"
    return f"> elastic {when}: world {world}: {describe(cfg)}"


def _store(timeout: timedelta):
    import torch.distributed as dist

    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           is_master=False, timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore(f"megalite/attempt_{_attempt()}", client)


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
