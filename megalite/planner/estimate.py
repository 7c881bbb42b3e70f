"""Step time, throughput and memory of one layout: the number the search ranks by.

step = m * slot + bubble + exposed DP communication + optimizer step, where a slot is one
micro-batch's forward + backward on the slowest stage (compute from planner/kernels.py
plus the TP / EP / PP communication on its critical path and whatever part of CP's ring
the attention core does not hide).  Bubble: (p-1) slots for 1F1B [Narayanan et al. 2021];
interleaved (p-1)/v of the compute but all (p-1) p2p hops; (p-1)(F+B-W) for ZB-H1 [Qi et
al. 2024].
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Dict, Optional

from megalite.config import ModelConfig
from megalite.config.pipeline_schedules import get_schedule, paired_counts
from megalite.planner import calibration
from megalite.planner import comm_model as cm
from megalite.planner import flops as fl
from megalite.planner import host_offload
from megalite.planner import kernels
from megalite.planner import memory as mem
from megalite.planner import model_spec as ms
from megalite.planner import muon_cost
from megalite.planner.hardware import Cluster
from megalite.planner.layout import Layout
from megalite.planner.moe_cost import Routing, capacity_load, routing_imbalance

# Selective-recompute modules the cost model knows beyond training's (config.RECOMPUTE_
# MODULES): Megatron's MLA up-projections, torchtitan's op-level SAC (every other matmul).
PLANNER_ONLY_RECOMPUTE = ("mla_up_proj", "every_other_mm")

# Whose rule places the EP overlap (ModelOptions.ep_overlap_rule, ep_overlap_applies).
EP_OVERLAP_RULES = ("megatron", "megalite")

# SMs the flex dispatchers' kernels hold while a dispatch / combine is in flight.
FLEX_DISPATCH_SMS = 20

# DeepEP / HybridEP across nodes (RDMA) with the EP overlap on: the dispatch and combine
# kernels take longer beside the compute, and far less of them hides than the pairing
# allows.  Measured, not fitted: NVIDIA's Nsight comparison of Qwen3-30B-A3B on 16 H100
# (BF16, EP16 over two nodes, HybridEP; Megatron-Bridge skills/nemo-mbridge-perf-moe-comm-
# overlap/SKILL.md, "HybridEP production-shape validation", commit 067f987d): 9.079 ms of
# communication ran beside compute with the overlap off (0.11% of it: 8.25 s in all) and
# 3,958.997 ms with it on (36.55%: 10.83 s in all).  The rounded 0.11% leaves the stretch
# within 1.26-1.37.
FLEX_RDMA_COMM_SECONDS = (9.079e-3 / 0.0011, 3.958997 / 0.3655)     # overlap off, on
FLEX_RDMA_OVERLAP_STRETCH = FLEX_RDMA_COMM_SECONDS[1] / FLEX_RDMA_COMM_SECONDS[0]
FLEX_RDMA_OVERLAP_HIDDEN = 0.3655

# Adam step traffic per owned parameter: read grad (4), master, m, v (12); write master, m, v
# (12) and the bf16 weight (2).
OPTIMIZER_BYTES_PER_PARAM = 30


@dataclass(frozen=True)
class ModelOptions:
    """Assumptions that are not part of a layout (documented in docs/planner.md)."""
    grad_bytes: int = 4                    # fp32 main grads (Megatron); 2 for bf16
    flash_attention: bool = True
    headroom: float = 0.90                 # usable fraction of GPU memory
    bucket_elements: int = 40_000_000      # DP bucket (Megatron's default floor)
    dp_exposed: Optional[float] = None     # force the exposed fraction of DP comm
    tp_overlap: float = 0.0                # fraction of exposed TP comm hidden (TE userbuffers)
    tp_async_backward: bool = True         # backward's input-grad reduction behind wgrad GEMM
    fp32: bool = False
    # HBM passes over a layer's activations per forward + backward (norms, activation
    # functions, residuals): FUSED_PASSES for fused kernels (Transformer Engine, Megatron,
    # torch.compile), EAGER_PASSES for eager PyTorch (planner/calibration.py).
    elementwise_passes: Optional[float] = None   # None: FUSED_PASSES (EAGER_ with ``eager``)
    eager: bool = False                    # eager PyTorch (no fusion): torchtitan uncompiled
    local_layers: bool = False             # megalite's local layers (memory.local_layer_bytes)
    fp8: Optional[str] = None              # FP8 GEMMs: kernels.FP8_RECIPES key, None = bf16
    fp4_gemm: Optional[float] = None       # NVFP4 GEMMs over the FP8 ceiling (calibration)
    attention_kernel: str = "cudnn"        # kernels.ATTENTION_TFLOPS key (flash kernels)
    causal: bool = True                    # causal mask: flash kernels skip half the scores
    recompute_modules: tuple = ("core_attn",)   # selective recompute (+ "every_other_mm")
    moe_routing: Routing = "uniform"       # moe_cost.routing_imbalance
    ep_overlap: bool = False               # EP all-to-all behind another micro-batch's compute
    # whose rule says where it runs, and so what is priced: "megatron" (a published
    # Megatron-Core run: PP 1 or virtual stages) or "megalite" (``megalite plan``'s
    # prediction of a megalite run: PP 1 or a schedule that pairs F&B -- 1F1B as combined
    # 1F1B, with its extra in-flight micro-batch, DualPipeV); ``ep_overlap_applies``
    ep_overlap_rule: str = "megatron"
    # Megatron's --delay-wgrad-compute beside the overlap (Bridge sets both; the first
    # version, --combined-1f1b-recipe ep_a2a of May 2025, ran without): the experts' weight
    # gradients wait behind the dispatch backward instead of delaying its start
    ep_delay_wgrad: bool = True
    moe_dispatcher: str = "alltoall"       # moe_cost.DISPATCHERS: NCCL, DeepEP, HybridEP
    moe_pad_to_capacity: bool = False      # --moe-pad-expert-input-to-capacity
    # SMs a flex dispatcher's kernels hold (Megatron's moe_flex_dispatcher_num_sms, formerly
    # moe_{deepep,hybridep}_num_sms); None: FLEX_DISPATCH_SMS, DeepEP's historical default
    moe_dispatch_sms: Optional[int] = None
    # Megatron's --cpu-offloading --cpu-offloading-num-layers N: the activations of the
    # first N layers of each model chunk go to host memory in forward, back in backward
    cpu_offload_layers: int = 0
    # TP collectives pipelined with their GEMMs: "all" (Transformer Engine's userbuffers),
    # "forward" (PyTorch's async TP, 2024: the forward pass's all-gather + matmul and
    # matmul + reduce-scatter), "none"
    tp_comm_overlap: str = "none"
    fsdp_reshard: bool = True              # ZeRO-3 frees gathered weights after forward
    fp8_param_gather: bool = False         # ZeRO-3 gathers FP8 weights (1 byte)
    # Megatron's --fp8-param-gather / --fp4-param-gather under ZeRO-1: the quantized copy is
    # the weight, no 16-bit one (memory.quantized_weight_bytes; the gathers' dtype is not
    # changed: MXFP8's run through the bf16 gradient buffer)
    quantized_weights: bool = False
    moe_output_kept: bool = True           # memory.ActivationOptions.moe_output_kept
    # Adam's state per parameter under Megatron's --use-precision-aware-optimizer
    # (optimizer_precision.adam_state_bytes): the bytes of exp_avg and exp_avg_sq (4 fp32,
    # 2 bf16 / fp16, 1 fp8) and of the master weight (4; 2 as fp16 or as the 16 low bits
    # FusedAdam keeps of an fp32 master).  Memory only: the step's traffic,
    # OPTIMIZER_BYTES_PER_PARAM, is not changed.
    moment_bytes: tuple = (4, 4)
    master_bytes: int = 4
    # Megatron's --optimizer-cpu-offload --optimizer-offload-fraction F (host_offload.py):
    # the share of each rank's optimizer shard on the host, Adam run there, transfers
    # overlapped (--overlap-cpu-optimizer-d2h-h2d) or not; ``optimizer_offload_master``:
    # the fp32 master leaves the GPU too (--use-precision-aware-optimizer, which
    # Megatron-LM requires; Megatron-Bridge's runs without it keep the master on the GPU)
    optimizer_offload: float = 0.0
    optimizer_offload_overlap: bool = False
    optimizer_offload_master: bool = True
    pp_overlap: bool = True                # interleaved p2p behind the next chunk's compute
    muon_ns_steps: int = 0                 # --optimizer muon's Newton-Schulz steps; 0: AdamW
    # Megatron's --cuda-graph-impl local | transformer_engine: a layer pass is one graph
    # launch, so the host's per-kernel launch time is no longer exposed (kernels.py)
    cuda_graphs: bool = False

    def __post_init__(self):
        if self.ep_overlap_rule not in EP_OVERLAP_RULES:
            raise ValueError(f"ModelOptions.ep_overlap_rule: {self.ep_overlap_rule!r}; "
                             f"choose from {EP_OVERLAP_RULES}")
        if not 0.0 <= self.optimizer_offload <= 1.0:
            raise ValueError(f"ModelOptions.optimizer_offload {self.optimizer_offload}: a "
                             f"share in [0, 1]")
        if self.optimizer_offload and self.muon_ns_steps:
            raise ValueError("ModelOptions: Megatron's hybrid optimizer offloads Adam (or "
                             "SGD), not Muon")

    @property
    def precision(self) -> mem.Precision:
        prec = mem.Precision.fp32() if self.fp32 else mem.Precision.bf16(self.grad_bytes)
        prec = replace(prec, adam=sum(self.moment_bytes),
                       master=0 if self.fp32 else self.master_bytes)
        return replace(prec, muon=True) if self.muon_ns_steps else prec

    @property
    def activations(self) -> mem.ActivationOptions:
        return mem.ActivationOptions(self.flash_attention, element_scale=2 if self.fp32 else 1,
                                     local_layers=self.local_layers,
                                     recompute_modules=tuple(
                                         x for x in self.recompute_modules
                                         if x != "every_other_mm") or ("layernorm",),
                                     paired=self.ep_overlap and self.ep_overlap_rule == "megalite",
                                     moe_output_kept=self.moe_output_kept)

    @property
    def passes(self) -> float:
        if self.elementwise_passes is not None:
            return self.elementwise_passes
        return calibration.EAGER_PASSES if self.eager else calibration.FUSED_PASSES


@dataclass
class Estimate:
    layout: Layout
    memory: Dict[str, int]
    capacity: int
    times: Dict[str, float] = field(default_factory=dict)
    flops: Dict[str, float] = field(default_factory=dict)
    moe_load: float = 1.0          # most loaded EP rank's tokens over the mean (moe_cost.py)

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.capacity

    @property
    def step(self) -> float:
        return self.times.get("step", float("inf"))

    @property
    def tflops(self) -> float:
        """Model TFLOP/s per GPU (no recomputation counted), Megatron-Core's convention."""
        return self.flops["model"] / self.step / self.layout.world / 1e12

    @property
    def hw_tflops(self) -> float:
        """Hardware TFLOP/s per GPU (recomputation counted), Narayanan et al.'s convention."""
        return self.flops["hardware"] / self.step / self.layout.world / 1e12

    def mfu(self, cluster: Cluster) -> float:
        return self.tflops / cluster.gpu.peak_tflops

    def to_dict(self, cluster: Cluster) -> dict:
        return {"layout": self.layout.to_dict(), "flags": self.layout.parallel_flags(),
                "memory_bytes": dict(self.memory),
                "capacity_bytes": self.capacity, "fits": self.fits,
                "times_s": dict(self.times), "tflops_per_gpu": self.tflops,
                "hw_tflops_per_gpu": self.hw_tflops, "mfu": self.mfu(cluster)}


