"""Tensor-parallel shorthands over ``megalite.param_spec``: shard a full tensor for one TP
rank, or rebuild it from every TP rank's shard.  The split rules themselves (``ParamSpec``:
groups, fused blocks, vocabulary padding) live in the bottom-layer ``param_spec`` module."""
from __future__ import annotations

from typing import Sequence

import torch

from megalite.param_spec import ParamSpec


def as_spec(spec) -> ParamSpec:
    """A ``ParamSpec`` from a spec or a checkpoint file's meta dict."""
    return spec if isinstance(spec, ParamSpec) else ParamSpec.from_meta_dict(spec)


def _tp_only(spec: ParamSpec) -> ParamSpec:
    if any(g != "tp" for g in spec.split_groups):
        raise ValueError(f"split over {spec.split_groups}: use ParamSpec.shard/unshard with "
                         f"the coordinates of every group")
    return spec


def shard_tensor(full: torch.Tensor, spec, tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s piece of the logical full tensor (a new tensor)."""
    return _tp_only(as_spec(spec)).shard(full, {"tp": (tp_rank, tp_size)})


def unshard_tensors(shards: Sequence[torch.Tensor], spec) -> torch.Tensor:
    """The logical full tensor from every TP rank's shard (rank order)."""
    spec = _tp_only(as_spec(spec))
    n = len(shards)
    return spec.unshard([({"tp": (r, n)}, s) for r, s in enumerate(shards)])
