"""How long one micro-batch's compute takes on one rank: each GEMM at the GPU's measured
matmul ceiling (bf16 or FP8), core attention at its kernel's measured rate, and the
memory-bound work (norms, activations, FP8 casts) at HBM speed.

Every rate here is a *measured kernel figure* (hardware.py's MAMF table, the attention
table below) or a count; the one end-to-end constant -- the fraction of those ceilings a
whole training step sustains -- is ``hardware.Efficiency.compute``, calibrated on the rows
``planner/calibration.py`` names.  What the terms are and where they come from:
docs/planner.md, "Compute".
"""
from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

from megalite.config import ModelConfig
from megalite.planner import calibration
from megalite.planner import flops as fl
from megalite.planner import memory as mem
from megalite.planner import model_spec as ms
from megalite.planner.hardware import MAMF_BF16_TFLOPS, Cluster
from megalite.planner.layout import Layout
from megalite.config.activations import activation_of

# Core attention, TFLOP/s on the FLOPs the kernel does (a causal mask halves the score
# work and the count), bf16, H100 SXM5: Shah et al. 2024 (FlashAttention-3), Fig. 5
# (forward, causal) and Fig. 6 (backward), by sequence length, at head dim 128 and 64
# (the paper's backward figures stop at 128; a wider head is priced at 128's rate, which
# the forward figure at 256 keeps within 7%).  "cudnn" is Transformer Engine's fused
# attention (Megatron / NeMo on Hopper), "fa2" FlashAttention-2 (PyTorch SDPA's flash
# backend in 2024), "fa3" FlashAttention-3.  A 64-wide head does half the MMA work per
# score the softmax pays for, so it keeps 70-85% of 128's rate at 4K.  Other GPUs scale by
# their matmul ceiling over H100's (an assumption: the same tensor cores do the work).
ATTENTION_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
ATTENTION_HEAD_DIMS = (64, 128)
ATTENTION_TFLOPS = {
    "fa2": {128: ((191, 260, 298, 319, 333, 335), (214, 260, 291, 310, 318, 322)),
            64: ((180, 229, 262, 284, 295, 299), (198, 238, 264, 279, 287, 291))},
    "cudnn": {128: ((315, 410, 484, 518, 529, 539), (305, 408, 465, 499, 518, 516)),
              64: ((225, 288, 334, 363, 379, 388), (266, 348, 395, 417, 432, 433))},
    "fa3": {128: ((292, 423, 521, 579, 602, 616), (316, 424, 501, 542, 559, 561)),
            64: ((197, 265, 371, 420, 460, 473), (272, 363, 422, 453, 472, 474))},
}
ATTENTION_KERNELS = tuple(ATTENTION_TFLOPS) + ("unfused",)
# FlashAttention's backward recomputes the scores and makes dV, dP, dQ, dK: 5 matmuls to
# the forward's 2.  Unfused attention keeps the probabilities and runs 4 (dV, dP, dQ, dK).
FLASH_BWD_OVER_FWD = 2.5
UNFUSED_BWD_OVER_FWD = 2.0
GEMM_TILE = 128          # output tile edge of the Hopper / Ampere GEMMs (wave quantization)
# A GEMM with a short inner dimension K pays each output tile's fixed cost (prologue, the
# epilogue's write) over fewer MMA steps: K / (K + K0) of the ceiling, relative to K =
# 16384 (where the MAMF sweep's best shapes sit).  K0 = 710 for FP8 is the least-squares
# fit to DeepGEMM's measured dense FP8 GEMMs on H800 at M = 4096 (github.com/deepseek-ai/
# DeepGEMM README, "Normal GEMMs for dense models": K 512 / 1536 / 2048 / 7168 / 16384 at
# 590 / 990 / 1025 / 1304 / 1358 TFLOPS, fitted to 0.437 / 0.714 / 0.775 / 0.949 of the
# K = 16384 rate against measured 0.434 / 0.729 / 0.755 / 0.960).  The fixed cost is
# time, so it scales with the main loop's rate per K step: half for bf16 (half the FP8
# rate), twice for FP4.  Applied to the grouped expert GEMMs only: the dense GEMMs' shapes
# are those of the rows the sustained fractions were fitted on (calibration.py), so the
# constant already holds their share; fine-grained experts (Qwen3-30B-A3B: 128 experts of
# width 768, fc2's K) fall far outside those shapes.
INNER_K0_FP8 = 710.0
INNER_K_REF = 16384


