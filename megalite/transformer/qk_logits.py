"""The largest attention logit per head, for QK-clip (``--qk-clip``, optimizer/qk_clip.py).

Recorded by the local core attention only when QK-clip is on: one extra q k^T per call
without autograd (the kernels never hand their scores out), reduced to one number per
local head at once, so nothing of size s x s outlives the call.  Heads are split over TP,
so each rank's maxima are its own heads'; the data-parallel maximum is taken at the clip.
"""
from __future__ import annotations

from typing import Optional

import torch


@torch.no_grad()
def max_logit_per_head(q: torch.Tensor, k: torch.Tensor, scale: Optional[float],
                       causal: bool) -> torch.Tensor:
    """[heads]: max over batch, queries and (visible) keys of scale * q.k; q [b, h, s, d],
    k [b, g, s, d] with h a multiple of g (GQA)."""
    b, h, s, d = q.shape
    g = k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    qg = q.float().reshape(b, g, h // g, s, d)
    scores = torch.einsum("bgrsd,bgtd->bgrst", qg, k.float()) * scale
    if causal:
        t = k.shape[2]
        hidden = torch.ones(s, t, dtype=torch.bool, device=q.device).triu(t - s + 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores.amax(dim=(0, 3, 4)).reshape(h)


def record_max(previous: Optional[torch.Tensor], current: torch.Tensor) -> torch.Tensor:
    """The running maximum over the step's micro-batches (and recomputed forwards)."""
    return current if previous is None else torch.maximum(previous, current)
