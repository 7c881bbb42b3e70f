"""What the generic training loop needs from a model family (Megatron's ``pretrain_gpt.py``).

The loop (``training/loop.py``) and the schedules know neither the model's inputs nor
its loss: a ``ModelFamily`` supplies them, and ``StepContext`` carries the per-iteration
values the loop computes for the forward step.

Order inside one iteration (the loop's side):
1. ``get_batch`` turns each raw micro-batch into this rank's micro-batch (on the device;
   context parallelism slices the sequence here);
2. the loop counts the loss tokens of *those* batches and all-reduces over dp-cp --
   the denominator of every micro-batch loss (``transformer/loss_reduction.py``;
   docs/architecture.md#numerical-contract);
3. the schedule calls ``forward_step(batch, model, ctx)`` -> ``(output, loss_func)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Tuple

import torch


def no_extra_losses(cfg) -> Tuple[str, ...]:
    return ()


def no_step_metrics(chunks, cfg, state) -> dict:
    return {}


@dataclass(frozen=True)
class ModelFamily:
    name: str
    # (cfg, state, device) -> this rank's model chunks in the training dtype, built (on meta
    # under FSDP2) and parallelized: spec choices -> RNG tracker -> recompute -> compile ->
    # fully_shard -> init (GPT's: ``models/parallelize.py``); the data-parallel strategy's
    # hooks follow (``parallelize.attach_data_parallel``)
    build_model_chunks: Callable
    # (raw micro-batch dict, state, device) -> this rank's micro-batch dict
    get_batch: Callable
    # (batch, model chunk, StepContext) -> (output, loss_func); loss_func(output) -> (loss,
    # {"loss_sum": detached sum}) on the last stage
    forward_step: Callable
    # cfg -> names of the extra loss terms modules may register (logged under these keys)
    extra_loss_names: Callable = no_extra_losses
    # (chunks, cfg, state) -> {metric: value} after each optimizer step (every rank calls
    # it: it may reduce statistics; MoE logs expert loads and updates its expert bias)
    after_train_step: Callable = no_step_metrics


@dataclass
class StepContext:
    """One iteration's values for the forward step; the loop builds it after ``get_batch``."""
    num_loss_tokens: torch.Tensor        # float64 [1]: loss tokens of the global batch
    extra_loss_names: Tuple[str, ...] = ()
    extra_loss_scale: float = 1.0        # each extra term enters the objective as scale*term
    extra_loss_sums: torch.Tensor = None  # float64 [len(names)]: this rank's detached sums
    grad_scale: float = 1.0              # --fp16 loss scale: backward starts from scale*loss

    def __post_init__(self):
        if self.extra_loss_sums is None:
            self.extra_loss_sums = torch.zeros(len(self.extra_loss_names), dtype=torch.float64,
                                               device=self.num_loss_tokens.device)
