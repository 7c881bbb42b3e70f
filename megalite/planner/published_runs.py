"""Published training runs the cost model is checked against: model, cluster, layout,
precision, recomputation, batch and throughput, each with its source (docs/planner.md,
"Planner vs published", prints this table).

A row records what its source states; ``assumed`` lists what the row had to assume where
the source is silent.  Layout fields the source does not give (Narayanan et al.'s micro-batch
and interleaving) are in ``free``: the comparison takes the planner's best value for them
under the published ones.  ``options`` are the cost model's switches for the software the
run used (ModelOptions fields).  planner/calibration.py names the rows its constants were
fitted on (at most a third); all others are held out.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from megalite.planner.optimizer_precision import adam_state_bytes

NARAYANAN = "Narayanan et al. 2021 (SC21), Table 1"
LLAMA3 = "Dubey et al. 2024, The Llama 3 Herd of Models, Table 4"
BRIDGE = ("Megatron-Bridge docs/performance-summary.md, 25.11 container, DGX-H100 "
          "(commit 5776a6d9)")
BRIDGE_ARCHIVE = ("Megatron-Bridge docs/performance-summary.md, 25.09 container, DGX-H100 "
                  "(commit fa0315ae; now performance-summary-archive.md)")
MCORE_MOE = ("Megatron-LM megatron/core/transformer/moe/README.md (rev. c230e0d7, 2024-11): "
             "468 TFLOPS with MCore v0.9; layout from its 'Reference Best Parallel Mapping'")
TORCHTITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"

# The software each source ran, as the cost model's switches (ModelOptions fields).
# Narayanan et al.'s Megatron: fused softmax, no flash attention; the input-gradient
# all-reduce ran after the weight-gradient GEMM and pipeline sends blocked (Megatron-LM
# overlapped them from commits 16c90445, 2021-09, and f9283c5a, 2023-05: after the paper).
MEGATRON_2021 = dict(flash_attention=False, tp_async_backward=False, pp_overlap=False)
MEGATRON_TE = dict(attention_kernel="cudnn")                 # TE fused (cuDNN) attention
BRIDGE_FP8 = dict(attention_kernel="cudnn", fp8="tensorwise", grad_bytes=2)
META_2024 = dict(attention_kernel="fa2")
TITAN = dict(attention_kernel="fa2", eager=True)            # eager PyTorch: unfused ops
TITAN_COMPILED = dict(attention_kernel="fa2")                # torch.compile fuses them
TITAN_FP8 = dict(TITAN_COMPILED, fp8="tensorwise", fp8_param_gather=True)
SAC_OP = dict(recompute_modules=("every_other_mm",))


@dataclass(frozen=True)
class PublishedRun:
    name: str
    model: str                      # model_presets key
    source: str
    gpu: str                        # hardware preset
    num_gpus: int
    seq_length: int
    global_batch: int               # sequences per step
    layout: Dict                    # Layout fields as run (world, global_batch added)
    metric: str                     # "model_tflops" | "hw_tflops" | "tokens_per_gpu"
    value: float
    flops: str = "full"             # attention FLOP count: "full" (PaLM / Megatron < 0.12 /
    #                                 Narayanan) or "causal" (Megatron-Core >= 0.12, Bridge)
    precision: str = "bf16"
    options: Dict = field(default_factory=dict)
    gpu_overrides: Dict = field(default_factory=dict)
    model_overrides: Dict = field(default_factory=dict)     # ModelConfig fields
    free: Tuple[str, ...] = ()
    memory_gib: Optional[float] = None      # peak memory the source states
    assumed: str = ""


def _narayanan(model, tp, pp, gpus, batch, tflops):
    return PublishedRun(
        model, model, NARAYANAN, "a100-80gb", gpus, 2048, batch,
        dict(tp=tp, pp=pp, recompute="full", zero=0, sp=False), "hw_tflops", tflops,
        options=MEGATRON_2021, free=("micro_batch", "vpp"),
        assumed="micro-batch and interleaving not given: the planner's best under the "
                "published TP/PP; interleaved schedule allowed; no SP (predates it)")


# The Meta split of Llama 3 405B (paper, section 3.3.2): one layer fewer on the first and
# last stage, interleaved -- 126 + embedding + loss = 128 slots = 16 stages x 8 chunks.
META_SPLIT = dict(vpp=8, schedule="interleaved", account_embedding=True, account_loss=True)
LLAMA3_ASSUMED = ("micro-batch 1 sequence; Meta's split as VPP 8 with embedding and loss "
                  "counted as layers; FSDP-style sharded grads + optimizer (ZeRO-2, fp32 "
                  "reduce-scatter), weights not resharded; no recomputation; FlashAttention-2; "
                  "MFU counted like PaLM (full attention)")

RUNS = [
    _narayanan("gpt-1.7b", 1, 1, 32, 512, 137),
    _narayanan("gpt-3.6b", 2, 1, 64, 512, 138),
    _narayanan("gpt-7.5b", 4, 1, 128, 512, 142),
    _narayanan("gpt-18.4b", 8, 1, 256, 1024, 135),
    _narayanan("gpt-39.1b", 8, 2, 512, 1536, 138),
    _narayanan("gpt-76.1b", 8, 4, 1024, 1792, 140),
    _narayanan("gpt-145.6b", 8, 8, 1536, 2304, 148),
    _narayanan("gpt-310.1b", 8, 16, 1920, 2160, 155),
    _narayanan("gpt-529.6b", 8, 35, 2520, 2520, 163),
    _narayanan("gpt-1t", 8, 64, 3072, 3072, 163),
    # ---- Llama 3 405B (Meta, 2024), BF16 on H100-80GB, 16M tokens per step -------------
    PublishedRun("llama3-405b-8k-8192gpu", "llama3-405b", LLAMA3, "h100-80gb", 8192, 8192,
                 2048, dict(tp=8, pp=16, cp=1, sp=True, zero=2, micro_batch=1, **META_SPLIT),
                 "model_tflops", 430, options=dict(META_2024), assumed=LLAMA3_ASSUMED),
    PublishedRun("llama3-405b-8k-16384gpu", "llama3-405b", LLAMA3, "h100-80gb", 16384, 8192,
                 2048, dict(tp=8, pp=16, cp=1, sp=True, zero=2, micro_batch=1, **META_SPLIT),
                 "model_tflops", 400, options=dict(META_2024), assumed=LLAMA3_ASSUMED),
    PublishedRun("llama3-405b-128k-16384gpu", "llama3-405b", LLAMA3, "h100-80gb", 16384,
                 131072, 128, dict(tp=8, pp=16, cp=16, sp=True, zero=2, micro_batch=1,
                                   cp_comm="allgather", **META_SPLIT),
                 "model_tflops", 380, options=dict(META_2024),
                 assumed=LLAMA3_ASSUMED + "; CP by all-gathering K/V (paper), exposed; "
                 "no document mask modelled"),
    # ---- Megatron-Bridge, DGX-H100, FP8 current scaling (TE), bf16 grads --------------
    PublishedRun("bridge-llama3-8b-fsdp", "llama3-8b", BRIDGE, "h100-80gb", 8, 8192, 128,
                 dict(zero=3, micro_batch=1, recompute="full", recompute_layers=5),
                 "model_tflops", 744, "causal", "fp8 tensorwise", dict(BRIDGE_FP8),
                 assumed="FSDP = Megatron-FSDP optim_grads_params (ZeRO-3); recompute_num_"
                 "layers 5 (block) from the recipe; 14451 tokens/s/GPU"),
    PublishedRun("bridge-llama3-70b", "llama3-70b", BRIDGE, "h100-80gb", 64, 8192, 128,
                 dict(tp=4, pp=8, vpp=5, sp=True, zero=1, micro_batch=1), "model_tflops", 719,
                 "causal", "fp8 tensorwise", dict(BRIDGE_FP8, tp_comm_overlap="all"),
                 assumed="distributed optimizer; TE userbuffers TP overlap (recipe); "
                 "1602 tokens/s/GPU"),
    PublishedRun("bridge-llama31-405b", "llama3-405b", BRIDGE, "h100-80gb", 1024, 8192, 512,
                 dict(tp=8, pp=8, cp=2, vpp=8, sp=True, zero=1, micro_batch=1,
                      account_embedding=True, account_loss=True),
                 "model_tflops", 737, "causal", "fp8 tensorwise",
                 dict(BRIDGE_FP8, tp_comm_overlap="all"),
                 assumed="embedding and loss counted in the split (recipe); distributed "
                 "optimizer; TE userbuffers TP overlap; 292 tokens/s/GPU"),
    PublishedRun("bridge-qwen3-235b-a22b", "qwen3-235b-a22b", BRIDGE, "h100-80gb", 256, 4096,
                 2048, dict(tp=2, pp=8, vpp=4, ep=32, etp=1, sp=True, zero=1, micro_batch=1,
                      account_embedding=True, account_loss=True),
                 "model_tflops", 233, "causal", "fp8 tensorwise",
                 dict(BRIDGE_FP8, moe_routing="uniform", ep_overlap=True),
                 assumed="GBS 2048 from commit 5776a6d9 (the current page drops it); "
                 "embedding and loss counted in the split (recipe); dropless, 'force-balanced' routing (page) = "
                 "random router logits (Megatron's router.py), i.e. uniform routing; NCCL "
                 "all-to-all dispatcher (no flex backend on H100) with EP A2A overlap "
                 "(recipe); q/k norm not counted; 1575 tokens/s/GPU"),
    PublishedRun("bridge-deepseek-v3", "deepseek-v3", BRIDGE_ARCHIVE, "h100-80gb", 1024,
                 4096, 8192, dict(tp=2, pp=8, vpp=4, ep=64, etp=1, sp=True, zero=1,
                                  micro_batch=1, recompute="selective",
                                  pipeline_layout="Et|(tt|)*30mL"),
                 "model_tflops", 338, "causal", "fp8 tensorwise",
                 dict(BRIDGE_FP8, moe_routing="uniform", ep_overlap=True,
                      moe_dispatcher="deepep", recompute_modules=("mla_up_proj", "mlp"),
                      dp_exposed=1.0),
                 assumed="Bridge's layout 'Et|(tt|)*30mL': the embedding, the loss and the "
                 "MTP module each counted as a pipeline layer, 61 + 3 = 32 x 2 slots at VPP 4 "
                 "(--pipeline-model-parallel-layout); 'force-balanced' = uniform "
                 "routing; DeepEP dispatch (its 20 SMs), EP A2A "
                 "overlap, selective recompute of mla_up_proj + mlp, no grad-reduce overlap "
                 "(run_script.py); priced as NCCL's per-copy all-to-all until DeepEP over "
                 "the NICs hid only the measured share (docs/planner.md: -6.6% that way, "
                 "+23.5% as DeepEP with the pairing alone); "
                 "338 is per-tensor current scaling (330 blockwise); 1297 tokens/s/GPU"),
    # ---- Megatron-Core MoE, Mixtral 8x7B, BF16 -----------------------------------------
    PublishedRun("mcore-mixtral-8x7b", "mixtral-8x7b", MCORE_MOE, "h100-80gb", 64, 4096, 256,
                 dict(tp=1, pp=4, vpp=8, ep=8, etp=1, zero=1, micro_batch=1), "model_tflops",
                 468, options=dict(MEGATRON_TE),
                 assumed="the 468 is v0.9's, the layout v0.8's reference mapping; dropless "
                 "all-to-all with the aux loss: uniform routing; distributed optimizer; "
                 "fp32 main grads (Megatron's bf16 default)"),
    # ---- torchtitan, 500 W H100 96 GB HBM2e, tokens/s per GPU ---------------------------
    # (an extra layout knob per table: local batch = micro-batch without PP)
]

TITAN_GPU = dict(memory_gib=96 * 0.9956, hbm_gbps=2400.0, clock="H100_500W_CLOCK")
TITAN_ASSUMED = ("the GPUs' sustained clock at 500 W is calibrated (calibration.py); FSDP2 "
                 "reshards after forward without PP; fp32 gradient reduce (torchtitan "
                 "default); SDPA = FlashAttention-2")


def _titan(name, model, gpus, batch, layout, tps, mem, opts, extra=""):
    return PublishedRun(name, model, TORCHTITAN, "h100-80gb", gpus, 8192, batch,
                        dict(layout), "tokens_per_gpu", tps, precision="fp8 tensorwise"
                        if opts.get("fp8") else "bf16", options=dict(opts),
                        gpu_overrides=TITAN_GPU, memory_gib=mem,
                        assumed=TITAN_ASSUMED + extra)


_FSDP8 = dict(zero=3, micro_batch=2, recompute="selective")
_SAC = SAC_OP
RUNS += [
    _titan("titan-8b-8gpu-fsdp", "llama3-8b", 8, 16, _FSDP8, 5762, 82.4, dict(TITAN, **_SAC)),
    _titan("titan-8b-8gpu-compile", "llama3-8b", 8, 16, _FSDP8, 6667, 77.0,
           dict(TITAN_COMPILED, **_SAC)),
    _titan("titan-8b-8gpu-compile-fp8", "llama3-8b", 8, 16, _FSDP8, 8532, 76.8,
           dict(TITAN_FP8, **_SAC)),
    _titan("titan-8b-128gpu-fsdp", "llama3-8b", 128, 256, _FSDP8, 5605, 67.0,
           dict(TITAN, **_SAC)),
    _titan("titan-8b-128gpu-compile", "llama3-8b", 128, 256, _FSDP8, 6514, 62.0,
           dict(TITAN_COMPILED, **_SAC)),
    _titan("titan-8b-128gpu-compile-fp8", "llama3-8b", 128, 256, _FSDP8, 8380, 61.8,
           dict(TITAN_FP8, **_SAC)),
    _titan("titan-70b-256gpu-2d", "llama3-70b", 256, 512,
           dict(tp=8, sp=True, zero=3, micro_batch=16, recompute="full"), 829, 71.9,
           dict(TITAN_FP8)),
    _titan("titan-70b-256gpu-2d-asynctp", "llama3-70b", 256, 512,
           dict(tp=8, sp=True, zero=3, micro_batch=16, recompute="full"), 876, 67.6,
           dict(TITAN_FP8, tp_comm_overlap="forward")),
    _titan("titan-405b-512gpu-3d-interleaved", "llama3-405b", 512, 256,
           dict(tp=8, pp=8, sp=True, zero=3, micro_batch=4, recompute="full", vpp=2,
                schedule="interleaved", account_embedding=True, account_loss=True), 128, 72.7,
           dict(TITAN_FP8, tp_comm_overlap="forward", fsdp_reshard=False),
           extra="; micro-batches = PP degree (torchtitan's default): 8 of 4 sequences; its "
           "7/8x14/7 split of 16 stages = embedding and loss counted as layers"),
    _titan("titan-405b-512gpu-3d-1f1b", "llama3-405b", 512, 256,
           dict(tp=8, pp=8, sp=True, zero=3, micro_batch=4, recompute="full",
                first_layers=15, last_layers=15), 100, 82.5,
           dict(TITAN_FP8, tp_comm_overlap="forward", fsdp_reshard=False),
           extra="; micro-batches = PP degree (torchtitan's default): 8 of 4 sequences; "
           "its 15/16x6/15 split"),
]

BY_NAME = {r.name: r for r in RUNS}

# ---- Megatron-Bridge on Blackwell (and the 26.06 H100 rows), model TFLOP/s per GPU -------
# Sources: Megatron-Bridge commit 067f987d (2026-08-22): docs/performance-summary.md (26.08
# container, "current") and docs/performance-summary-archive.md (26.06 and 25.11 tables),
# each row with its line.  Software from the benchmark recipes beside them
# (src/megatron/bridge/perf_recipes/<family>/<system>/*.py): MoE rows dispatch with HybridEP
# (moe_token_dispatcher_type "flex", backend "hybridep"; the rack's 72-GPU NVLink domain on
# GB200 / GB300, 8 on B300 and H100) with overlap_moe_expert_parallel_comm; routing force-
# balanced, dropless (the page's footnote); FP8 rows are current scaling, TE attention.
BRIDGE26 = "Megatron-Bridge docs/performance-summary.md (26.08), commit 067f987d"
BRIDGE26_ARCHIVE = "Megatron-Bridge docs/performance-summary-archive.md, commit 067f987d"
BF_DENSE = dict(attention_kernel="cudnn", grad_bytes=2)
# Every HybridEP run of these tables holds 32 SMs for its kernels: the benchmark scripts set
# moe_hybridep_num_sms = 32 whenever the backend is hybridep (scripts/performance/utils/
# overrides.py line 89 at commit 067f987d, line 75 at 8f341b04f, the 26.06 configs' commit).
# Their Megatron-Core applies the router's probabilities in the experts' activation and
# combines without them (memory.ActivationOptions.moe_output_kept): the experts' output is
# not saved for backward.
BF_MOE = dict(BF_DENSE, moe_routing="uniform", ep_overlap=True, moe_dispatcher="hybridep",
              moe_dispatch_sms=32, moe_output_kept=False)
# FP8 / MXFP8 / NVFP4 rows keep quantized primary weights (ModelOptions.quantized_weights):
# the precision configs the benchmark scripts take (scripts/performance/utils/precision.py,
# perf_recipes/_common.py _perf_precision) set fp8_param_gather = True for FP8 current
# scaling and MXFP8, fp4_param_gather = True for NVFP4 (src/megatron/bridge/training/
# mixed_precision.py lines 302, 264-265, 416 at commits 8f341b04f and 067f987d; line 289
# at 5776a6d9, the 25.11 rows'); both set fp8_param with it (lines 81-87).
# DeepSeek-V3's recipe runs the precision-aware optimizer with bf16 moments
# (ModelOptions.moment_bytes (2, 2)): recipes/deepseek/deepseek_v3.py lines 205-209 at
# 8f341b04f (the 26.06 configs); at 067f987d the perf recipes' deepseek_v3_pretrain_config
# (perf_recipes/deepseek/common.py line 24) is recipes/deepseek/h100/deepseek_v3.py's
# 1024-GPU config, lines 221-225.
# Every DeepSeek-V3 row runs an FP8 recipe whose fp32 master Megatron-Core keeps (tensorwise
# on H100, MXFP8 on Blackwell): bf16 moments, a 4-byte master.
_DSV3_MOMENTS, _DSV3_MASTER = adam_state_bytes(True, "bf16", "bf16", "fp32", "mxfp8",
                                               quantized_weights=True)
DSV3_OPT = dict(moment_bytes=_DSV3_MOMENTS, master_bytes=_DSV3_MASTER)
# The embedding, the MTP depth and the loss each take a pipeline slot: 61 + 3 = 64 slots over
# the stages, as --pipeline-model-parallel-layout strings (16 stages of 4; 8 stages of 8).
DSV3_16 = dict(pipeline_layout="Ettt|(tttt|)*14,ttmL")
DSV3_8 = dict(pipeline_layout="Et*7|(t*8|)*6,t*6mL")
EMB_LOSS = dict(account_embedding=True, account_loss=True)
# Qwen3-30B-A3B (its Hugging Face config.json): 48 layers of hidden 2048, 32 heads of 128
# with 4 KV groups, 128 experts of width 768, top-8 -- Qwen3-235B's family.
QWEN3_30B = dict(num_layers=48, hidden_size=2048, num_attention_heads=32,
                 num_query_groups=4, kv_channels=128, ffn_hidden_size=6144,
                 moe_ffn_hidden_size=768)
_FP8 = {"FP8": "tensorwise", "MXFP8": "mxfp8", "NVFP4": "nvfp4"}


def _bridge26(name, model, gpu, gpus, gbs, seq, layout, value, precision, line, moe=False,
              source=BRIDGE26_ARCHIVE, overrides=None, opts=None, assumed=""):
    o = dict(BF_MOE if moe else BF_DENSE, **(opts or {}))
    if precision != "BF16":
        o["fp8"] = _FP8[precision]
        o.setdefault("quantized_weights", True)
    if not moe and layout.get("tp", 1) > 1:
        o.setdefault("tp_comm_overlap", "all")         # TE userbuffers (the recipes)
    return PublishedRun(name, model, f"{source}, line {line}", gpu, gpus, seq, gbs,
                        dict(dict(zero=1, sp=layout.get("tp", 1) > 1), **layout),
                        "model_tflops", value, "causal", precision.lower(), o,
                        model_overrides=dict(overrides or {}), assumed=assumed)


def _gptoss(name, gpu, layout, tps, line, source, opts, assumed):
    """GPT-OSS 120B on 64 GPUs, MXFP8, mbs 4, TP/PP/CP 1: the table's tokens/s/GPU."""
    r = _bridge26(name, "gpt-oss-120b", gpu, 64, 1280, 4096,
                  dict(tp=1, pp=1, cp=1, etp=1, micro_batch=4, **layout), tps, "MXFP8", line,
                  moe=True, source=source, opts=opts, assumed=assumed)
    return dataclasses.replace(r, metric="tokens_per_gpu")


