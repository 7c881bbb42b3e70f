"""Which tokens each context-parallel rank holds: causal load balancing.

Under a causal mask, query i attends to i + 1 keys, so a plain split of the sequence into
CP contiguous pieces gives the last rank ~2 CP - 1 times the first rank's attention work.
Instead the sequence is cut into 2 CP chunks and rank r keeps chunks r and 2 CP - 1 - r
(an early chunk paired with its mirror late chunk): every rank does the same work.

    seq:    | c0 | c1 | c2 | c3 | c4 | c5 | c6 | c7 |      CP = 4, 8 chunks
    rank 0:   c0                                  c7
    rank 1:        c1                        c6
    rank 2:             c2              c5
    rank 3:                  c3    c4

A rank's two chunks stay in sequence order (r < 2 CP - 1 - r), so a plain causal mask on
its local tokens is the true mask between them.  Every per-token tensor of the micro-batch
is sliced along the sequence, including the true ``position_ids`` (RoPE and learned
positions need them).
"""
from __future__ import annotations

import torch

SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def chunk_ids(cp_size: int, cp_rank: int) -> tuple:
    """The two chunk indices (of 2 CP) rank ``cp_rank`` holds."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def token_indices(seq_length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Sequence positions this CP rank holds, in order: its two chunks concatenated."""
    if seq_length % (2 * cp_size):
        raise ValueError(f"sequence length {seq_length} is not divisible by 2 x CP "
                         f"({2 * cp_size})")
    c = seq_length // (2 * cp_size)
    first, second = chunk_ids(cp_size, cp_rank)
    return torch.cat([torch.arange(first * c, (first + 1) * c, device=device),
                      torch.arange(second * c, (second + 1) * c, device=device)])


def gathered_order(seq_length: int, cp_size: int, device=None) -> torch.Tensor:
    """Positions of the rank-ordered concatenation of every rank's tokens (what an all-gather
    of the sequence over CP yields): ``x_full = x_gathered[argsort(gathered_order)]``."""
    return torch.cat([token_indices(seq_length, cp_size, r, device) for r in range(cp_size)])


def slice_batch(batch: dict, cp_size: int, cp_rank: int) -> dict:
    """This CP rank's part of a micro-batch ([b, s] tensors -> [b, 2 s / (2 CP)]).

    ``position_ids`` are made (0..s-1) when the batch has none, so the model always sees
    the true positions of its tokens."""
    if cp_size == 1:
        return dict(batch)
    seq = batch["tokens"].shape[-1]
    idx = token_indices(seq, cp_size, cp_rank, batch["tokens"].device)
    out = dict(batch)
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(seq, device=idx.device).expand_as(batch["tokens"])
    for key in SEQUENCE_KEYS:
        if key in out:
            out[key] = out[key].index_select(-1, idx).contiguous()
    return out


def causal_pairs(seq_length: int, cp_size: int, cp_rank: int, balanced: bool = True) -> int:
    """(query, key) pairs a causal mask leaves to this rank: its attention work.  With
    ``balanced=False``, the plain contiguous split (for comparison)."""
    if balanced:
        pos = token_indices(seq_length, cp_size, cp_rank)
    else:
        n = seq_length // cp_size
        pos = torch.arange(cp_rank * n, (cp_rank + 1) * n)
    return int((pos + 1).sum())