@dataclass(frozen=True)
class Fp8Recipe:
    """A Transformer Engine / torchao FP8 recipe as the cost model sees it.

    ``cast_bytes``: HBM bytes per element each quantized GEMM operand costs beyond bf16
    (the forward inputs, the backward output gradients): reading the bf16 tensor and writing
    the fp8 copy and its transpose (Hopper's FP8 GEMMs take only the TN layout) is 4 bytes;
    current ("tensorwise") scaling reads the tensor once more for its amax first, 6.
    ``gemm`` is the fraction of the FP8 matmul ceiling the GEMMs run at.  ``bits`` 4: the
    GEMMs run on the FP4 tensor cores (hardware.GPU.fp4_matmul_tflops); ``operand_bytes``:
    an operand element with its share of the block scales, as the GEMM streams it.
    What stays in BF16 under every recipe: core attention, the router, norms, the
    embedding, and optimizer / gradient reduction (fp32 or bf16 as configured).
    """
    name: str
    cast_bytes: float
    gemm: float = 1.0
    source: str = ""
    bits: int = 8
    operand_bytes: float = 1.0


FP8_RECIPES = {
    "delayed": Fp8Recipe("delayed", 4.0, source="TE DelayedScaling: scale from the amax "
                         "history, amax taken inside the cast"),
    "tensorwise": Fp8Recipe("tensorwise", 6.0, source="TE Float8CurrentScaling / torchao "
                            "dynamic tensorwise: an amax pass, then the cast"),
    "blockwise": Fp8Recipe("blockwise", 4.0, source="TE Float8BlockScaling (1x128 "
                           "activations, 128x128 weights): block amax inside the cast"),
    "mxfp8": Fp8Recipe("mxfp8", 4.0 + 2 / 32, source="TE MXFP8BlockScaling (Blackwell): "
                       "32-element blocks, one E8M0 scale each, applied by the tensor cores; "
                       "a rowwise and a columnwise copy (the block runs along K for each "
                       "GEMM) instead of a transpose: read 2 + write 2 + 2/32 scale bytes",
                       operand_bytes=1 + 1 / 32),
    # NVFP4 (TE NVFP4BlockScaling; Megatron --fp4-format e2m1 --fp4-recipe nvfp4; NVIDIA,
    # "Pretraining Large Language Models with NVFP4", arXiv 2509.25149): 16-element blocks
    # with an E4M3 scale each and one FP32 scale per tensor -- so an amax pass first (2),
    # then read (2) and write a rowwise and a columnwise FP4 copy with their scales
    # (2 x (0.5 + 1/16)); the wgrad operands go through a 16-point random Hadamard
    # transform whose amax is taken again (2 more).  Stochastic rounding of the gradients
    # happens inside the cast.  Megatron keeps optionally the first / last layers in BF16
    # (--first-last-layers-bf16): not modelled (Bridge's benchmark recipes leave it off).
    "nvfp4": Fp8Recipe("nvfp4", 2 + 2 + 2 * (0.5 + 1 / 16) + 2,
                       source="TE NVFP4BlockScaling: 16-element blocks, E4M3 block scales "
                       "plus an FP32 tensor scale, RHT on the wgrad operands",
                       bits=4, operand_bytes=0.5 + 1 / 16),
}
# Megatron's --fp8-recipe values the planner knows; NVFP4 is --fp4-recipe.
FP4_RECIPES = tuple(k for k, r in FP8_RECIPES.items() if r.bits == 4)
FP8_ONLY_RECIPES = tuple(k for k, r in FP8_RECIPES.items() if r.bits == 8)


