"""Rotary position embeddings, Hugging Face's ``rotate_half`` convention.

Frequencies pair dimension i with i + d/2 (not adjacent pairs), which is also
Megatron's default (non-interleaved) layout, so Llama weights convert without
permuting q/k rows.  cos/sin are computed in fp32 exactly as transformers does.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, base: float):
        super().__init__()
        # A plain attribute, not a buffer: ``model.to(bfloat16)`` must not round it.
        self.inv_freq = 1.0 / (float(base) ** (torch.arange(0, head_dim, 2, dtype=torch.float)
                                               / head_dim))
        self._cache = None

    def forward(self, seq_len: int, position_ids: Optional[torch.Tensor] = None,
                device=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of shape [b or 1, 1, s, d], ready for [b, heads, s, d] tensors."""
        device = device or self.inv_freq.device
        if position_ids is None:
            key = (seq_len, str(device))
            if self._cache is not None and self._cache[0] == key:
                return self._cache[1]
            pos = torch.arange(seq_len, device=device)[None]
        else:
            pos = position_ids.to(device)
        freqs = pos[..., None].float() * self.inv_freq.to(device)
        emb = torch.cat((freqs, freqs), dim=-1)
        out = (emb.cos()[:, None], emb.sin()[:, None])
        if position_ids is None:
            self._cache = (key, out)
        return out


def _rotate(x, c, s, sign: float):
    """[x1 c - sign x2 s, x2 c + sign x1 s], written straight into a contiguous output."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if torch.compiler.is_compiling():
        # --compile: writing through out= views of one buffer breaks dynamo's graph (and the
        # resumed graph then has aliased inputs); the same products and sums, functionally.
        if sign > 0:
            return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        return torch.cat((x1 * c + x2 * s, x2 * c - x1 * s), dim=-1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, c, out=o1)
    torch.mul(x2, c, out=o2)
    if sign > 0:
        o1.sub_(x2 * s)
        o2.add_(x1 * s)
    else:
        o1.add_(x2 * s)
        o2.sub_(x1 * s)
    return out


class _ApplyRotary(torch.autograd.Function):
    """out = [x1 c - x2 s, x2 c + x1 s] (c, s: first half of cos/sin).

    Equal bit for bit to HF's ``x * cos + rotate_half(x) * sin`` (same products, same
    additions).  As one autograd node, backward is the inverse rotation of the grad, with
    no zero-filled slice grads and no concatenation.
    """

    @staticmethod
    def forward(ctx, x, cos, sin):
        half = x.shape[-1] // 2
        c, s = cos[..., :half].to(x.dtype), sin[..., :half].to(x.dtype)
        ctx.save_for_backward(c, s)
        return _rotate(x, c, s, 1.0)

    @staticmethod
    def backward(ctx, grad):
        c, s = ctx.saved_tensors
        return _rotate(grad, c, s, -1.0), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [..., s, d] by cos/sin broadcastable to it; output is contiguous."""
    return _ApplyRotary.apply(x, cos, sin)
