"""Sharded state dicts: every tensor of model and optimizer state as its global shape plus
this rank's chunks at global offsets, and whether this rank writes them.

Why: a checkpoint writer (DCP next) and a resharding loader only need, per tensor, the
logical shape and which rectangle of it each rank holds.  The rectangles come from the
parameter specs (``megalite.param_spec``: which groups split which dims, fused blocks,
vocabulary padding clipped off) and, for the distributed optimizer's state, from each
``ShardedBuffer.shard_ranges()``: a DP rank owns a flat range of a parameter, which is cut
into rectangles (``flat_range_boxes``).

Writers: a chunk held identically by several ranks is written once, by the first of them
(``param_spec.writes_chunk``: index 0 of every group that replicates it; the tied copy
never).  So expert chunks, replicated over expert-DP rather than DP, are written by
expert-DP rank 0 wherever that rank sits in the dense grid -- nothing is lost, nothing is
written twice.  ``assemble`` checks exactly that: every element written exactly once.

Keys: ``model.<canonical name>``, ``optimizer.<state>.<canonical name>`` (``exp_avg``,
``exp_avg_sq``, ``momentum_buffer``, and ``master`` for the fp32 copies of bf16 params),
``optimizer.step``.  How each optimizer lays out its state is the optimizer's own
(``MasterWeightOptimizer.sharded_state``); this module keeps the chunk geometry both use
and ``ModelState``, the model's Stateful part of the training state
(``checkpointing/train_state.py``).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megalite.state_format.dcp_format import ChunkedTensor
from megalite.param_spec import ParamSpec, group_coords, param_table, writes_chunk
from megalite.parallel_state import HYBRID_GROUPS


@dataclass
class ShardedTensor:
    global_shape: Tuple[int, ...]
    chunks: List[Tuple[Tuple[int, ...], torch.Tensor]]   # (global offsets, local tensor)
    writer: bool                                         # this rank writes its chunks


def _spec_chunks(spec: ParamSpec, local: torch.Tensor, coords, at=None) -> list:
    """``(global offsets, tensor)`` of each spec chunk inside ``local``, which holds the
    region starting at ``at`` of this rank's (TP-)local tensor (default: all of it)."""
    if at is None:
        return [(c.offsets, local[c.local_slices()]) for c in spec.chunks(coords)]
    out = []
    for c in spec.chunks(coords):
        lo = [max(a, l) for a, l in zip(at, c.local_offsets)]
        hi = [min(a + n, l + s) for a, n, l, s in zip(at, local.shape, c.local_offsets, c.sizes)]
        if all(a < b for a, b in zip(lo, hi)):
            out.append((tuple(o + a - l for o, a, l in zip(c.offsets, lo, c.local_offsets)),
                        local[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, at))]))
    return out


def fsdp_piece(p: torch.Tensor, state):
    """(local tensor, its offsets in the TP-local tensor, DP groups it is sharded over) of
    an FSDP2 DTensor parameter (``__create_chunk_list__``: DCP's protocol); a plain
    parameter is all of its local tensor.  An HSDP mesh (replicate x shard) spans the whole
    data-parallel group: its pieces repeat across instances (``first_fsdp_replica``)."""
    if not (hasattr(p, "__create_chunk_list__") and hasattr(p, "device_mesh")):
        return p.detach(), None, ()
    (meta,) = p.__create_chunk_list__()
    ranks = sorted(p.device_mesh.mesh.flatten().tolist())
    groups = tuple(n for n, g in state.groups.items() if sorted(g.ranks) == ranks)
    if not groups:
        raise ValueError(f"DTensor mesh over ranks {ranks} is none of this rank's groups")
    return p.to_local().detach(), tuple(meta.offsets), groups


def first_fsdp_replica(p: torch.Tensor) -> bool:
    """False on the HSDP instances but the first, whose piece of ``p`` repeats another's
    (a mesh dimension with a ``Replicate`` placement, at a coordinate other than 0)."""
    if not hasattr(p, "device_mesh"):
        return True
    coordinate = p.device_mesh.get_coordinate() or ()
    return all(c == 0 for c, placement in zip(coordinate, p.placements)
               if placement.is_replicate())


def buffer_writer(spec: ParamSpec, coords, group_name: str) -> bool:
    """The owner rule for a distributed optimizer's flat range sharded over ``group_name``:
    its data-parallel group, or with instances ("dp-cp-shard", ...) the first instance."""
    base, part = HYBRID_GROUPS.get(group_name, (group_name, None))
    first_instance = part is None or coords[f"{base}-replicate"][0] == 0
    return first_instance and writes_chunk(spec, coords, sharded_over=(base,))