def _log_interpolate(points: tuple, values: tuple, x: float) -> float:
    """``values`` at ``x``, log-linear between the table's ``points``, clamped at its ends."""
    i = min(bisect_left(points, x), len(points) - 1)
    if i == 0 or x >= points[i]:
        return values[i]
    lo, hi = points[i - 1], points[i]
    w = math.log(x / lo) / math.log(hi / lo)
    return values[i - 1] + w * (values[i] - values[i - 1])


def attention_rate(cluster: Cluster, kernel: str, kv_len: int,
                   head_dim: int = 128) -> Tuple[float, float]:
    """(forward, backward) FLOP/s of core attention over ``kv_len`` keys with query/key
    heads ``head_dim`` wide, before the sustained-fraction constant."""
    if kernel == "unfused":
        r = cluster.gpu.matmul_tflops * 1e12          # batched GEMMs; softmax is HBM work
        return r, r
    by_dim = ATTENTION_TFLOPS[kernel]
    rates = []
    for d in ATTENTION_HEAD_DIMS:                      # (fwd, bwd) at each measured width
        rates.append([_log_interpolate(ATTENTION_SEQS, x, kv_len) for x in by_dim[d]])
    fb = [_log_interpolate(ATTENTION_HEAD_DIMS, tuple(r[j] for r in rates), head_dim)
          for j in (0, 1)]
    scale = cluster.gpu.matmul_tflops / MAMF_BF16_TFLOPS["H100"]
    return fb[0] * scale * 1e12, fb[1] * scale * 1e12


def gemm_efficiency(rows: int, n: int, groups: int, sms: int) -> float:
    """Fraction of the matmul ceiling a (grouped) GEMM of ``groups`` x (rows x n) outputs
    keeps: rows padded to the tile, and the last wave of tiles over the SMs part-empty."""
    if rows <= 0 or n <= 0:
        return 1.0
    tiles = math.ceil(rows / GEMM_TILE) * math.ceil(n / GEMM_TILE) * groups
    pad = rows / (math.ceil(rows / GEMM_TILE) * GEMM_TILE)
    waves = math.ceil(tiles / sms)
    return pad * tiles / (waves * sms)


@dataclass(frozen=True)
class Gemm:
    rows: int
    k: int
    n: int
    groups: int = 1            # grouped GEMM: local experts
    # How TP splits it: "column" / "row" (their FLOPs apportion flops.py's count, and TP's
    # collectives pipeline with them), "duplicated" (every TP rank runs it whole: MLA's
    # down projections), "expert" (the grouped routed experts, rows as routed).
    split: str = "column"

    @property
    def expert(self) -> bool:
        return self.split == "expert"

    @property
    def tp_split(self) -> bool:
        return self.split in ("column", "row")

    @property
    def flops(self) -> float:
        return 2.0 * self.rows * self.k * self.n * self.groups


