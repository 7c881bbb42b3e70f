"""Attention on one (query block, key block) pair in plain torch, with its log-sum-exp.

Ring attention computes a rank's attention as a sum over key blocks it sees one at a time.
Each block returns its own softmax-normalised output and the row log-sum-exp (LSE) of its
scores, so blocks merge exactly (``merge``) and backward can rebuild each block's
probabilities from the *final* LSE (``block_backward``, FlashAttention's formulas) without
keeping any s x s matrix between forward and backward.

Layout ``bhsd``: q [b, np, sq, d], k [b, ng, sk, d] and v [b, ng, sk, dv] (dv = d except
for Multi-Latent Attention); query head j reads K/V head j // (np/ng), so K/V heads are
never repeated (GQA costs no extra memory or messages).
A score modification (config/score_mods.py, ``mods``: Gemma 2's soft-cap) is applied to each
tile's scaled scores before the mask; backward rebuilds them and multiplies the score
gradient by the entry's derivative.
Query rows are processed in tiles of at most ``TILE_ELEMENTS`` scores, so the transient
score matrix stays small however long the sequence (rows are independent: tiling changes
no result).
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

from megalite.config.score_mods import apply_all_with_grad

TILE_ELEMENTS = 1 << 20     # scores per tile (4 MiB in fp32)


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics and running sums: fp32 for 16-bit inputs, else the input's."""
    return torch.promote_types(dtype, torch.float32)


def query_tiles(q: torch.Tensor, sk: int):
    """Query-row ranges [r0, r1) whose scores fit in ``TILE_ELEMENTS``."""
    b, h, sq, _ = q.shape
    rows = max(1, TILE_ELEMENTS // max(1, b * h * sk))
    return [(r0, min(sq, r0 + rows)) for r0 in range(0, sq, rows)]


def _grouped(q: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, np, s, d] -> [b, ng, (np/ng)*s, d]: each K/V head's query heads as one matrix."""
    b, h, s, d = q.shape
    return q.reshape(b, groups, (h // groups) * s, d)


def _scores(q, k, scale: float, causal: bool, row0: int, keep=None, mods: Sequence = (),
            grad: list = None) -> torch.Tensor:
    """Scaled scores [b, ng, rep*rows, sk] of query rows ``row0``.. (a tile), modified by
    ``mods`` (their derivative appended to ``grad`` when given); ``causal`` masks key
    j > query i, both counted from the block's origin; ``keep`` [b, sq, sk] (a document
    mask, ``transformer/attention_masks.py``) replaces it."""
    g, rows, sk = k.shape[1], q.shape[2], k.shape[2]
    s = torch.matmul(_grouped(q, g), k.transpose(-1, -2)).mul_(scale)
    if mods:                     # before the mask: the mask follows the modification
        s, d = apply_all_with_grad(s, mods)
        if grad is not None:
            grad.append(d)
    if keep is not None:
        tile = keep[:, None, None, row0:row0 + rows]                 # [b, 1, 1, rows, sk]
        s.view(s.shape[0], g, -1, rows, sk).masked_fill_(~tile, float("-inf"))
    elif causal:
        i = torch.arange(row0, row0 + rows, device=q.device)[:, None]
        keep = torch.arange(sk, device=q.device)[None, :] <= i
        s.view(s.shape[0], g, -1, rows, sk).masked_fill_(~keep, float("-inf"))
    return s.to(accum_dtype(s.dtype))


def block_forward(q, k, v, scale: float, causal: bool, keep=None,
                  mods: Sequence = ()) -> Tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q k^T * scale) v [b, np, sq, dv], LSE [b, np, sq] in ``accum_dtype``).
    A row whose keys are all masked (possible with ``keep``) gives output 0, LSE -inf."""
    b, h, sq, d = q.shape
    out = torch.empty((b, h, sq, v.shape[-1]), dtype=v.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=accum_dtype(q.dtype), device=q.device)
    for r0, r1 in query_tiles(q, k.shape[2]):
        qt = q[:, :, r0:r1]
        s = _scores(qt, k, scale, causal, r0, keep, mods)
        tile_lse = torch.logsumexp(s, dim=-1)
        shift = tile_lse if keep is None else tile_lse.masked_fill(tile_lse == float("-inf"), 0)
        p = s.sub_(shift[..., None]).exp_().to(v.dtype)          # in place: one tile alive
        out[:, :, r0:r1] = torch.matmul(p, v).view(b, h, r1 - r0, v.shape[-1])
        lse[:, :, r0:r1] = tile_lse.view(qt.shape[:3])
    return out, lse


def merge(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor,
          blk_lse: torch.Tensor) -> None:
    """Fold a block's (output, LSE) into the running ones, in place (log-sum-exp rule):
    lse' = log(e^lse + e^blk_lse), out' = out e^(lse-lse') + blk_out e^(blk_lse-lse').
    A row that no key reached yet (both -inf: a masked block pair) stays 0 and -inf."""
    new = torch.logaddexp(lse, blk_lse)
    shift = new.masked_fill(torch.isneginf(new), 0.0)
    out.mul_(torch.exp(lse - shift)[..., None].to(out.dtype))
    out.add_(blk_out * torch.exp(blk_lse - shift)[..., None].to(out.dtype))
    lse.copy_(new)


def block_backward(dout, q, k, v, lse, delta, scale: float, causal: bool, keep=None,
                   mods: Sequence = ()):
    """(dq, dk, dv) of one block pair given the *final* LSE and delta = rowsum(dout * out):
    p = exp(s - lse), dv = p^T dout, ds = p (dout v^T - delta) (times the score
    modifications' derivative), dq = ds k, dk = ds^T q."""
    b, h, sq, d = q.shape
    g = k.shape[1]
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    for r0, r1 in query_tiles(q, k.shape[2]):
        qt = q[:, :, r0:r1]
        dmod = []
        s = _scores(qt, k, scale, causal, r0, keep, mods, dmod)
        p = s.sub_(lse[:, :, r0:r1].reshape(b, g, -1)[..., None]).exp_().to(q.dtype)
        do = _grouped(dout[:, :, r0:r1], g)
        dv += torch.matmul(p.transpose(-1, -2), do)                  # [b, ng, sk, d]
        dp = torch.matmul(do, v.transpose(-1, -2))
        row_delta = delta[:, :, r0:r1].reshape(b, g, -1)[..., None].to(dp.dtype)
        ds = dp.sub_(row_delta).mul_(p).mul_(scale)                  # dp's buffer reused
        if dmod:
            ds.mul_(dmod[0].to(ds.dtype))
        dq[:, :, r0:r1] = torch.matmul(ds, k).view(qt.shape)
        dk += torch.matmul(ds.transpose(-1, -2), _grouped(qt, g))
    return dq, dk, dv


def block_flops(q: torch.Tensor, k: torch.Tensor) -> int:
    """Forward matmul FLOPs of one block pair (q k^T and p v): 4 b np sq sk d."""
    b, h, sq, d = q.shape
    return 4 * b * h * sq * k.shape[2] * d
