"""Learning-rate and weight-decay schedules, step for step Megatron-Core's
``OptimizerParamScheduler``.

Megatron counts scheduler *steps* in samples (``--train-samples`` runs) or in iterations
times the global batch size (``--train-iters`` runs): after every update the scheduler
advances by the samples consumed, and the lr an update uses is the one computed *before*
that advance.  So update ``i`` (1-based, constant batch size) uses ``lr_at((i - 1) * gbs)``:
the first update of a linear schedule without warmup uses the peak lr, and the last one
the lr one step above ``--min-lr``.  Both lr and weight decay are pure functions of the
consumed samples, so a resume needs nothing but the consumed-sample count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

DECAY_STYLES = ["constant", "linear", "cosine", "inverse-square-root", "WSD"]
WSD_DECAY_STYLES = ["linear", "cosine", "exponential", "minus_sqrt"]


@dataclass(frozen=True)
class StepSettings:
    """What one update uses (the schedule's values; the optimizer writes them into its
    parameter groups, ``MasterWeightOptimizer.step``): the lr, the lr of the
    ``--decoupled-lr`` groups (None: the same lr) and the weight decay of the groups that
    decay (None: each group keeps its configured decay)."""
    lr: float
    decoupled_lr: Optional[float] = None
    weight_decay: Optional[float] = None


class LRScheduler:
    """lr(num_steps) and wd(num_steps) with Megatron's formulas; ``num_steps`` counts samples
    (or iterations when ``steps_per_iteration`` is 1, as in unit tests)."""

    def __init__(self, max_lr: float, min_lr: float, warmup_steps: float, decay_steps: int,
                 style: str = "linear", wsd_decay_steps: Optional[int] = None,
                 wsd_decay_style: str = "linear", *, init_lr: float = 0.0,
                 steps_per_iteration: int = 1, start_wd: float = 0.0,
                 end_wd: Optional[float] = None, wd_incr_steps: int = 1,
                 wd_incr_style: str = "constant", decoupled_lr: Optional[float] = None,
                 decoupled_min_lr: Optional[float] = None):
        if style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style {style}: expected one of {DECAY_STYLES}")
        self.max_lr, self.min_lr, self.init_lr = float(max_lr), float(min_lr), float(init_lr)
        self.warmup_steps, self.decay_steps = warmup_steps, max(decay_steps, 1)
        self.style, self.wsd_decay_style = style, wsd_decay_style
        # Megatron requires --lr-wsd-decay-*; megalite keeps its old default of 10%.
        self.wsd_decay_steps = wsd_decay_steps or max(self.decay_steps // 10, 1)
        self.steps_per_iteration = steps_per_iteration
        self.start_wd = start_wd
        self.end_wd = start_wd if end_wd is None else end_wd
        self.wd_incr_steps, self.wd_incr_style = max(wd_incr_steps, 1), wd_incr_style
        self.decoupled_lr = decoupled_lr
        self.decoupled_min_lr = min_lr if decoupled_min_lr is None else decoupled_min_lr

    @classmethod
    def from_config(cls, cfg, train_iters: int) -> "LRScheduler":
        """Megatron's ``get_optimizer_param_scheduler``: steps in samples either way."""
        o, t = cfg.optimizer, cfg.training
        gbs = t.global_batch_size or 1
        if t.train_iters is not None or t.train_samples is None:
            decay = (o.lr_decay_iters or train_iters) * gbs
            wd_steps = train_iters * gbs
            wsd = o.lr_wsd_decay_iters * gbs if o.lr_wsd_decay_iters else None
            warmup = o.lr_warmup_iters * gbs
        else:
            decay = o.lr_decay_samples or t.train_samples
            wd_steps = t.train_samples
            wsd = o.lr_wsd_decay_samples
            warmup = o.lr_warmup_samples
        if o.lr_warmup_fraction is not None:
            warmup = o.lr_warmup_fraction * decay
        start_wd = o.weight_decay if o.start_weight_decay is None else o.start_weight_decay
        end_wd = o.weight_decay if o.end_weight_decay is None else o.end_weight_decay
        return cls(o.lr, o.min_lr, warmup, decay, o.lr_decay_style, wsd, o.lr_wsd_decay_style,
                   init_lr=o.lr_warmup_init, steps_per_iteration=gbs, start_wd=start_wd,
                   end_wd=end_wd, wd_incr_steps=wd_steps, wd_incr_style=o.weight_decay_incr_style,
                   decoupled_lr=o.decoupled_lr, decoupled_min_lr=o.decoupled_min_lr)

    @staticmethod
    def _wsd_coeff(style: str, ratio: float) -> float:
        if style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if style == "exponential":
            return (2.0 * math.pow(0.5, ratio)) - 1.0
        if style == "minus_sqrt":
            return 1.0 - math.sqrt(ratio)
        return 1.0 - ratio

    def lr_at(self, num_steps: float, decoupled: bool = False) -> float:
        """Megatron's ``get_lr`` at ``num_steps``; ``decoupled`` for the embedding and output
        layer under ``--decoupled-lr``."""
        max_lr, min_lr = self.max_lr, self.min_lr
        if decoupled and self.decoupled_lr is not None:
            max_lr, min_lr = self.decoupled_lr, self.decoupled_min_lr
        if self.warmup_steps > 0 and num_steps <= self.warmup_steps:
            return self.init_lr + ((max_lr - self.init_lr) * float(num_steps)
                                   / float(self.warmup_steps))
        if self.style == "constant":
            return max_lr
        if num_steps > self.decay_steps:
            return min_lr
        if self.style == "inverse-square-root":
            warmup_steps = max(self.warmup_steps, 1)
            lr = max_lr * warmup_steps ** 0.5 / (max(num_steps, 1) ** 0.5)
            return max(min_lr, lr)
        decay_ratio = float(num_steps - self.warmup_steps) / float(
            self.decay_steps - self.warmup_steps)
        delta_lr = max_lr - min_lr
        if self.style == "linear":
            coeff = 1.0 - decay_ratio
        elif self.style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        else:  # WSD
            anneal_start = self.decay_steps - self.wsd_decay_steps
            if num_steps <= anneal_start:
                coeff = 1.0
            else:
                coeff = self._wsd_coeff(self.wsd_decay_style,
                                        float(num_steps - anneal_start) / float(self.wsd_decay_steps))
        return min_lr + coeff * delta_lr

    def wd_at(self, num_steps: float) -> float:
        """Megatron's ``get_wd``: weight decay for parameters that decay."""
        if num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = float(num_steps) / float(self.wd_incr_steps)
        coeff = ratio if self.wd_incr_style == "linear" else \
            0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def lr(self, iteration: int) -> float:
        """lr used for the update of 1-based ``iteration`` at a constant batch size."""
        return self.lr_at((iteration - 1) * self.steps_per_iteration)

    def settings_at(self, num_steps: float) -> StepSettings:
        """The lr (default and ``--decoupled-lr`` groups) and weight decay of the update made
        after ``num_steps`` samples, as Megatron's ``step`` sets them."""
        return StepSettings(self.lr_at(num_steps), self.lr_at(num_steps, decoupled=True),
                            self.wd_at(num_steps))


class SchedulePosition:
    """DCP ``Stateful``: how far the LR / WD schedule lags the consumed samples.

    The schedule itself is a function of the samples it has stepped over
    (``LRScheduler.settings_at``); Megatron steps it on updates only, so a ``--fp16`` step
    skipped on overflow does not move it.  Its position is consumed samples minus
    ``skipped_samples``; ``skipped_iterations`` counts those steps."""

    def __init__(self):
        self.skipped_samples = 0
        self.skipped_iterations = 0

    def skip(self, samples: int) -> None:
        self.skipped_samples += samples
        self.skipped_iterations += 1

    def state_dict(self) -> dict:
        return {"skipped_samples": self.skipped_samples,
                "skipped_iterations": self.skipped_iterations}

    def load_state_dict(self, sd: dict) -> None:
        """A checkpoint without the entries (older, converted): nothing was skipped."""
        sd = sd or {}
        self.skipped_samples = int(sd.get("skipped_samples", 0))
        self.skipped_iterations = int(sd.get("skipped_iterations", 0))
