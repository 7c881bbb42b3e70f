"""This rank's routed experts as one grouped MLP (Megatron's ``GroupedMLP``).

All experts of a layer are two parameters with an expert dimension:
``linear_fc1.weight`` [E, 2F (SwiGLU [gate; up]) or F, h] and ``linear_fc2.weight``
[E, h, F].  The expert dimension is split over EP (which experts this rank holds) and F
over expert-TP (column-parallel fc1 with SwiGLU's two blocks, row-parallel fc2), both
recorded in the parameter-spec table with ``expert=True`` -- so initialization (the full
[E, ...] tensor drawn from the name, then sliced), grad sync over expert-DP, the expert
grad norm and checkpoints follow without anything expert-specific in those places.

``forward(x, tokens_per_expert)``: ``x`` holds the rows of each local expert one after
the other.  Each linear is one grouped GEMM over the whole buffer (``torch._grouped_mm``
where the device and dtype support it; otherwise a loop over the local experts into one
output buffer, never a loop over tokens), and the activation runs once on the whole
buffer.  Both paths defer their weight gradient as the dense linears do
(``tensor_parallel.deferred_wgrad``): zero bubble's B computes the input gradient alone
and stores (input, dY); its W runs only the expert-weight GEMMs.  With expert-TP the output is this
shard's partial sum (the dispatcher reduces it).

``--moe-expert-bias`` (gpt-oss): ``linear_fc1.bias`` [E, 2F] and ``linear_fc2.bias`` [E, h],
split over EP with the experts (and fc1's over expert-TP with its columns); each row takes
its expert's bias.  fc2's bias would be added once per expert-TP shard of a partial sum, so
the rule engine refuses it with expert-TP > 1 (cli/features.py).
"""
from __future__ import annotations

import functools
from typing import List, Union

import torch
from torch import nn

from megalite.param_spec import ParamSpec, Split, make_param
from megalite.config.activations import activation_of
from megalite.tensor_parallel.deferred_wgrad import (engine_wants, grouped_mm, stash_for,
                                                     weight_edges)

Counts = Union[List[int], torch.Tensor]


@functools.lru_cache(maxsize=None)
def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward here (it exists on CPU in
    recent torch; on CUDA it needs bf16 and a recent GPU).  Probed once per device/dtype."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:    # the first call may come from an eval forward: probe with autograd on, and
        # from inside a recomputed (checkpointed) forward: identity saved-tensor hooks on top
        # keep the probe's saved tensors out of that checkpoint's count (else its recompute,
        # which no longer probes, saves fewer tensors and torch refuses the backward)
        with torch.inference_mode(False), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            a = torch.ones(4, 8, device=device_type, dtype=dtype, requires_grad=True)
            b = torch.ones(2, 8, 8, device=device_type, dtype=dtype, requires_grad=True)
            offs = torch.tensor([1, 4], dtype=torch.int32, device=device_type)
            y = torch._grouped_mm(a, b, offs=offs)
            y.backward(torch.ones_like(y))
            return bool(torch.equal(y.detach(), torch.full_like(y, 8.0)))
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def aligned_16(x: torch.Tensor, w: torch.Tensor) -> bool:
    """``torch._grouped_mm`` wants 16-byte aligned rows (in, weight and out)."""
    return rows_aligned_16(x, w) and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0


