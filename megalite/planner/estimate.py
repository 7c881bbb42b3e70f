"""Step time, throughput and memory of one layout: the number the search ranks by.

step = m * slot + bubble + exposed DP communication + optimizer step, where a slot is one
micro-batch's forward + backward on the slowest stage (compute at peak x efficiency plus
the TP / EP / PP communication on its critical path and whatever part of CP's ring the
attention core does not hide).  Bubble: (p-1) slots for 1F1B [Narayanan et al. 2021],
(p-1)/v for interleaved, (p-1)(F+B-W) for ZB-H1 [Qi et al. 2024].
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

from megalite.config import ModelConfig
from megalite.planner import comm_model as cm
from megalite.planner import flops as fl
from megalite.planner import memory as mem
from megalite.planner import model_spec as ms
from megalite.planner.hardware import Cluster
from megalite.planner.layout import Layout

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
    elementwise_passes: float = 6.0        # HBM passes over a layer's activations (fwd+bwd)
    local_layers: bool = False             # megalite's local layers (memory.local_layer_bytes)

    @property
    def precision(self) -> mem.Precision:
        return mem.Precision.fp32() if self.fp32 else mem.Precision.bf16(self.grad_bytes)

    @property
    def activations(self) -> mem.ActivationOptions:
        return mem.ActivationOptions(self.flash_attention, element_scale=2 if self.fp32 else 1,
                                     local_layers=self.local_layers)


@dataclass
class Estimate:
    layout: Layout
    memory: Dict[str, int]
    capacity: int
    times: Dict[str, float] = field(default_factory=dict)
    flops: Dict[str, float] = field(default_factory=dict)

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
                "emittable": self.layout.emittable, "memory_bytes": dict(self.memory),
                "capacity_bytes": self.capacity, "fits": self.fits,
                "times_s": dict(self.times), "tflops_per_gpu": self.tflops,
                "hw_tflops_per_gpu": self.hw_tflops, "mfu": self.mfu(cluster)}


def memory_of(m: ModelConfig, L: Layout, seq: int, cluster: Cluster,
              opts: ModelOptions) -> Estimate:
    peak = mem.peak_rank_memory(m, L, seq, opts.precision, opts.activations)
    return Estimate(L, peak, int(cluster.gpu.memory_bytes * opts.headroom))


def _stages(L: Layout):
    """Representative pipeline ranks (first, a middle one, last) and how many each stands for."""
    if L.pp == 1:
        return [(0, 1)]
    if L.pp == 2:
        return [(0, 1), (1, 1)]
    return [(0, 1), (1, L.pp - 2), (L.pp - 1, 1)]


def _stage_row(m: ModelConfig, L: Layout, seq: int, r: int, cluster: Cluster,
               opts: ModelOptions) -> dict:
    """Per-micro-batch times of pipeline rank ``r``: compute (t_f, t_b) and exposed comm."""
    F = cluster.effective_flops() * (0.5 if opts.fp32 else 1.0)   # fp32 runs on TF32 cores
    per_gpu, mbs = L.tp * L.cp, L.num_micro_batches
    kinds = ms.stage_layer_kinds(m, L.pp, r, L.vpp, *L.stage_split)
    f = fl.stage_flops_per_microbatch(m, kinds, seq, L.micro_batch, r == L.pp - 1, L.recompute)
    t_f, t_b = f["fwd"] / per_gpu / F, f["bwd"] / per_gpu / F
    # Memory-bound work (norms, activation functions, dropout, softmax): HBM passes over
    # the layer's activations, split like the FLOPs (forward 1, backward 2, recompute 1).
    hbm = cluster.gpu.hbm_gbps * 1e9 * cluster.eff.hbm
    act = sum(n * mem.layer_activation_bytes(m, L, moe, seq, opts.activations, "none")
              for n, moe in zip(kinds, (False, True)) if n)
    extra = opts.elementwise_passes * act / hbm
    rec = 1.0 if L.recompute == "full" else 0.0
    t_f, t_b = t_f + extra / (3 + rec), t_b + extra * (2 + rec) / (3 + rec)
    comm = cm.comm_seconds(cm.events(m, L, seq, r, 4 if opts.fp32 else opts.grad_bytes,
                                     dtype_bytes=4 if opts.fp32 else 2), L, cluster)
    tp = comm.get("tp", 0.0) + (0.0 if opts.tp_async_backward else comm.get("tp_hidden", 0.0))
    # ring attention sends the next K/V block behind the current block's attention;
    # the all-to-alls of --cp-comm-type a2a block (nothing to hide them behind)
    ring_hidden = 3 * f["core"] / per_gpu / F if L.cp_comm == "p2p" else 0.0
    row = dict(r=r, t_f=t_f, t_b=t_b, rec=f["recompute"] / per_gpu / F,
               tp=tp * (1 - opts.tp_overlap) / mbs,
               cp=max(0.0, comm.get("cp", 0.0) / mbs - ring_hidden),
               ep=comm.get("ep", 0.0) / mbs, pp=comm.get("pp", 0.0) / mbs,
               dp=comm.get("dp", 0.0))
    row["slot"] = t_f + t_b + row["tp"] + row["cp"] + row["ep"] + row["pp"]
    return row


def _bubble(L: Layout, worst: dict, mean_slot: float) -> float:
    p = L.pp
    if p == 1:
        return 0.0
    if L.schedule == "zero-bubble":        # (p-1)(F + B - W) with B = W; B carries recompute
        comm = worst["slot"] - worst["t_f"] - worst["t_b"]
        frac = (worst["t_f"] + worst["rec"]) / (worst["t_f"] + worst["t_b"])
        return (p - 1) * (worst["t_f"] + worst["rec"] + comm * frac)
    return (p - 1) * mean_slot / L.vpp


def _dp_exposed(m: ModelConfig, L: Layout, row: dict, opts: ModelOptions) -> float:
    """What of the DP reduction sticks out of the compute that can hide it.

    ZeRO-0/1 reduce the accumulated gradients during the last micro-batch's backward (ZeRO-1
    gathers parameters during the next forward); ZeRO-2/3 communicate every micro-batch,
    behind the compute of the ones that follow.  Stage r also hides it in its r cool-down
    idle slots.  At least the last bucket is exposed.
    """
    total, mbs = row["dp"], L.num_micro_batches
    if total <= 0:
        return 0.0
    if opts.dp_exposed is not None:
        return opts.dp_exposed * total
    idle = row["r"] * row["t_b"]
    window = {0: row["t_b"], 1: row["t_b"] + row["t_f"]}.get(
        L.zero, mbs * (row["t_b"] + row["t_f"])) + idle
    params = ms.stage_params(m, row["r"], L.tp, L.pp, L.vpp, L.etp, L.ep, *L.stage_split).total
    bucket = total * min(1.0, opts.bucket_elements / max(1, params)) / (2 if L.zero else 1)
    exposed = max(bucket, total - window)
    if L.zero >= 2:
        exposed = max(exposed, total / mbs - row["t_b"] - idle)
    return exposed


def estimate(m: ModelConfig, L: Layout, seq: int, cluster: Cluster,
             opts: ModelOptions = ModelOptions(), est: Optional[Estimate] = None) -> Estimate:
    est = est or memory_of(m, L, seq, cluster, opts)
    mbs = L.num_micro_batches
    stages = _stages(L)
    rows = [_stage_row(m, L, seq, r, cluster, opts) for r, _ in stages]
    weights = [w for _, w in stages]
    worst = max(rows, key=lambda x: x["slot"])
    mean_slot = sum(r["slot"] * w for r, w in zip(rows, weights)) / L.pp
    mean_compute = sum((r["t_f"] + r["t_b"]) * w for r, w in zip(rows, weights)) / L.pp
    bubble = _bubble(L, worst, mean_slot)
    dp = max(_dp_exposed(m, L, r, opts) for r in rows)
    local = est.memory["params"] / (L.dp * L.cp) if L.zero >= 1 else est.memory["params"]
    optim = local * OPTIMIZER_BYTES_PER_PARAM / (cluster.gpu.hbm_gbps * 1e9 * cluster.eff.hbm)
    est.times = {"compute": mbs * mean_compute,
                 "imbalance": mbs * (worst["t_f"] + worst["t_b"] - mean_compute),
                 "tp": mbs * worst["tp"], "cp": mbs * worst["cp"], "ep": mbs * worst["ep"],
                 "pp": mbs * worst["pp"], "bubble": bubble, "dp": dp, "optimizer": optim,
                 "dp_total": max(r["dp"] for r in rows)}
    est.times["step"] = mbs * worst["slot"] + bubble + dp + optim
    est.flops = fl.iteration_flops(m, seq, L.global_batch, L.recompute)
    return est