def memory_of(m: ModelConfig, L: Layout, seq: int, cluster: Cluster,
              opts: ModelOptions) -> Estimate:
    peak = mem.peak_rank_memory(m, L, seq, opts.precision, opts.activations)
    if L.recompute == "full" and L.recompute_layers:
        # Block recomputation: the first N layers of each chunk keep only their input, the
        # rest everything (memory.py models all-or-nothing; mix the two by layer share).
        full = dict(peak)
        none = mem.peak_rank_memory(m, replace(L, recompute="none", recompute_layers=None),
                                    seq, opts.precision, opts.activations)
        kinds = ms.stage_layer_kinds(m, L.pp, full["pp_rank"], L.vpp, *L.stage_split)
        share = min(1.0, L.recompute_layers * L.vpp / max(1, sum(kinds)))
        act = share * full["activations"] + (1 - share) * (none["activations"])
        peak = dict(full, activations=int(act))
        peak["total"] = peak["weights"] + peak["grads"] + peak["optimizer"] + peak["activations"]
    if opts.cpu_offload_layers:
        share = host_offload.offloaded_share(m, L, peak["pp_rank"], opts.cpu_offload_layers)
        gone = int(share * peak["activations"])
        peak = dict(peak, activations=peak["activations"] - gone, host=gone)
        peak["total"] -= gone
    if opts.fp8 and cluster.gpu.fp8_matmul_tflops:
        # Transformer Engine keeps each weight's quantized copies between micro-batches
        # (the cast once per step that kernels.weight_cast_seconds counts; with quantized
        # primary weights instead of the 16-bit ones), and saves the GEMM inputs backward
        # needs in FP8: half their bytes.
        copies = mem.quantized_weight_bytes(m, L, peak["pp_rank"], opts.precision.weight,
                                            kernels.FP8_RECIPES[opts.fp8].operand_bytes,
                                            opts.quantized_weights)
        saved = fp8_activation_saving(m, L, seq, peak["pp_rank"], opts)
        peak = dict(peak, weights=peak["weights"] + copies,
                    activations=peak["activations"] - saved)
        peak["total"] += copies - saved
    if opts.optimizer_offload:
        left, host, moved = host_offload.optimizer_offload_bytes(
            peak["optimizer"], opts.moment_bytes, opts.master_bytes, opts.optimizer_offload,
            opts.optimizer_offload_master)
        peak = dict(peak, optimizer=left, host=peak.get("host", 0) + host,
                    offloaded_params=moved,
                    total=peak["total"] - (peak["optimizer"] - left))
    if L.zero >= 3 and not opts.fsdp_reshard and L.pp == 1:
        # ZeRO-3 without resharding after forward: the gathered bf16 weights stay until
        # backward (with PP memory.rank_memory counts them, and the unsharded gradients).
        unsharded = peak["params"] * opts.precision.weight
        peak = dict(peak, weights=peak["weights"] + unsharded)
        peak["total"] += unsharded
    return Estimate(L, peak, int(cluster.gpu.memory_bytes * opts.headroom))


