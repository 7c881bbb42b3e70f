"""The peak bytes of one training step on one rank: what is live at the step's worst moment.

Why a second model next to ``memory.rank_memory``: that one adds weights + gradients +
optimizer states + activations, the classic sum that decides whether a layout fits.  A
measured peak (``training.tensor_memory_meter`` on CPU, the CUDA allocator on GPU) also holds
the step's temporaries, and for a small model these are as large as the activations.  A
step has three phases and each peaks on its own:

* backward (its start): every activation, the fresh gradient of the largest parameter before
  autograd accumulates it, plus -- ZeRO-2 -- the full-size gradient bucket being accumulated
  and reduced (and gloo's copy of it), or -- FSDP2 -- the all-gathered units (the one being
  computed, the one being prefetched, the all-gather's input and, on gloo, its output copy);
* gradient sync (activations freed): DDP without overlap flattens the gradients into one
  buffer per 40M elements (``comm.all_reduce_coalesced``); ZeRO-1 reduce-scatters its whole
  buffer into a fresh shard, and gloo copies the input;
* optimizer step: ZeRO-1/2 all-gather each buffer from a copy of the shard, gloo through an
  output-sized temporary.  AdamW's own foreach temporaries are small (measured: ~0.1 x the
  parameter bytes, below the other phases) and not modelled.

Gradients live at the peak: DDP and ZeRO-1 keep their full buffers, ZeRO-2 its shards;
FSDP2 frees them at ``zero_grad`` and re-makes them during backward, so at the start of
the last micro-batch's backward (its peak) those of the earlier micro-batches are live, as
shards.  FSDP2 under PP keeps each chunk gathered and its gradients unsharded (fp32) until
the chunk's one reduction after its last backward: the stage's parameters (compute dtype)
and gradients are live next to the in-flight activations -- unless every forward runs
before the first backward (1F1B, interleaved), when the activation peak has no gradient yet
and the first backward ends with one micro-batch fewer held.  The first ZeRO-2 step reduces
every bucket after backward (it learns the accumulation counts), so its full gradient is
live once: this models the steps after it.  gloo's copies are measured (``benchmarks/data_parallel.py``): its
reduce-scatter and all-gather allocate one temporary the size of the full tensor; NCCL
works in place.
"""
from __future__ import annotations

from typing import Dict, Optional

from megalite.config import MegaliteConfig, ModelConfig
from megalite.planner import model_spec as ms
from megalite.planner.layout import Layout, layout_from_config
from megalite.config.pipeline_schedules import get_schedule
from megalite.planner.memory import (ActivationOptions, Precision, activation_bytes,
                                     in_flight, layout_state_bytes,
                                     local_head_bytes, local_layer_parts,
                                     unfused_backward_bytes)
from megalite.config.activations import activation_of
from megalite.parallel_state import pick_device_and_backend

COALESCE_ELEMENTS = 40_000_000     # comm.all_reduce_coalesced's flat-buffer bound


def ddp_bucket_elements(cfg: MegaliteConfig, dp: int) -> int:
    """``--ddp-bucket-size`` or Megatron-Core's default, as ``grad_buckets.bucket_size``."""
    given = cfg.parallel.ddp_bucket_size
    return given if given else max(40_000_000, 1_000_000 * dp)