_405 = dict(micro_batch=1, **EMB_LOSS)
RUNS += [
    # 26.06 container: Llama 3.1 405B, 1536 x 8192 tokens
    _bridge26("bridge26-405b-gb300-fp8", "llama3-405b", "gb300-nvl72", 256, 1536, 8192,
              dict(tp=4, pp=8, vpp=4, **_405), 2646, "FP8", 100),
    _bridge26("bridge26-405b-gb300-mxfp8", "llama3-405b", "gb300-nvl72", 256, 1536, 8192,
              dict(tp=2, pp=8, cp=2, vpp=4, **_405), 2403, "MXFP8", 101),
    _bridge26("bridge26-405b-gb300-nvfp4", "llama3-405b", "gb300-nvl72", 256, 1536, 8192,
              dict(tp=4, pp=8, vpp=4, **_405), 3575, "NVFP4", 102),
    _bridge26("bridge26-405b-gb200-fp8", "llama3-405b", "gb200-nvl72", 256, 1536, 8192,
              dict(tp=4, pp=16, vpp=4, **_405), 2129, "FP8", 103),
    _bridge26("bridge26-405b-gb200-mxfp8", "llama3-405b", "gb200-nvl72", 256, 1536, 8192,
              dict(tp=4, pp=16, vpp=8, **_405), 1976, "MXFP8", 104),
    _bridge26("bridge26-405b-gb200-nvfp4", "llama3-405b", "gb200-nvl72", 256, 1536, 8192,
              dict(tp=4, pp=16, vpp=8, **_405), 2944, "NVFP4", 105),
    _bridge26("bridge26-405b-h100-fp8", "llama3-405b", "h100-80gb", 1024, 1536, 8192,
              dict(tp=8, pp=8, cp=2, vpp=8, **_405), 822, "FP8", 106),
    # 25.11 container: Llama 3 8B / 70B and 3.1 405B on B200, 8B / 70B on GB200 / GB300
    _bridge26("bridge25-8b-gb300", "llama3-8b", "gb300-nvl72", 8, 128, 8192,
              dict(micro_batch=2), 1933, "FP8", 552),
    _bridge26("bridge25-70b-gb300-fsdp", "llama3-70b", "gb300-nvl72", 64, 256, 8192,
              dict(micro_batch=2, zero=3), 2030, "FP8", 553, opts=dict(cpu_offload_layers=20),
              assumed="FSDP 64 = Megatron-FSDP (ZeRO-3), no recomputation; activations of "
              "20 layers offloaded to the CPU (the gb300 llama3.py recipe)"),
    _bridge26("bridge25-8b-gb200", "llama3-8b", "gb200-nvl72", 8, 128, 8192,
              dict(micro_batch=2), 1622, "FP8", 565),
    _bridge26("bridge25-70b-gb200-fsdp", "llama3-70b", "gb200-nvl72", 64, 256, 8192,
              dict(micro_batch=2, zero=3), 1937, "FP8", 566, opts=dict(cpu_offload_layers=40),
              assumed="FSDP 64 = Megatron-FSDP (ZeRO-3), no recomputation; activations of "
              "40 layers offloaded to the CPU (the gb200 llama3.py recipe)"),
    _bridge26("bridge25-8b-b200", "llama3-8b", "b200", 8, 128, 8192,
              dict(micro_batch=2), 1576, "FP8", 578),
    _bridge26("bridge25-405b-b200", "llama3-405b", "b200", 128, 64, 8192,
              dict(tp=4, pp=8, cp=2, vpp=8, **_405), 1667, "FP8", 579),
    # MoE, 26.08 container (current page) on GB200 / GB300, 26.06 on B300 / H100
    _bridge26("bridge26-dsv3-gb300", "deepseek-v3", "gb300-nvl72", 256, 4096, 4096,
              dict(tp=1, pp=2, vpp=8, ep=32, etp=1, micro_batch=1, **DSV3_16), 1635,
              "MXFP8", 45, moe=True, source=BRIDGE26,
              opts=dict(recompute_modules=(), **DSV3_OPT),
              assumed="recompute_modules [] (recipe)"),
    _bridge26("bridge26-dsv3-gb200", "deepseek-v3", "gb200-nvl72", 256, 4096, 4096,
              dict(tp=1, pp=4, vpp=4, ep=64, etp=1, micro_batch=1, recompute="selective",
                   **DSV3_16), 1276, "MXFP8", 46, moe=True, source=BRIDGE26,
              opts=dict(recompute_modules=("mla_up_proj",), **DSV3_OPT)),
    _bridge26("bridge26-dsv3-b300", "deepseek-v3", "b300", 256, 4096, 4096,
              dict(tp=1, pp=8, ep=8, etp=1, micro_batch=2, recompute="selective",
                   **DSV3_8), 920, "MXFP8", 115, moe=True,
              opts=dict(recompute_modules=("mla_up_proj",), **DSV3_OPT),
              assumed="the 26.06 config (commit 8f341b04f, scripts/performance/configs/"
              "deepseek/deepseek_workload_base_configs.py lines 224-233, DEEPSEEK_V3_"
              "PRETRAIN_CONFIG_B300_V2): PP8 without VPP, mbs 2, recompute mla_up_proj, "
              "moe_a2a_overlap=False (line 140) -- Megatron allows no EP overlap at PP > 1 "
              "without VPP anyway; the row keeps the planner's ep_overlap switch on to show "
              "the rule (estimate.ep_overlap_applies)"),
    _bridge26("bridge26-qwen3-30b-gb300", "qwen3-235b-a22b", "gb300-nvl72", 8, 512, 4096,
              dict(ep=8, etp=1, micro_batch=8), 1029, "MXFP8", 66, moe=True,
              source=BRIDGE26, overrides=QWEN3_30B),
    _bridge26("bridge26-qwen3-30b-gb200", "qwen3-235b-a22b", "gb200-nvl72", 8, 512, 4096,
              dict(ep=8, etp=1, micro_batch=4), 923, "MXFP8", 67, moe=True,
              source=BRIDGE26, overrides=QWEN3_30B),
    _bridge26("bridge26-qwen3-30b-b300", "qwen3-235b-a22b", "b300", 8, 512, 4096,
              dict(ep=8, etp=1, micro_batch=8), 938, "MXFP8", 131, moe=True,
              overrides=QWEN3_30B),
    _bridge26("bridge26-qwen3-30b-h100", "qwen3-235b-a22b", "h100-80gb", 16, 1024, 4096,
              dict(ep=16, etp=1, micro_batch=1), 203, "FP8", 132, moe=True,
              overrides=QWEN3_30B, opts=dict(ep_overlap=False),
              assumed="no EP A2A overlap and no CUDA graphs, as the 26.06 config ran it "
              "(commit 8f341b04f, scripts/performance/configs/qwen/qwen3_workload_base_"
              "configs.py lines 470-477, QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1: "
              "moe_a2a_overlap=False; the current recipe perf_recipes/qwen/h100/qwen3_moe.py "
              "line 92 keeps it off)"),
    _bridge26("bridge26-qwen3-235b-gb300", "qwen3-235b-a22b", "gb300-nvl72", 256, 8192, 4096,
              dict(tp=1, pp=4, vpp=12, ep=32, etp=1, micro_batch=2, **EMB_LOSS), 1306,
              "MXFP8", 73, moe=True, source=BRIDGE26),
    _bridge26("bridge26-qwen3-235b-gb200", "qwen3-235b-a22b", "gb200-nvl72", 256, 8192, 4096,
              dict(tp=1, pp=8, vpp=3, ep=32, etp=1, micro_batch=1, **EMB_LOSS), 1077,
              "MXFP8", 74, moe=True, source=BRIDGE26),
    # 26.04.01 container (the archive's H100 row of Qwen3-235B; the later tables drop it)
    _bridge26("bridge26-qwen3-235b-h100", "qwen3-235b-a22b", "h100-80gb", 256, 8192, 4096,
              dict(tp=2, pp=8, vpp=4, ep=32, etp=1, micro_batch=1, **EMB_LOSS), 253, "FP8",
              258, moe=True, opts=dict(moe_dispatcher="alltoall"),
              assumed="the 26.04 config (commit 17a381f95, scripts/performance/configs/qwen/"
              "qwen3_llm_pretrain.py lines 177-200: moe_token_dispatcher_type alltoall, no TP "
              "comm overlap; qwen3_workload_base_configs.py lines 175-184 and 280-283, "
              "QWEN3_235B_A22B_PRETRAIN_CONFIG_H100_FP8_CS_V2: moe_a2a_overlap=True, GBS 8192)"),
]
# GPT-OSS 120B, 1280 x 4096 tokens, tokens/s/GPU (a unit with no FLOP convention; the
# planner's count is Bridge's within 0.3%); the configs (GOSS): their EP is the 26.08 rows'.
GOSS = "8f341b04f scripts/performance/configs/gpt_oss/gpt_oss_workload_base_configs.py"
RUNS += [
    _gptoss("bridge26-gptoss-120b-gb300", "gb300-nvl72", dict(ep=16), 33024, 59, BRIDGE26,
            dict(), f"{GOSS} lines 201-210 (GB300_FP8_MX_V2): EP16 mbs 4, hybridep, "
            "moe_a2a_overlap, full-iteration CUDA graph, cutedsl grouped MLP, FP8 attention "
            "(not priced); the 26.08 perf_recipes not re-read"),
    _gptoss("bridge26-gptoss-120b-gb200", "gb200-nvl72", dict(ep=64), 28672, 60, BRIDGE26,
            dict(recompute_modules=()), f"{GOSS} lines 211-221 (GB200_FP8_MX_V2): EP64 mbs 4, "
            "hybridep, moe_a2a_overlap, recompute_modules [], full-iteration CUDA graph, "
            "FP8 attention (not priced); the 26.08 perf_recipes not re-read"),
    _gptoss("bridge26-gptoss-120b-b300", "b300", dict(ep=8), 18534, 123, BRIDGE26_ARCHIVE,
            dict(ep_overlap=False), f"{GOSS} lines 134-140, 181-186, 222 (B300_FP8_MX_V2 = "
            "B300_BF16_V2): EP8 mbs 4, hybridep, TE CUDA graphs of attn/moe_router/"
            "moe_preprocess (not priced); moe_a2a_overlap not set (WorkloadBaseConfig "
            "default taken as off)"),
]
BY_NAME = {r.name: r for r in RUNS}

