"""Flat, padded parameter and gradient storage sharded over a data-parallel group.

Why flat: a reduce-scatter hands each DP rank one contiguous shard, so the distributed
optimizer can keep state for ``[start, end)`` of the buffer only; the model's parameters
become views of the param buffer, their gradients views of the grad buffer.  The data-parallel
strategy owns these buffers (``megalite.distributed.data_parallel``); the distributed
optimizer steps their shards.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from megalite import comm


class ShardedBuffer:
    """Flat, padded param and grad storage of one DP group and dtype.

    Parameter i occupies ``[offsets[i], offsets[i] + numel)`` of both buffers (the model's
    parameters become views of the param buffer); DP rank r owns ``[start, end)`` =
    ``[r * shard_size, (r + 1) * shard_size)``.  The padding (< d elements, at the end)
    belongs to no parameter and stays zero.
    """

    def __init__(self, params: List[torch.nn.Parameter], group, grad_dtype: torch.dtype,
                 keep_shard_only: bool = False, replicate=None):
        # ``replicate`` (--num-distributed-optimizer-instances > 1): the same shard's ranks
        # in the other instances; the reduced shard is all-reduced over them
        self.params, self.group, self.replicate = list(params), group, replicate
        # ZeRO-2 (``keep_shard_only``): the reduced shard lives in its own tensor and the
        # full-size grad buffer is freed after the reduce-scatter, re-allocated (zeroed) on
        # the next step's first gradient (``ensure_full_grads``).
        self.keep_shard_only = keep_shard_only
        self.offsets, total = [], 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.shard_size = -(-total // group.size)
        self.padded = self.shard_size * group.size
        self.start = group.rank * self.shard_size
        self.end = self.start + self.shard_size
        first = self.params[0]
        self.param_data = torch.zeros(self.padded, dtype=first.dtype, device=first.device)
        self.grad_data = torch.zeros(self.padded, dtype=grad_dtype, device=first.device)
        self.grad_views = []
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets):
                view = self.param_data[off:off + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view                  # the model now reads its weights from here
                self.grad_views.append(self.grad_data[off:off + p.numel()].view_as(p))
        self._own_shard = torch.zeros(self.shard_size, dtype=grad_dtype, device=first.device) \
            if keep_shard_only else None
        self.full_grads_allocated = True

    @property
    def param_shard(self) -> torch.Tensor:
        return self.param_data[self.start:self.end]

    @property
    def grad_shard(self) -> torch.Tensor:
        if self._own_shard is not None:
            return self._own_shard
        return self.grad_data[self.start:self.end]

    def release_full_grads(self) -> None:
        """ZeRO-2: free the full-size gradient storage (the views stay, storage-less)."""
        if self.keep_shard_only and self.full_grads_allocated:
            self.grad_data.untyped_storage().resize_(0)
            self.full_grads_allocated = False

    def ensure_full_grads(self) -> None:
        """Give the full-size gradient storage back, zeroed, before a gradient lands in it."""
        if not self.full_grads_allocated:
            storage = self.grad_data.untyped_storage()
            storage.resize_(self.padded * self.grad_data.element_size())
            self.grad_data.zero_()
            self.full_grads_allocated = True

    def start_reduce_scatter(self) -> "comm.Pending":
        """Asynchronous ``reduce_scatter_grads`` (the overlapped buckets): ``wait()`` leaves
        the DP-summed shard in ``grad_shard`` (across instances too)."""
        self.ensure_full_grads()
        if self._own_shard is not None:
            pending = comm.reduce_scatter_tensor(self._own_shard, self.grad_data, self.group,
                                                 async_op=True)
            return comm.Pending(self._own_shard, pending, self._reduce_across_instances)
        out = torch.empty_like(self.grad_shard)
        pending = comm.reduce_scatter_tensor(out, self.grad_data, self.group, async_op=True)
        return comm.Pending(self.grad_shard, pending, lambda: (
            self.grad_shard.copy_(out), self._reduce_across_instances()))

    def _reduce_across_instances(self) -> None:
        if self.replicate is not None:
            comm.all_reduce(self.grad_shard, self.replicate)

    def shard_ranges(self) -> List[Tuple[torch.nn.Parameter, int, int]]:
        """``(param, lo, hi)``: the part of each parameter inside this rank's shard, in
        shard coordinates (0 .. shard_size)."""
        out = []
        for p, off in zip(self.params, self.offsets):
            lo, hi = max(off, self.start), min(off + p.numel(), self.end)
            if lo < hi:
                out.append((p, lo - self.start, hi - self.start))
        return out

    def reduce_scatter_grads(self) -> None:
        """Sum the grad buffer over the DP group (a plain sum: the loss-reduction policy,
        ``transformer/loss_reduction.py``); this rank keeps its (summed) shard.  The rest of
        the buffer keeps this rank's local, unreduced values: nothing reads them."""
        if self._own_shard is not None:
            self.start_reduce_scatter().wait()
            return
        if self.group.size > 1:
            out = torch.empty_like(self.grad_shard)
            comm.reduce_scatter_tensor(out, self.grad_data, self.group)
            self.grad_shard.copy_(out)
        self._reduce_across_instances()

    def start_all_gather_params(self) -> "comm.Pending":
        """Asynchronous ``all_gather_params`` (``--overlap-param-gather``)."""
        return comm.all_gather_into_tensor(self.param_data, self.param_shard.clone(), self.group,
                                           async_op=True)

    def all_gather_params(self) -> None:
        """Every rank's updated shard into every rank's param buffer (param dtype)."""
        if self.group.size == 1:
            return
        comm.all_gather_into_tensor(self.param_data, self.param_shard.clone(), self.group)


def contiguous_runs(ranges, size: int, key) -> List[Tuple[int, int, object]]:
    """Cover ``[0, size)`` with maximal runs of equal ``key(param)``; ranges are contiguous
    from 0 and the uncovered tail (padding) gets ``key(None)``."""
    runs: List[list] = []
    end = ranges[-1][2] if ranges else 0
    for p, lo, hi in [*ranges, (None, end, size)]:
        k = key(p)
        if lo == hi:
            continue
        if runs and runs[-1][2] == k:
            runs[-1][1] = hi
        else:
            runs.append([lo, hi, k])
    return [tuple(r) for r in runs]
