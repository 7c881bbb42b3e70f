"""GPT's parallelize step: everything that happens to a model chunk besides its structure.

``GPTModel(...)`` only builds modules (tensor-parallel layers are constructed sharded,
Megatron style) from the layer spec it is handed.  Training policy is applied here, one
pipeline chunk at a time, in torchtitan's order (``parallelize_chunk``):

1. spec choices (``spec_choices``): the backend's layer spec (``--transformer-impl``) with
   MLA's attention (``--multi-latent-attention``) and context-parallel core attention when
   CP > 1.  The one step taken *before* the
   constructor runs, because a spec decides which modules -- and which parameters -- exist
   (TE's fused norm+linear owns the norm weight);
2. RNG tracker: the rank's tensor-parallel tracker attached to every module that draws
   dropout from it (``tensor_parallel.random.DrawsFromTracker``); one tracker shared by
   all chunks of a rank, seeded per stage;
3. activation recomputation (``--recompute-*``; the decoder's and the MTP modules' layers),
   which captures that tracker;
4. ``--compile``: each transformer layer compiled in place (``backends/compile.py``);
5. initialisation: every parameter drawn as its full tensor from a generator seeded by
   (seed, canonical name), then sliced -- so the steps above cannot change it; the tied
   word embedding of the last stage made equal to the first stage's; then the training
   dtype and device;
6. with ``--use-torch-fsdp2``, ``fully_shard`` (``distributed.fsdp2.shard_chunk``) over the
   units ``fsdp_units`` names, *before* step 5: the family builds the chunk on the meta
   device, and only this rank's shards are allocated and initialised (each the same piece
   of the same name-seeded full tensor);
7. after the data-parallel strategy has allocated its gradient buffers
   (``attach_data_parallel``): its gradient hooks on the parameters and, with
   --overlap-param-gather, its forward pre-hooks on the modules.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import nn

from megalite import comm
from megalite.backends import compile as layer_compile   # a module: tests patch its compile_layers
from megalite.backends import (context_parallel_spec, get_layer_spec, layer_spec_kwargs,
                               multi_latent_attention_spec)
from megalite.config.pipeline_schedules import resolve_schedule
from megalite.tensor_parallel.random import attach_rng_tracker, model_parallel_tracker
from megalite.transformer.recompute import configure_layer_recompute, configure_recompute
from megalite.transformer.spec import LayerSpec

STAGE_SEED_OFFSET = 100   # tracker seed = seed + 100 * pp rank (Megatron's per-stage offset)


def spec_choices(cfg, state) -> LayerSpec:
    """Step 1: the layer spec every chunk of this run is built from -- the backend's
    (``--transformer-impl``, ``auto`` resolved by ``selection.resolve_backend_config``;
    unresolved here it means local), MLA's attention with --multi-latent-attention, CP core
    attention when CP > 1."""
    impl = "local" if cfg.model.transformer_impl == "auto" else cfg.model.transformer_impl
    spec = get_layer_spec(impl, **layer_spec_kwargs(impl, cfg, state))
    if cfg.model.multi_latent_attention:
        spec = multi_latent_attention_spec(spec)
    if state.cp.size > 1:
        spec = context_parallel_spec(spec, cfg.parallel.cp_comm_type)
    return spec


def stage_rng_tracker(cfg, state):
    """The tensor-parallel RNG tracker of this rank (shared by its virtual stages)."""
    return model_parallel_tracker(cfg.training.seed + STAGE_SEED_OFFSET * state.pp.rank,
                                  state.tp.rank)


def fsdp_units(chunk) -> List[nn.Module]:
    """The modules of a GPT chunk that get their own ``fully_shard``, in forward order (the
    chunk itself is the root): the embedding, each transformer layer, the output layer.
    A word embedding shared with the other end (tied output, or MTP's inputs on the last
    stage) keeps the embedding and the output layer in the root unit."""
    tied = chunk.shared_embedding_weight() is not None
    units = []
    if getattr(chunk, "embedding", None) is not None and not tied:
        units.append(chunk.embedding)
    units += list(chunk.decoder.layers.values())
    if getattr(chunk, "output_layer", None) is not None and not tied:
        units.append(chunk.output_layer)
    return units


def apply_recompute(chunk: nn.Module, cfg, tracker) -> None:
    """``--recompute-*`` on the decoder's layers and on the MTP modules' layers.  The
    tracker's states are put back for each recomputation only when the model draws dropout:
    without, there is no random number to reproduce, and a checkpoint without a
    ``context_fn`` is one torch.compile can trace (``recompute.checkpointed``)."""
    m = cfg.model
    tracker = tracker if (m.hidden_dropout or m.attention_dropout) else None
    configure_recompute(chunk.decoder, cfg.training, tracker)
    if getattr(chunk, "mtp", None) is not None:
        configure_layer_recompute([layer.transformer_layer for layer in chunk.mtp.layers],
                                  cfg.training, tracker)


def splits_backward(cfg) -> bool:
    """Whether this run's pipeline schedule splits each backward into B and W passes."""
    p = cfg.parallel
    return p.pp > 1 and resolve_schedule(
        p.pipeline_schedule, p.virtual_stages(cfg.model.num_layers)).split_backward


