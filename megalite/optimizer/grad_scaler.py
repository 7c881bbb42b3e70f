"""Loss scaling for ``--fp16``: Megatron-Core's ``ConstantGradScaler`` / ``DynamicGradScaler``.

Why: fp16 has 5 exponent bits, so small gradients underflow to zero.  The loss is
multiplied by ``scale`` before backward; the (fp32) main gradients are divided by it
before the norm, clipping and the update.  A step whose gradients hold an inf/nan is
skipped (parameters and optimizer state untouched) and the dynamic scale backs off.

Semantics, step for step Megatron-Core's ``optimizer/grad_scaler.py``:

* on an overflow the growth tracker resets and the hysteresis tracker drops by one; once
  it reaches 0 the scale is multiplied by ``backoff`` (0.5), never below ``min_scale``
  (and every further overflow backs off again until ``window`` good steps pass);
* after ``window`` (``--loss-scale-window``) consecutive good steps the scale is
  multiplied by ``growth`` (2) and the hysteresis tracker is refilled.

The scale is a Python float (a power of two times a power of two stays exact): the
overflow flag has already been reduced across every rank, so all ranks hold the same
state, and the state goes to the checkpoint's metadata as JSON.
"""
from __future__ import annotations

from typing import List, Optional

import torch


class ConstantGradScaler:
    """``--loss-scale S``: a fixed scale; overflowing steps are still skipped."""

    def __init__(self, scale: float):
        if not scale > 0:
            raise ValueError(f"loss scale must be positive, got {scale}")
        self.scale = float(scale)

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass


class DynamicGradScaler(ConstantGradScaler):
    """Backs off by ``backoff`` after ``hysteresis`` overflows in a row; grows by ``growth``
    after ``window`` steps without one."""

    def __init__(self, initial_scale: float, min_scale: float, window: int, hysteresis: int,
                 growth: float = 2.0, backoff: float = 0.5):
        super().__init__(initial_scale)
        if not 0 < min_scale <= initial_scale:
            raise ValueError(f"min loss scale {min_scale} must be in (0, {initial_scale}]")
        if window < 1 or hysteresis < 1:
            raise ValueError("loss-scale window and hysteresis must be >= 1")
        self.min_scale, self.window, self.hysteresis = float(min_scale), int(window), int(hysteresis)
        self.growth, self.backoff = float(growth), float(backoff)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.window:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, sd: dict) -> None:
        if sd:
            self.scale = float(sd["scale"])
            self.growth_tracker = int(sd["growth_tracker"])
            self.hysteresis_tracker = int(sd["hysteresis_tracker"])


def build_grad_scaler(optim_config) -> Optional[ConstantGradScaler]:
    """Megatron's choice (``get_megatron_optimizer``): none in fp32; constant with
    ``--loss-scale`` (under ``--bf16`` too); else, under ``--fp16``, dynamic from
    ``--initial-loss-scale`` / ``--min-loss-scale`` / ``--loss-scale-window`` /
    ``--hysteresis``."""
    o = optim_config
    if not (o.fp16 or o.bf16):
        return None
    if o.loss_scale:
        return ConstantGradScaler(o.loss_scale)
    if not o.fp16:
        return None
    return DynamicGradScaler(o.initial_loss_scale, o.min_loss_scale,
                             int(o.loss_scale_window), o.hysteresis)


def unscale_and_find_inf(grads: List[torch.Tensor], inv_scale: float) -> torch.Tensor:
    """Multiply every gradient by ``inv_scale`` in place; return a float32 [1] tensor that
    is 1 when any element was inf/nan (reduce it with max over the ranks before use)."""
    found = torch.zeros(1, dtype=torch.float32,
                        device=grads[0].device if grads else torch.device("cpu"))
    for g in grads:
        if g.numel():
            found = torch.maximum(found, (~torch.isfinite(g)).any().float().reshape(1))
            g.mul_(inv_scale)
    return found
