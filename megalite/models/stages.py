"""This rank's GPT model chunks: one per virtual pipeline stage, placed by the stage-split
rule (``megalite.pipeline_parallel.stages.layers_of_stage``) and built by the one builder
(``models.gpt.build_chunk``) with the rank's one RNG tracker."""
from __future__ import annotations

from megalite.models.gpt import build_chunk
from megalite.models.parallelize import stage_rng_tracker
from megalite.optimizer.optimizer import model_dtype
from megalite.pipeline_parallel.stages import layers_of_stage


def build_model_chunks(cfg, state, device=None, dtype=None) -> list:
    """One chunk per virtual stage of this rank, built on ``device`` and parallelized
    (``models/parallelize.py``) into ``dtype`` (None: the run's training dtype, bf16 / fp16
    / fp32) -- GPT's ``ModelFamily.build_model_chunks``.

    ``state.virtual_pipeline_rank`` is set while each chunk is built so that
    ``is_first_stage()`` / ``is_last_stage()`` give the right pre/post processing.  With
    PP > 1 the first stage's word embedding (the owner) and the last stage's output-layer
    copy are both tied in the chunks' ``param_table`` (grads summed over the 'embedding'
    group; the copy is not counted in the grad norm); both start from the same parameter
    name's values, and the parallelize step broadcasts the owner's.  In DualPipeV's V both
    ends are chunks of pp rank 0: its output layer reads chunk 0's embedding (one parameter).
    """
    dtype = dtype or model_dtype(cfg.optimizer)
    tracker = stage_rng_tracker(cfg, state)    # one per rank, shared by its chunks
    chunks = []
    old = state.virtual_pipeline_rank
    try:
        for vr in range(state.vpp_size):
            state.virtual_pipeline_rank = vr
            last = state.is_last_stage()
            same_rank = last and chunks and chunks[0].pre_process   # the V's two ends
            chunks.append(build_chunk(cfg, state, state.is_first_stage(), last,
                                      layers_of_stage(cfg, state.pp.rank, vr),
                                      rng_tracker=tracker, device=device, dtype=dtype,
                                      embedding_of=chunks[0] if same_rank else None))
    finally:
        state.virtual_pipeline_rank = old
    return chunks