def is_meta(chunk: nn.Module) -> bool:
    return any(p.is_meta for p in chunk.parameters())


def tie_shared_embedding(chunk, state) -> None:
    """With PP > 1 the first stage's word embedding (the owner) and the last stage's output
    layer copy start from the same name-seeded values; the owner's broadcast over the
    'embedding' group makes the equality explicit.  Under FSDP2 each end broadcasts its
    local shard: both stages shard the weight alike (same DP x CP position, same rows)."""
    weight = chunk.shared_embedding_weight()
    group = state.groups.get("embedding")
    if state.pp.size > 1 and weight is not None and group is not None and \
            group.handle is not None:
        local = weight.to_local() if hasattr(weight, "to_local") else weight.data
        with torch.no_grad():
            comm.broadcast(local, group.ranks[0], group)


def initialize_chunk(chunk: nn.Module, cfg, state) -> None:
    """Step 5: the name-seeded values (on the local shards, when FSDP2 already sharded the
    chunk: ``copy_into_param`` keeps each rank's piece of the full tensor), then the tie."""
    chunk.initialize(cfg.training.seed)
    tie_shared_embedding(chunk, state)


def round_to(chunk: nn.Module, dtype: Optional[torch.dtype]) -> None:
    """FSDP2 keeps fp32 shards (the optimizer's masters) under --bf16/--fp16: round them
    through the training dtype, so they start from the values a DDP rank's half-precision
    parameters (and their fp32 masters) hold."""
    if dtype is None or dtype == torch.float32:
        return
    with torch.no_grad():
        for p in chunk.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p.data
            local.copy_(local.to(dtype))


def shard_then_initialize(chunk: nn.Module, cfg, state, device, dtype) -> None:
    """Step 6 under --use-torch-fsdp2, before the values: ``fully_shard`` (on the meta
    device when the chunk was built there), then allocate and initialize only this rank's
    shards -- a ZeRO-3 rank never holds its whole model."""
    # start-up time: torch's FSDP2 and DTensor cost ~0.8 s of every process's start-up
    from megalite.distributed.fsdp2 import materialize_shards, shard_chunk
    target = torch.device(device) if device is not None else \
        next(chunk.parameters()).device
    if not is_meta(chunk):
        chunk.to(device=target)
    shard_chunk(chunk, cfg, state, fsdp_units(chunk), device=target.type)
    if is_meta(chunk) and target.type != "meta":
        unset = [n for n, _, spec in chunk.param_table.named(chunk) if spec.init is None]
        assert not unset, f"parameters without an init rule cannot start on meta: {unset}"
        materialize_shards(chunk, target)
    if not is_meta(chunk):
        initialize_chunk(chunk, cfg, state)
        round_to(chunk, dtype)


def parallelize_chunk(chunk: nn.Module, cfg, state, *, rng_tracker=None, device=None,
                      dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Steps 2-6 on one pipeline chunk, in place; returns it (step 7 follows the
    strategy: ``attach_data_parallel``).

    ``rng_tracker``: the rank's tracker (``stage_rng_tracker`` when None: one chunk alone);
    ``device`` / ``dtype``: where and in what the chunk trains (unchanged when None).  A
    chunk on the meta device is left uninitialised unless FSDP2 materialises its shards on
    a real ``device``."""
    tracker = rng_tracker if rng_tracker is not None else stage_rng_tracker(cfg, state)
    attach_rng_tracker(chunk, tracker)
    apply_recompute(chunk, cfg, tracker)
    if getattr(cfg.training, "compile", False):      # --compile: each layer, in place

        layer_compile.compile_layers(chunk, retains_graph=splits_backward(cfg))
    if cfg.parallel.use_torch_fsdp2:
        shard_then_initialize(chunk, cfg, state, device, dtype)
        return chunk
    if not is_meta(chunk):
        initialize_chunk(chunk, cfg, state)
    if device is not None or dtype is not None:
        chunk.to(device=device, dtype=dtype)
    return chunk


def attach_data_parallel(chunks: Sequence[nn.Module], strategy):
    """Step 7: install the data-parallel strategy's hooks on this rank's chunks -- its
    post-accumulate-grad hooks (gradients into its buffers; with --overlap-grad-reduce, the
    bucket launches) and its forward pre-hooks (--overlap-param-gather).  The strategy
    allocates buffers; only this step changes the model.  Returns the strategy."""
    for param, hook in strategy.grad_hooks:
        param.register_post_accumulate_grad_hook(hook)
    for module, hook in strategy.forward_pre_hooks(chunks):
        module.register_forward_pre_hook(hook)
    return strategy
