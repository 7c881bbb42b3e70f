"""Learning-rate schedules: linear warmup, then constant / linear / cosine / WSD decay."""
from __future__ import annotations

import math


class LRScheduler:
    """lr as a pure function of the iteration, so resuming needs only the iteration."""

    def __init__(self, max_lr: float, min_lr: float, warmup_iters: int, decay_iters: int,
                 style: str = "linear", wsd_decay_iters: int | None = None,
                 wsd_decay_style: str = "linear"):
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_iters, self.decay_iters = warmup_iters, max(decay_iters, 1)
        self.style, self.wsd_decay_style = style, wsd_decay_style
        self.wsd_decay_iters = wsd_decay_iters or max(self.decay_iters // 10, 1)

    @classmethod
    def from_config(cls, cfg, train_iters: int) -> "LRScheduler":
        o = cfg.optimizer
        decay = o.lr_decay_iters or train_iters
        warmup = o.lr_warmup_iters
        if o.lr_warmup_fraction is not None:
            warmup = int(o.lr_warmup_fraction * decay)
        return cls(o.lr, o.min_lr, warmup, decay, o.lr_decay_style, o.lr_wsd_decay_iters,
                   o.lr_wsd_decay_style)

    @staticmethod
    def _shape(style: str, ratio: float) -> float:
        """Fraction of (max - min) still applied after ``ratio`` of the decay (1 -> 0)."""
        if style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if style == "exponential":
            return (0.01 ** ratio - 0.01) / 0.99
        return 1.0 - ratio

    def lr(self, iteration: int) -> float:
        """lr used for the update of 1-based ``iteration``."""
        if self.warmup_iters and iteration <= self.warmup_iters:
            return self.max_lr * iteration / self.warmup_iters
        if self.style == "constant":
            return self.max_lr
        if iteration > self.decay_iters:
            return self.min_lr
        delta = self.max_lr - self.min_lr
        if self.style == "WSD":
            start = self.decay_iters - self.wsd_decay_iters
            if iteration <= start:
                return self.max_lr
            ratio = (iteration - start) / self.wsd_decay_iters
            return self.min_lr + delta * self._shape(self.wsd_decay_style, ratio)
        ratio = (iteration - self.warmup_iters) / max(self.decay_iters - self.warmup_iters, 1)
        return self.min_lr + delta * self._shape(self.style, ratio)
