"""Cross entropy over vocabulary-parallel logits without gathering them.

Each rank holds logits for a contiguous vocabulary slice [start, start + v/tp).  The
softmax needs three global quantities per token, obtained with two all-reduces over TP:
the max logit (MAX), then the target logit and the sum of exponentials (SUM, one stacked
tensor).  Columns at or beyond the logical vocabulary (TP padding) are excluded from the
max and the sum, and get zero gradient, so the loss does not depend on the padded size
(which itself depends on TP).
"""
from __future__ import annotations

import torch

from megalite import comm
from megalite.parallel_state import Group


class _VocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, inplace):
        shape = target.shape
        v_local = logits.shape[-1]
        x = logits.reshape(-1, v_local)
        if x.dtype != torch.float32 or not inplace:
            x = x.float() if x.dtype != torch.float32 else x.clone()
        t = target.reshape(-1)
        start = group.rank * v_local
        valid = max(0, min(v_local, vocab_size - start))
        xv = x[:, :valid]

        if valid:
            token_max = xv.max(dim=-1).values
        else:
            token_max = x.new_full((x.shape[0],), float("-inf"))
        comm.all_reduce(token_max, group, op="max")
        xv.sub_(token_max.unsqueeze(-1))

        t_local = t - start
        mine = (t_local >= 0) & (t_local < valid)
        t_idx = t_local.clamp(0, max(valid - 1, 0))
        stats = x.new_zeros((2, x.shape[0]))
        if valid:
            stats[0] = xv.gather(1, t_idx.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)
            torch.exp(xv, out=xv)
            stats[1] = xv.sum(dim=-1)
        comm.all_reduce(stats, group)
        target_logit, sum_exp = stats[0], stats[1]
        loss = torch.log(sum_exp) - target_logit

        if valid < v_local:
            x[:, valid:] = 0.0                   # x holds exp(logit - max); padding: 0
        # Kept on ctx rather than save_for_backward: x may alias the (dead) logits buffer,
        # which was written in place, and autograd's version check would reject it.  The
        # division by the sum is deferred to backward, where it folds into one scaling.
        ctx.exp, ctx.sum_exp, ctx.t_idx, ctx.mine = x, sum_exp, t_idx, mine
        ctx.in_dtype, ctx.in_shape = logits.dtype, logits.shape
        return loss.view(shape)

    @staticmethod
    def backward(ctx, grad_loss):
        grad, t_idx, mine = ctx.exp, ctx.t_idx, ctx.mine  # reuse the buffer: backward runs once
        ctx.exp = None
        g = grad_loss.reshape(-1).to(grad.dtype)
        grad.mul_((g / ctx.sum_exp).unsqueeze(1))              # softmax * dloss
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, t_idx] -= mine.to(grad.dtype) * g           # - onehot(target) * dloss
        return grad.view(ctx.in_shape).to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Group,
                                 vocab_size: int, inplace: bool = False) -> torch.Tensor:
    """Per-token fp32 loss, shape of ``target``.

    ``logits``: [..., v/tp] this rank's vocabulary slice (rank r owns columns starting at
    r * v/tp); ``target``: global ids < ``vocab_size``.  ``inplace=True`` reuses the fp32
    logits buffer for the softmax (the model passes it; the logits are dead afterwards).
    The graph may be backpropagated once (the buffer becomes the gradient).
    """
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size, inplace)