def rows_aligned_16(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The shape half of ``aligned_16``: what the path choice may depend on.  Where the
    buffers sit is not (a recomputed forward gets other addresses, and activation
    checkpointing requires it to take the same path)."""
    size = x.element_size()
    return all(n * size % 16 == 0 for n in (x.shape[1], w.shape[1], w.shape[2]))


class LoopedGroupedLinear(torch.autograd.Function):
    """y[rows of e] = x[rows of e] @ w[e].t(), one GEMM per expert into one buffer; backward
    writes each expert's weight gradient straight into its slice of one [E, ...] tensor
    (indexing ``w[e]`` under autograd would allocate and add a full-size zero gradient per
    expert).  The fallback where ``torch._grouped_mm`` is missing."""

    @staticmethod
    def forward(ctx, x, w, sizes):
        ctx.save_for_backward(x, w)
        ctx.sizes = sizes
        out = x.new_empty((x.shape[0], w.shape[1]))
        for e, (rows, dst) in enumerate(zip(x.split(sizes), out.split(sizes))):
            torch.mm(rows, w[e].t(), out=dst)
        return out

    defers_wgrad = (1,)     # zero bubble's W computes gw (tensor_parallel.deferred_wgrad)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        sizes = ctx.sizes
        grad = grad.contiguous()
        gx = torch.empty_like(x) if engine_wants(ctx, 0) else None
        stash, later = stash_for(ctx, (1,))
        if stash is not None:
            stash.add(weight_edges(ctx, (1,), later),
                      lambda: (_looped_wgrad(x, w, grad, sizes),))
        elif engine_wants(ctx, 1):
            return _looped_dgrad(x, w, grad, sizes, gx), _looped_wgrad(x, w, grad, sizes), None
        return _looped_dgrad(x, w, grad, sizes, gx), None, None


def _looped_dgrad(x, w, grad, sizes, gx):
    if gx is not None:
        for e, (g, dst) in enumerate(zip(grad.split(sizes), gx.split(sizes))):
            torch.mm(g, w[e], out=dst)
    return gx


def _looped_wgrad(x, w, grad, sizes):
    gw = torch.empty_like(w)
    for e, (g, rows) in enumerate(zip(grad.split(sizes), x.split(sizes))):
        torch.mm(g.t(), rows, out=gw[e])
    return gw


def grouped_linear(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: Counts) -> torch.Tensor:
    """Rows of expert e times ``w[e].t()``; ``tokens_per_expert`` as a list or a tensor
    (a tensor needs no host round trip on the grouped-GEMM path)."""
    if grouped_mm_supported(x.device.type, x.dtype) and rows_aligned_16(x, w):
        if not aligned_16(x, w):            # a misaligned view: an aligned copy, same path
            x, w = x.clone(), w.clone()
        counts = torch.as_tensor(tokens_per_expert, device=x.device)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return grouped_mm(x, w, offs)
    sizes = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) \
        else list(tokens_per_expert)
    return LoopedGroupedLinear.apply(x, w, sizes)


class GroupedMLP(nn.Module):
    def __init__(self, model_cfg, comm_groups, *, device=None, dtype=None):
        super().__init__()
        m = model_cfg
        E, h, ffn = m.num_experts, m.hidden_size, m.resolved_moe_ffn_hidden_size()
        ep, etp = comm_groups.ep, comm_groups.expert_tp
        self.activation = activation_of(m)
        sizes = {"ep": ep.size, "expert-tp": etp.size}
        kw = dict(device=device, dtype=dtype)
        blocks = self.activation.fc1_blocks
        self.linear_fc1 = nn.Module()
        make_param(self.linear_fc1, "weight", ParamSpec(
            (E, blocks * ffn, h), (Split(0, "ep"), Split(1, "expert-tp", blocks)),
            init=("normal", m.init_method_std), expert=True), sizes, **kw)
        self.linear_fc2 = nn.Module()
        make_param(self.linear_fc2, "weight", ParamSpec(
            (E, h, ffn), (Split(0, "ep"), Split(2, "expert-tp")),
            init=("normal", m.init_method_std / (2.0 * m.num_layers) ** 0.5), expert=True),
            sizes, **kw)
        self.with_bias = bool(getattr(m, "moe_expert_bias", False))
        if self.with_bias:      # gpt-oss (module docstring)
            make_param(self.linear_fc1, "bias", ParamSpec(
                (E, blocks * ffn), (Split(0, "ep"), Split(1, "expert-tp", blocks)),
                init=("zeros",), expert=True), sizes, **kw)
            make_param(self.linear_fc2, "bias", ParamSpec(
                (E, h), (Split(0, "ep"),), init=("zeros",), expert=True), sizes, **kw)

    def forward(self, x: torch.Tensor, tokens_per_expert: Counts) -> torch.Tensor:
        y = grouped_linear(x, self.linear_fc1.weight, tokens_per_expert)
        rows = self._row_experts(tokens_per_expert, x.device) if self.with_bias else None
        if rows is not None:
            y = y + self.linear_fc1.bias[rows]
        y = self.activation.fn(y)       # gated: every expert's [gate; up] rows at once
        y = grouped_linear(y, self.linear_fc2.weight, tokens_per_expert)
        return y if rows is None else y + self.linear_fc2.bias[rows]

    def _row_experts(self, tokens_per_expert: Counts, device) -> torch.Tensor:
        """The local expert of each row of the buffer [rows]."""
        counts = torch.as_tensor(tokens_per_expert, device=device)
        return torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts)