def largest_param(m: ModelConfig, L: Layout) -> int:
    """Elements of the largest single parameter on a rank (its fresh gradient is one tensor)."""
    h, a, g, d = m.hidden_size, m.num_attention_heads, m.resolved_query_groups(), \
        m.resolved_kv_channels()
    gate = activation_of(m).fc1_blocks
    cands = [m.padded_vocab_size(L.tp) * h // L.tp, (a + 2 * g) * d * h // L.tp,
             h * a * d // L.tp]
    if not m.num_experts or m.moe_layer_freq != 1:
        cands.append(gate * m.resolved_ffn_hidden_size() * h // L.tp)
    if m.num_experts:
        cands.append(gate * ms.moe_ffn(m) * h // L.etp)
    return max(cands)


def largest_fsdp_unit(m: ModelConfig, L: Layout, pp_rank: int) -> int:
    """Elements of the biggest FSDP2 unit: a transformer layer, the embedding or the output
    layer (``distributed.fsdp2``: one unit each)."""
    kinds = ms.stage_layer_kinds(m, L.pp, pp_rank, L.vpp, *L.stage_split)
    units = [L.kind_params(m, moe).total
             for n, moe in zip(kinds, (False, True)) if n]
    units += [ms.embedding_params(m, L.tp), L.head_params(m)]
    return max(units)


def step_peak(m: ModelConfig, L: Layout, seq: int, pp_rank: int, prec: Precision,
              opts: ActivationOptions, gloo: bool, overlap: bool,
              bucket_elements: int) -> Dict[str, object]:
    params = L.stage_params(m, pp_rank)
    d = L.dense_shards
    st = layout_state_bytes(params, L, prec)
    act = activation_bytes(m, L, seq, pp_rank, opts)
    copy = 1 if gloo else 0
    psi = max(params.dense, params.expert)          # the larger of the two DP buffers
    backward = max(act + largest_param(m, L) * prec.weight,
                   unfused_attention_backward(m, L, seq, pp_rank, opts, act))
    sync = step = gathered = 0
    grads = st["grads"]
    if L.zero == 0 and not overlap and d > 1:
        sync = min(psi, COALESCE_ELEMENTS) * prec.grad
    elif L.zero == 1 and d > 1:
        sync = -(-psi // d) * prec.grad + copy * psi * prec.grad      # fresh shard + gloo
        step = -(-psi // d) * prec.weight + copy * psi * prec.weight  # shard copy + gloo
    elif L.zero == 2:
        bucket = min(psi, bucket_elements + largest_param(m, L))      # closes at >= size
        live = bucket * prec.grad * (1 + (copy if d > 1 else 0))
        backward += live
        sync = live
        if d > 1:
            step = -(-bucket // d) * prec.weight + copy * bucket * prec.weight
    elif L.zero == 3 and L.pp > 1:
        # PP: each unit stays gathered from its first forward to the chunk's one reduction
        # (after its last backward), its gradients accumulate unsharded in the reduce dtype
        # (fp32); the reduction copies a unit's gradients into the reduce-scatter input
        # (and gloo into its own buffer) before freeing them
        unit = largest_fsdp_unit(m, L, pp_rank)
        gathered, grads = params.total * prec.weight, params.total * 4
        sync = int(unit * 4 * (1 + (copy if d > 1 else 0) + 1 / d))
        k = in_flight(L, pp_rank, opts.paired)
        if k >= L.num_micro_batches and not get_schedule(L.schedule).split_backward:
            # every forward runs before the first backward: at the activation peak no
            # gradient exists yet; after the first backward one micro-batch fewer is held
            # (zero bubble keeps the activations until each W: not so)
            backward = max(act - grads, act * (k - 1) / k) + largest_param(m, L) * prec.weight
    elif L.zero == 3:
        unit = largest_fsdp_unit(m, L, pp_rank)
        backward += int(unit * prec.weight * (2 + 1 / d + (copy if d > 1 else 0)))
        # the sharded gradients of the earlier micro-batches (none with one)
        grads = st["grads"] if L.num_micro_batches > 1 else 0
    phases = {"backward": int(backward), "grad_sync": int(sync), "optimizer_step": int(step)}
    peak_phase = max(phases, key=phases.get)
    weights, optimizer = st["weights"] + gathered, st["optimizer"]
    total = weights + grads + optimizer + phases[peak_phase]
    return {"weights": weights, "grads": grads, "optimizer": optimizer, "activations": act,
            "transient": phases[peak_phase] - (act if peak_phase == "backward" else 0),
            "total": int(total), "peak_phase": peak_phase, "phases": phases}


def unfused_attention_backward(m: ModelConfig, L: Layout, seq: int, pp_rank: int,
                               opts: ActivationOptions, act: int) -> int:
    """Live bytes when backward reaches the last layer's unfused core attention: every
    activation but that layer's part after the core (and the head's, on the last stage),
    plus the kernel's score-sized gradients.  0 for the other kernels."""
    if not opts.unfused_attention:
        return 0
    kinds = ms.stage_layer_kinds(m, L.pp, pp_rank, L.vpp, *L.stage_split)
    recompute = "none" if L.recompute == "full" else L.recompute   # the re-made layer
    after = min(local_layer_parts(m, L, seq, opts, recompute, moe)[1]
                for n, moe in zip(kinds, (False, True)) if n)
    if pp_rank == L.output_rank:
        after += local_head_bytes(m, L, seq, opts)
    return act - after + unfused_backward_bytes(m, L, seq, opts)


def predict_step_peak(cfg: MegaliteConfig, rank: int, *, gloo: Optional[bool] = None,
                      grad_bytes: int = 4) -> Dict[str, object]:
    """Predicted peak of a training step for global ``rank`` of the run ``cfg`` describes.

    ``weights`` / ``grads`` / ``optimizer`` are the bytes live at the peak (FSDP2: no
    gradient), ``activations`` the planner's activation model (megalite's local layers unless
    --transformer-impl transformer_engine), ``transient`` the peak phase's temporaries and
    ``total`` = weights + grads + optimizer + the peak phase (``phases``, ``peak_phase``).
    ``gloo``: the collectives' backend (default: the run's; gloo on CPU)."""
    device, backend = pick_device_and_backend(cfg.training.device,
                                              cfg.parallel.distributed_backend)
    if gloo is None:
        gloo = backend == "gloo"
    # start-up time: the planner imports no torch; only a run's own peak asks torch's kernels
    from megalite.transformer.attention_kernels import attention_kernel_of

    kernel = attention_kernel_of(cfg, device)
    local = cfg.model.transformer_impl != "transformer_engine"
    L = layout_from_config(cfg)
    prec = Precision.bf16(grad_bytes) if cfg.optimizer.bf16 else Precision.fp32()
    pp_rank = L.pp_rank_of(rank)
    opts = ActivationOptions(kernel == "flash", tuple(cfg.training.recompute_modules or ()),
                             1 if cfg.optimizer.bf16 else 2, local, kernel == "unfused",
                             paired=cfg.parallel.overlap_moe_expert_parallel_comm)
    return step_peak(cfg.model, L, cfg.model.seq_length, pp_rank, prec, opts, gloo,
                     cfg.parallel.overlap_grad_reduce,
                     ddp_bucket_elements(cfg, L.dp * L.cp))
