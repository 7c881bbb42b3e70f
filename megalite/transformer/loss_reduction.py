"""The loss-reduction policy: what each micro-batch loss is divided by, and which groups
sum the loss, its extra terms and the gradients.  Written once here; the model's step
(``models/gpt_step.py``), the MTP weight (``models/gpt.py``), the MoE statistics
(``moe/metrics.py``), the loop, the data-parallel strategies (``distributed/``) and FSDP2
read it.  Why these rules: docs/architecture.md#loss-reduction.

The objective is the single-process one, whatever the layout:

    L = sum_t mask_t * ce_t / N  +  sum_terms weight * (1 / (M * R)) * sum term

N: the loss tokens of the whole global batch (every micro-batch, every dp-cp rank); M: the
micro-batches of one rank; R: the dp-cp ranks; each extra term (MoE aux / z, MTP depth) is
summed over micro-batches, dp-cp ranks and pipeline stages -- the mean over the global
batch's micro-batches.  Because every rank's share is already divided by the global
counts, gradients are SUMMED over their data-parallel group (divide factor 1): DDP buckets,
the sharded buffers' reduce-scatter and FSDP2 alike.  ``--fp16`` multiplies everything that
starts backward by the loss scale; the strategy divides it out of the gradients.

It lives below ``models`` and ``distributed`` (only ``comm`` beneath it) so every reader
can import it without importing up a layer.
"""
from __future__ import annotations

from typing import Dict, Sequence

import torch

from megalite import comm

# ranks that hold OTHER tokens of the same global batch: loss tokens and loss sums add here
TOKEN_GROUP = "dp-cp"
# an extra term is summed here: other tokens (dp-cp) and other layers (pp); TP ranks compute
# the same term from statistics already reduced over them, so TP is not summed
EXTRA_TERM_GROUPS = ("dp-cp", "pp")
# the group each parameter class's gradient is summed over (CP ranks saw other tokens of
# the same sequences; routed experts see the tokens of their expert-DP replicas)
GRAD_SUM_GROUPS = {"dense": "dp-cp", "expert": "expert-dp"}
# the data-parallel gradient reduction is a plain sum (what ``comm``'s all-reduce and
# reduce-scatter do): the loss is already divided by N, so nothing divides by the DP size
GRAD_DIVIDE_FACTOR = 1.0


def micro_batch_loss(loss_sum: torch.Tensor, num_loss_tokens: torch.Tensor,
                     loss_scale: float = 1.0) -> torch.Tensor:
    """What backward starts from for one micro-batch: its masked loss sum over the global
    batch's token count N, times the ``--fp16`` loss scale (1 otherwise)."""
    loss = loss_sum / num_loss_tokens.to(loss_sum.dtype)
    if loss_scale != 1.0:
        loss = loss * loss_scale
    return loss


def extra_term_scale(num_micro_batches: int, state) -> float:
    """1 / (M x dp-cp): each extra term's share of the objective from one micro-batch on
    one rank, so that summed over ``EXTRA_TERM_GROUPS`` it is the global-batch mean."""
    return 1.0 / (num_micro_batches * state[TOKEN_GROUP].size)


def extra_term_backward_scale(term_scale: float, loss_scale: float) -> float:
    """What an extra term's weight is multiplied by in backward: its objective share times
    the ``--fp16`` loss scale (the same factor as the language-model loss)."""
    return term_scale * loss_scale


def mtp_depth_weight(scaling_factor: float, num_depths: int) -> float:
    """Each MTP depth's weight: ``--mtp-loss-scaling-factor`` shared over the D depths
    (Megatron's ``mtp_loss_scaling_factor / mtp_num_layers``)."""
    return scaling_factor / num_depths


def global_loss_tokens(batches, state, device) -> torch.Tensor:
    """N, the loss tokens of the global batch: this rank's micro-batches as ``get_batch``
    shaped them (CP already sliced: each CP rank counts its slice, so every token counts
    once), summed over ``TOKEN_GROUP``.  float64 [1]."""
    n = torch.zeros(1, dtype=torch.float64, device=device)
    for b in batches:
        n += b["loss_mask"].sum()
    comm.all_reduce(n, state[TOKEN_GROUP])
    return n


def reduce_lm_loss(loss_sums: Sequence[torch.Tensor], num_loss_tokens: torch.Tensor,
                   state, device) -> float:
    """The logged language-model loss: the unscaled loss sums of this rank's micro-batches
    (none off the last stage), summed over ``TOKEN_GROUP``, over N."""
    loss = torch.zeros(1, dtype=torch.float64, device=device)
    for s in loss_sums:
        loss += s.double()
    comm.all_reduce(loss, state[TOKEN_GROUP])
    return (loss / num_loss_tokens).item()


def reduce_extra_terms(sums: torch.Tensor, names: Sequence[str], term_scale: float,
                       state) -> Dict[str, float]:
    """Each extra term as it entered the objective: this rank's detached per-name sums over
    its micro-batches, summed over ``EXTRA_TERM_GROUPS``, times ``term_scale``."""
    if not names:
        return {}
    sums = sums.clone()
    for group in EXTRA_TERM_GROUPS:
        comm.all_reduce(sums, state[group])
    return {name: float(v) * term_scale for name, v in zip(names, sums.tolist())}


def reduce_moe_step_table(table: torch.Tensor, num_experts: int, state) -> torch.Tensor:
    """Per-MoE-layer rows ``[expert counts (E) | aux, z, micro-batches]`` to global-batch
    values on every rank, in place: summed over ``EXTRA_TERM_GROUPS``; the counts' sum over
    dp-cp is divided by CP, since every CP rank holds the same whole-sequence counts (the
    router already summed them over the ranks holding parts of the same tokens)."""
    comm.all_reduce(table, state[TOKEN_GROUP])
    table[:, :num_experts] /= state.cp.size
    comm.all_reduce(table, state[EXTRA_TERM_GROUPS[1]])
    return table
