"""Autograd functions that move activations between tensor-parallel regions.

Each function is the conjugate of another: what one does forward, its partner does
backward.  ``copy_to_tp_region`` (Megatron's *f*) and ``reduce_from_tp_region`` (*g*)
bracket a column/row-parallel pair without sequence parallelism; with sequence
parallelism the all-reduce is split into ``gather_from_sp_region`` (all-gather along the
sequence, dim 0) and ``reduce_scatter_to_sp_region``.  The group is always passed in;
on a group of size 1 every function is the identity and no autograd node is added.
All communication goes through ``megalite.comm`` so it is counted; a function that
communicates in backward keeps the forward's module frames for the flight recorder.
"""
from __future__ import annotations

import torch

from megalite import comm
from megalite.comm.flight_recorder import captured_where, restored_site
from megalite.parallel_state import Group


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    out = x.contiguous().clone()  # never write into a tensor autograd may still hold
    return comm.all_reduce(out, group)


def _gather_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    out = x.new_empty((x.shape[0] * group.size, *x.shape[1:]))
    return comm.all_gather_into_tensor(out, x.contiguous(), group)


def _reduce_scatter_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    if x.shape[0] % group.size:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by TP={group.size}")
    out = x.new_empty((x.shape[0] // group.size, *x.shape[1:]))
    return comm.reduce_scatter_tensor(out, x.contiguous(), group)


def _split_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    if x.shape[0] % group.size:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by TP={group.size}")
    return x.chunk(group.size, dim=0)[group.rank].contiguous()


def _gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    stacked = _gather_dim0(x.unsqueeze(0), group)           # [tp, ..., d]
    return torch.cat(stacked.unbind(0), dim=-1)


def _split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x.chunk(group.size, dim=-1)[group.rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.where = group, captured_where()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        with restored_site(ctx.where):
            return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSP(torch.autograd.Function):
    """All-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.where = group, captured_where()
        return _gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        with restored_site(ctx.where):
            return _reduce_scatter_dim0(grad, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    """Reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.where = group, captured_where()
        return _reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        with restored_site(ctx.where):
            return _gather_dim0(grad, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    """Keep this rank's sequence chunk forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.where = group, captured_where()
        return _split_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        with restored_site(ctx.where):
            return _gather_dim0(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward (gather_output), split backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToTP(torch.autograd.Function):
    """Split the last dim forward (row-parallel on a full input), all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.where = group, captured_where()
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        with restored_site(ctx.where):
            return _gather_last(grad, ctx.group), None


def _apply(fn, x, group):
    return x if group.size == 1 else fn.apply(x, group)


def copy_to_tp_region(x, group: Group):
    return _apply(_CopyToTP, x, group)


def reduce_from_tp_region(x, group: Group):
    return _apply(_ReduceFromTP, x, group)


def gather_from_sp_region(x, group: Group):
    return _apply(_GatherFromSP, x, group)


def reduce_scatter_to_sp_region(x, group: Group):
    return _apply(_ReduceScatterToSP, x, group)


def scatter_to_sp_region(x, group: Group):
    return _apply(_ScatterToSP, x, group)


def gather_from_tp_region(x, group: Group):
    return _apply(_GatherFromTP, x, group)


def scatter_to_tp_region(x, group: Group):
    return _apply(_ScatterToTP, x, group)
