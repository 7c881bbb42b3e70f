"""This rank's GPT model chunks: one per virtual pipeline stage, built from the stage-split
rule (``megalite.pipeline_parallel.stages.layers_of_stage``), parallelized together, with the
tied word embedding made equal on the first and last stage."""
from __future__ import annotations

import torch

from megalite import comm
from megalite.models.gpt import GPTModel
from megalite.models.parallelize import parallelize_model
from megalite.pipeline_parallel.stages import layers_of_stage


def build_model_chunks(cfg, state) -> list:
    """One ``GPTModel`` per virtual stage of this rank, with tied embeddings marked.

    ``state.virtual_pipeline_rank`` is set while each chunk is built so that
    ``is_first_stage()`` / ``is_last_stage()`` give the right pre/post processing.  With
    PP > 1 the first stage's word embedding (the owner) and the last stage's output-layer
    copy are both tied in the chunks' ``param_table`` (grads summed over the 'embedding'
    group; the copy is not counted in the grad norm).  Both are initialized from the same
    parameter name; a broadcast from the first stage makes equality explicit.  The chunks
    are built bare and parallelized together (``models/parallelize.py``).
    """
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
    """Make the tied first/last-stage word embeddings start equal (the owner broadcasts);
    which parameters are tied is already in each chunk's ``param_table``."""
    shared = None
    for chunk in chunks:
        weight = chunk.shared_embedding_weight()
        if weight is not None:
            shared = weight
    group = state.groups.get("embedding")
    if shared is not None and group is not None and group.handle is not None:
        with torch.no_grad():
            comm.broadcast(shared.data, group.ranks[0], group)
