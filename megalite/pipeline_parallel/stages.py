"""Which layers each pipeline stage holds, and building this rank's model chunks.

Without virtual stages rank r holds one contiguous block; ``--decoder-first/last-
pipeline-num-layers`` pin the first/last block sizes and the rest is split evenly.
With v virtual stages the layers form p*v equal blocks and chunk c of rank r holds block
c*p + r (Megatron's interleaving), so a micro-batch visits every rank v times.

``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``
(Megatron) count the embedding / the loss as one more layer: the L' = L (+1) (+1) slots
are split into p*v equal blocks as above, the embedding takes the first slot of block 0
(rank 0, chunk 0) and the loss the last slot of block p*v-1 (last rank, last chunk), so
those two chunks hold one transformer layer fewer.
"""
from __future__ import annotations

from typing import List

import torch

from megalite import comm


def stage_layer_counts(cfg) -> List[int]:
    """Layers per pipeline rank (all its virtual stages together)."""
    m, p = cfg.model, cfg.parallel
    if p.pipeline_slots(m.num_layers) != m.num_layers or p.virtual_stages(m.num_layers) > 1:
        v = p.virtual_stages(m.num_layers)
        return [sum(len(layers_of_stage(cfg, r, c)) for c in range(v)) for r in range(p.pp)]
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    if first is None and last is None:
        if m.num_layers % p.pp:
            raise ValueError(f"--num-layers ({m.num_layers}) is not divisible by PP ({p.pp})")
        return [m.num_layers // p.pp] * p.pp
    fixed = {0: first, p.pp - 1: last}
    fixed = {r: n for r, n in fixed.items() if n is not None}
    rest = m.num_layers - sum(fixed.values())
    middle = p.pp - len(fixed)
    if rest < 0 or (middle == 0 and rest) or (middle and rest % middle):
        raise ValueError(f"{m.num_layers} layers do not split as first={first} last={last} "
                         f"over {p.pp} stages")
    return [fixed.get(r, rest // middle if middle else 0) for r in range(p.pp)]


def layers_of_stage(cfg, pp_rank: int, vpp_rank: int = 0) -> List[int]:
    """Global layer numbers held by chunk ``vpp_rank`` of pipeline rank ``pp_rank``."""
    m, p = cfg.model, cfg.parallel
    v = p.virtual_stages(m.num_layers)
    if not 0 <= pp_rank < p.pp or not 0 <= vpp_rank < v:
        raise ValueError(f"stage ({pp_rank}, {vpp_rank}) outside PP={p.pp} x VPP={v}")
    slots = p.pipeline_slots(m.num_layers)
    if slots != m.num_layers:                 # embedding and/or loss count as layers
        if slots % (p.pp * v):
            raise ValueError(f"{slots} pipeline layers (--num-layers {m.num_layers} + embedding"
                             f"/loss) are not divisible by PP x VPP ({p.pp} x {v})")
        per = slots // (p.pp * v)
        block = vpp_rank * p.pp + pp_rank
        shift = int(p.account_for_embedding_in_pipeline_split)   # slot 0 is the embedding
        start, stop = block * per - shift, (block + 1) * per - shift
        return list(range(max(0, start), min(m.num_layers, stop)))
    if v > 1:
        if m.num_layers % (p.pp * v):
            raise ValueError(f"--num-layers ({m.num_layers}) is not divisible by PP x VPP "
                             f"({p.pp} x {v})")
        per = m.num_layers // (p.pp * v)
        block = vpp_rank * p.pp + pp_rank
        return list(range(block * per, (block + 1) * per))
    counts = stage_layer_counts(cfg)
    start = sum(counts[:pp_rank])
    return list(range(start, start + counts[pp_rank]))


def build_model_chunks(cfg, state) -> list:
    """One ``GPTModel`` per virtual stage of this rank, with tied embeddings marked.

    ``state.virtual_pipeline_rank`` is set while each chunk is built so that
    ``is_first_stage()`` / ``is_last_stage()`` give the right pre/post processing.  With
    PP > 1 the first stage's word embedding and the last stage's output-layer copy are
    both ``shared_embedding`` (grads summed over the 'embedding' group); the copy is also
    ``is_embedding_copy`` (counted once in the grad norm).  Both are initialized from the
    same parameter name; a broadcast from the first stage makes equality explicit.  The
    chunks are built bare and parallelized together (``models/parallelize.py``).
    """
    from megalite.models.gpt import GPTModel
    from megalite.models.parallelize import parallelize_model

    v = state.vpp_size
    chunks = []
    old = state.virtual_pipeline_rank
    try:
        for vr in range(v):
            state.virtual_pipeline_rank = vr
            chunks.append(GPTModel(cfg, state, pre_process=state.is_first_stage(),
                                   post_process=state.is_last_stage(),
                                   layer_numbers=layers_of_stage(cfg, state.pp.rank, vr),
                                   init=False))
    finally:
        state.virtual_pipeline_rank = old
    # One RNG tracker per rank, shared by its chunks (seed offset per stage, as Megatron).
    parallelize_model(chunks, cfg, state)
    if state.pp.size > 1:
        mark_shared_embeddings(chunks, state)
    return chunks


def mark_shared_embeddings(chunks, state) -> None:
    """Mark the tied first/last-stage word embeddings and make the copy start equal."""
    shared = None
    for chunk in chunks:
        weight = chunk.shared_embedding_weight()
        if weight is None:
            continue
        weight.shared_embedding = True
        if not chunk.pre_process:
            weight.is_embedding_copy = True
        shared = weight
    group = state.groups.get("embedding")
    if shared is not None and group is not None and group.handle is not None:
        with torch.no_grad():
            comm.broadcast(shared.data, group.ranks[0], group)
