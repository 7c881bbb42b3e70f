"""How a full (logical) tensor maps onto tensor-parallel shards, and back.

One description, ``ParamMeta``, is shared by initialization, checkpoints and the
Hugging Face converter, so the three can never disagree about which rows a rank holds.

* ``partition_blocks``: the full tensor is ``partition_blocks`` equal blocks along
  ``partition_dim``; rank r takes the r-th piece of every block (fused SwiGLU
  ``[gate; up]`` has 2 blocks, so each rank holds ``[gate_r; up_r]``).  The fused QKV
  is laid out per query group, so plain contiguous chunks (1 block) already keep every
  group's q, k and v together on one rank.
* ``pad_multiple``: vocabulary-sized tensors are stored *unpadded* (the logical vocab)
  and padded with zero rows up to ``ceil(V / (pad_multiple * tp)) * pad_multiple * tp``
  when sharded, so the same checkpoint loads at any TP (Megatron's padding rule).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence

import torch


@dataclass
class ParamMeta:
    """Logical shape of a parameter and how it is split over tensor-parallel ranks."""
    full_shape: tuple
    tensor_model_parallel: bool = False
    partition_dim: int = 0
    partition_blocks: int = 1
    pad_multiple: Optional[int] = None  # set on vocabulary-sized tensors

    def to_dict(self) -> dict:
        d = asdict(self)
        d["full_shape"] = list(self.full_shape)
        return d

    @classmethod
    def from_dict(cls, d) -> "ParamMeta":
        if isinstance(d, ParamMeta):
            return d
        d = dict(d)
        d["full_shape"] = tuple(d["full_shape"])
        return cls(**d)

    def padded_size(self, tp_size: int) -> int:
        """Size along ``partition_dim`` of the (padded) full tensor for a TP size."""
        size = self.full_shape[self.partition_dim]
        if self.pad_multiple:
            multiple = self.pad_multiple * tp_size
            size = int(math.ceil(size / multiple) * multiple)
        return size

    def local_shape(self, tp_size: int) -> tuple:
        shape = list(self.full_shape)
        if self.tensor_model_parallel:
            size = self.padded_size(tp_size)
            if size % (tp_size * self.partition_blocks):
                raise ValueError(f"dimension {size} does not split into {self.partition_blocks} "
                                 f"blocks x {tp_size} ranks")
            shape[self.partition_dim] = size // tp_size
        return tuple(shape)


def param_meta(param: torch.Tensor) -> ParamMeta:
    """The ``ParamMeta`` recorded on a parameter by the tensor-parallel layers."""
    meta = getattr(param, "shard_meta", None)
    if meta is None:  # plain replicated parameter
        return ParamMeta(full_shape=tuple(param.shape))
    return meta


def shard_tensor(full: torch.Tensor, meta, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's piece of the logical full tensor (a new contiguous tensor)."""
    meta = ParamMeta.from_dict(meta)
    if tuple(full.shape) != tuple(meta.full_shape):
        raise ValueError(f"full tensor has shape {tuple(full.shape)}, expected {meta.full_shape}")
    if not meta.tensor_model_parallel:
        return full.clone()
    dim = meta.partition_dim
    padded = meta.padded_size(tp_size)
    if padded != full.shape[dim]:
        pad_shape = list(full.shape)
        pad_shape[dim] = padded - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    blocks = full.chunk(meta.partition_blocks, dim=dim) if meta.partition_blocks > 1 else [full]
    pieces = [b.chunk(tp_size, dim=dim)[tp_rank] for b in blocks]
    return torch.cat(pieces, dim=dim).contiguous() if len(pieces) > 1 else pieces[0].contiguous()


def unshard_tensors(shards: Sequence[torch.Tensor], meta) -> torch.Tensor:
    """Rebuild the logical full tensor from every TP rank's shard (rank order)."""
    meta = ParamMeta.from_dict(meta)
    if not meta.tensor_model_parallel:
        return shards[0].clone()
    dim, nblocks = meta.partition_dim, meta.partition_blocks
    per_rank: List[tuple] = [s.chunk(nblocks, dim=dim) for s in shards]
    full = torch.cat([per_rank[r][b] for b in range(nblocks) for r in range(len(shards))],
                     dim=dim)
    logical = meta.full_shape[dim]
    if full.shape[dim] != logical:
        full = full.narrow(dim, 0, logical)
    return full.contiguous()
