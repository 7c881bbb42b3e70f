"""GPT's training step for the generic loop: what Megatron keeps in ``pretrain_gpt.py``.

``GPT_FAMILY`` bundles ``build_model_chunks`` (``models/stages.py``), ``get_batch`` and
``forward_step`` (whose ``loss_func`` is the masked per-token loss over the global token
count).  Extra loss terms
that modules register (``transformer/extra_losses.py``) join the backward of the chunk
that computed them and are logged under their names: the MoE layers' aux and z losses
(``moe/router.py``) and the MTP depths' losses (``transformer/mtp.py``); ``after_train_step`` adds the per-layer expert-load statistics.
"""
from __future__ import annotations

import functools

import torch

from megalite.context_parallel.load_balance import slice_batch
from megalite.models.family import ModelFamily, StepContext
from megalite.models.stages import build_model_chunks
from megalite.moe.metrics import moe_step_metrics
from megalite.moe.router import extra_loss_names as moe_extra_loss_names
from megalite.transformer.extra_losses import collect_extra_losses
from megalite.transformer.loss_reduction import extra_term_backward_scale, micro_batch_loss
from megalite.transformer.mtp import mtp_loss_names


def get_batch(batch: dict, state, device) -> dict:
    """This rank's micro-batch (tokens, labels, loss_mask[, position_ids]) on ``device``.

    Context parallelism slices the sequence HERE (``context_parallel.load_balance``: CP
    rank r keeps chunks r and 2CP-1-r of 2CP), before the loop counts loss tokens: the
    loop sums ``loss_mask`` of what this returns and all-reduces over dp-cp, so each token
    is counted exactly once.  Counting the unsliced batch would make the denominator CP x
    too large.  ``document_ids`` (``--reset-attention-mask``) stay whole: CP attention
    needs the documents of every rank's tokens.
    """
    if state.cp.size > 1:  # chunks r and 2CP-1-r, with their true position ids
        batch = slice_batch(batch, state.cp.size, state.cp.rank)
    return {k: v.to(device) for k, v in batch.items()}


def loss_func(loss_mask: torch.Tensor, num_loss_tokens: torch.Tensor,
              per_token_loss: torch.Tensor, grad_scale: float = 1.0):
    """The masked loss sum as the loss-reduction policy divides it (global token count,
    times the fp16 loss scale: ``transformer/loss_reduction.micro_batch_loss``); reports
    the detached, unscaled sum."""
    mask = loss_mask.to(per_token_loss.dtype)
    total = (per_token_loss.float() * mask).sum()
    return micro_batch_loss(total, num_loss_tokens, grad_scale), {"loss_sum": total.detach()}


def forward_step(batch: dict, model, ctx: StepContext):
    """Run one chunk on one micro-batch; any stage may add extra loss terms."""
    with collect_extra_losses(ctx.extra_loss_names) as extra:
        docs = {} if "document_ids" not in batch else {"document_ids": batch["document_ids"]}
        output = model(batch["tokens"], batch.get("position_ids"), labels=batch["labels"],
                       loss_mask=batch["loss_mask"],   # the fused loss's token weights
                       **docs)                         # --reset-attention-mask
    if extra.terms:
        extra.accumulate(ctx.extra_loss_sums)
        output = extra.attach(output, extra_term_backward_scale(ctx.extra_loss_scale,
                                                                ctx.grad_scale))
    return output, functools.partial(loss_func, batch["loss_mask"], ctx.num_loss_tokens,
                                     grad_scale=ctx.grad_scale)


def extra_loss_names(cfg):
    """The MoE layers' load-balancing terms (none for a dense model) and each MTP depth's
    loss (``mtp_1_loss``, ...)."""
    return moe_extra_loss_names(cfg.model) + mtp_loss_names(cfg.model)


def after_train_step(chunks, cfg, state) -> dict:
    """Per-layer expert loads and terms; the expert-bias update ({} for a dense model)."""
    return moe_step_metrics(chunks, cfg, state)


GPT_FAMILY = ModelFamily(name="gpt", build_model_chunks=build_model_chunks,
                         get_batch=get_batch, forward_step=forward_step,
                         extra_loss_names=extra_loss_names, after_train_step=after_train_step)
