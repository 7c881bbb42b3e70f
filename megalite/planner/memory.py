"""Bytes on one rank: model states (weights, gradients, optimizer) and activations.

Formulas and their sources are written out in docs/planner.md; the function names follow
the sections there.  Everything is exact integer arithmetic on the megalite model's shapes
except activations, which follow Korthikanti et al. 2022 term by term.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from megalite.config import MegaliteConfig, ModelConfig
from megalite.config.pipeline_schedules import get_schedule, paired_counts
from megalite.planner import model_spec as ms
from megalite.planner import linear_attention_cost as lac
from megalite.planner import muon_cost
from megalite.planner.layout import Layout, layout_from_config
from megalite.config.activations import activation_of


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model state.

    bf16 mixed precision: 2 (bf16 weight) + g (main gradient: 4 = fp32, Megatron's default;
    2 = bf16, ZeRO paper's count) + 4 (fp32 master) + 8 (Adam m, v) -> 18 or 16 bytes.
    fp32 training: 4 + 4 + 0 + 8 = 16 (the weights are the master copy).
    """
    weight: int = 2
    grad: int = 4
    master: int = 4
    adam: int = 8
    muon: bool = False      # --optimizer muon: weight matrices keep one momentum (muon_cost.py)

    @property
    def optimizer(self) -> int:
        return self.master + self.adam

    @classmethod
    def bf16(cls, grad_bytes: int = 4) -> "Precision":
        if grad_bytes not in (2, 4):
            raise ValueError("grad_bytes must be 2 (bf16) or 4 (fp32)")
        return cls(2, grad_bytes, 4, 8)

    @classmethod
    def fp32(cls) -> "Precision":
        return cls(4, 4, 0, 8)


