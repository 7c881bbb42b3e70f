"""QK-clip's largest logit per head under context parallelism (``transformer/qk_logits.py``
says why it is recorded).  Each CP rank covers part of the (query, key) pairs, and the
maximum over the dp-cp group at the clip joins them: ring attention's rank takes its own
queries against every key of the ring (K gathered over CP: one all-gather of this rank's
keys per layer and micro-batch, only with --qk-clip), all-to-all attention's rank the whole
sequence of its block of heads (the other heads left at -inf).
"""
from __future__ import annotations

from typing import Tuple

import torch

from megalite import comm
from megalite.context_parallel.load_balance import gathered_order


@torch.no_grad()
def ring_keys(k: torch.Tensor, group) -> Tuple[torch.Tensor, torch.Tensor]:
    """(every CP rank's keys [b, g, S, d] in rank order, their sequence positions [S]): the
    keys ring attention's queries meet over the whole ring."""
    cp = group.size
    gathered = torch.empty((cp,) + tuple(k.shape), dtype=k.dtype, device=k.device)
    comm.all_gather_into_tensor(gathered, k.contiguous()[None], group)
    keys = gathered.permute(1, 2, 0, 3, 4).reshape(k.shape[0], k.shape[1], cp * k.shape[2],
                                                 k.shape[3])
    return keys, gathered_order(cp * k.shape[2], cp, k.device)


def head_block(block: torch.Tensor, heads: int, index: int) -> torch.Tensor:
    """[heads]: ``block``'s maxima at heads ``index * len(block) ...``, -inf elsewhere (the
    heads another CP rank covers under all-to-all attention)."""
    out = torch.full((heads,), float("-inf"), dtype=block.dtype, device=block.device)
    out[index * block.numel():(index + 1) * block.numel()] = block
    return out
