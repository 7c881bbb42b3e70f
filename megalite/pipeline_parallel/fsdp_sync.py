"""How a pipeline schedule drives FSDP2 chunks: one gradient reduction per chunk per step.

A pipelined rank runs many micro-batches' backwards per chunk, interleaved with other
chunks' work.  FSDP2 by default would reshard and reduce-scatter after every one of them.
torch's own pipelining (``torch.distributed.pipelining.stage``) instead, and we with it:

* before the step's first backward, ``defer_gradient_sync`` tells every FSDP module of the
  chunk that no backward is the last one (``set_is_last_backward(False)``), to keep the
  gathered parameters (``set_reshard_after_backward(False)``) and to accumulate the
  unsharded gradients without reducing them (``set_requires_gradient_sync(False)``);
* after the chunk's last backward op of the program -- BW, or with zero bubble the last W
  (its weight gradients come after the last B) -- ``reduce_gradients`` flips the three back
  and runs FSDP's post-backward for every parameter group: one reduce-scatter (HSDP: and one
  all-reduce) per unit, then the parameters are resharded.  It is torch's
  ``perform_reduce_grad`` (the REDUCE_GRAD action of torch's schedules), called on our chunk.

Forward-only runs (evaluation) gather without resharding (``reshard_after_forward=False``
under PP): ``reshard`` frees the gathered parameters afterwards.

Zero bubble's W works because the chunk's parameters, gathered and kept, are the module's
registered (unsharded) parameters between the forward and the reduction: W accumulates into
exactly the gradients the reduction reads (``PipelineExecutor`` takes them at B time).
"""
from __future__ import annotations

import types
from typing import Iterable, List

from megalite.torch_classes import is_fsdp_module
from megalite.transformer.loss_reduction import GRAD_DIVIDE_FACTOR


def fsdp_chunks(chunks: Iterable) -> List:
    """The chunks fully sharded by FSDP2 (their root is an ``FSDPModule``)."""
    return [c for c in chunks if is_fsdp_module(c)]


def defer_gradient_sync(chunk) -> None:
    chunk.set_is_last_backward(False)
    chunk.set_reshard_after_backward(False)
    chunk.set_requires_gradient_sync(False)


def reduce_gradients(chunk) -> None:
    """Reduce the chunk's accumulated gradients now (and reshard): torch's REDUCE_GRAD,
    with the loss-reduction policy's divide factor (a plain sum: the loss is already over
    the global token count)."""
    # start-up time: torch.distributed's DCP/DTensor/FSDP packages, ~0.5 s
    from torch.distributed.pipelining.stage import _PipelineStageBase
    _PipelineStageBase.perform_reduce_grad(types.SimpleNamespace(submod=chunk),
                                           GRAD_DIVIDE_FACTOR)


def reshard(chunk) -> None:
    """Free every unit's gathered parameters (after a forward-only run under PP)."""
    for module in chunk.modules():
        if is_fsdp_module(module):
            module.reshard()
