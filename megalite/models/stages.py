"""This rank's GPT model chunks: one per virtual pipeline stage, built from the stage-split
rule (``megalite.pipeline_parallel.stages.layers_of_stage``) and the run's spec choices,
then parallelized one chunk at a time with the rank's one RNG tracker."""
from __future__ import annotations

from megalite.models.gpt import GPTModel
from megalite.models.parallelize import parallelize_chunk, spec_choices, stage_rng_tracker
from megalite.pipeline_parallel.stages import layers_of_stage


def build_model_chunks(cfg, state, device=None, dtype=None) -> list:
    """One ``GPTModel`` per virtual stage of this rank, built on ``device`` and parallelized
    (``models/parallelize.py``) into ``dtype`` (None: the constructor's defaults).

    ``state.virtual_pipeline_rank`` is set while each chunk is built so that
    ``is_first_stage()`` / ``is_last_stage()`` give the right pre/post processing.  With
    PP > 1 the first stage's word embedding (the owner) and the last stage's output-layer
    copy are both tied in the chunks' ``param_table`` (grads summed over the 'embedding'
    group; the copy is not counted in the grad norm); both start from the same parameter
    name's values, and the parallelize step broadcasts the owner's.
    """
    spec = spec_choices(cfg, state)
    tracker = stage_rng_tracker(cfg, state)    # one per rank, shared by its chunks
    chunks = []
    old = state.virtual_pipeline_rank
    try:
        for vr in range(state.vpp_size):
            state.virtual_pipeline_rank = vr
            chunk = GPTModel(cfg, state, pre_process=state.is_first_stage(),
                             post_process=state.is_last_stage(),
                             layer_numbers=layers_of_stage(cfg, state.pp.rank, vr), spec=spec,
                             device=device)
            chunks.append(parallelize_chunk(chunk, cfg, state, rng_tracker=tracker,
                                            device=device, dtype=dtype))
    finally:
        state.virtual_pipeline_rank = old
    return chunks