def model_sharded_state_dict(model_chunks, state) -> Dict[str, ShardedTensor]:
    """``model.<canonical name>`` -> this rank's chunks of every parameter (of its FSDP2
    shard when the parameter is a DTensor)."""
    coords = group_coords(state)
    out = {}
    for chunk in _as_list(model_chunks):
        for name, p, spec in param_table(chunk).named(chunk):
            local, at, fsdp_groups = fsdp_piece(p, state)
            out[f"model.{name}"] = ShardedTensor(
                spec.full_shape, _spec_chunks(spec, local, coords, at),
                param_writer(p, spec, coords, fsdp_groups))
    return out


def param_writer(p: torch.Tensor, spec: ParamSpec, coords, fsdp_groups=()) -> bool:
    """Whether this rank writes its chunks of ``p`` (or of a state tensor placed as ``p``
    is): the first rank of every group that replicates them, and of an HSDP mesh the
    first instance only.  The one rule for weights and the plain optimizer's state."""
    return writes_chunk(spec, coords, fsdp_groups) and first_fsdp_replica(p)


def param_index(model_chunks) -> Dict[int, Tuple[str, ParamSpec]]:
    """id(parameter) -> (canonical name, spec) over this rank's chunks: how the optimizer
    names and cuts the state it keeps per parameter."""
    return {id(p): (name, spec) for chunk in _as_list(model_chunks)
            for name, p, spec in param_table(chunk).named(chunk)}


class ModelState:
    """DCP ``Stateful``: the weights of this rank's model chunks, ``<canonical name>`` ->
    global shape + this rank's chunks.  The chunks are views of the parameters, so a loader
    fills them in place; ``on_load`` then runs (the strategy refreshes the fp32 masters
    that mirror the weights, whether or not optimizer state is loaded too)."""

    def __init__(self, model_chunks, state, on_load: Optional[Callable[[], None]] = None):
        self.model_chunks, self.state, self.on_load = model_chunks, state, on_load

    def state_dict(self) -> Dict[str, ChunkedTensor]:
        return {k[len("model."):]: ChunkedTensor(v.global_shape, v.chunks, v.writer)
                for k, v in model_sharded_state_dict(self.model_chunks, self.state).items()}

    def load_targets(self, saved=None, values=None) -> Dict[str, ChunkedTensor]:
        """The tensors a load fills: the parameters themselves (every one is required)."""
        return self.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        with torch.no_grad():
            fill_from(self.state_dict(), sd)
        if self.on_load is not None:
            self.on_load()


def fill_from(targets: Dict[str, ChunkedTensor], source: dict) -> None:
    """Copy ``source``'s values into the chunks of ``targets`` (a part's own tensors), so a
    ``load_state_dict`` takes either the targets a loader filled in place (nothing to copy)
    or another state dict of the same layout (chunk for chunk) or full tensors."""
    for key, target in targets.items():
        if key not in source:
            raise KeyError(f"state dict lacks '{key}'")
        src = source[key]
        for offsets, t in target.chunks:
            if isinstance(src, torch.Tensor):
                t.copy_(src[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))])
                continue
            piece = next((c for o, c in src.chunks if tuple(o) == tuple(offsets)
                          and c.shape == t.shape), None)
            if piece is None:
                raise ValueError(f"'{key}': no chunk at {tuple(offsets)} of shape "
                                 f"{tuple(t.shape)} (another layout: load it through DCP)")
            if not _same_memory(piece, t):
                t.copy_(piece)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.dtype == b.dtype


def optimizer_sharded_state_dict(optimizer, model_chunks, state) -> Dict[str, ShardedTensor]:
    """``optimizer.<state>.<name>`` -> this rank's chunks of every optimizer state tensor,
    and ``optimizer.step`` (rank 0 writes it); the layouts live with their optimizers
    (``MasterWeightOptimizer.sharded_state``)."""
    tensors, step = optimizer.sharded_state(param_index(model_chunks), state)
    out: Dict[str, ShardedTensor] = {f"optimizer.{k}": v for k, v in tensors.items()}
    if step is not None:
        out["optimizer.step"] = ShardedTensor((), [((), torch.tensor(step))], state.rank == 0)
    return out


