"""The output layer fused with the vocabulary-parallel cross entropy, chunked over tokens.

Why: on small models the output layer and its loss are most of the FLOPs and most of
the memory traffic.  The unfused path (``output_layer`` then ``cross_entropy.py``) writes
the whole [tokens, v/tp] logits in fp32 (256 MiB for 2048 tokens x 32000), reads it back
for the max, the exponentials, the sum, and again in backward.  Here the tokens are cut
into chunks of ``chunk_tokens`` rows; each chunk's logits live only while that chunk is
processed (a few MiB, in cache), and are never held whole.

Per chunk: logits = X_c W^T (this rank's vocabulary slice), the local log-sum-exp and
target logit, ONE all-gather over TP of those two numbers per token (the global
log-sum-exp is the log-sum-exp of the ranks'), then the gradients are formed at once,
Liger-kernel style: G = (softmax - onehot) * w per token, dX_c = G W, dW += G^T X_c.
``w`` is the per-token weight the loss will be given in backward, up to one scalar (the
loss mask; the loop divides by the global token count).  Backward checks that the
incoming per-token gradient IS ``c * w`` and then only scales the stored dX, dW by ``c``:
the logits matmul is not recomputed.  Any other incoming gradient (a caller that weights
tokens differently) takes the exact path: recompute each chunk's logits with the true
per-token gradient.  So the result never depends on the guess, only the speed does.

Padding columns (>= ``vocab_size``, from the TP padding of the table) are excluded from
the softmax and get zero gradient, as in the unfused path.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megalite import comm
from megalite.parallel_state import Group
from megalite.tensor_parallel.mappings import copy_to_tp_region, gather_from_sp_region

# Bytes of one chunk's fp32 logits: small enough to stay in a CPU's L2/L3, large enough
# that each matmul is still efficient (measured in benchmarks/step_time.py, docs/performance.md).
CHUNK_LOGIT_BYTES = 32 * 2 ** 20


def auto_chunk_tokens(v_local: int) -> int:
    """Rows per chunk so that one chunk's fp32 logits take about ``CHUNK_LOGIT_BYTES``."""
    rows = CHUNK_LOGIT_BYTES // (4 * max(v_local, 1))
    return max(16, min(4096, rows))


def _chunk(x, weight, target, row_w, group: Group, valid: int, start: int, want_grads: bool,
           softcap: Optional[float] = None):
    """Loss of one chunk of tokens and, if ``want_grads``, its dX and dW with per-token
    weights ``row_w``.  Returns (loss [n] fp32, dX [n, h] or None, dW [v_l, h] or None).
    ``softcap`` c: the loss of c * tanh(logits / c) (the unfused path's operations), whose
    derivative 1 - tanh^2 multiplies the logits' gradient."""
    logits = F.linear(x, weight).float()                        # [n, v_l]; fresh buffer
    slope = None
    if softcap is not None:
        logits = torch.tanh(logits / softcap)
        slope = 1 - logits.square() if want_grads else None
        logits.mul_(softcap)
    n = logits.shape[0]
    t_local = target - start
    mine = (t_local >= 0) & (t_local < valid)
    t_idx = t_local.clamp(0, max(valid - 1, 0))
    stats = logits.new_empty((2, n))                            # local lse, target logit
    if valid:
        lv = logits[:, :valid]
        local_max = lv.max(dim=-1).values
        stats[1] = lv.gather(1, t_idx.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)
        lv.sub_(local_max.unsqueeze(1))
        torch.exp(lv, out=lv)                                   # exp(logit - local max)
        stats[0] = local_max + torch.log(lv.sum(dim=-1))
    else:
        stats[0] = float("-inf")
        stats[1] = 0.0
    if group.size > 1:
        every = stats.new_empty((group.size * 2, n))
        comm.all_gather_into_tensor(every, stats, group)
        every = every.view(group.size, 2, n)
        lse = torch.logsumexp(every[:, 0], dim=0)
        target_logit = every[:, 1].sum(dim=0)
    else:
        lse, target_logit = stats[0], stats[1]
    loss = lse - target_logit
    if not want_grads:
        return loss, None, None
    grad = logits                                               # reuse the buffer
    if valid:   # softmax = exp(logit - local max) * exp(local max - lse), times w
        scale = torch.exp(local_max - lse)                      # <= 1: lse >= local max
        grad[:, :valid].mul_((scale * row_w).unsqueeze(1))
        rows = torch.arange(n, device=grad.device)
        grad[rows, t_idx] -= mine.to(grad.dtype) * row_w
    if valid < grad.shape[1]:
        grad[:, valid:] = 0.0
    if slope is not None:
        grad.mul_(slope)
    g = grad.to(weight.dtype)
    return loss, g.matmul(weight), g.t().matmul(x)