# ---- MaxText (JAX / XLA) on one A3 VM (8 H100-80GB), TFLOP/s per chip -------------------
# Source: AI-Hypercomputer/maxtext, README of the A3 Llama2-7B configs (commit efb6d9e4a,
# 2024-04-09, MaxText/configs/a3/llama_2_7b/README.md line 24; now src/maxtext/configs/gpu/
# a3/llama_2_7b/README.md, commit e591f30c), the run its 1vm.sh (same commit) states: FSDP 8
# over the VM's GPUs (ici_fsdp_parallelism=8), per_device_batch_size 4 of 4096 tokens,
# cuDNN flash attention through TE, remat_policy minimal_flash (matmul and attention
# outputs saved, elementwise ops recomputed), bf16 compute.  Its 2-16 VM rows are DCN data
# parallelism over FSDP-8 groups (hybrid sharding), which the planner's layouts do not
# express: left out.  MaxText counted full (non-causal) attention until July 2025.
MAXTEXT = ("AI-Hypercomputer/maxtext MaxText/configs/a3/llama_2_7b/README.md line 24 "
           "(commit efb6d9e4a), run as its 1vm.sh")
LLAMA2_7B = dict(num_layers=32, hidden_size=4096, num_attention_heads=32,
                 num_query_groups=32, kv_channels=128, ffn_hidden_size=11008,
                 vocab_size=32000)
