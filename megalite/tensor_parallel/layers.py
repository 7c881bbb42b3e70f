"""Column/row-parallel linears and the vocabulary-parallel embedding.

Parameters are created *empty* at their local (shard) shape by ``make_param``, which
records each one's ``ParamSpec`` (``megalite.param_spec``: full shape, which group splits
which dim, fused blocks, vocab padding, init rule, sequence-parallel flag) in the layer's
``param_specs`` dict -- never on the parameter.  The split group is the layer's own group
(``tp_group.name``), so a layer built on "expert-tp" is described as such.
``tensor_parallel.random.init_parameters`` draws the full tensor from a name-seeded
generator and slices it, which makes the initial weights independent of TP and PP.
A replicated parameter that only sees this rank's sequence shard (``sequence_parallel``)
has its grad summed over that group by ``allreduce_sequence_parallel_grads``.
Every linear's matmul goes through ``deferred_wgrad`` (``linear`` or the SP column
Function): the same forward and backward, except that zero bubble's B stores what dW needs
and its W computes it.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megalite import comm
from megalite.param_spec import ParamSpec, make_param, named_specs
from megalite.parallel_state import Group
from megalite.tensor_parallel.deferred_wgrad import engine_wants, linear, stash_for, weight_edges
from megalite.tensor_parallel.mappings import (copy_to_tp_region, gather_from_tp_region,
                                               reduce_from_tp_region, reduce_scatter_to_sp_region,
                                               scatter_to_tp_region)


class _SPColumnLinear(torch.autograd.Function):
    """Sequence-parallel column-parallel linear, Megatron-Core's
    ``LinearWithGradAccumulationAndAsyncCommunication`` with ``sequence_parallel``.

    Forward: all-gather the sequence shard ``x`` [s/t, b, h] along dim 0, then
    ``y = X_full W^T (+ b)`` [s, b, out/t].  Only the SHARD is saved for backward -- saving
    the gathered input (what autograd does for ``F.linear(gather(x))``) would keep a
    full-sequence copy per column-parallel linear and leave SP's activation memory at
    4sbh + 28sbh/t instead of 34sbh/t per layer.

    Backward: the shard is all-gathered again (asynchronously, while the input-gradient
    GEMM ``dX = dY W`` runs), ``dX`` is reduce-scattered along the sequence (asynchronously,
    while the weight-gradient GEMM ``dW = dYᵀ X_full`` runs), ``db = Σ dY``.  So SP's
    backward makes one all-gather more per column-parallel linear than the conjugate
    mappings alone (two s·b·h all-gathers per linear per micro-batch, forward and
    backward, instead of one), the price Megatron pays too.  Under zero bubble's B
    (``deferred_wgrad``) the shard and dY are stored and only dX is computed and
    reduce-scattered; W re-gathers the shard for dW/db.
    """

    defers_wgrad = (1, 2)

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        full = x.new_empty((x.shape[0] * group.size, *x.shape[1:]))
        comm.all_gather_into_tensor(full, x, group)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        group, has_bias = ctx.group, ctx.has_bias
        slots = (1, 2) if has_bias else (1,)
        stash, later = stash_for(ctx, slots)
        if stash is not None:           # zero bubble's B: dX now, dW/db in W
            w_b = (later[0], has_bias and later[1])
            stash.add(weight_edges(ctx, slots, later),
                      lambda: _sp_column_grads(x, weight, grad, group, False, *w_b)[1:])
        now = (engine_wants(ctx, 1), has_bias and engine_wants(ctx, 2))
        return (*_sp_column_grads(x, weight, grad, group, engine_wants(ctx, 0), *now), None)


def _sp_column_grads(x, weight, grad, group, want_x, want_w, want_b):
    """(dX reduce-scattered, dW, db) of ``_SPColumnLinear``, each only if wanted."""
    gather = None
    if want_w or want_b:                    # re-gather the shard, overlapped with dX
        full = x.new_empty((x.shape[0] * group.size, *x.shape[1:]))
        gather = comm.all_gather_into_tensor(full, x, group, async_op=True)
    grad_x = scatter = None
    if want_x:
        gi = grad.matmul(weight)                                       # [s, b, in]
        grad_x = gi.new_empty((gi.shape[0] // group.size, *gi.shape[1:]))
        if gather is not None:
            gather.wait()   # one collective in flight per group: RS after AG completes
        scatter = comm.reduce_scatter_tensor(grad_x, gi, group, async_op=True)
    grad_w = grad_b = None
    if gather is not None:
        full = gather.wait()
        g2 = grad.reshape(-1, grad.shape[-1])
        if want_w:                                                     # overlapped with RS
            grad_w = g2.t().matmul(full.reshape(-1, full.shape[-1]))
        if want_b:
            grad_b = g2.sum(0)
    if scatter is not None:
        grad_x = scatter.wait()
    return grad_x, grad_w, grad_b


def linear_with_sp_gather(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          group: Group) -> torch.Tensor:
    """``F.linear(gather_from_sp_region(x), weight, bias)`` that saves only the shard of
    ``x`` and re-gathers it in backward (``_SPColumnLinear``)."""
    if group.size == 1:
        return linear(x, weight, bias)
    return _SPColumnLinear.apply(x, weight, bias, group)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T with A split by rows (output features) over TP: each rank gets Y_i.

    Input: full hidden [s, b, h] (or [s/tp, b, h] with ``sequence_parallel``, all-gathered
    here by ``linear_with_sp_gather``, which keeps only the shard for backward).  Output:
    [s, b, out/tp] unless ``gather_output``.  ``partition_blocks`` > 1 for fused weights
    whose blocks must each be split (SwiGLU [gate; up]).  ``weight=`` in
    ``forward`` lets a tied output layer borrow the embedding matrix.
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group: Group, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 init_std: float = 0.02, partition_blocks: int = 1,
                 pad_multiple: Optional[int] = None, skip_weight_param: bool = False,
                 device=None, dtype=None):
        super().__init__()
        if gather_output and sequence_parallel:
            raise ValueError("gather_output does not combine with sequence_parallel")
        self.tp_group, self.gather_output = tp_group, gather_output
        self.sequence_parallel = sequence_parallel and tp_group.size > 1
        g, sizes = tp_group.name, {tp_group.name: tp_group.size}
        kw = dict(device=device, dtype=dtype)
        self.weight = self.bias = None
        if not skip_weight_param:
            make_param(self, "weight", ParamSpec.split(
                (output_size, input_size), 0, g, partition_blocks, pad_multiple,
                init=("normal", init_std)), sizes, **kw)
        if bias:
            make_param(self, "bias", ParamSpec.split(
                (output_size,), 0, g, partition_blocks, pad_multiple, init=("zeros",)), sizes, **kw)

    @property
    def takes_loss_head(self) -> bool:
        """Whether ``forward(loss_head=...)`` computes this layer exactly: the fused loss
        sees the input and the weight only, so not with a bias."""
        return self.bias is None

    def forward(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None,
                loss_head=None) -> torch.Tensor:
        w = self.weight if weight is None else weight
        if loss_head is not None:   # the fused output layer + loss: ``loss_head(x, w)``
            if not self.takes_loss_head:
                raise ValueError("a fused loss head would drop this layer's bias")
            return loss_head(x, w)  # called here so module hooks (FSDP2) see the call
        if self.sequence_parallel:          # gather, matmul; saves only the sequence shard
            y = linear_with_sp_gather(x, w, self.bias, self.tp_group)
        else:
            y = linear(copy_to_tp_region(x, self.tp_group), w, self.bias)
        return gather_from_tp_region(y, self.tp_group) if self.gather_output else y


class DuplicatedLinear(nn.Module):
    """Y = X W^T with W whole on every TP rank (TE's ``parallel_mode="duplicated"``; MLA's
    down projections, whose small outputs every head needs).

    Without sequence parallelism every TP rank computes the same output from the same
    input; what follows it must hand back the full gradient (MLA's up projections are
    column-parallel, whose backward all-reduces), so W's gradient is the same on every rank.
    With SP each rank projects only its sequence shard: W is marked ``sequence_parallel``
    and its gradient is summed over the TP group."""

    def __init__(self, input_size: int, output_size: int, *, tp_group: Group, bias: bool = False,
                 sequence_parallel: bool = False, init_std: float = 0.02, device=None,
                 dtype=None):
        super().__init__()
        sp = tp_group.name if sequence_parallel and tp_group.size > 1 else None
        kw = dict(device=device, dtype=dtype)
        make_param(self, "weight", ParamSpec((output_size, input_size),
                                             init=("normal", init_std), sequence_parallel=sp),
                   {}, **kw)
        self.bias = None
        if bias:
            make_param(self, "bias", ParamSpec((output_size,), init=("zeros",),
                                               sequence_parallel=sp), {}, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = X A^T with A split by columns (input features): partial sums are all-reduced,
    or reduce-scattered along the sequence with ``sequence_parallel``.

    The bias is replicated and added after the reduction; with sequence parallelism it
    only sees this rank's tokens, so it is marked ``sequence_parallel``.
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group: Group, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 init_std: float = 0.02, device=None, dtype=None):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel=True")
        self.tp_group, self.input_is_parallel = tp_group, input_is_parallel
        self.sequence_parallel = sequence_parallel and tp_group.size > 1
        g, sizes = tp_group.name, {tp_group.name: tp_group.size}
        kw = dict(device=device, dtype=dtype)
        make_param(self, "weight", ParamSpec.split((output_size, input_size), 1, g,
                                                   init=("normal", init_std)), sizes, **kw)
        self.bias = None
        if bias:   # replicated; with SP it sees only this rank's tokens: grad summed over g
            make_param(self, "bias", ParamSpec((output_size,), init=("zeros",),
                                               sequence_parallel=g if self.sequence_parallel
                                               else None), sizes, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_group.size == 1:
            return linear(x, self.weight, self.bias)  # fused bias, no collective
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp_group)
        y = linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sp_region(y, self.tp_group)
        else:
            y = reduce_from_tp_region(y, self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; each rank looks up the ids it owns.

    The table is padded (zero rows) to a multiple of ``pad_multiple * tp``; padded rows are
    never looked up.  Output partial sums are all-reduced, or reduce-scattered along the
    sequence (dim 0) when ``reduce_scatter`` (sequence parallelism).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group: Group,
                 pad_multiple: int = 1, init_std: float = 0.02, reduce_scatter: bool = False,
                 device=None, dtype=None):
        super().__init__()
        self.tp_group = tp_group
        self.reduce_scatter = reduce_scatter and tp_group.size > 1
        spec = ParamSpec.split((num_embeddings, embedding_dim), 0, tp_group.name,
                               pad_multiple=pad_multiple, init=("normal", init_std))
        make_param(self, "weight", spec, {tp_group.name: tp_group.size}, device=device,
                   dtype=dtype)
        self.vocab_start = tp_group.rank * self.weight.shape[0]
        self.vocab_end = self.vocab_start + self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter:
            return reduce_scatter_to_sp_region(out, self.tp_group)
        return reduce_from_tp_region(out, self.tp_group)


def _grad_of(p: torch.Tensor):
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def allreduce_sequence_parallel_grads(model_or_params, state, grad_of=_grad_of,
                                      specs=None) -> int:
    """Sum the grads of replicated params that saw only a sequence shard over the group
    their spec names (``ParamSpec.sequence_parallel``, "tp" for the dense layers).

    Call after backward (and before clipping / the optimizer) when sequence parallelism is
    on.  Takes a module or a list of modules (their specs are looked up by parameter name
    in the table, so parameters replaced after construction, e.g. by FSDP2, are found), or
    a list of parameters with ``specs``, their ``ParamSpec`` in the same order.
    ``grad_of`` says where a parameter's gradient lives (default ``main_grad`` if present,
    else ``.grad``).  Returns the number of elements reduced.
    """
    items = [model_or_params] if isinstance(model_or_params, nn.Module) else list(model_or_params)
    if items and all(isinstance(it, nn.Module) for it in items):
        pairs = [(p, spec) for _, p, spec in named_specs(items)]
    else:
        if specs is None:
            raise ValueError("a list of parameters needs their specs")
        pairs = list(zip(items, specs))
    by_group = {}
    for p, spec in pairs:
        if spec.sequence_parallel and (g := grad_of(p)) is not None:
            by_group.setdefault(spec.sequence_parallel, []).append(g)
    reduced = 0
    for name, grads in by_group.items():
        group = state[name]
        if group.size > 1:
            comm.all_reduce_coalesced(grads, group)
            reduced += sum(g.numel() for g in grads)
    return reduced