def layer_gemms(m: ModelConfig, L: Layout, moe: bool, seq: int,
                imbalance: float = 1.0) -> List[Gemm]:
    """The forward GEMMs of one layer on one rank per micro-batch: the attention's
    projections (standard QKV + output, or MLA's from ``model_spec.mla_projections``, its
    duplicated down projections on SP's sequence shard), the MLP's, and the experts as one
    grouped GEMM over the local experts, rows scaled by the routing ``imbalance`` of the
    most loaded EP rank."""
    t, T = L.tp, (seq // L.cp) * L.micro_batch
    h = m.hidden_size
    gate = activation_of(m).fc1_blocks
    if m.multi_latent_attention:
        rows = {"duplicated": T // (t if L.sp else 1), "column": T, "row": T}
        out = [Gemm(rows[how], i // t if how == "row" else i,
                    o // t if how == "column" else o, split=how)
               for _, i, o, how in ms.mla_projections(m)]
    else:
        a, g, d = m.num_attention_heads, m.resolved_query_groups(), m.resolved_kv_channels()
        out = [Gemm(T, h, (a + 2 * g) * d // t), Gemm(T, a * d // t, h, split="row")]
    if not moe:
        f = m.resolved_ffn_hidden_size()
        return out + [Gemm(T, h, gate * f // t), Gemm(T, f // t, h, split="row")]
    shared = m.moe_shared_expert_intermediate_size
    if shared:
        out += [Gemm(T, h, gate * shared // t), Gemm(T, shared // t, h, split="row")]
    local = max(1, m.num_experts // L.ep)
    copies = T * m.moe_router_topk * L.etp // t         # token copies this rank's experts get
    rows = max(1, round(copies * imbalance / local))
    fe = ms.moe_ffn(m)
    return out + [Gemm(rows, h, gate * fe // L.etp, local, "expert"),
                  Gemm(rows, fe // L.etp, h, local, "expert")]


def _unfused_attention_gemms(m: ModelConfig, L: Layout, seq: int) -> List[Gemm]:
    """Unfused core attention as batched GEMMs, one per (sample, local head): scores
    s_q x d_qk x s_kv, then probabilities x V s_q x s_kv x d_v (bf16 operands)."""
    heads = L.micro_batch * m.num_attention_heads // L.tp
    _, _, dqk, dv = ms.attention_head_dims(m)
    sq = seq // L.cp
    return [Gemm(sq, dqk, seq, heads), Gemm(sq, seq, dv, heads)]


def inner_efficiency(k: int, op_bytes: float) -> float:
    """Fraction of the ceiling a GEMM of inner dimension ``k`` keeps (INNER_K0_FP8)."""
    k0 = INNER_K0_FP8 / max(op_bytes, 0.5) if op_bytes < 4 else INNER_K0_FP8 / 2
    return (k / (k + k0)) / (INNER_K_REF / (INNER_K_REF + k0)) if k < INNER_K_REF else 1.0


def _gemm_seconds(gs: List[Gemm], rate: float, hbm: float, sms: int, op_bytes: float) -> float:
    """Roofline per GEMM: the slower of its compute (at ``rate`` x wave efficiency x the
    inner dimension's efficiency) and streaming its operands once (``op_bytes`` per input
    element, 2 per output element)."""
    total = 0.0
    for gm in gs:
        eff = gemm_efficiency(gm.rows, gm.n, gm.groups, sms)
        if gm.expert:
            eff *= inner_efficiency(gm.k, op_bytes)
        byts = gm.groups * (op_bytes * (gm.rows * gm.k + gm.k * gm.n) + 2 * gm.rows * gm.n)
        total += max(gm.flops / (rate * eff), byts / hbm)
    return total


def _recomputed_gemm_share(m: ModelConfig, gs: List[Gemm], moe: bool, recompute: str,
                           modules: tuple, seq: int) -> float:
    """Fraction of a layer's forward GEMM work its recomputation repeats."""
    if recompute == "full":
        return 1.0
    if recompute != "selective":
        return 0.0
    total = sum(gm.flops for gm in gs) or 1.0
    share = 0.0
    n_attn = len(ms.mla_projections(m)) if m.multi_latent_attention else 2
    if "every_other_mm" in modules:
        # torchtitan's op-level SAC saves every matmul output but every second one of a
        # layer (Llama: wq, wk, wv, wo, w1, w3, w2 -> wk, wo and w3 run again).  Here
        # standard attention's QKV is one GEMM (wq, wk, wv by their widths) and an MLP's
        # fc1 (the first of its pair) holds w1 and w3.
        mms: List[float] = []
        for i, gm in enumerate(gs):
            if i == 0 and not m.multi_latent_attention:
                a, g = m.num_attention_heads, m.resolved_query_groups()
                mms += [gm.flops * x / (a + 2 * g) for x in (a, g, g)]
            elif i >= n_attn and (i - n_attn) % 2 == 0 and activation_of(m).gated:
                mms += [gm.flops / 2, gm.flops / 2]
            else:
                mms.append(gm.flops)
        share += sum(mms[1::2]) / total
    if "mlp" in modules and not moe:      # Megatron's "mlp": the dense MLP ("moe" is apart)
        share += sum(gm.flops for gm in gs[n_attn:]) / total
    if "mla_up_proj" in modules and m.multi_latent_attention:
        share += fl.mla_projection_flops(m, "column") / fl.kind_forward_flops(m, moe, seq)[
            "linear"]
    return min(1.0, share)


# Host time per launched kernel of an eager training step (PyTorch's dispatcher, Megatron's
# Python modules and the CUDA launch call together: an assumption, no measured figure
# here), the kernels a layer's forward launches (norms, GEMMs, RoPE, attention, residual
# adds, activation; the TP/SP collectives; an MoE layer's router, permutations, all-to-alls
# and grouped GEMMs) -- backward launches about twice as many -- and the one graph launch per
# layer and pass that replaces them under CUDA graphs (Megatron's --cuda-graph-impl).  The
# GPU runs ahead of the host, so only host time beyond the layer's GPU time is exposed.
HOST_SECONDS_PER_KERNEL = 10e-6
KERNELS_PER_LAYER = {False: 16, True: 30}          # dense, MoE forward
BACKWARD_KERNELS_OVER_FORWARD = 2.0
GRAPH_LAUNCHES_PER_LAYER = 1
# GPU idle per MoE layer and micro-batch (forward and backward together) at the dispatcher's
# device-to-host syncs: the token counts per expert reach the host before it can size the
# permutation and launch the grouped GEMMs, so the GPU drains and waits for the launches
# that follow.  Measured, not fitted: NVIDIA's Nsight comparison of Qwen3-30B-A3B on 16
# H100 (BF16, EP16, HybridEP, no EP overlap; Megatron-Bridge skills/nemo-mbridge-perf-moe-
# comm-overlap/SKILL.md, "HybridEP production-shape validation", commit 067f987d): step
# 24.7138 s against a GPU-active union of 22.821 s, over 48 layers x 64 micro-batches.
# With the EP overlap on, the other micro-batch's work fills the gap (union 21.221 s, step
# 20.992 s); a graph of the whole layer has no sync inside.
MOE_SYNC_IDLE_SECONDS = (24.7138 - 22.821) / (48 * 64)


def exposed_launch_seconds(gpu_seconds: float, moe: bool, backward: bool,
                           cuda_graphs: bool) -> float:
    """Host launch time one layer pass leaves exposed beyond its ``gpu_seconds``."""
    kernels = GRAPH_LAUNCHES_PER_LAYER if cuda_graphs else KERNELS_PER_LAYER[moe] * (
        BACKWARD_KERNELS_OVER_FORWARD if backward else 1.0)
    return max(0.0, kernels * HOST_SECONDS_PER_KERNEL - gpu_seconds)


def stage_compute(m: ModelConfig, L: Layout, seq: int, r: int, cluster: Cluster, opts,
                  imbalance: float = 1.0) -> Dict[str, float]:
    """Seconds of one micro-batch on a rank of pipeline stage ``r``: ``t_f``, ``t_b``
    (recomputation included), ``rec`` (the recomputation alone), ``core`` (attention's
    share of t_f + t_b, what CP's ring hides behind), ``gemm`` (the dense GEMMs, what
    TP's comm-GEMM overlap hides behind), ``head`` (the output layer, forward and
    backward: outside the layers, so outside the EP overlap), ``moe_f`` / ``moe_b`` (the
    MoE layers' forward / backward) and ``mlp_f`` / ``mlp_b`` (their routed experts: what
    the EP overlap pairs the dispatches with, estimate.paired_ep_exposed; ``mlp_bd`` the
    backward's data-gradient part) and ``moe_layers`` (the MoE layers the stage runs)."""
    gpu, eff = cluster.gpu, cluster.eff
    sustain = eff.compute
    fp8 = FP8_RECIPES.get(opts.fp8) if opts.fp8 else None
    if fp8 and not low_precision_tflops(gpu, fp8):
        fp8 = None                      # no FP8 / FP4 tensor cores: bf16 (the caller warns)
    if opts.fp32:
        rate = gpu.matmul_tflops * 0.5 * 1e12 * sustain     # TF32 tensor cores: half rate
    elif fp8:
        rate = low_precision_rate(gpu, fp8, opts.fp4_gemm) * 1e12 * sustain
    else:
        rate = gpu.matmul_tflops * 1e12 * sustain
    hbm = gpu.hbm_gbps * 1e9 * eff.hbm
    op_bytes = fp8.operand_bytes if fp8 else (4.0 if opts.fp32 else 2.0)
    kernel = opts.attention_kernel if opts.flash_attention else "unfused"
    kv = seq if L.cp_comm != "p2p" else seq // L.cp     # a ring step attends to one block
    r_f, r_b = attention_rate(cluster, kernel, kv, ms.attention_head_dims(m)[2])
    r_f, r_b = r_f * sustain, r_b * sustain
    bwd_ratio = UNFUSED_BWD_OVER_FWD if kernel == "unfused" else FLASH_BWD_OVER_FWD
    # Flash kernels skip the masked half of a causal score matrix; unfused attention
    # multiplies the whole matrix and masks it.
    causal = 0.5 if opts.causal and kernel != "unfused" else 1.0
    per_gpu = L.tp * L.cp
    kinds = ms.stage_layer_kinds(m, L.pp, r, L.vpp, *L.stage_split)
    n_layers = sum(kinds) or 1
    rec_layers = L.recompute_layers if L.recompute == "full" and L.recompute_layers else None
    rec_frac = min(1.0, rec_layers * L.vpp / n_layers) if rec_layers else 1.0
    last = r == L.output_rank
    kinds = ms.with_mtp_layers(m, kinds, last)          # + the MTP layers on the last stage
    t = dict(gemm_f=0.0, gemm_b=0.0, attn_f=0.0, attn_b=0.0, rec=0.0, hbm=0.0, cast=0.0,
             launch_f=0.0, launch_b=0.0, mlp_f=0.0, mlp_bd=0.0, mlp_bw=0.0, moe_f=0.0,
             moe_b=0.0)
    tokens = seq * L.micro_batch              # the micro-batch's tokens, all CP ranks together
    T = (seq // L.cp) * L.micro_batch         # ... on this rank's CP shard
    for n, moe in zip(kinds, (False, True)):
        if not n:
            continue
        gs = layer_gemms(m, L, moe, seq, imbalance if moe else 1.0)
        # The model's own FLOP count (flops.py) sets the TP-split GEMMs' work; the list
        # above only apportions it.  Experts and duplicated GEMMs run as listed: the
        # experts' rows are the most loaded rank's, and a duplicated GEMM without SP does
        # every TP rank's share of the work on each.
        lin = fl.kind_forward_flops(m, moe, seq)
        listed = sum(gm.flops for gm in gs if gm.tp_split) or 1.0
        want = lin["linear"] * tokens / per_gpu - sum(
            gm.flops / (imbalance if moe else 1.0) for gm in gs if gm.expert) - sum(
            gm.flops * T / L.tp / gm.rows for gm in gs if gm.split == "duplicated")
        scale = max(want, 0.0) / listed
        # Forward: out rows x n; backward: dgrad out rows x k, wgrad out k x n (the same
        # FLOPs, different tiles).  Comm-GEMM overlap runs the GEMMs next to a TP
        # collective as TP pieces of rows / t each (ring exchange): TE overlaps the forward
        # ones and the row-parallel dgrads, PyTorch's async TP the forward ones.
        ov = opts.tp_comm_overlap if L.tp > 1 else "none"

        def secs(gm: Gemm, out_rows: int, out_cols: int, inner: int, pieces: int = 1):
            g = Gemm(max(1, out_rows // pieces), inner, out_cols, gm.groups, gm.split)
            return pieces * _gemm_seconds([g], rate, hbm, gpu.sms, op_bytes) * (
                scale if gm.tp_split else 1.0)

        fwd_pieces = L.tp if ov in ("all", "forward") else 1
        gfs = [secs(gm, gm.rows, gm.n, gm.k, fwd_pieces if gm.tp_split else 1) for gm in gs]
        gbd = [secs(gm, gm.rows, gm.k, gm.n, L.tp if ov == "all" and gm.split == "row"
                    else 1) for gm in gs]                          # dgrad
        gbw = [secs(gm, gm.k, gm.n, gm.rows) for gm in gs]           # wgrad
        gf, gb = sum(gfs), sum(gbd) + sum(gbw)
        core = lin["core"] * tokens / per_gpu * causal
        if kernel == "unfused":          # batched GEMMs per head: QK^T then P V (roofline)
            ab = _unfused_attention_gemms(m, L, seq)
            af = _gemm_seconds(ab, rate, hbm, gpu.sms, 2.0) * core / max(
                1.0, sum(gm.flops for gm in ab))
            ab_t = bwd_ratio * af
        else:
            af, ab_t = core / r_f, bwd_ratio * core / r_b
        t["gemm_f"] += n * gf
        t["gemm_b"] += n * gb
        t["attn_f"] += n * af
        t["attn_b"] += n * ab_t
        share = _recomputed_gemm_share(m, gs, moe, L.recompute, opts.recompute_modules, seq)
        attn_rec = af if L.recompute == "full" or (
            L.recompute == "selective" and "core_attn" in opts.recompute_modules) else 0.0
        t["rec"] += n * (share * gf + attn_rec) * (rec_frac if L.recompute == "full" else 1.0)
        # Memory-bound work: HBM passes over the layer's activations (fwd 1, bwd 2 shares);
        # the experts' output is written and read by the combine whether or not backward
        # keeps it (memory.ActivationOptions.moe_output_kept)
        act = mem.layer_activation_bytes(m, L, moe, seq, replace(opts.activations,
                                                                  moe_output_kept=True), "none")
        t["hbm"] += n * opts.passes * act / hbm
        layer_hbm = opts.passes * act / hbm
        t["launch_f"] += n * exposed_launch_seconds(gf + af + layer_hbm / 3, moe, False,
                                                    opts.cuda_graphs)
        t["launch_b"] += n * exposed_launch_seconds(gb + ab_t + 2 * layer_hbm / 3, moe, True,
                                                    opts.cuda_graphs)
        if fp8:
            t["cast"] += n * fp8.cast_bytes * _quantized_elements(gs) / hbm
        if moe:
            # The MoE layers' passes and, within them, the routed experts' GEMMs and
            # their casts: what EP A2A overlap pairs the dispatches with
            # (estimate.paired_ep_exposed).  The shared experts run in the attention-side
            # node (megatron/core/models/gpt/fine_grained_callables.py, pre_dispatch_
            # computation: "attention -> pre-MLP layernorm -> router -> dispatch
            # preprocess", shared_experts_compute inside it).
            mlp = [gm for gm in gs if gm.expert]
            mcast = fp8.cast_bytes * _quantized_elements(mlp) / hbm if fp8 else 0.0
            t["mlp_f"] += n * (sum(x for x, gm in zip(gfs, gs) if gm.expert) + mcast / 2)
            # backward: the data gradients (the output gradients' casts with them), then
            # the weight gradients -- Bridge delays them with the overlap (delay_wgrad_
            # compute, scripts/performance/utils/overrides.py), so the dispatch backward
            # waits for the data gradients only
            t["mlp_bd"] += n * (sum(x for x, gm in zip(gbd, gs) if gm.expert) + mcast / 2)
            t["mlp_bw"] += n * sum(x for x, gm in zip(gbw, gs) if gm.expert)
            t["moe_f"] += n * (gf + af + layer_hbm / 3) + (
                n * fp8.cast_bytes * _quantized_elements(gs) / hbm / 2 if fp8 else 0.0)
            t["moe_b"] += n * (gb + ab_t + 2 * layer_hbm / 3) + (
                n * fp8.cast_bytes * _quantized_elements(gs) / hbm / 2 if fp8 else 0.0)
    head = 0.0
    if last:                  # output layer; the MTP depths' eh_proj and output-layer passes
        mtp = fl.mtp_forward_flops(m, seq)
        lo = (fl.logits_forward_flops(m) + mtp["logits"] + mtp["proj"]) * tokens / per_gpu
        t["gemm_f"] += lo / rate
        t["gemm_b"] += 2 * lo / rate
        head = 3 * lo / rate
    # Recomputing a whole layer (or, with op-level SAC, every elementwise op) repeats the
    # forward's memory-bound work too.
    rec_hbm = t["hbm"] / 3 * rec_frac if L.recompute == "full" else (
        t["hbm"] / 3 if L.recompute == "selective" and "every_other_mm" in opts.recompute_modules
        else 0.0)
    t_f = t["gemm_f"] + t["attn_f"] + t["hbm"] / 3 + t["cast"] / 2 + t["launch_f"]
    t_b = t["gemm_b"] + t["attn_b"] + 2 * t["hbm"] / 3 + t["cast"] / 2 + t["rec"] + rec_hbm + \
        t["launch_b"]
    return {"t_f": t_f, "t_b": t_b, "rec": t["rec"] + rec_hbm,
            "core": t["attn_f"] + t["attn_b"], "gemm": t["gemm_f"] + t["gemm_b"],
            "cast": t["cast"], "hbm": t["hbm"], "head": head,
            "launch": t["launch_f"] + t["launch_b"],
            "mlp_f": t["mlp_f"], "mlp_b": t["mlp_bd"] + t["mlp_bw"], "mlp_bd": t["mlp_bd"],
            "moe_f": t["moe_f"], "moe_b": t["moe_b"], "moe_layers": kinds[1]}


def _quantized_elements(gs: List[Gemm]) -> float:
    """Elements FP8 quantizes per layer: each GEMM's input forward, its output gradient
    backward (the weights are cast once per step, counted in ``weight_cast_seconds``)."""
    return sum(gm.groups * (gm.rows * gm.k + gm.rows * gm.n) for gm in gs)


def low_precision_rate(gpu, recipe: Fp8Recipe, fp4_gemm: Optional[float] = None) -> float:
    """The measured-ceiling rate (TFLOP/s, before the sustained fraction) a recipe's GEMMs
    run at.  FP8 recipes: the FP8 ceiling times the recipe's ``gemm`` share.  NVFP4: a
    multiple of the *FP8* ceiling (calibration.NVFP4_GEMM), not a share of the FP4 peak:
    Blackwell Ultra raises the FP4 datasheet peak 1.5x over Blackwell at the same FP8 peak
    (hardware.py), yet the published NVFP4-over-FP8 gain of Llama 3.1 405B is the same on
    GB300 and GB200 (Megatron-Bridge performance-summary-archive.md lines 100-105: 3575 /
    2646 = 1.35, 2944 / 2129 = 1.38) -- the two-level block scales, the RHT'd wgrad operands
    and the FP4 operands' unpacking, not the FP4 MMA rate, bound TE's NVFP4 GEMMs at
    training shapes.  A share of the FP4 peak fitted on GB300 under-predicted GB200 by 23%."""
    if recipe.bits == 4:
        mult = fp4_gemm if fp4_gemm is not None else calibration.NVFP4_GEMM
        return gpu.fp8_matmul_tflops * mult
    return gpu.fp8_matmul_tflops * recipe.gemm


def low_precision_tflops(gpu, recipe: Fp8Recipe) -> Optional[float]:
    """The GEMM ceiling a recipe runs at: FP8's, or FP4's for NVFP4 (None: no such cores)."""
    return gpu.fp4_matmul_tflops if recipe.bits == 4 else gpu.fp8_matmul_tflops


def weight_cast_seconds(params: int, cluster: Cluster, opts) -> float:
    """FP8: each weight is quantized once per step (cached across micro-batches)."""
    if not opts.fp8 or not low_precision_tflops(cluster.gpu, FP8_RECIPES[opts.fp8]):
        return 0.0
    return params * FP8_RECIPES[opts.fp8].cast_bytes / (cluster.gpu.hbm_gbps * 1e9 *
                                                       cluster.eff.hbm)


def fp8_unavailable(cluster: Cluster, opts) -> Optional[str]:
    if opts.fp8 and not low_precision_tflops(cluster.gpu, FP8_RECIPES[opts.fp8]):
        kind = "FP4" if FP8_RECIPES[opts.fp8].bits == 4 else "FP8"
        return f"{cluster.gpu.name} has no {kind} tensor cores"
    return None