RUNS += [
    PublishedRun("maxtext-llama2-7b-8gpu", "llama3-8b", MAXTEXT, "h100-80gb", 8, 4096, 32,
                 dict(zero=3, micro_batch=4), "model_tflops", 492, "full",
                 options=dict(attention_kernel="cudnn"), model_overrides=LLAMA2_7B,
                 assumed="XLA's fusions priced like Transformer Engine's (fused passes); "
                 "fp32 weights (MaxText's weight_dtype) and fp32 gradient reduce-scatter; "
                 "minimal_flash's elementwise recomputation not counted; Llama 2 7B as "
                 "llama3-8b's preset with Llama 2's sizes (32000 vocabulary, MHA, 11008)"),
]
BY_NAME = {r.name: r for r in RUNS}

# ---- Megatron-Core's EP-overlap figure, Qwen3-235B-A22B on 256 H100 (BF16, DeepEP) ------
# Source of the 245 -> 276 TFLOP/s (+12.7%, step 19.7 -> 17.6 s) that the EP A2A overlap
# bought ("+1f1b overlap"): NVIDIA's Megatron-MoE-ModelZoo, examples/qwen3/readme.md (commit
# 8017e11, 2025-05-27; now best_practice/qwen3/readme.md), the "Cross-node EP strategy"
# rows, run on Megatron-LM's moe_dev branch at f3e6c5: DeepEP, BF16, TP2 CP1 EP32 PP8 VPP4
# ETP1 DP16, micro-batch 1, GBS 2048, recompute "norm, act".  The launch script added the
# same day (examples/qwen3/run_235b.sh, commit 31c5686) runs both with --recompute-
# granularity selective --recompute-modules moe_act layernorm --moe-router-force-load-
# balancing, the overlap as --combined-1f1b --combined-1f1b-recipe ep_a2a -- the first
# version of today's --overlap-moe-expert-parallel-comm, with no --delay-wgrad-compute;
# model_configs/benchmarking/Qwen3-235B-A22B.yaml (same commit): flex dispatcher with
# DeepEP, distributed optimizer, grad-reduce and param-gather overlap, SP, embedding and
# loss counted in the split.  The same repository's best_practice/qwen3/run_h100_235b.sh
# (commit 1ed4179, 2026-03-09) runs the same layout with today's overlap, forced balance
# and CUDA graphs of the router and the dispatch preprocessing: "H100 config, 320 TFLOPS".
# Kept out of RUNS: the pair shows what the overlap changes (benchmarks/moe_overlap_
# prediction.py); the held-out set stays as it was.
MCORE_ZOO = ("NVIDIA/Megatron-MoE-ModelZoo examples/qwen3/readme.md and run_235b.sh "
             "(commits 8017e11, 31c5686; Megatron-LM moe_dev f3e6c5)")