def _all_chunks(x, weight, target, row_w, group, vocab_size, chunk_tokens, want_grads,
                softcap=None):
    """Run every chunk; dW is accumulated in fp32 (one rounding to the weight's dtype)."""
    v_local = weight.shape[0]
    start = group.rank * v_local
    valid = max(0, min(v_local, vocab_size - start))
    n = x.shape[0]
    loss = x.new_empty((n,), dtype=torch.float32)
    grad_x = torch.empty_like(x) if want_grads else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
        if want_grads else None
    for a in range(0, n, chunk_tokens):
        b = min(n, a + chunk_tokens)
        w = row_w[a:b] if row_w is not None else None
        loss[a:b], gx, gw = _chunk(x[a:b], weight, target[a:b], w, group, valid, start,
                                   want_grads, softcap)
        if want_grads:
            grad_x[a:b] = gx
            grad_w += gw
    return loss, grad_x, grad_w


class _FusedLinearCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, target, token_weights, group, vocab_size, chunk_tokens,
                softcap=None):
        want = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        w = token_weights.to(torch.float32) if token_weights is not None else \
            x.new_ones((x.shape[0],), dtype=torch.float32)
        loss, grad_x, grad_w = _all_chunks(x, weight, target, w, group, vocab_size,
                                           chunk_tokens, want, softcap)
        ctx.save_for_backward(x, weight, target)
        ctx.token_weights, ctx.grad_x, ctx.grad_w = w, grad_x, grad_w
        ctx.group, ctx.vocab_size, ctx.chunk_tokens = group, vocab_size, chunk_tokens
        ctx.softcap = softcap
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        x, weight, target = ctx.saved_tensors
        g = grad_loss.reshape(-1).float()
        c = proportional_scale(g, ctx.token_weights)
        if c is not None and ctx.grad_x is not None:
            grad_x = ctx.grad_x * c if ctx.needs_input_grad[0] else None
            grad_w = (ctx.grad_w * c).to(weight.dtype) if ctx.needs_input_grad[1] else None
        else:       # the exact path: recompute every chunk with the true per-token grads
            _, grad_x, grad_w = _all_chunks(x, weight, target, g, ctx.group, ctx.vocab_size,
                                            ctx.chunk_tokens, True, ctx.softcap)
            grad_w = grad_w.to(weight.dtype)
        return grad_x, grad_w, None, None, None, None, None, None


def proportional_scale(grad: torch.Tensor, weights: torch.Tensor) -> Optional[float]:
    """``c`` with ``grad == c * weights`` (to fp32 rounding), or None if no such ``c``."""
    if grad.shape != weights.shape:
        return None
    g, w = grad.double(), weights.double()      # fp64: an fp32 dot drifts with the length
    ww = float(w.dot(w))
    if ww == 0.0:
        return 0.0 if not bool(g.any()) else None
    c = float(g.dot(w)) / ww
    tol = 1e-6 * max(float(g.abs().max()), 1e-30)
    return c if float((g - c * w).abs().max()) <= tol else None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               group: Group, vocab_size: int, *, sequence_parallel: bool = False,
                               token_weights: Optional[torch.Tensor] = None,
                               chunk_tokens: int = 0,
                               softcap: Optional[float] = None) -> torch.Tensor:
    """Per-token fp32 loss [s, b] of ``hidden`` [s(/tp), b, h] through the column-parallel
    output ``weight`` [v/tp, h] against ``labels`` [s, b], without holding the logits.

    Equals ``vocab_parallel_cross_entropy(F.linear(x, weight), labels)`` with x the hidden
    states entering the output layer (all-gathered along the sequence under
    ``sequence_parallel``).  ``token_weights`` [s, b]: how the caller will weight each
    token's loss (its loss mask), up to a scalar; None means equally.  ``chunk_tokens``:
    rows per chunk, 0 for ``auto_chunk_tokens``.  ``softcap``: the loss of the soft-capped
    logits (``--final-logit-softcapping``, Gemma 2), elementwise, so each vocabulary shard
    caps its own chunk.
    """
    if sequence_parallel and group.size > 1:
        x = gather_from_sp_region(hidden, group)        # backward: reduce-scatter dX
    else:
        x = copy_to_tp_region(hidden, group)            # backward: all-reduce dX
    s, b, h = x.shape
    chunk = chunk_tokens or auto_chunk_tokens(weight.shape[0])
    tw = token_weights.reshape(-1) if token_weights is not None else None
    loss = _FusedLinearCrossEntropy.apply(x.reshape(s * b, h), weight, labels.reshape(-1), tw,
                                          group, vocab_size, chunk, softcap)
    return loss.view(s, b)
