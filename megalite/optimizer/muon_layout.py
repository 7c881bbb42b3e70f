"""Muon at every layout: each weight matrix orthogonalised whole, as the single process does.

Newton-Schulz needs the whole matrix, which TP (rows or columns over TP ranks), the
distributed optimizer (flat ranges of a buffer over DP) and FSDP2 (row pieces over DP) all
cut.  Every layout describes each Muon parameter the same way (``MatrixSlot``): this
rank's piece is a contiguous flat range of the parameter's TP-local tensor, and ``group``
holds the other pieces (None: the piece is the whole TP-local tensor -- one process, DDP,
PP, EP's local experts).

``WholeMatrices`` then, per group (in name order, so ranks in several groups agree):

1. assigns each matrix to one rank of the group, layer-wise and balanced by size (largest
   first to the least loaded rank) -- the same assignment on every rank;
2. sends every piece to its owner (one all-to-all over the group);
3. on the owner: all-gathers the TP-local tensors over the group that splits a matrix
   dimension (tp / expert-tp; the owner's TP peers own the same matrices), reassembles the
   logical weight from the parameter table (fused blocks in place), orthogonalises it
   (``muon.orthogonalized``: Q, K, V apart) and keeps its own TP piece;
4. sends every rank its piece of the result (one all-to-all back).

Traffic per step over the shard group of size d (``docs/training.md``): each all-to-all
moves each rank's pieces of the matrices others own, about Psi (d-1)/d^2 elements per rank
for Psi Muon elements of the TP-local model (balanced), in fp32, both ways; plus, under TP,
an all-gather of every matrix over TP on its owner only (Psi t/d elements gathered per rank).
Without a shard group every data-parallel replica computes its matrices itself (DDP).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megalite import comm
from megalite.optimizer.muon import orthogonalized
from megalite.param_spec import ParamSpec


@dataclass
class MatrixSlot:
    """One Muon parameter as a layout holds it on this rank."""
    name: str
    spec: ParamSpec
    shape: Tuple[int, ...]              # its TP-local tensor's shape
    lo: int                             # this rank's piece: flat offset in that tensor ...
    numel: int                          # ... and length (0: no piece here)
    tensor: Optional[torch.Tensor]      # the stepped tensor holding the piece
    group: object = None                # the group holding the other pieces (or None)
    qkv: bool = False                   # a linear_qkv weight split into Q, K, V


def assign_owners(sizes: Sequence[int], n: int) -> List[int]:
    """Layer-wise ownership: the largest matrix first, each to the least loaded rank
    (ties: the lower index) -- deterministic, so every rank computes the same."""
    loads, owners = [0] * n, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(n), key=lambda r: (loads[r], r))
        owners[i] = r
        loads[r] += sizes[i]
    return owners


def matrix_split(spec: ParamSpec, state):
    """The split (over a group of more than one rank) of one of the last two dimensions:
    the rows or columns TP cut; None when the TP-local tensor holds whole matrices."""
    ndim = len(spec.full_shape)
    splits = [s for s in spec.splits if s.dim >= ndim - 2 and state[s.group].size > 1]
    if len(splits) > 1:
        raise ValueError(f"Muon: a matrix split over two groups {splits}")
    return splits[0] if splits else None


class WholeMatrices:
    """The ``orthogonalize`` of ``muon.MuonAdamW`` for one layout's ``slots``."""

    def __init__(self, slots: List[MatrixSlot], state, optim_config, qkv_rows: List[int]):
        self.slots, self.state, self.o, self.qkv_rows = slots, state, optim_config, qkv_rows
        self._plans: Dict[str, tuple] = {}
        # where the exchange buffers live: the stepped tensors' device (NCCL needs CUDA)
        held = [s.tensor for s in slots if s.tensor is not None]
        self.device = held[0].device if held else torch.device("cpu")

    def __call__(self, tensors: List[torch.Tensor], inputs: List[torch.Tensor]):
        given = {id(t): u for t, u in zip(tensors, inputs)}
        out: Dict[int, torch.Tensor] = {}
        by_group: Dict[Optional[str], List[MatrixSlot]] = {}
        for s in self.slots:
            key = s.group.name if s.group is not None and s.group.size > 1 else None
            by_group.setdefault(key, []).append(s)
        for s in by_group.pop(None, []):
            if s.tensor is not None:
                u = self._input(s, given)
                out[id(s.tensor)] = self._whole(s, u.reshape(s.shape)).reshape(u.shape)
        for name in sorted(by_group):
            self._over_group(by_group[name], given, out)
        return [out[id(t)].reshape(u.shape) for t, u in zip(tensors, inputs)]

    def _input(self, s: MatrixSlot, given) -> torch.Tensor:
        """This rank's piece of the momentum-updated input (zeros if its tensor had no
        gradient: the group's exchange needs every member)."""
        u = given.get(id(s.tensor)) if s.tensor is not None else None
        if u is None:
            return torch.zeros(s.numel, dtype=torch.float32, device=self.device)
        return u.float().reshape(-1)

    def _whole(self, s: MatrixSlot, local: torch.Tensor) -> torch.Tensor:
        """The orthogonalised update of ``s``'s TP-local tensor ``local``: gathered over the
        group splitting a matrix dimension, orthogonalised whole, this rank's piece kept."""
        split = matrix_split(s.spec, self.state)
        qkv = self.qkv_rows if s.qkv else None
        if split is None:
            return orthogonalized(local, self.o, qkv)
        g = self.state[split.group]
        gathered = torch.empty(g.size * local.numel(), dtype=local.dtype, device=local.device)
        comm.all_gather_into_tensor(gathered, local.contiguous().reshape(-1), g)
        shape = list(local.shape)
        shape[split.dim] = s.spec.full_shape[split.dim]
        whole = ParamSpec(tuple(shape), (split,))
        full = whole.unshard([({split.group: (r, g.size)}, piece.view(local.shape))
                              for r, piece in enumerate(gathered.chunk(g.size))])
        return whole.shard(orthogonalized(full, self.o, qkv), {split.group: (g.rank, g.size)})

    def _plan(self, name: str, slots: List[MatrixSlot]) -> tuple:
        """(every rank's (lo, numel) per slot, the owner of each slot): exchanged once."""
        if name not in self._plans:
            group = slots[0].group
            ranges = comm.all_gather_object([(s.lo, s.numel) for s in slots], group)
            owners = assign_owners([math.prod(s.shape) for s in slots], group.size)
            self._plans[name] = (ranges, owners)
        return self._plans[name]

    def _over_group(self, slots: List[MatrixSlot], given, out) -> None:
        group = slots[0].group
        ranges, owners = self._plan(group.name, slots)
        me, n = group.rank, group.size
        mine = [i for i, o in enumerate(owners) if o == me]
        # 1. every piece to its owner
        pieces = [self._input(s, given) for s in slots]
        send = [pieces[i] for j in range(n) for i, o in enumerate(owners) if o == j]
        send_sizes = [sum(ranges[me][i][1] for i, o in enumerate(owners) if o == j)
                      for j in range(n)]
        recv_sizes = [sum(ranges[r][i][1] for i in mine) for r in range(n)]
        received = self._exchange(send, send_sizes, recv_sizes, group)
        # 2. each owned matrix whole, orthogonalised
        results, at = {}, 0
        flats = {i: torch.zeros(math.prod(slots[i].shape), dtype=torch.float32,
                                device=self.device) for i in mine}
        for r in range(n):
            for i in mine:
                lo, k = ranges[r][i]
                flats[i][lo:lo + k] = received[at:at + k]
                at += k
        for i in mine:
            results[i] = self._whole(slots[i], flats[i].view(slots[i].shape)).reshape(-1)
        # 3. every rank its piece of the results
        back = [results[i][ranges[r][i][0]:ranges[r][i][0] + ranges[r][i][1]]
                for r in range(n) for i in mine]
        got = self._exchange(back, recv_sizes, send_sizes, group)
        at = 0
        for j in range(n):
            for i, o in enumerate(owners):
                if o == j:
                    k = ranges[me][i][1]
                    if slots[i].tensor is not None:
                        out[id(slots[i].tensor)] = got[at:at + k]
                    at += k

    def _exchange(self, chunks, send_sizes, recv_sizes, group) -> torch.Tensor:
        send = torch.cat([c.reshape(-1) for c in chunks]) if chunks else \
            torch.zeros(0, device=self.device)
        recv = torch.empty(sum(recv_sizes), dtype=torch.float32, device=self.device)
        comm.all_to_all_single(recv, send.float(), group, output_split_sizes=recv_sizes,
                               input_split_sizes=send_sizes)
        return recv
