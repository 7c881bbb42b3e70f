"""Optimizer: AdamW with fp32 master weights, global-norm clipping, LR schedules."""
from megalite.optimizer.lr_schedule import LRScheduler  # noqa: F401
from megalite.optimizer.optimizer import MixedPrecisionOptimizer, build_optimizer  # noqa: F401
