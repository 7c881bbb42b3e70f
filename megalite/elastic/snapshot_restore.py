"""Restarting from the peer snapshots (``megalite.elastic.snapshot``) that the survivors hold.

``find_snapshot(cfg, state_rank, world, newer_than)`` -- collective: every new rank lists the
snapshot files of its own node's folder; all of them learn which (old rank, iteration) each
holder has and pick the newest iteration for which every old rank's state is held by
someone (its own file on a surviving node, or its buddy's replica), newer than the newest
disk checkpoint.  Each old rank's file is then assigned to one new rank that can read it
(ranks sharing a folder take turns), so every file is read once.

``restore_snapshot(trainer, plan)`` -- collective: reads the assigned files and restores
the trainer with ``checkpoint.restore_training_state`` (the seam a disk checkpoint uses),
filling the new layout's target chunks with ``peer_fill``: every rank's needed chunks and
every held chunk are gathered, their boxes intersected, and each region copied locally or
sent point to point by one holder (identical replicas -- DP copies of the model -- are read
from one holder, chosen deterministically, preferring the rank that needs them).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from megalite import comm
from megalite.checkpointing import checkpoint, train_state
from megalite.elastic import snapshot as snap
from megalite.parallel_state import Group


@dataclass(frozen=True)
class SnapshotPlan:
    iteration: int
    gen: str
    old_world: int
    assign: Tuple[Tuple[int, int, str], ...]   # (old rank, new rank that reads it, path)
    from_replicas: int                         # old ranks whose own node is gone

    def describe(self) -> str:
        return (f"the in-memory snapshot of iteration {self.iteration} held by the survivors "
                f"({self.from_replicas} of {self.old_world} old ranks' shards from replicas)")


def choose(held: List[Tuple[str, List[dict]]], newer_than: int) -> Optional[SnapshotPlan]:
    """The plan from every new rank's (holder identity, files it sees); pure, the same on
    every rank."""
    by_holder: Dict[str, List[int]] = {}
    files: Dict[str, List[dict]] = {}
    for rank, (ident, seen) in enumerate(held):
        by_holder.setdefault(ident, []).append(rank)
        files.setdefault(ident, seen)
    sets: Dict[Tuple[int, str, int], Dict[int, List[Tuple[str, dict]]]] = {}
    for ident, seen in files.items():
        for f in seen:
            key = (f["iteration"], f["gen"], f["world"])
            sets.setdefault(key, {}).setdefault(f["rank"], []).append((ident, f))
    for (it, gen, world) in sorted(sets, reverse=True):
        if it <= newer_than:
            break
        ranks = sets[(it, gen, world)]
        if sorted(ranks) != list(range(world)):
            continue
        assign, replicas = [], 0
        for old in range(world):
            options = sorted(ranks[old], key=lambda o: (o[1]["kind"] != "own", o[0]))
            replicas += options[0][1]["kind"] != "own"
            ident, f = options[0]
            readers = by_holder[ident]
            assign.append((old, readers[old % len(readers)], f["name"]))
        return SnapshotPlan(it, gen, world, tuple(assign), replicas)
    return None


def find_snapshot(cfg, newer_than: int) -> Optional[SnapshotPlan]:
    """Collective over the world (see the module docstring)."""
    mine = snap.list_snapshots(snap.snapshot_dir(), snap.run_fingerprint(cfg))
    held = comm.all_gather_object((snap.holder_identity(), mine), comm.world_group())
    return choose(held, newer_than)


def restore_snapshot(trainer, plan: SnapshotPlan) -> None:
    world = comm.world_group()
    rank = world.rank
    folder = snap.snapshot_dir()
    payloads = {old: snap.read_snapshot(os.path.join(folder, name))
                for old, reader, name in plan.assign if reader == rank}
    # the index of what every rank holds: key -> [(offset, shape, dtype, holder)]
    index = []
    shapes = {}
    tensors: Dict[Tuple[str, tuple, tuple], torch.Tensor] = {}
    writer_boxes = set()
    for p in payloads.values():
        for key, entry in p["tensors"].items():
            shapes[key] = (tuple(entry["shape"]), str(entry["chunks"][0][1].dtype)
                           if entry["chunks"] else None)
            for off, t in entry["chunks"]:
                box = (key, tuple(off), tuple(t.shape))
                tensors.setdefault(box, t)
                if entry["writer"]:
                    writer_boxes.add(box)
    index = [(box, str(t.dtype), box in writer_boxes) for box, t in tensors.items()]
    meta = next(iter(payloads.values()))["meta"] if payloads else None
    gathered = comm.all_gather_object((index, shapes, meta is not None), world)
    src = next(r for r, g in enumerate(gathered) if g[2])
    meta = comm.broadcast_object(meta, src, world)
    # start-up time: torch.distributed's DCP/DTensor/FSDP packages, ~0.5 s
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata
    saved = {}
    for _, sh, _ in gathered:
        for key, (shape, dtype) in sh.items():
            if dtype is not None and key not in saved:
                saved[key] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=getattr(torch, dtype.split(".")[-1])),
                    size=torch.Size(shape), chunks=[])
    holders: Dict[tuple, List[int]] = {}
    dtypes, writers = {}, set()
    for r, (idx, _, _) in enumerate(gathered):
        for box, dtype, writer in idx:
            holders.setdefault(box, []).append(r)
            dtypes[box] = dtype
            if writer:
                writers.add(box)
    fill = lambda sd: peer_fill(sd, tensors, holders, dtypes, writers, world)  # noqa: E731
    checkpoint.restore_training_state(train_state.training_state(trainer),
                                      trainer.cfg.checkpoint, meta, saved, plan.describe(), fill)


def intersect(a_off, a_shape, b_off, b_shape):
    """The global box both cover, as (offset, shape), or None."""
    lo = [max(x, y) for x, y in zip(a_off, b_off)]
    hi = [min(x + n, y + m) for x, n, y, m in zip(a_off, a_shape, b_off, b_shape)]
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return tuple(lo), tuple(h - l for l, h in zip(lo, hi))


def _region(t: torch.Tensor, t_off, off, shape) -> torch.Tensor:
    return t[tuple(slice(o - b, o - b + n) for o, b, n in zip(off, t_off, shape))]


def transfer_plan(needs: List[list], holders: Dict[tuple, List[int]], writers: set):
    """[(holder, dest, dest's target index, source box, region offset, region shape)] for
    every rank's needed chunks (``needs[dest]``: [(key, offset, shape)]), from the writers'
    boxes of each key (they tile the tensor once, as a disk checkpoint holds it), each read
    from the dest itself when it holds it, else from one holder picked by the dest's rank."""
    by_key: Dict[str, List[tuple]] = {}
    for box in sorted(writers):
        by_key.setdefault(box[0], []).append(box)
    plan = []
    for dest, wanted in enumerate(needs):
        for i, (key, t_off, t_shape) in enumerate(wanted):
            for box in by_key.get(key, ()):
                hit = intersect(t_off, t_shape, box[1], box[2])
                if hit is None:
                    continue
                who = holders[box]
                holder = dest if dest in who else who[dest % len(who)]
                plan.append((holder, dest, i, box, *hit))
    return plan


def peer_fill(sd: dict, tensors: Dict[tuple, torch.Tensor], holders: Dict[tuple, List[int]],
              dtypes: Dict[tuple, str], writers: set, world: Group) -> None:
    """Write the snapshot's values into the target chunks of ``sd`` (in place), reading
    each region from one holder: a local copy, or point-to-point messages (one per pair
    of ranks, the regions' bytes back to back).  Collective over ``world``."""
    rank = world.rank
    targets = [(key, o, t) for key, ct in sd.items() for o, t in ct.chunks]
    needs = comm.all_gather_object([(k, tuple(o), tuple(t.shape)) for k, o, t in targets],
                                   world)
    # identical boxes held by several ranks (DP copies) may be non-writers: any holder is fine
    all_holders = {}
    for box, who in holders.items():
        all_holders[box] = sorted(set(who))
    plan = transfer_plan(needs, all_holders, writers)
    sends: Dict[int, List[torch.Tensor]] = {}
    recvs: Dict[int, List[tuple]] = {}
    for holder, dest, i, box, off, shape in plan:
        if holder == rank:
            region = _region(tensors[box], box[1], off, shape)
            if dest == rank:
                key, t_off, t = targets[i]
                _region(t, t_off, off, shape).copy_(region)
            else:
                sends.setdefault(dest, []).append(region.contiguous().reshape(-1)
                                                  .view(torch.uint8))
        elif dest == rank:
            recvs.setdefault(holder, []).append((i, box, off, shape))
    send_bufs = [(torch.cat(parts), peer) for peer, parts in sorted(sends.items())]
    recv_bufs = []
    for peer, items in sorted(recvs.items()):
        n = sum(_nbytes(dtypes[box], shape) for _, box, _, shape in items)
        recv_bufs.append((torch.empty(n, dtype=torch.uint8), peer))
    if send_bufs or recv_bufs or world.size > 1:
        comm.batch_send_recv(send_bufs, recv_bufs, world)
    for (buf, peer) in recv_bufs:
        at = 0
        for i, box, off, shape in recvs[peer]:
            n = _nbytes(dtypes[box], shape)
            values = buf[at:at + n].view(_dtype(dtypes[box])).reshape(shape)
            key, t_off, t = targets[i]
            _region(t, t_off, off, shape).copy_(values)
            at += n


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.split(".")[-1])


def _nbytes(dtype: str, shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=_dtype(dtype)).element_size()
