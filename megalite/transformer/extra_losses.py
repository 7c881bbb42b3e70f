"""Extra loss terms from any module on any pipeline stage (the MoE load-balancing loss).

A module calls ``add_extra_loss(name, value[, weight])`` in its forward.  The model family's forward
step runs the chunk under ``collect_extra_losses(names)`` and then ``attach``-es the terms
to the chunk's output: the output is unchanged, but backward through it -- from the loss
on the last stage, from the received gradient on any other stage -- also back-propagates
``scale * weight * term`` (weight 1 unless given: MoE's terms carry their coefficient in
the value; MTP logs its cross entropy and weights it).  So no schedule needs to know about extra losses, and a stage that is
not the last can still add one (Megatron's ``MoEAuxLossAutoScaler`` does the same).

A term must have the same value on every TP rank (compute it from statistics reduced over
the ranks that hold parts of the same tokens): the loop sums terms over pipeline stages and
dp-cp, not TP, and ``scale`` is the term's share of the objective -- both the loss-reduction
policy's (``transformer/loss_reduction.py``).  Outside a collection (inference, or recomputation during backward)
``add_extra_loss`` does nothing, so a recomputed region never counts its term twice.  A
name the family did not declare is an error: the loop reduces a fixed list of names.
"""
from __future__ import annotations

import contextlib
import threading
from typing import List, Sequence, Tuple

import torch

class _Collectors(threading.local):
    """Per thread: the two halves of an overlapped F&B pair (``comm/overlap.py``) run on
    two threads, and the backward half's recomputation must not see the forward half's
    collection."""

    def __init__(self):
        self.stack: List["ExtraLosses"] = []


_LOCAL = _Collectors()


class _AttachTerms(torch.autograd.Function):
    """Identity on ``output``; backward also feeds ``scale`` times each term's weight into
    every term."""

    @staticmethod
    def forward(ctx, output, scales, *terms):
        ctx.term_specs = [(t.shape, t.dtype, t.device, w) for t, w in zip(terms, scales)]
        return output

    @staticmethod
    def backward(ctx, grad_output):
        grads = [torch.full(shape, w, dtype=dtype, device=device)
                 for shape, dtype, device, w in ctx.term_specs]
        return (grad_output, None, *grads)


class ExtraLosses:
    """The terms one forward step (one micro-batch, one chunk) registered."""

    def __init__(self, names: Sequence[str]):
        self.names = tuple(names)
        self.terms: List[Tuple[str, torch.Tensor]] = []
        self.weights: List[float] = []      # each term's weight in the objective

    def add(self, name: str, value: torch.Tensor, weight: float = 1.0) -> None:
        if name not in self.names:
            raise KeyError(f"extra loss {name!r} is not declared by the model family "
                           f"(declared: {list(self.names)})")
        if value.numel() != 1:
            raise ValueError(f"extra loss {name!r} must be a scalar, got shape "
                             f"{tuple(value.shape)}")
        self.terms.append((name, value.reshape(())))
        self.weights.append(float(weight))

    def accumulate(self, totals: torch.Tensor) -> None:
        """Add each term's detached value into ``totals`` (one slot per declared name)."""
        for name, value in self.terms:
            totals[self.names.index(name)] += value.detach().to(totals.dtype)

    def attach(self, output: torch.Tensor, scale: float) -> torch.Tensor:
        """``output`` with ``scale * sum(weight * term)`` joined to its backward."""
        terms = [(v, scale * w) for (_, v), w in zip(self.terms, self.weights)
                 if v.requires_grad]
        if not terms or not torch.is_grad_enabled():
            return output
        return _AttachTerms.apply(output, [w for _, w in terms], *[v for v, _ in terms])


@contextlib.contextmanager
def collect_extra_losses(names: Sequence[str]):
    collector = ExtraLosses(names)
    _LOCAL.stack.append(collector)
    try:
        yield collector
    finally:
        _LOCAL.stack.remove(collector)


def is_collecting() -> bool:
    """True inside a forward step's collection (not in recomputation or plain inference):
    where per-step statistics such as MoE token counts should be recorded, once."""
    return bool(_LOCAL.stack)


def add_extra_loss(name: str, value: torch.Tensor, weight: float = 1.0) -> None:
    """Register a scalar loss term from inside a model's forward (see module docstring).
    It is logged as ``value``; the objective gets ``weight * value`` (MTP logs its cross
    entropy and trains on a scaled share of it)."""
    if _LOCAL.stack:
        _LOCAL.stack[-1].add(name, value, weight)