def _shard(n: int, d: int) -> int:
    return -(-n // d)  # sharded buffers are padded to a multiple of the shard count


def state_bytes(params: ms.ParamCount, dense_shards: int, expert_shards: int, zero: int,
                prec: Precision) -> Dict[str, int]:
    """Weights / grads / optimizer bytes for ZeRO stage 0..3 (Rajbhandari et al. 2020).

    Stage 1 shards the optimizer (fp32 master + Adam) -> Megatron's "6 + 12/d" with fp32
    grads; stage 2 also the gradients; stage 3 also the weights ((2+2+12)/d with bf16 grads).
    Dense parameters shard over DP x CP, routed experts over the expert-DP group.
    """
    def part(n: int, shards: int) -> Dict[str, int]:
        # ZeRO keeps unsharded weights / grads in flat buffers padded to a multiple of d
        full = _shard(n, shards) * shards if zero >= 1 else n
        return {"weights": (_shard(n, shards) if zero >= 3 else full) * prec.weight,
                "grads": (_shard(n, shards) if zero >= 2 else full) * prec.grad,
                "optimizer": (_shard(n, shards) if zero >= 1 else n) * prec.optimizer}
    a, b = part(params.dense, dense_shards), part(params.expert, expert_shards)
    return {k: a[k] + b[k] for k in a}


def layout_state_bytes(params: ms.ParamCount, L: Layout, prec: Precision) -> Dict[str, int]:
    """``state_bytes`` over the layout's shard groups (DP x CP and expert-DP, or one instance
    of them with ``--num-distributed-optimizer-instances``), as megalite holds them: under
    FSDP2 (stage 3) the fp32 shards *are* the optimizer's masters (half precision exists
    only in the gathered compute copies), so a shard's master bytes count as weights."""
    st = state_bytes(params, L.dense_shards, L.expert_shards, L.zero, prec)
    if L.zero == 3 and prec.master:
        shard = st["weights"] // prec.weight
        st["weights"], st["optimizer"] = shard * prec.master, shard * prec.adam
    return st


# ---- activations (Korthikanti et al. 2022, generalised to GQA / SwiGLU / MoE / CP) -----

@dataclass(frozen=True)
class ActivationOptions:
    flash_attention: bool = True     # no s x s score matrix is stored (FlashAttention)
    recompute_modules: tuple = ("core_attn",)
    element_scale: int = 1           # 2 for fp32 training: every 16-bit term doubles
    # megalite's local (pure PyTorch) layers instead of Megatron / Transformer Engine's
    # fused kernels: buffer by buffer what they keep (``local_layer_bytes``).  Both save
    # only SP's sequence shard of a column-parallel input and re-gather it in backward.
    local_layers: bool = False
    # megalite's unfused core attention (``--attention-backend``): only the probabilities
    # (and with dropout the dropped copy and its mask) are kept, not SDPA math's scaled q, k
    unfused_attention: bool = False
    # the run overlaps its F&B pairs as megalite runs them (--overlap-moe-expert-parallel-
    # comm: 1F1B becomes combined 1F1B), so the schedule's paired program sets the
    # in-flight count (``in_flight``)
    paired: bool = False
    # The routed experts' output [T*k, h] is kept for backward: where the router's
    # probabilities multiply it at the unpermute (megalite's MoE, Megatron-Core before
    # "Memory efficient token permutation", Megatron-LM commit 2659630721, 2025-04-09).
    # Since then Megatron applies them in the experts' activation (experts.py,
    # bias_act_func / TE ScaledSwiGLU) and the combine takes no probabilities
    # (token_dispatcher.py, HybridEP's hybrid_ep_combine at commit d98e8a64dd), so nothing
    # of the output is saved: False.
    moe_output_kept: bool = True


def layer_activation_bytes(m: ModelConfig, L: Layout, moe: bool, seq: int,
                           opts: ActivationOptions = ActivationOptions(),
                           recompute: Optional[str] = None, linear: bool = False) -> int:
    """Bytes one transformer layer keeps for backward, per micro-batch, on one rank.

    Without parallelism, GPT (a = heads, dropout on, no flash) this is
    s*b*h*(34 + 5*a*s/h), the paper's per-layer total.  With TP t and SP every term is /t;
    TP without SP leaves the 10*s*b*h of norms, their outputs and dropout masks replicated.
    ``linear``: a Gated DeltaNet layer (its mixer: linear_attention_cost.py).
    """
    recompute = L.recompute if recompute is None else recompute
    if opts.local_layers:
        return local_layer_bytes(m, L, seq, opts, recompute, moe, linear)
    t, T = L.tp, (seq // L.cp) * L.micro_batch      # tokens on this rank
    h, a, g, d = m.hidden_size, m.num_attention_heads, m.resolved_query_groups(), \
        m.resolved_kv_channels()
    sp = t if L.sp else 1
    drop_h = 1 if m.hidden_dropout > 0 else 0
    drop_a = m.attention_dropout > 0
    if recompute == "full":
        return 2 * T * h // sp * opts.element_scale   # only the layer input is checkpointed
    modules = set(opts.recompute_modules) if recompute == "selective" else set()
    # Replicated over TP unless SP: two norm inputs, two norm outputs, two dropout masks.
    norm_in = 2 * 2 * T * h
    norm_out = 0 if "layernorm" in modules else 2 * 2 * T * h
    masks = 2 * drop_h * T * h
    rep = (norm_in + masks) // sp + norm_out // sp
    # Attention: Q, K, V kept for the core; the core's output feeds the projection.
    if m.multi_latent_attention:
        attn = mla_latent_bytes(m, T // sp, 2) + mla_core_input_bytes(
            m, T, t, 2, up_recomputed="mla_up_proj" in modules)
    else:
        attn = 2 * T * (a * d + 2 * g * d) // t + 2 * T * a * d // t
    if linear:                                     # megalite's chunked rule's buffers
        attn = lac.gated_delta_net_mixer_bytes(m, seq // L.cp, L.micro_batch, t, L.sp,
                                               2 * opts.element_scale) // opts.element_scale
    elif "core_attn" not in modules:
        kv_len = seq                               # each query sees the whole (ring) sequence
        if opts.flash_attention:
            attn += 4 * a * T // t                 # fp32 log-sum-exp per head and query
        else:
            scores = a * T * kv_len // t
            attn += 2 * scores + ((scores + 2 * scores) if drop_a else 0)
    # MLP.
    gate = activation_of(m).fc1_blocks
    if not moe:
        f = m.resolved_ffn_hidden_size()
        mlp = 0 if "mlp" in modules else (2 * gate * T * f + 2 * T * f) // t
    else:
        fe, k = ms.moe_ffn(m), m.moe_router_topk
        copies = T * k * L.etp // t                # token copies an expert rank processes
        mlp = 4 * (T // sp) * m.num_experts        # fp32 router probabilities
        mlp += (2 if opts.moe_output_kept else 1) * copies * h * 2   # permuted expert
        #                                          inputs (and outputs, ``moe_output_kept``)
        if "mlp" not in modules:
            mlp += (2 * gate * copies * fe + 2 * copies * fe) // L.etp
    return (rep + attn + mlp) * opts.element_scale


def mla_latent_bytes(m: ModelConfig, Tn: int, e: int) -> int:
    """Multi-Latent Attention's latents per micro-batch (on the ``Tn`` tokens a norm sees):
    the q and kv latents before and after their norms (the up projections' inputs) and the
    shared rope key, ``e`` bytes each."""
    n = (m.q_lora_rank or 0) + m.kv_lora_rank
    return e * Tn * (2 * n if m.qk_layernorm else n) + e * Tn * m.qk_pos_emb_head_dim


def mla_core_input_bytes(m: ModelConfig, T: int, t: int, e: int,
                         up_recomputed: bool = False) -> int:
    """MLA's expanded q, k ([heads, qk + rope]) and v ([heads, v]) kept for core attention,
    and the core output the projection keeps ([heads, v]).  ``up_recomputed``: Megatron's
    selective ``mla_up_proj`` frees q, k, v after the core's forward and rebuilds them from
    the latents in backward (``CheckpointWithoutOutput``): only the output stays."""
    a, qh, v = m.num_attention_heads, m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
    qkv = 0 if up_recomputed else e * T * a * (2 * qh + v) // t
    return qkv + e * T * a * v // t


def mtp_activation_bytes(m: ModelConfig, L: Layout, seq: int, opts: "ActivationOptions",
                         recompute: Optional[str] = None) -> int:
    """The MTP modules on the last stage, per micro-batch (transformer/mtp.py): per depth a
    layer like the model's last, the two input norms and the eh_proj input [2h] (its output
    is gathered to the full hidden size), the shifted tokens' ids and embedding, and a loss
    head like the model's (final norm, output-layer input, fp32 logits)."""
    if not m.mtp_num_layers:
        return 0
    recompute = L.recompute if recompute is None else recompute
    t, T, h = L.tp, (seq // L.cp) * L.micro_batch, m.hidden_size
    e = 2 * opts.element_scale
    Tn = T // (t if L.sp else 1)
    layer = layer_activation_bytes(m, L, ms.is_moe_layer(m, m.num_layers), seq, opts,
                                   recompute)
    norms = 2 * (_local_norm(m, Tn, e) + e * Tn * h)          # enorm, hnorm and outputs
    if opts.local_layers:
        head = local_head_bytes(m, L, seq, opts)
    else:
        head = 2 * 2 * Tn * h * opts.element_scale + 4 * T * m.padded_vocab_size(t) // t
    per_depth = layer + norms + e * Tn * 2 * h + e * T * h // t + 8 * T + head
    return m.mtp_num_layers * per_depth


def in_flight(L: Layout, pp_rank: int, paired: bool = False) -> float:
    """Micro-batches whose activations rank ``pp_rank`` holds at its peak.

    1F1B: stage i holds min(p - i, m).  ZB-H1: min(p, m) on every stage -- deferred weight
    gradients keep their inputs, up to 1F1B's stage-0 bound (Qi et al.; measured in
    docs/pipeline.md).  Interleaved: Megatron's warm-up of 2(p - i - 1) + (v - 1)p + 1
    chunks, i.e. p(1 + (p-1)/(pv)) layers-worth on stage 0.  ``paired``
    (``ActivationOptions.paired``): a schedule with a combined variant runs it, and the
    count is that program's peak (``paired_counts``: combined 1F1B min(p - i + 1, m),
    PP 1 included -- its forward of the next micro-batch beside this one's backward).
    """
    p, m, v = L.pp, L.num_micro_batches, L.vpp
    spec = get_schedule(L.schedule)
    if paired and spec.combined is not None:
        return paired_counts(L.schedule, p, m, v)[pp_rank][0]
    if p == 1:
        return 1.0
    return spec.in_flight(p, m, v, pp_rank)


def recompute_working_bytes(m: ModelConfig, L: Layout, seq: int, pp_rank: int,
                            opts: ActivationOptions = ActivationOptions()) -> int:
    """Full recomputation re-materialises one layer at a time during backward."""
    kinds = ms.stage_layer_kinds(m, L.pp, pp_rank, L.vpp, *L.stage_split)
    if L.recompute != "full" or not sum(kinds):
        return 0
    return max([layer_activation_bytes(m, L, moe, seq, opts, "none")
                for n, moe in zip(kinds, (False, True)) if n] +
               [layer_activation_bytes(m, L, moe, seq, opts, "none", linear=True)
                for moe in lac.linear_layer_counts(m, L, pp_rank)])    # DeltaNet layers


def activation_bytes(m: ModelConfig, L: Layout, seq: int, pp_rank: int,
                     opts: ActivationOptions = ActivationOptions()) -> int:
    """Peak activation bytes of one rank of pipeline stage ``pp_rank``."""
    kinds = ms.stage_layer_kinds(m, L.pp, pp_rank, L.vpp, *L.stage_split)
    per_mb = sum(n * layer_activation_bytes(m, L, moe, seq, opts)
                 for n, moe in zip(kinds, (False, True)) if n)
    for moe, n in lac.linear_layer_counts(m, L, pp_rank).items():   # DeltaNet's mixers
        per_mb += n * (layer_activation_bytes(m, L, moe, seq, opts, linear=True)
                       - layer_activation_bytes(m, L, moe, seq, opts))
    if pp_rank == L.output_rank:                    # the MTP modules (none: 0)
        per_mb += mtp_activation_bytes(m, L, seq, opts)
    total = per_mb * in_flight(L, pp_rank, opts.paired) + \
        recompute_working_bytes(m, L, seq, pp_rank, opts)
    if opts.local_layers:
        return int(total + local_stage_extra_bytes(m, L, seq, pp_rank, opts, kinds))
    T, h, t = (seq // L.cp) * L.micro_batch, m.hidden_size, L.tp
    sp = t if L.sp else 1
    if pp_rank == 0 and m.hidden_dropout > 0:     # embedding dropout mask
        total += T * h // sp * in_flight(L, pp_rank, opts.paired)
    if pp_rank == L.output_rank:                    # final norm in/out + fp32 logits for the loss
        norm_out = 2 * T * h // sp
        total += (2 * T * h // sp + norm_out) * opts.element_scale + \
            4 * T * m.padded_vocab_size(t) // t
    return int(total)


def quantized_weight_bytes(m: ModelConfig, L: Layout, pp_rank: int, weight_bytes: int,
                           operand_bytes: float, primary: bool) -> int:
    """Bytes FP8 / FP4 GEMMs add to the weights of stage ``pp_rank`` (negative: save).

    Transformer Engine keeps each weight's quantized rowwise and columnwise copies between
    micro-batches (the transpose, or MXFP8 / NVFP4's second block direction), each
    ``operand_bytes`` an element with its block scales (kernels.FP8_RECIPES: 1 tensorwise,
    1 + 1/32 MXFP8, 0.5 + 1/16 NVFP4).  ``primary``: the quantized copy *is* the weight --
    Megatron's --fp8-param-gather / --fp4-param-gather under the distributed optimizer
    (TE's quantized model init; the fp32 shard is the master): the DDP parameter buffer
    holds uint8 (megatron/core/distributed/param_and_grad_buffer.py, "param_dtype =
    torch.uint8" for FP8 / NVFP4 parameters, commit d98e8a64dd), MXFP8's all-gather
    borrows the gradient buffer (reuse_grad_buf_for_mxfp8_param_ag, same file), so the
    transformer layers' 16-bit copy is gone; the embedding and output layer (not TE
    linears) keep theirs.  ZeRO-3 holds shards of the copies."""
    params = L.stage_params(m, pp_rank).total
    copies = int(2 * operand_bytes * (params if L.zero < 3 else -(-params // L.dense_shards)))
    if not primary or L.zero >= 3:
        return copies
    kinds = ms.stage_layer_kinds(m, L.pp, pp_rank, L.vpp, *L.stage_split)
    layers = sum(n * L.kind_params(m, moe).total for n, moe in zip(kinds, (False, True)) if n)
    return copies - layers * weight_bytes


# ---- megalite's local layers, buffer by buffer ------------------------------------------

def _local_norm(m: ModelConfig, tokens: int, e: int, size: Optional[int] = None) -> int:
    """What a norm keeps besides its output: LayerNorm x, mean, rstd; megalite's RMSNorm an
    fp32 copy of x, the normalised x and an fp32 rsqrt per token (``size``: its width,
    default the hidden size)."""
    h = size or m.hidden_size
    if m.normalization == "RMSNorm":
        return 4 * tokens * h + e * tokens * h + 4 * tokens
    return e * tokens * h + 2 * e * tokens


def _qk_norm_bytes(m: ModelConfig, tokens: int, t: int, e: int) -> int:
    """--qk-layernorm over this rank's (a + g) / t heads of ``tokens`` tokens: as
    ``_local_norm`` but the input x is a view of the qkv output (already counted), so
    RMSNorm keeps the normalised x, its fp32 copy under bf16 and the rsqrt; LayerNorm mean
    and rstd."""
    if not m.qk_layernorm:
        return 0
    rows = tokens * (m.num_attention_heads + m.resolved_query_groups()) // t
    d = m.resolved_kv_channels()
    if m.normalization == "RMSNorm":
        return (4 if e == 2 else 0) * rows * d + e * rows * d + 4 * rows
    return 2 * e * rows


def local_layer_bytes(m: ModelConfig, L: Layout, seq: int, opts: ActivationOptions,
                      recompute: str, moe: bool = False, linear: bool = False) -> int:
    """One dense layer of megalite's local kernels per micro-batch (docs/planner.md, "Local
    layers"): they keep more than the fused kernels Korthikanti et al. count -- RoPE'd q
    and k are new buffers, the attention output is copied for the projection, SwiGLU keeps
    silu(gate), dropout masks are in the activation dtype.  Like Megatron's, the
    column-parallel linears save only SP's sequence shard of their input (re-gathered in
    backward).  Elements are ``e`` bytes; statistics are fp32."""
    if recompute == "full":
        e, Tn = 2 * opts.element_scale, (seq // L.cp) * L.micro_batch // (L.tp if L.sp else 1)
        return e * Tn * m.hidden_size               # the checkpointed layer input
    return sum(local_layer_parts(m, L, seq, opts, recompute, moe, linear))


def local_layer_parts(m: ModelConfig, L: Layout, seq: int, opts: ActivationOptions,
                      recompute: str, moe: bool = False, linear: bool = False
                      ) -> Tuple[int, int]:
    """``local_layer_bytes`` (without full recomputation) as (up to and with the core
    attention, after it): backward frees the second part before it reaches the core."""
    t, T = L.tp, (seq // L.cp) * L.micro_batch
    e = 2 * opts.element_scale
    h, a, g, d = m.hidden_size, m.num_attention_heads, m.resolved_query_groups(), \
        m.resolved_kv_channels()
    Tn = T // (t if L.sp else 1)                   # tokens a norm (and dropout) sees
    mods = set(opts.recompute_modules) if recompute == "selective" else set()
    rope = m.uses_rotary()
    norm = e * Tn * h if "layernorm" in mods else _local_norm(m, Tn, e)
    drop = e * Tn * h if m.hidden_dropout > 0 else 0
    if m.multi_latent_attention:
        flash = opts.flash_attention and "core_attn" not in mods
        attn = local_mla_bytes(m, T, Tn, t, e, flash, seq // L.cp)
        d = m.v_head_dim                           # the core output below is [heads, v]
        if flash:
            mods = mods | {"core_attn"}            # its buffers are counted above
    else:
        attn = e * Tn * h + e * T * (a + 2 * g) * d // t     # qkv input (SP: shard), qkv
        attn += _qk_norm_bytes(m, T, t, e)
        if rope:                                   # rotated q, k; bf16 copies of cos, sin
            attn += e * T * (a + g) * d // t + (4 * T * d if e == 2 else 0)
        elif m.qk_layernorm:
            attn += e * T * (a + g) * d // t       # normalized q, k
        elif g != a:
            attn += e * T * a * d // t             # q regrouped per head
    if "core_attn" not in mods:
        if opts.flash_attention:                   # output (shared with proj input for MHA
            shared = not rope and not m.qk_layernorm and g == a   # without RoPE or q/k
            # norm) and fp32 log-sum-exp
            attn += 4 * a * T // t + (0 if shared else e * T * a * d // t)
        elif opts.unfused_attention:               # probabilities (+ dropped copy, mask)
            per_score = e + (e + 1 if m.attention_dropout > 0 else 0)
            attn += per_score * a * T * seq // t
        else:                                      # math path: scaled q, k; probabilities
            drop_a = 2 if m.attention_dropout > 0 else 0            # (+ mask, dropped)
            attn += 2 * e * T * a * d // t + (1 + drop_a) * e * a * T * seq // t
    proj = e * T * a * d // t                      # projection input
    f = m.resolved_ffn_hidden_size()
    if "mlp" in mods:
        mlp = e * Tn * h                           # checkpointed pre-MLP-norm output
    elif moe:
        mlp = local_moe_bytes(m, L, Tn, e)
    else:                                          # fc1 input; fc1 output, (silu,) fc2 input
        mlp = e * Tn * h + activation_of(m).saved_elements * e * T * f // t
    if linear:                                     # Gated DeltaNet's mixer instead
        mixer = lac.gated_delta_net_mixer_bytes(m, seq // L.cp, L.micro_batch, t, L.sp, e)
        return norm + drop + mixer, norm + drop + mlp
    return norm + drop + attn, proj + norm + drop + mlp


def local_mla_bytes(m: ModelConfig, T: int, Tn: int, t: int, e: int, flash: bool,
                    positions: int) -> int:
    """megalite's MLA (transformer/mla.py) through core attention's inputs, per micro-batch
    (measured against ``activation_memory.measure_saved``): the down projections' input;
    each latent norm's buffers (``_local_norm``) and the up projections' inputs; the query
    and key built for core attention ([heads, qk + rope] each); then v: with SDPA's fused
    kernel a zero-padded copy as wide as q and the padded output (``DotProductAttention``),
    otherwise the kv up output, which v (a view of it) keeps whole.  ``Tn``: the tokens a
    norm sees (SP: a shard).  The kv latent is kept as a view of the kv down output (whole,
    rope key included) by the up projection without a norm, or by the norm in fp32; a
    16-bit norm keeps an fp32 copy of the latent alone."""
    a, h = m.num_attention_heads, m.hidden_size
    qr, kvr, rope = m.q_lora_rank or 0, m.kv_lora_rank, m.qk_pos_emb_head_dim
    qh = m.qk_head_dim + rope
    n = e * Tn * h                                          # down projections' input
    for r in ((qr,) if qr else ()) + (kvr,):
        n += e * Tn * r                                     # the up projection's input
        if m.qk_layernorm:
            n += _local_norm(m, Tn, e, r)
    if e == 4 or not m.qk_layernorm:    # what keeps the kv latent is a view of the kv down
        n += e * Tn * rope              # output: that keeps the rope key's columns too
    n += 2 * e * T * a * qh // t                            # query, key
    if e == 2:
        n += 4 * positions * rope                           # 16-bit copies of cos, sin
    if flash:
        n += 2 * e * T * a * qh // t + 4 * a * T // t       # padded v, padded output, LSE
    else:
        n += e * T * a * (m.qk_head_dim + m.v_head_dim) // t    # kv up output
    return n


def unfused_backward_bytes(m: ModelConfig, L: Layout, seq: int, opts: ActivationOptions) -> int:
    """Backward temporaries of megalite's unfused core attention in one layer: the gradients
    of the probabilities and of the scores, each [heads/t, tokens, seq] (measured against the
    tensor meter: tests/unit/test_attention_kernels.py), plus the probabilities themselves
    when only the core attention is recomputed (they were not counted as kept)."""
    if not opts.unfused_attention:
        return 0
    e, T = 2 * opts.element_scale, (seq // L.cp) * L.micro_batch
    recomputed = L.recompute == "selective" and "core_attn" in opts.recompute_modules
    return (3 if recomputed else 2) * e * m.num_attention_heads * T * seq // L.tp


def local_moe_bytes(m: ModelConfig, L: Layout, Tn: int, e: int) -> int:
    """megalite's MoE block (``megalite/moe``) per micro-batch with alltoall dispatch and
    uniform routing (each rank receives as many pairs as it sends): the router input, fp32
    logits / scores, int64 choices and permutations, the sorted expert input, fc1 output,
    (silu,) fc2 input, the returned expert output, and the shared expert's MLP (and gate)."""
    h, E, k = m.hidden_size, m.num_experts, m.moe_router_topk
    pairs = Tn * k
    rows = pairs * L.etp                           # expert rows after the expert-TP gather
    fe = ms.moe_ffn(m) // L.etp
    n = e * Tn * h                                 # router / dispatch input (pre-MLP norm)
    n += 4 * Tn * E + 4 * Tn * k                   # fp32 logits; softmax over the top-k
    if m.moe_router_load_balancing_type != "none" and m.moe_aux_loss_coeff:
        n += 4 * Tn * E                            # scores over all experts for the aux loss
    if m.moe_z_loss_coeff:
        n += 4 * Tn                                # logsumexp
    n += 8 * Tn * k + 2 * 8 * pairs + 2 * 8 * rows  # int64 choices, pair order and token,
    n += e * pairs                                 # sort permutation + inverse; pair weights
    saved = activation_of(m).saved_elements
    n += e * rows * h + saved * e * rows * fe      # expert input; fc1 out, act
    n += e * pairs * h                             # expert output back at this rank (x prob)
    shared = m.moe_shared_expert_intermediate_size
    if shared:                                     # its fc1 input is the router's input
        n += saved * e * (Tn * (L.tp if L.sp else 1)) * shared // L.tp
        if m.moe_shared_expert_gate:               # output x sigmoid gate keeps both factors
            n += e * Tn * h + e * Tn
    return n


def local_stage_extra_bytes(m: ModelConfig, L: Layout, seq: int, pp_rank: int,
                            opts: ActivationOptions, kinds: tuple) -> int:
    """Embedding and head of megalite's GPTModel, per in-flight micro-batch: token (and
    position) ids, TP's out-of-shard mask, dropout mask; final norm, output-layer input,
    the cross entropy's fp32 exp(logits) and per-token statistics, the loss mask."""
    t, T, h = L.tp, (seq // L.cp) * L.micro_batch, m.hidden_size
    e = 2 * opts.element_scale
    Tn = T // (t if L.sp else 1)
    rope = m.uses_rotary()
    out = 0
    if rope and e == 4 and sum(kinds):             # fp32 cos, sin of the micro-batch's positions
        out += 8 * T * m.resolved_kv_channels() * in_flight(L, pp_rank, opts.paired)
    if pp_rank == 0:
        first = 8 * T + (T if t > 1 else 0) + (0 if rope else 8 * T)
        first += e * Tn * h if m.hidden_dropout > 0 else 0
        out += first * in_flight(L, pp_rank, opts.paired)
    if pp_rank == L.output_rank:
        out += local_head_bytes(m, L, seq, opts)
    return out


def local_head_bytes(m: ModelConfig, L: Layout, seq: int, opts: ActivationOptions) -> int:
    """The last stage's head: final norm, output-layer input, the cross entropy's fp32
    exp(logits), (target logit, sum_exp), target index, mask; the loss mask."""
    t, T = L.tp, (seq // L.cp) * L.micro_batch
    e, Tn = 2 * opts.element_scale, T // (t if L.sp else 1)
    return _local_norm(m, Tn, e) + e * Tn * m.hidden_size + \
        4 * T * m.padded_vocab_size(t) // t + 21 * T


# ---- the whole rank -------------------------------------------------------------------

def rank_memory(m: ModelConfig, L: Layout, seq: int, pp_rank: int, prec: Precision,
                opts: ActivationOptions = ActivationOptions()) -> Dict[str, int]:
    params = L.stage_params(m, pp_rank)
    out = layout_state_bytes(params, L, prec)
    if prec.muon:
        out["optimizer"] -= muon_cost.optimizer_state_saving(m, L, pp_rank, prec.adam)
    if L.zero >= 3 and L.pp > 1:    # PP keeps the stage gathered, its gradients unsharded
        out["weights"] += params.total * prec.weight
        out["grads"] = params.total * prec.grad
    elif L.zero >= 3:               # two all-gathered layers in flight (prefetch)
        kinds = ms.stage_layer_kinds(m, L.pp, pp_rank, L.vpp, *L.stage_split)
        biggest = max((L.kind_params(m, moe).total
                       for n, moe in zip(kinds, (False, True)) if n), default=0)
        out["weights"] += 2 * biggest * prec.weight
    out["activations"] = activation_bytes(m, L, seq, pp_rank, opts)
    out["recompute_working"] = recompute_working_bytes(m, L, seq, pp_rank, opts)  # included
    out["params"] = params.total
    out["total"] = out["weights"] + out["grads"] + out["optimizer"] + out["activations"]
    return out


def peak_rank_memory(m: ModelConfig, L: Layout, seq: int, prec: Precision,
                     opts: ActivationOptions = ActivationOptions()) -> Dict[str, int]:
    """The most loaded pipeline stage (the one that decides whether a layout fits)."""
    # In-flight micro-batches fall with the stage index and only the first and last
    # stages differ in content, so stages 0, 1 and the last bound the peak.
    stages = sorted({0, min(1, L.pp - 1), L.pp - 1})
    best = None
    for r in stages:
        cur = rank_memory(m, L, seq, r, prec, opts)
        if best is None or cur["total"] > best["total"]:
            best = dict(cur, pp_rank=r)
    return best


def predict_rank_memory(cfg: MegaliteConfig, rank: int, *, grad_bytes: int = 4,
                        zero: Optional[int] = None, flash_attention: bool = True,
                        local_layers: Optional[bool] = None,
                        attention_kernel: Optional[str] = None) -> Dict[str, int]:
    """Predicted bytes for global ``rank`` of a run described by ``cfg``.

    Returns ``weights`` / ``grads`` / ``optimizer`` (exact for the parameter count: these are
    numel x bytes of the tensors the rank owns), ``activations`` (Korthikanti's model) and
    ``total``.  ``zero`` overrides the sharding stage (default: 1 with
    --use-distributed-optimizer, else 0); ``grad_bytes`` is the main-grad dtype size;
    ``local_layers`` (default: unless --transformer-impl transformer_engine) models megalite's
    local layers buffer by buffer (``local_layer_bytes``); ``attention_kernel`` (from
    ``transformer.attention_kernels.attention_kernel_of``) overrides ``flash_attention``.
    """
    if attention_kernel is not None:
        flash_attention = attention_kernel == "flash"
    if local_layers is None:
        local_layers = cfg.model.transformer_impl != "transformer_engine"
    L = layout_from_config(cfg, zero)
    half = cfg.optimizer.bf16 or cfg.optimizer.fp16        # fp16: the same bytes as bf16
    prec = Precision.bf16(grad_bytes) if half else Precision.fp32()
    prec = dataclasses.replace(prec, muon=cfg.optimizer.optimizer == "muon")
    pp_rank = L.pp_rank_of(rank)
    opts = ActivationOptions(flash_attention, tuple(cfg.training.recompute_modules or ()),
                             1 if half else 2, local_layers, attention_kernel == "unfused",
                             paired=cfg.parallel.overlap_moe_expert_parallel_comm)
    return rank_memory(cfg.model, L, cfg.model.seq_length, pp_rank, prec, opts)
