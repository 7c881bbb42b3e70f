"""Differentiable collectives of the token dispatchers (the calls themselves go through
``megalite.comm``, which counts them).

* ``all_to_all``: uneven all-to-all; backward is the all-to-all with the splits swapped.
  Both may overlap with the other half of an F&B pair (``comm/overlap.py``); a forward
  recomputed during backward blocks.
* ``gather_uneven`` / ``reduce_scatter_uneven``: all-gather and reduce-scatter of blocks of
  different lengths per rank (expert-TP: every peer received a different number of
  tokens), done as equal-size collectives over blocks padded to the longest; each is the
  other's backward.
* ``gather_equal`` / ``reduce_scatter_equal``: the same over equal blocks (allgather
  dispatcher: every rank holds the same number of tokens).
"""
from __future__ import annotations

from typing import List

import torch

from megalite import comm
from megalite.comm.flight_recorder import captured_where, restored_site


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.splits = group, (output_splits, input_splits)
        ctx.where = captured_where()       # the flight recorder's site, for the backward's
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        # a recomputed forward (inside a backward) never hands over: ``comm/overlap.py``
        recompute = torch._C._current_graph_task_id() != -1
        return comm.all_to_all_single(out, x, group, output_splits, input_splits,
                                      overlap=not recompute)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        with restored_site(ctx.where):
            comm.all_to_all_single(out, grad.contiguous(), ctx.group, input_splits,
                                   output_splits, overlap=True)
        return out, None, None, None


def all_to_all(x: torch.Tensor, group, output_splits: List[int],
               input_splits: List[int]) -> torch.Tensor:
    """Rows ``input_splits[j]`` go to rank j; rows ``output_splits[j]`` arrive from rank j."""
    if group.size == 1:
        return x
    return _AllToAll.apply(x, group, list(output_splits), list(input_splits))


def _gather_padded(x: torch.Tensor, group, sizes: List[int]) -> torch.Tensor:
    longest = max(sizes)
    if longest == 0:        # every rank knows the sizes: all skip together
        return x.new_empty((0, *x.shape[1:]))
    padded = x.new_zeros((longest, *x.shape[1:]))
    padded[:x.shape[0]] = x
    full = x.new_empty((longest * group.size, *x.shape[1:]))
    comm.all_gather_into_tensor(full, padded, group)
    return torch.cat([full[q * longest:q * longest + n] for q, n in enumerate(sizes)])


def _reduce_scatter_padded(y: torch.Tensor, group, sizes: List[int]) -> torch.Tensor:
    longest = max(sizes)
    if longest == 0:
        return y.new_empty((0, *y.shape[1:]))
    padded = y.new_zeros((longest * group.size, *y.shape[1:]))
    start = 0
    for q, n in enumerate(sizes):
        padded[q * longest:q * longest + n] = y[start:start + n]
        start += n
    out = y.new_empty((longest, *y.shape[1:]))
    comm.reduce_scatter_tensor(out, padded, group)
    return out[:sizes[group.rank]]


class _GatherUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _gather_padded(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_padded(grad.contiguous(), ctx.group, ctx.sizes), None, None


class _ReduceScatterUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _reduce_scatter_padded(y, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _gather_padded(grad.contiguous(), ctx.group, ctx.sizes), None, None


def gather_uneven(x: torch.Tensor, group, sizes: List[int]) -> torch.Tensor:
    """Concatenate every rank's ``x`` (rank q has ``sizes[q]`` rows) in rank order."""
    return x if group.size == 1 else _GatherUneven.apply(x, group, list(sizes))


def reduce_scatter_uneven(y: torch.Tensor, group, sizes: List[int]) -> torch.Tensor:
    """Sum ``y`` (blocks of ``sizes[q]`` rows) over ranks; keep this rank's block."""
    return y if group.size == 1 else _ReduceScatterUneven.apply(y, group, list(sizes))


def gather_equal(x: torch.Tensor, group) -> torch.Tensor:
    return gather_uneven(x, group, [x.shape[0]] * group.size)


def reduce_scatter_equal(y: torch.Tensor, group) -> torch.Tensor:
    n = y.shape[0] // group.size
    return reduce_scatter_uneven(y, group, [n] * group.size)


def all_gather_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """[group size, *counts.shape]: every rank's (integer) counts, no gradient."""
    if group.size == 1:
        return counts.unsqueeze(0)
    out = counts.new_empty((group.size, *counts.shape))
    comm.all_gather_into_tensor(out.view(-1, *counts.shape[1:]) if counts.dim() > 1
                                else out.view(-1), counts, group)
    return out
