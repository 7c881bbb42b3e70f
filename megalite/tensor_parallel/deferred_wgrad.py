"""Deferred weight gradients: the linears' dW GEMMs kept for zero bubble's W pass.

Zero-bubble schedules run backward in two halves: B (input gradients, on the critical
path) and W (weight gradients, in the bubbles).  Replaying the autograd graph for W
(asking a node for its weight edges only) costs as much as the GEMMs -- unless the node's
saved tensors are gone: under activation recomputation every W replay re-runs the
checkpointed forward (non-reentrant checkpoint recomputes once per backward call), and
every replay is one more engine call.  Megatron and the zero-bubble paper do it the other
way round, and so does this module: during B a linear's backward computes dX only and
*stores* what dW needs (its input and the gradient of its output); W runs just those
GEMMs.  No graph is replayed and nothing is recomputed.

How a backward finds where to store: ``collecting(roots)`` registers a pre-hook on B's
root nodes that maps the engine's graph-task id (``torch._C._current_graph_task_id``, set
on whichever thread runs the backward -- CUDA backwards run on the device's engine thread)
to a ``WgradStash``.  A deferring ``autograd.Function`` calls ``stash_for(ctx, slots)``: it
gets the stash only if one is registered for the running backward, and defers only the
slots the engine does not want (the weights that are not among B's inputs); what the
engine wants it computes now, as in any backward.  So a plain ``loss.backward()`` and a user's
``torch.autograd.grad`` are unchanged.

W hands each dW to the gradient edge the weight came in on (``ctx.next_functions``), so
the usual ``AccumulateGrad`` node accumulates it: ``.grad`` accumulation, post-accumulate
hooks (bf16 ``main_grad``) and any op between the parameter and the linear (a cast, a
tied weight) run exactly as in a normal backward.
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge

_LOCK = threading.Lock()
_ACTIVE: Dict[int, "WgradStash"] = {}      # graph-task id -> the stash of that B


class WgradStash:
    """The dW work one B pass deferred, in the order the engine ran it (the same on every
    tensor-parallel rank, so a collective inside a deferred GEMM lines up)."""

    def __init__(self):
        self.entries: List[tuple] = []     # (edges, compute) ; compute() -> grads per edge

    def add(self, edges: Sequence, compute: Callable[[], Sequence[torch.Tensor]]) -> None:
        self.entries.append((list(edges), compute))

    def run(self) -> None:
        """Compute each deferred dW and accumulate it through its gradient edge at once,
        one linear at a time as a plain backward does: holding many dW before one
        accumulation costs memory, and on CPU fresh pages (measured: 7-9% of W)."""
        entries, self.entries = self.entries, []
        for edges, compute in entries:
            with torch.no_grad():           # as inside backward (in-place collectives)
                computed = compute()
            roots = [GradientEdge(n, i) for (n, i), g in zip(edges, computed)
                     if n is not None and g is not None]
            if roots:   # retain: a cast node two linears share is walked twice
                torch.autograd.backward(roots, [g for (n, _), g in zip(edges, computed)
                                                if n is not None and g is not None],
                                        retain_graph=True)
            del computed

    def __len__(self):
        return len(self.entries)


class collecting:
    """Context manager: deferring Functions that run in a backward started from ``roots``
    (graph nodes) inside it store their dW work in the yielded ``WgradStash``."""

    def __init__(self, roots):
        self.roots, self.stash, self.ids, self.handles = list(roots), WgradStash(), [], []

    def _register(self, _grads):
        task = torch._C._current_graph_task_id()
        with _LOCK:
            if task not in _ACTIVE:
                _ACTIVE[task] = self.stash
                self.ids.append(task)

    def __enter__(self) -> WgradStash:
        self.handles = [r.register_prehook(self._register) for r in self.roots]
        return self.stash

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        with _LOCK:
            for task in self.ids:
                _ACTIVE.pop(task, None)
        return False


def engine_wants(ctx, i: int) -> bool:
    """Will the running backward use the gradient of ``forward``'s input ``i``?

    A plain ``loss.backward()`` wants every input that requires grad; zero bubble's B
    (``torch.autograd.grad`` w.r.t. the stage input) does not want the weights."""
    if not ctx.needs_input_grad[i]:
        return False
    node = ctx.next_functions[i][0]
    if node is None:
        return False
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # a leaf captured by torch.autograd.grad(..., inputs=[leaf])
        return True


def stash_for(ctx, slots: Sequence[int]):
    """``(stash, later)`` for ``forward`` inputs ``slots`` (the weights): ``later[k]`` says
    slot k needs a gradient that the running backward does not want, so W computes it into
    ``stash``.  ``(None, all False)`` unless this backward is a collecting B; the slots the
    engine wants (a weight B takes too, module docstring) are computed now either way."""
    none = None, (False,) * len(slots)
    if not _ACTIVE:
        return none
    later = tuple(bool(ctx.needs_input_grad[i]) and ctx.next_functions[i][0] is not None
                  and not engine_wants(ctx, i) for i in slots)
    stash = _ACTIVE.get(torch._C._current_graph_task_id()) if any(later) else None
    return (stash, later) if stash is not None else none


def weight_edges(ctx, slots: Sequence[int], later: Sequence[bool]):
    """(node, input_nr) of each slot W computes, (None, 0) for the others."""
    return [ctx.next_functions[i] if defer else (None, 0) for i, defer in zip(slots, later)]


def _linear_wgrad(x, grad, has_bias: bool, want_w: bool, want_b: bool):
    g2 = grad.reshape(-1, grad.shape[-1])
    grad_w = g2.t().mm(x.reshape(-1, x.shape[-1])) if want_w else None
    grad_b = g2.sum(0) if has_bias and want_b else None
    return grad_w, grad_b


class LinearWithDeferredWgrad(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose weight and bias gradients a collecting B defers
    to W (module docstring).  Same forward; backward uses the GEMMs autograd uses for
    ``F.linear`` (``dX = dY W``, ``dW = dYᵀ X``, ``db = Σ dY``)."""

    defers_wgrad = (1, 2)      # the forward inputs whose gradient W may compute

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if engine_wants(ctx, 0) else None
        has_bias = ctx.has_bias
        slots = (1, 2) if has_bias else (1,)
        stash, later = stash_for(ctx, slots)
        if stash is not None:
            later_w, later_b = later[0], has_bias and later[1]
            stash.add(weight_edges(ctx, slots, later),
                      lambda: _linear_wgrad(x, grad, has_bias, later_w, later_b))
        grad_w, grad_b = _linear_wgrad(x, grad, has_bias, engine_wants(ctx, 1),
                                       has_bias and engine_wants(ctx, 2))
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
    """``F.linear`` whose dW/db zero bubble's W computes from stored (input, grad_output);
    plain ``F.linear`` when no gradient is being recorded for the weights."""
    if not torch.is_grad_enabled() or not (weight.requires_grad or
                                           (bias is not None and bias.requires_grad)):
        return torch.nn.functional.linear(x, weight, bias)
    return LinearWithDeferredWgrad.apply(x, weight, bias)


