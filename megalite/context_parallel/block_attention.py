"""Attention on one (query block, key block) pair in plain torch, with its log-sum-exp.

Ring attention computes a rank's attention as a sum over key blocks it sees one at a time.
Each block returns its own softmax-normalised output and the row log-sum-exp (LSE) of its
scores, so blocks merge exactly (``merge``) and backward can rebuild each block's
probabilities from the *final* LSE (``block_backward``, FlashAttention's formulas) without
keeping any s x s matrix between forward and backward.

Layout ``bhsd``: q [b, np, sq, d], k and v [b, ng, sk, d]; query head j reads K/V head
j // (np/ng), so K/V heads are never repeated (GQA costs no extra memory or messages).
"""
from __future__ import annotations

from typing import Tuple

import torch


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics and running sums: fp32 for 16-bit inputs, else the input's."""
    return torch.promote_types(dtype, torch.float32)


def _grouped(q: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, np, s, d] -> [b, ng, (np/ng)*s, d]: each K/V head's query heads as one matrix."""
    b, h, s, d = q.shape
    return q.reshape(b, groups, (h // groups) * s, d)


def _scores(q, k, scale: float, causal: bool) -> torch.Tensor:
    """Scaled scores [b, ng, rep*sq, sk]; ``causal`` masks key j > query i (same origin)."""
    g, sq, sk = k.shape[1], q.shape[2], k.shape[2]
    s = torch.matmul(_grouped(q, g), k.transpose(-1, -2)) * scale
    if causal:
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        s.view(s.shape[0], g, -1, sq, sk).masked_fill_(~keep, float("-inf"))
    return s


def block_forward(q, k, v, scale: float, causal: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q k^T * scale) v [b, np, sq, d], LSE [b, np, sq] in ``accum_dtype``)."""
    b, h, sq, d = q.shape
    s = _scores(q, k, scale, causal)
    s = s.to(accum_dtype(s.dtype))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).to(v.dtype)
    out = torch.matmul(p, v)                                          # [b, ng, rep*sq, d]
    return out.reshape(b, h, sq, d), lse.reshape(b, h, sq)


def merge(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor,
          blk_lse: torch.Tensor) -> None:
    """Fold a block's (output, LSE) into the running ones, in place (log-sum-exp rule):
    lse' = log(e^lse + e^blk_lse), out' = out e^(lse-lse') + blk_out e^(blk_lse-lse')."""
    new = torch.logaddexp(lse, blk_lse)
    out.mul_(torch.exp(lse - new)[..., None].to(out.dtype))
    out.add_(blk_out * torch.exp(blk_lse - new)[..., None].to(out.dtype))
    lse.copy_(new)


def block_backward(dout, q, k, v, lse, delta, scale: float, causal: bool):
    """(dq, dk, dv) of one block pair given the *final* LSE and delta = rowsum(dout * out):
    p = exp(s - lse), dv = p^T dout, ds = p (dout v^T - delta), dq = ds k, dk = ds^T q."""
    b, h, sq, d = q.shape
    g = k.shape[1]
    s = _scores(q, k, scale, causal)
    p = torch.exp(s.to(lse.dtype) - lse.reshape(b, g, -1)[..., None]).to(q.dtype)
    do = _grouped(dout, g)
    dv = torch.matmul(p.transpose(-1, -2), do)                       # [b, ng, sk, d]
    dp = torch.matmul(do, v.transpose(-1, -2))
    ds = p * (dp - delta.reshape(b, g, -1)[..., None].to(dp.dtype)) * scale
    dq = torch.matmul(ds, k).reshape(b, h, sq, d)
    dk = torch.matmul(ds.transpose(-1, -2), _grouped(q, g))
    return dq, dk, dv


def block_flops(q: torch.Tensor, k: torch.Tensor) -> int:
    """Forward matmul FLOPs of one block pair (q k^T and p v): 4 b np sq sk d."""
    b, h, sq, d = q.shape
    return 4 * b * h * sq * k.shape[2] * d