def assemble(rank_dicts: Sequence[Dict[str, ShardedTensor]]) -> Dict[str, torch.Tensor]:
    """Full tensors from every rank's sharded state dict, using the writers' chunks only;
    raises if an element is written twice or by nobody (a broken owner rule)."""
    full: Dict[str, torch.Tensor] = {}
    count: Dict[str, torch.Tensor] = {}
    for sd in rank_dicts:
        for key, st in sd.items():
            if key not in full:
                like = st.chunks[0][1] if st.chunks else torch.zeros(())
                full[key] = torch.zeros(st.global_shape, dtype=like.dtype)
                count[key] = torch.zeros(st.global_shape, dtype=torch.int32)
            if not st.writer:
                continue
            for offsets, local in st.chunks:
                where = tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))
                full[key][where] = local
                count[key][where] += 1
    for key, c in count.items():
        if c.numel() and not bool((c == 1).all()):
            raise ValueError(f"'{key}': {int((c == 0).sum())} element(s) written by no rank, "
                             f"{int((c > 1).sum())} by several")
    return full


def flat_range_boxes(shape: Tuple[int, ...], lo: int, hi: int
                     ) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """``[lo, hi)`` of a row-major tensor of ``shape`` as rectangles ``(offsets, sizes)``,
    each a contiguous run of the flat range: a partial leading row, whole rows, a partial
    trailing row (recursively for the inner dims)."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    inner = 1
    for s in shape[1:]:
        inner *= s
    first_full, last_full = -(-lo // inner), hi // inner
    if first_full > last_full:                      # inside one row
        r = lo // inner
        return [((r, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], lo - r * inner,
                                                                 hi - r * inner)]
    out = []
    if lo < first_full * inner:
        r = lo // inner
        out += [((r, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], lo - r * inner, inner)]
    if first_full < last_full:
        out.append(((first_full, *[0] * (len(shape) - 1)), (last_full - first_full, *shape[1:])))
    if hi > last_full * inner:
        out += [((last_full, *o), (1, *s))
                for o, s in flat_range_boxes(shape[1:], 0, hi - last_full * inner)]
    return out


def flat_chunks(spec: ParamSpec, coords, local_shape, p_lo: int, flat: torch.Tensor) -> list:
    """Chunks of the flat range ``[p_lo, p_lo + len(flat))`` of a local tensor, in global
    coordinates: each rectangle of the range intersected with each spec chunk."""
    numel = 1
    for s in local_shape:
        numel *= s
    index = torch.arange(numel).view(local_shape)
    out = []
    for box_off, box_size in flat_range_boxes(local_shape, p_lo, p_lo + flat.numel()):
        for c in spec.chunks(coords):
            lo = [max(b, l) for b, l in zip(box_off, c.local_offsets)]
            hi = [min(b + s, l + n) for b, s, l, n in zip(box_off, box_size, c.local_offsets,
                                                          c.sizes)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            where = tuple(slice(a, b) for a, b in zip(lo, hi))
            idx = index[where].reshape(-1) - p_lo
            glob = tuple(o + a - l for o, a, l in zip(c.offsets, lo, c.local_offsets))
            out.append((glob, flat[idx].view([b - a for a, b in zip(lo, hi)])))
    return out


def _as_list(model_chunks) -> list:
    return [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)


def spec_chunks(spec: ParamSpec, local: torch.Tensor, coords, at=None) -> list:
    """``(global offsets, view of local)`` of each chunk of a TP-local tensor shaped like the
    parameter, or of its FSDP2 piece starting at ``at`` (views: a loader copies into them)."""
    return _spec_chunks(spec, local, coords, at)


def layout_chunks(spec: ParamSpec, full: torch.Tensor, sizes) -> list:
    """``(global offsets, piece of full)`` of every distinct chunk the ranks of a layout
    (``sizes``: {group: size}, e.g. tp, ep, expert-tp) hold of a full tensor: the pieces a run
    at that layout would write, so a load at that layout reads exactly its own pieces."""
    groups = list(spec.split_groups)
    missing = [g for g in groups if g not in sizes]
    if missing:
        raise ValueError(f"no size given for the group(s) {missing} that split {spec.full_shape}")
    seen: Dict[tuple, torch.Tensor] = {}
    for ranks in itertools.product(*(range(sizes[g]) for g in groups)):
        coords = {g: (r, sizes[g]) for g, r in zip(groups, ranks)}
        for c in spec.chunks(coords):
            seen.setdefault(c.offsets, full[c.global_slices()])
    return list(seen.items())