class GroupedMMWithDeferredWgrad(torch.autograd.Function):
    """``torch._grouped_mm(x, w.transpose(1, 2), offs=offs)`` -- rows of group e times
    ``w[e].t()`` -- whose expert-weight gradient a collecting B defers to W.  Backward is
    the native one's: ``dX = grouped_mm(dY, w)``, ``dW = grouped_mm(dYᵀ, X)`` grouped
    along the token dimension (an empty group gets a zero gradient)."""

    defers_wgrad = (1,)

    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, w, offs = ctx.saved_tensors
        grad_x = torch._grouped_mm(grad, w, offs=offs) if engine_wants(ctx, 0) else None
        stash, later = stash_for(ctx, (1,))
        if stash is not None:
            stash.add(weight_edges(ctx, (1,), later),
                      lambda: (torch._grouped_mm(grad.t(), x, offs=offs),))
            return grad_x, None, None
        grad_w = torch._grouped_mm(grad.t(), x, offs=offs) if engine_wants(ctx, 1) else None
        return grad_x, grad_w, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x, w.transpose(1, 2), offs=offs)`` whose dW zero bubble's W
    computes from stored (input, grad_output)."""
    if not torch.is_grad_enabled() or not w.requires_grad:
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    return GroupedMMWithDeferredWgrad.apply(x, w, offs)
