"""Copies of one parameter on several ranks: keep them bit-identical, and prove it.

Why: a replica that differs by one ulp is a silent bug -- the checkpoint and the Hugging Face
export describe one copy while the model computes with two.  Equality of independently
updated copies rests on identical floating-point paths, and those are not guaranteed: a
vectorised kernel and its scalar tail round differently, so the same AdamW update applied at
another offset of a flat buffer (the distributed optimizer's layout differs per pipeline
stage) can give another last bit.  So:

* the tied word embedding (first and last pipeline stage) has one owner, the first stage.
  After every optimizer step the owner broadcasts its updated copy over the 'embedding'
  group (``broadcast_tied_embeddings``): equality by construction, on any CPU or GPU, at the
  price of one V/t x h broadcast per iteration (counted by ``comm`` as
  ``embedding/broadcast``);
* copies that *are* equal by construction -- TP-replicated parameters (norms, row-parallel
  biases: same all-reduced gradient, same buffer layout on every TP rank) and data-parallel
  replicas (same reduced gradient, same layout; the distributed optimizer all-gathers them)
  -- are checked, not re-broadcast: ``check_replicas`` compares an exact integer checksum of
  every replicated tensor over its group and raises naming the parameter and the ranks.  It
  runs at every checkpoint save, so drift can never be written to disk unnoticed.
"""
from __future__ import annotations

from typing import Iterable, List, Tuple

import torch
from megalite.torch_classes import is_dtensor

from megalite import comm
from megalite.distributed.grad_sync import dp_group_name, is_tied_embedding
from megalite.param_spec import named_specs, param_table


def tied_embedding_params(params: Iterable[torch.nn.Parameter],
                          specs) -> List[torch.nn.Parameter]:
    """The params whose ``ParamSpec`` (``specs``, same order) marks them tied."""
    return [p for p, spec in zip(params, specs) if is_tied_embedding(spec)]


def broadcast_tied_embeddings(params: Iterable[torch.nn.Parameter], state, specs) -> None:
    """Overwrite the last stage's copy of the tied embedding with the first stage's (the
    owner's).  Called after the optimizer step; a no-op without PP or tied embeddings."""
    if state.pp.size == 1 or "embedding" not in state.groups:
        return
    group = state["embedding"]
    tied = tied_embedding_params(params, specs)
    if group.size == 1 or not tied:
        return
    with torch.no_grad():
        for p in tied:      # FSDP2: both stages hold the same rows (same DP x CP position)
            local = p.to_local() if is_dtensor(p) else p.data
            comm.broadcast(local, src=group.ranks[0], group=group)


def checksum(tensor: torch.Tensor) -> Tuple[int, int]:
    """An exact fingerprint of the bits of ``tensor``: two position-weighted integer sums of
    its raw words (one ulp anywhere changes it; unlike a float sum it has no rounding)."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype in (torch.float64, torch.int64):
        words = flat.view(torch.int64)
    elif flat.element_size() == 4:
        words = flat.view(torch.int32).to(torch.int64)
    elif flat.element_size() == 2:
        words = flat.view(torch.int16).to(torch.int64)
    else:
        words = flat.to(torch.int64)
    words = words.cpu()
    weights = torch.arange(1, words.numel() + 1, dtype=torch.int64) % 65521 + 1
    return int(words.sum()), int((words * weights).sum())


def _replica_groups(model_chunks, state) -> List[Tuple[str, str, torch.Tensor]]:
    """(group, name, tensor) for every tensor that must be identical over ``group``."""
    out, tied = [], []
    for i, chunk in enumerate(model_chunks):
        table = param_table(chunk)
        for fqn, p, spec in named_specs(chunk):
            name = table.canonical(fqn)
            if is_dtensor(p):   # FSDP2: DP ranks hold different shards, TP ranks
                p = p.to_local()         # the same shard of their (replicated) tensor
            else:
                out.append((dp_group_name(spec), f"{i}:{name}", p))
            for group in ("tp", "expert-tp"):   # replicated over the model-parallel dim
                if group in spec.replica_groups():
                    out.append((group, f"{i}:{name}", p))
            if is_tied_embedding(spec):
                tied.append(p)
    if state.pp.size > 1 and "embedding" in state.groups:
        for p in tied:
            out.append(("embedding", "embedding.word_embeddings.weight", p))
    return out


def check_replicas(model_chunks, state) -> None:
    """Raise ``RuntimeError`` if any replicated parameter differs, bit for bit, between the
    ranks that hold a copy: tied embedding over 'embedding', replicated params over 'tp',
    every param over its data-parallel group.  One all-gather of a few integers per group."""
    entries = _replica_groups(model_chunks, state)
    by_group = {}
    for group, name, p in entries:
        by_group.setdefault(group, []).append((name, checksum(p)))
    problems = []       # raise only after every group's collective: no rank is left waiting
    for group_name in sorted(by_group):
        group = state.groups.get(group_name)
        if group is None or group.size == 1:
            continue
        mine = by_group[group_name]
        everyone = comm.all_gather_object(mine, group)
        for r, theirs in enumerate(everyone):
            if [n for n, _ in theirs] != [n for n, _ in mine]:
                problems.append(f"ranks {group.ranks} of group '{group_name}' hold different "
                                f"parameter lists")
                continue
            problems += [f"'{name}' differs between rank {state.rank} and rank {group.ranks[r]} "
                         f"of group '{group_name}'"
                         for (name, a), (_, b) in zip(mine, theirs) if a != b]
    if problems:
        raise RuntimeError(f"replica check: {problems[0]} ({len(problems)} mismatch(es)); copies "
                           f"that must be bit-identical have drifted apart, so a checkpoint "
                           f"would describe only one of them")
