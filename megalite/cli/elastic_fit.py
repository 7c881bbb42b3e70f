"""The re-layout rule of an elastic run (``--elastic``): which world its layout trains at.

DP is recomputed from the world; the other sizes of the run's ``ParallelDims``
(config/parallel_dims.py: TP, PP, CP, EP, expert-TP) and the global batch stay,
so each DP rank runs more micro-batches when the world shrinks and fewer when it grows back:
the loss curve is the uninterrupted one (docs/architecture.md#numerical-contract).  Expert-DP and the
FSDP/HSDP groups follow from the same grid.

When the world does not fit the layout (not a multiple of TP x CP x PP, a DP that does not
divide the global batch, an interleaved schedule short of micro-batches), the largest world
below it that fits trains and the remaining ranks wait as spares; one line says so.  What
"fits" means is validation's business (``megalite.cli.validation``): this module only asks it
about smaller worlds, so the rule is not written twice.  The command line applies it at
every (re)start, before any process group exists; how a spare waits is
``megalite.elastic.relayout``'s.
"""
from __future__ import annotations

import copy
import os
from typing import Optional, Tuple

from megalite.cli.validation import validate
from megalite.errors import ConfigError


def restart_attempt() -> str:
    """torchrun's restart count of this start ("0" on the first)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"


def fits(cfg, world: int) -> Optional[str]:
    """None when ``cfg`` validates at ``world`` ranks, else validation's one-line reason."""
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
    restart = restart_attempt()
    when = "start" if restart == "0" else f"restart {restart}"
    return f"> elastic {when}: world {world}: {describe(cfg)}"
