"""Optimizer: AdamW with fp32 master weights, clipping by a given norm, LR schedules."""
from megalite.optimizer.lr_schedule import LRScheduler  # noqa: F401
from megalite.optimizer.optimizer import (MasterWeightOptimizer,  # noqa: F401
                                          MixedPrecisionOptimizer)