_ZOO_LAYOUT = dict(tp=2, pp=8, vpp=4, ep=32, etp=1, sp=True, zero=1, micro_batch=1,
                   recompute="selective", account_embedding=True, account_loss=True)
_ZOO_OPTS = dict(MEGATRON_TE, moe_dispatcher="deepep", moe_routing="uniform",
                 recompute_modules=("layernorm",))
_ZOO_ASSUMED = ("forced balance (the script) = random router logits (Megatron's router.py), "
                "i.e. uniform routing, as for the Bridge rows; moe_act recompute not counted (the planner "
                "knows layernorm's); DeepEP's default 20 SMs; fp32 main grads")
OVERLAP_RUNS = [
    PublishedRun("zoo-qwen3-235b-deepep", "qwen3-235b-a22b", MCORE_ZOO, "h100-80gb", 256,
                 4096, 2048, dict(_ZOO_LAYOUT), "model_tflops", 245, "causal",
                 options=dict(_ZOO_OPTS, ep_overlap=False), assumed=_ZOO_ASSUMED),
    PublishedRun("zoo-qwen3-235b-deepep-overlap", "qwen3-235b-a22b", MCORE_ZOO, "h100-80gb",
                 256, 4096, 2048, dict(_ZOO_LAYOUT), "model_tflops", 276, "causal",
                 options=dict(_ZOO_OPTS, ep_overlap=True, ep_delay_wgrad=False),
                 assumed=_ZOO_ASSUMED + "; the experts' weight gradients not delayed"),
    PublishedRun("zoo-qwen3-235b-deepep-overlap-2026", "qwen3-235b-a22b",
                 "NVIDIA/Megatron-MoE-ModelZoo best_practice/qwen3/run_h100_235b.sh "
                 "(commit 1ed4179)", "h100-80gb", 256, 4096, 2048, dict(_ZOO_LAYOUT),
                 "model_tflops", 320, "causal",
                 options=dict(_ZOO_OPTS, ep_overlap=True, cuda_graphs=True),
                 assumed="the script's comment states the figure; --overlap-moe-expert-"
                 "parallel-comm with delayed weight gradients (sbatch_benchmarking.sh's "
                 "A2A_OVERLAP=1); CUDA graphs of the router and the preprocessing priced "
                 "as graphed layers"),
]
# The pair the HybridEP constants were measured on (kernels.MOE_SYNC_IDLE_SECONDS,
# estimate.FLEX_RDMA_*): NVIDIA's Nsight comparison, Qwen3-30B-A3B on 16 H100, BF16, EP16
# over two nodes, HybridEP, forced balance, delayed weight gradients off; its step times
# 24.7138 s and 20.9920 s.  Not held out: the benchmark prints it as the constants' source.
NSIGHT_SKILL = ("Megatron-Bridge skills/nemo-mbridge-perf-moe-comm-overlap/SKILL.md "
                "(commit 067f987d)")
_NSIGHT_ASSUMED = ("the config's TE CUDA graphs of moe_router + moe_preprocess not priced "
                   "(the planner's switch graphs whole layers; the measured sync idle "
                   "has them)")
OVERLAP_RUNS += [
    _bridge26(f"nsight-qwen3-30b-hybridep{tag}", "qwen3-235b-a22b", "h100-80gb", 16, 1024,
              4096, dict(ep=16, etp=1, micro_batch=1), value, "BF16", line, moe=True,
              source=NSIGHT_SKILL, overrides=QWEN3_30B,
              opts=dict(ep_overlap=on, ep_delay_wgrad=False), assumed=_NSIGHT_ASSUMED)
    for tag, on, value, line in (("", False, 244.039, 70), ("-overlap", True, 287.305, 72))
]