def fp8_activation_saving(m: ModelConfig, L: Layout, seq: int, pp_rank: int,
                          opts: ModelOptions) -> int:
    """Bytes FP8 training does not keep of what memory.py counts: the saved inputs of the
    GEMMs (QKV and fc1 inputs, the projection and fc2 inputs -- MLA: the up projections'
    latents too --, the experts' inputs) in 1 byte instead of 2, on the in-flight
    micro-batches of stage ``pp_rank``."""
    if L.recompute == "full" and not L.recompute_layers:
        return 0
    t, T = L.tp, (seq // L.cp) * L.micro_batch
    sp = t if L.sp else 1
    h = m.hidden_size
    if m.multi_latent_attention:
        attn_in = T // sp * ((m.q_lora_rank or 0) + m.kv_lora_rank) + \
            T * m.num_attention_heads * m.v_head_dim // t
    else:
        attn_in = T * m.num_attention_heads * m.resolved_kv_channels() // t
    kinds = ms.with_mtp_layers(m, ms.stage_layer_kinds(m, L.pp, pp_rank, L.vpp,
                                                       *L.stage_split),
                               pp_rank == L.output_rank)
    norm_outs = 0 if "layernorm" in opts.activations.recompute_modules and \
        L.recompute == "selective" else 2 * T * h // sp
    per = 0
    for n, moe in zip(kinds, (False, True)):
        if not n:
            continue
        one = norm_outs + attn_in                           # (QKV, fc1) inputs, proj input
        if moe:
            copies = T * m.moe_router_topk * L.etp // t
            one += copies * h + copies * ms.moe_ffn(m) // L.etp
        else:
            one += T * m.resolved_ffn_hidden_size() // t     # fc2 input
        per += n * one
    return int(per * mem.in_flight(L, pp_rank, opts.activations.paired))


def _stages(m: ModelConfig, L: Layout):
    """Representative pipeline ranks and how many ranks each stands for: the first, the
    last, and one middle rank per distinct (dense, MoE) layer mix -- a model whose first
    layers are dense (DeepSeek-V3: 3 of 61) gives its middle stages different loads, and
    the step waits for the heaviest.  Of the ranks with one mix the lowest stands for them
    all: its warm-up is the longest and it has the least cool-down idle to hide DP in."""
    if L.pp <= 2:
        return [(r, 1) for r in range(L.pp)]
    if not m.num_experts or m.moe_layer_freq == 1:
        return [(0, 1), (1, L.pp - 2), (L.pp - 1, 1)]   # middle stages differ in nothing
    freq = m.moe_layer_freq
    key = (m.num_layers, tuple(freq) if isinstance(freq, list) else freq)
    if key not in _MOE_PATTERNS:            # parsing --moe-layer-freq per layer is slow
        _MOE_PATTERNS[key] = tuple(m.is_moe_layer(i) for i in range(m.num_layers))
    return [(0, 1)] + list(_middle_groups(_MOE_PATTERNS[key], L.pp, L.vpp, L.stage_split,
                                          m.mtp_num_layers or 0)) + [(L.pp - 1, 1)]


_MOE_PATTERNS: dict = {}


@lru_cache(maxsize=1024)
def _middle_groups(moe: tuple, pp: int, vpp: int, split: tuple, mtp_layers: int) -> tuple:
    """(lowest rank, ranks) per distinct (dense, MoE) mix of the middle stages; ``moe``:
    which layers hold experts (the search asks this for many layouts)."""
    groups: dict = {}
    for r in range(1, pp - 1):
        ids = ms.pipeline_split(len(moe), pp, vpp, split[0], split[1], split[2],
                                mtp_layers, split[3], split[4]).rank_layers(r)
        key = sum(moe[i] for i in ids), len(ids)
        first, n = groups.get(key, (r, 0))
        groups[key] = (first, n + 1)
    return tuple(sorted(groups.values()))


def overlapped(comm: float, gemm: float, chunks: int) -> float:
    """Exposed part of a collective pipelined with the GEMM it feeds in ``chunks`` pieces
    (Transformer Engine's comm-GEMM overlap, PyTorch's async TP): the first piece waits,
    the rest run behind the GEMM's remaining pieces."""
    if comm <= 0:
        return 0.0
    first = comm / max(1, chunks)
    return first + max(0.0, comm - first - gemm * (1 - 1 / max(1, chunks)))


def _unpaired_share(L: Layout, r: int) -> float:
    """Share of a stage's chunk forwards with no backward beside them (warm-up; the
    cool-down mirrors it), of m * v: the schedule's ``unpaired_forwards`` (Megatron's
    p - r - 1 for 1F1B, 2(p - r - 1) + (v - 1)p chunks interleaved, DualPipeV's phases)."""
    p, v, m = L.pp, L.vpp, L.num_micro_batches
    if p == 1:
        return 1.0 / max(1, m)              # the first forward and the last backward
    if get_schedule(L.schedule).combined is not None:   # megalite's combined 1F1B: p - r
        return paired_counts(L.schedule, p, m, v)[r][1] / (m * v)
    return get_schedule(L.schedule).unpaired_forwards(p, m, v, r) / (m * v)


def ep_overlap_applies(L: Layout, opts: ModelOptions) -> bool:
    """Whether ``--ep-overlap`` (Megatron's --overlap-moe-expert-parallel-comm) can run on
    this layout.  Megatron pairs one micro-batch's forward with another's backward inside
    the interleaved schedule only: with PP > 1 it requires virtual stages (megatron/core/
    transformer/transformer_config.py, __post_init__: "If enabling EP A2A overlap,
    virtual_pipeline_model_parallel_size must be specified when pipeline_model_parallel_size
    > 1").  On plain 1F1B the all-to-alls stay on the critical path.  megalite's rule
    (``ep_overlap_rule="megalite"``, training's "--overlap-moe-expert-parallel-comm needs
    F&B pairs") is the other way round: a schedule that pairs F&B (``pairs_f_and_b``:
    1F1B run as combined 1F1B, DualPipeV), not interleaving."""
    if not opts.ep_overlap or L.pp == 1:
        return opts.ep_overlap
    if opts.ep_overlap_rule == "megalite":
        return get_schedule(L.schedule).pairs_f_and_b
    return L.vpp > 1


def megalite_run_settings(opts: ModelOptions) -> Dict[str, bool]:
    """The ``ParallelConfig`` fields a megalite run sets for what ``opts`` prices (empty
    under Megatron's rule, a published run's): the search validates each candidate with
    them and the printed flags carry them, so training's own rules (the overlap needs F&B
    pairs, --delay-wgrad-compute excludes a recomputed MoE layer) pick the layouts."""
    if not (opts.ep_overlap and opts.ep_overlap_rule == "megalite"):
        return {}
    return {"overlap_moe_expert_parallel_comm": True,
            "delay_wgrad_compute": opts.ep_delay_wgrad}


def with_run_settings(cfg, opts: ModelOptions):
    """``cfg`` (a layout's ``MegaliteConfig``) with ``megalite_run_settings(opts)`` set."""
    for name, value in megalite_run_settings(opts).items():
        setattr(cfg.parallel, name, value)
    return cfg


def paired_ep_exposed(ep: float, c: dict, delay_wgrad: bool = True) -> tuple:
    """(exposed, overlapped) seconds of one micro-batch's EP all-to-alls ``ep`` when
    Megatron's EP A2A overlap pairs its layers with another micro-batch's, and ``c`` holds
    the MoE layers' compute (kernels.stage_compute: ``moe_f`` / ``moe_b`` their passes,
    ``mlp_f`` / ``mlp_b`` their routed experts; the rest, shared experts included, is the
    attention side).  The pairing is fixed per layer
    (megatron/core/models/common/model_chunk_schedule_plan.py, TransformerLayerSchedulePlan
    .run's docstring):
        comm stream:    combine_bwd      | dispatch_fwd -> dispatch_bwd     | combine_fwd
        compute stream: pre_dispatch_fwd | mlp_bwd -> mlp_bwd_dw -> mlp_fwd | pre_dispatch_bwd
    so each all-to-all hides only behind its partner: a combine longer than the other
    micro-batch's attention block sticks out even where the step as a whole has compute
    to spare, and dense layers, the embedding and the output layer hide nothing.  The four
    all-to-alls move the same bytes (dispatch = combine, forward = backward): a quarter each.
    In the middle block the data decide the order: the expert forward needs the dispatch
    forward's tokens, the dispatch backward the experts' data gradients (``mlp_bd``; their
    weight gradients are delayed behind it -- ``delay_wgrad``, Megatron's
    --delay-wgrad-compute; without it the expert backward returns its input gradient only
    after its weight gradients, so the dispatch backward waits for both)."""
    if ep <= 0:
        return 0.0, 0.0
    q = ep / 4
    attn_f, attn_b = c["moe_f"] - c["mlp_f"], c["moe_b"] - c["mlp_b"]
    dgrad, wgrad, fwd = c["mlp_bd"], c["mlp_b"] - c["mlp_bd"], c["mlp_f"]
    ready = dgrad if delay_wgrad else dgrad + wgrad        # the dispatch backward's input
    middle = max(max(q, ready) + q, max(dgrad + wgrad, q) + fwd) - (dgrad + wgrad + fwd)
    exposed = max(0.0, q - attn_f) + middle + max(0.0, q - attn_b)
    return exposed, ep - exposed


def _stage_row(m: ModelConfig, L: Layout, seq: int, r: int, cluster: Cluster,
               opts: ModelOptions, imbalance: float = 1.0) -> dict:
    """Per-micro-batch times of pipeline rank ``r``: compute (t_f, t_b) and exposed comm."""
    mbs = L.num_micro_batches
    c = kernels.stage_compute(m, L, seq, r, cluster, opts, imbalance)
    t_f, t_b = c["t_f"], c["t_b"]
    evts = cm.events(m, L, seq, r, 4 if opts.fp32 else opts.grad_bytes,
                     dtype_bytes=4 if opts.fp32 else 2, fsdp_reshard=opts.fsdp_reshard,
                     param_gather_bytes=1 if opts.fp8_param_gather and opts.fp8 else None,
                     dispatcher=opts.moe_dispatcher,
                     # DeepEP's node is the host (an NVL72 tray); HybridEP's the NVLink domain
                     dispatch_node=cluster.gpus_per_node if opts.moe_dispatcher == "deepep"
                     else cluster.nvlink_domain)
    comm = cm.comm_seconds(evts, L, cluster, ep_load=imbalance)
    hidden = 0.0 if opts.tp_async_backward else comm.get("tp_hidden", 0.0)
    fwd, rest = comm.get("tp_fwd", 0.0) / mbs, (comm.get("tp", 0.0) + hidden) / mbs
    if opts.tp_comm_overlap == "all":          # TE userbuffers: every TP collective
        tp = overlapped(fwd + rest, c["gemm"], L.tp)
    elif opts.tp_comm_overlap == "forward":    # PyTorch async TP (2024): the forward's
        tp = overlapped(fwd, c["gemm"] / 3, L.tp) + rest
    else:
        tp = fwd + rest
    tp *= 1 - opts.tp_overlap
    # ring attention sends the next K/V block behind the current block's attention;
    # the all-to-alls of --cp-comm-type a2a block (nothing to hide them behind)
    ring_hidden = c["core"] if L.cp_comm == "p2p" else 0.0
    ep = comm.get("ep", 0.0) / mbs
    pp = comm.get("pp", 0.0) / mbs
    interleaved_p2p = L.vpp > 1 and opts.pp_overlap
    nic_shared = 0.0
    # the dispatcher's host syncs idle the GPU unless another micro-batch's work runs beside
    # them (the EP overlap's pairs) or the layer is one graph (kernels.MOE_SYNC_IDLE_SECONDS)
    sync = 0.0 if opts.cuda_graphs else c["moe_layers"] * kernels.MOE_SYNC_IDLE_SECONDS
    if ep_overlap_applies(L, opts):
        # Megatron's EP A2A overlap pairs one micro-batch's forward with another's
        # backward, the all-to-alls of each behind the other's compute -- in the 1F1B
        # steady state only: the warm-up's forwards and the cool-down's backwards run alone.
        # It pairs them layer by layer; the embedding and the output layer + loss (and
        # the MTP heads) run before and after the layers with the comm stream idle
        # (megatron/core/models/common/model_chunk_schedule_plan.py, the chunk schedule's
        # phases 0 and 6), so they hide no all-to-all.
        alone = _unpaired_share(L, r)
        if interleaved_p2p and cm.leaves_node(L, cluster, "ep"):
            # Meanwhile the interleaved schedule's p2p (asynchronous, beside the paired
            # chunks: schedules.py, send_forward_recv_forward(overlap_p2p_comm=True)) goes
            # to the neighbouring stage -- on another node, since an EP group that leaves
            # the node lies inside one stage -- through the NIC the all-to-all's other-node
            # share uses: one NIC per GPU (DGX H100: 8 x 400 Gb/s ConnectX-7), and NCCL's
            # PXN sends what is bound for rail j through NIC j.  Where the all-to-all keeps
            # that NIC busy, the p2p's bytes add to its time.
            nic_shared = pp
        # DeepEP / HybridEP over the NICs, measured as a whole (the SMs they hold
        # included): stretched, and at most the measured share hidden
        rdma = opts.moe_dispatcher != "alltoall" and cm.leaves_node(L, cluster, "ep")
        hops = (ep + nic_shared) * (FLEX_RDMA_OVERLAP_STRETCH if rdma else 1.0)
        exposed, hidden_behind = paired_ep_exposed(hops, c, opts.ep_delay_wgrad)
        stolen = 0.0
        if rdma:
            hidden_behind = min(hidden_behind, FLEX_RDMA_OVERLAP_HIDDEN * hops)
            exposed = hops - hidden_behind
        elif opts.moe_dispatcher != "alltoall":
            # DeepEP / HybridEP kernels move the tokens on SMs of their own (Megatron's
            # moe_flex_dispatcher_num_sms: "historical default 20", transformer_config.py),
            # so the compute beside them runs on the rest while they are in flight.
            sms = opts.moe_dispatch_sms or FLEX_DISPATCH_SMS
            s = min(sms, cluster.gpu.sms - 1) / cluster.gpu.sms
            stolen = (1 - alone) * hidden_behind * s / (1 - s)
        ep = alone * ep + (1 - alone) * exposed + stolen
        sync *= alone
    # p2p: 1F1B's sends block in the steady state; interleaving overlaps them with the
    # next chunk (Megatron's --overlap-p2p-communication, 2023; ``pp_overlap``), leaving
    # what a message takes beyond a chunk (nothing more when it shares the NIC above).
    if nic_shared:
        pp = 0.0
    elif interleaved_p2p:
        pp = max(0.0, pp - (t_f + t_b))
    offload = host_offload.activation_offload_seconds(m, L, seq, r, cluster,
                                                      opts.cpu_offload_layers,
                                                      opts.activations, t_f, t_b)
    row = dict(r=r, t_f=t_f, t_b=t_b, rec=c["rec"], tp=tp, offload=offload,
               cp=max(0.0, comm.get("cp", 0.0) / mbs - ring_hidden), ep=ep, pp=pp,
               pp_hop=comm.get("pp", 0.0) / mbs / max(1, L.vpp), dp=comm.get("dp", 0.0),
               cast=c["cast"], moe_sync=sync)
    row["slot"] = t_f + t_b + row["tp"] + row["cp"] + row["ep"] + row["pp"] + offload + sync
    return row


def _bubble(L: Layout, worst: dict, mean_work: float, mean_hop: float) -> float:
    """Pipeline fill and drain.  ``mean_work``: a micro-batch's slot without its p2p;
    ``mean_hop``: one forward and one backward message between neighbouring stages.  The
    warm-up crosses p-1 stage boundaries whatever the interleaving, so interleaving divides
    the bubble's compute by v but not its hops (the v-fold extra p2p of the schedule)."""
    p = L.pp
    if p == 1:
        return 0.0
    # the forward (+ recompute) share of the slowest stage's slot, its communication
    # shared in proportion: what ZB-H1's (p-1)(F + B - W) with B = W leaves exposed
    comm = worst["slot"] - worst["t_f"] - worst["t_b"]
    compute = worst["t_f"] + worst["t_b"]
    frac = (worst["t_f"] + worst["rec"]) / compute if compute else 0.0
    forward_part = worst["t_f"] + worst["rec"] + comm * frac
    return get_schedule(L.schedule).bubble_time(p, L.vpp, mean_work, mean_hop,
                                                forward_part)


def _dp_exposed(m: ModelConfig, L: Layout, row: dict, opts: ModelOptions) -> float:
    """What of the DP reduction sticks out of the compute that can hide it.

    ZeRO-0/1 reduce the accumulated gradients during the last micro-batch's backward (ZeRO-1
    gathers parameters during the next forward); ZeRO-2/3 communicate every micro-batch,
    behind the compute of the ones that follow -- except FSDP2 under PP, which gathers once
    at a chunk's first forward and reduces once after its last backward, as ZeRO-1 does.
    Stage r also hides it in its r cool-down idle slots.  At least the last bucket is
    exposed.
    """
    total, mbs = row["dp"], L.num_micro_batches
    if total <= 0:
        return 0.0
    if opts.dp_exposed is not None:
        return opts.dp_exposed * total
    idle = row["r"] * row["t_b"]
    per_step = L.zero == 1 or (L.zero == 3 and L.pp > 1)
    window = {0: row["t_b"]}.get(L.zero, row["t_b"] + row["t_f"] if per_step
                                 else mbs * (row["t_b"] + row["t_f"])) + idle
    params = L.stage_params(m, row["r"]).total
    bucket = total * min(1.0, opts.bucket_elements / max(1, params)) / (2 if L.zero else 1)
    exposed = max(bucket, total - window)
    if L.zero >= 2 and not per_step:
        exposed = max(exposed, total / mbs - row["t_b"] - idle)
    return exposed


def estimate(m: ModelConfig, L: Layout, seq: int, cluster: Cluster,
             opts: ModelOptions = ModelOptions(), est: Optional[Estimate] = None) -> Estimate:
    est = est or memory_of(m, L, seq, cluster, opts)
    mbs = L.num_micro_batches
    stages = _stages(m, L)
    load = capacity_load(m, routing_imbalance(opts.moe_routing, m, L, seq),
                         opts.moe_pad_to_capacity)
    rows = [_stage_row(m, L, seq, r, cluster, opts, load) for r, _ in stages]
    weights = [w for _, w in stages]
    worst = max(rows, key=lambda x: x["slot"])

    def mean(key):
        return sum(key(r) * w for r, w in zip(rows, weights)) / L.pp

    mean_compute = mean(lambda r: r["t_f"] + r["t_b"])
    bubble = _bubble(L, worst, mean(lambda r: r["slot"] - r["pp"]), mean(lambda r: r["pp_hop"]))
    dp = max(_dp_exposed(m, L, r, opts) for r in rows)
    local = est.memory["params"] / L.dense_shards if L.zero >= 1 else est.memory["params"]
    optim = local * (1 - opts.optimizer_offload) * OPTIMIZER_BYTES_PER_PARAM / (
        cluster.gpu.hbm_gbps * 1e9 * cluster.eff.hbm)
    # the host's share: gradients out, Adam on the CPU, parameters back (host_offload.py)
    host_optim = host_offload.optimizer_offload_seconds(
        est.memory.get("offloaded_params", 0), cluster, opts.optimizer_offload_overlap)
    optim += host_optim
    optim += kernels.weight_cast_seconds(est.memory["params"], cluster, opts)
    if opts.muon_ns_steps:      # Newton-Schulz GEMMs of the slowest stage (muon_cost.py)
        optim += max(muon_cost.stage_newton_schulz_flops(m, L, r["r"], opts.muon_ns_steps)
                     for r in rows) / (cluster.gpu.peak_tflops * 1e12 * cluster.eff.compute)
    est.times = {"compute": mbs * mean_compute,
                 "imbalance": mbs * (worst["t_f"] + worst["t_b"] - mean_compute),
                 "tp": mbs * worst["tp"], "cp": mbs * worst["cp"], "ep": mbs * worst["ep"],
                 "pp": mbs * worst["pp"], "offload": mbs * worst["offload"],
                 "moe_sync": mbs * worst["moe_sync"],
                 "bubble": bubble, "dp": dp, "optimizer": optim,
                 "dp_total": max(r["dp"] for r in rows), "fp8_cast": mbs * worst["cast"],
                 "optimizer_offload": host_optim}
    est.moe_load = load
    est.times["step"] = mbs * worst["slot"] + bubble + dp + optim
    est.flops = fl.iteration_flops(m, seq, L.global_batch, L.recompute)
    return est
