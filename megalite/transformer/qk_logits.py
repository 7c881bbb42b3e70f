"""The largest attention logit per head, for QK-clip (``--qk-clip``, optimizer/qk_clip.py).

Recorded by the core attention only when QK-clip is on: one extra q k^T per call without
autograd (the kernels never hand their scores out), reduced to one number per local head at
once, so nothing of size s x s outlives the call.  Heads are split over TP, so each rank's
maxima are its own heads'; the maximum over data and context parallelism (the dp-cp group)
is taken at the clip.  Under CP each rank covers part of the (query, key) pairs: ring
attention its own queries against every key, all-to-all attention the whole sequence of
its block of heads (``context_parallel/max_logits.py``).
"""
from __future__ import annotations

from typing import Optional

import torch


@torch.no_grad()
def max_logit_per_head(q: torch.Tensor, k: torch.Tensor, scale: Optional[float],
                       causal: bool, q_pos: Optional[torch.Tensor] = None,
                       k_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[heads]: max over batch, queries and (visible) keys of scale * q.k; q [b, h, s, d],
    k [b, g, t, d] with h a multiple of g (GQA).  ``q_pos`` / ``k_pos``: the sequence
    positions of q's and k's tokens (default: the last s of the t keys' positions), which
    the causal mask compares."""
    b, h, s, d = q.shape
    g, t = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    qg = q.float().reshape(b, g, h // g, s, d)
    scores = torch.einsum("bgrsd,bgtd->bgrst", qg, k.float()) * scale
    if causal:
        k_pos = torch.arange(t, device=q.device) if k_pos is None else k_pos
        q_pos = k_pos[t - s:] if q_pos is None else q_pos
        hidden = k_pos[None, :] > q_pos[:, None]                         # [s, t]
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores.amax(dim=(0, 3, 4)).reshape(h)


def record_max(previous: Optional[torch.Tensor], current: torch.Tensor) -> torch.Tensor:
    """The running maximum over the step's micro-batches (and recomputed forwards)."""
    return current if previous is None else torch.maximum(previous, current)
