"""Plain-text and JSON presentation of a search: the ranked table, the winner's flags,
and ``--explain``'s account of why the top layouts win; and the estimate of one run's own
layout (``planner_estimate``), which ``--dry-run``, ``megalite plan --goodput`` and the
recipe checks print."""
from __future__ import annotations

import dataclasses
import json
import shlex
from typing import List

from megalite.config import MegaliteConfig, ModelConfig, field_flag, find_field
from megalite.planner import model_spec as ms
from megalite.planner.estimate import Estimate, ModelOptions, megalite_run_settings
from megalite.planner.hardware import GiB, Cluster, make_cluster
from megalite.planner.layout import ZERO_NAMES, layout_from_config
from megalite.planner.search import SearchResult, evaluate

TIME_TERMS = ("compute", "imbalance", "bubble", "tp", "cp", "ep", "moe_sync", "pp", "offload",
              "dp", "optimizer")
TERM_NAMES = {"compute": "compute", "imbalance": "stage imbalance", "bubble": "pipeline bubble",
              "tp": "TP communication",
              "cp": "CP ring (not hidden)", "ep": "EP all-to-all", "pp": "PP p2p",
              "moe_sync": "MoE dispatch host syncs (GPU idle)",
              "offload": "CPU offload (not hidden)",
              "dp": "DP reduction (exposed)", "optimizer": "optimizer step"}
_SKIP_MODEL_FLAGS = {"transformer_impl", "seq_length"}


def model_flags(m: ModelConfig, seq: int) -> List[str]:
    """pretrain_gpt.py flags that rebuild ``m`` (only those that differ from the defaults)."""
    out = []
    for f in dataclasses.fields(ModelConfig):
        if f.name in _SKIP_MODEL_FLAGS:
            continue
        value, default = getattr(m, f.name), f.default
        if value == default or value is None:
            continue
        action = f.metadata.get("action")
        if action == "store_true":
            if value:
                out.append(field_flag(f))
        elif action == "store_false":
            if not value:
                out.append(field_flag(f))
        else:
            out += [field_flag(f), str(value)]
    return out + ["--seq-length", str(seq)]


def winner_flags(e: Estimate, m: ModelConfig, seq: int, fp32: bool = False,
                 opts: ModelOptions = ModelOptions()) -> List[str]:
    flags = model_flags(m, seq) + e.layout.parallel_flags() + [
        field_flag(find_field(name, "parallel")[1])
        for name, on in megalite_run_settings(opts).items() if on]
    return [f for f in flags if f != "--bf16"] if fp32 else flags


def _gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def table(res: SearchResult, cluster: Cluster, top: int) -> str:
    w = max([30] + [len(e.layout.short()) for e in res.ranked[:top]])
    head = (f"{'#':>3} {'layout':<{w}} {'mbs':>3} {'recomp':<9} {'sharding':<8} {'sched':<11} "
            f"{'weights':>7} {'grads':>6} {'optim':>6} {'activ':>6} {'total':>6} "
            f"{'step s':>8} {'TFLOP/s':>8} {'MFU':>6}")
    lines = [head, "-" * len(head)]
    for i, e in enumerate(res.ranked[:top], 1):
        L, mm = e.layout, e.memory
        shard = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP"}[L.zero] + \
            (f"/{L.instances}" if L.instances > 1 else "")
        lines.append(
            f"{i:>3} {L.short():<{w}} {L.micro_batch:>3} {L.recompute:<9} {shard:<8} "
            f"{L.schedule:<11} {_gib(mm['weights']):>7} {_gib(mm['grads']):>6} "
            f"{_gib(mm['optimizer']):>6} {_gib(mm['activations']):>6} {_gib(mm['total']):>6} "
            f"{e.step:>8.4g} {e.tflops:>8.1f} {100 * e.mfu(cluster):>5.1f}%")
    cap = res.ranked[0].capacity if res.ranked else int(cluster.gpu.memory_bytes)
    lines.append(f"memory in GiB on the most loaded rank; capacity {_gib(cap)} GiB usable of "
                 f"{_gib(cluster.gpu.memory_bytes)}; sharding /R = R instances (HSDP)")
    return "\n".join(lines)


def header(m: ModelConfig, seq: int, global_batch: int, cluster: Cluster, res: SearchResult) -> str:
    g = cluster.gpu
    return (f"model: {ms.describe(m)}\n"
            f"cluster: {cluster.num_gpus} x {g.name} ({cluster.gpus_per_node}/node, "
            f"{_gib(g.memory_bytes)} GiB, {g.peak_tflops:.0f} TFLOP/s bf16, NVLink "
            f"{g.intra_node_gbps:.0f} GB/s, network {g.inter_node_gbps:.0f} GB/s per GPU)\n"
            f"batch: {global_batch} x {seq} tokens = {global_batch * seq:,} tokens per step\n"
            f"searched {res.considered} layouts in {res.seconds:.2f} s: {len(res.ranked)} fit")


def shares(e: Estimate) -> dict:
    return {k: e.times.get(k, 0.0) / e.step for k in TIME_TERMS}


def explain(res: SearchResult, cluster: Cluster, top: int) -> str:
    if not res.ranked:
        return no_fit(res)
    out = []
    best = res.ranked[0]
    for i, e in enumerate(res.ranked[:top], 1):
        s = shares(e)
        parts = ", ".join(f"{TERM_NAMES[k]} {100 * v:.0f}%" for k, v in
                          sorted(s.items(), key=lambda kv: -kv[1]) if v >= 0.01)
        line = f"#{i} {e.layout.short()} ({e.step:.4g} s): {parts}"
        if i > 1:
            deltas = {k: e.times.get(k, 0.0) - best.times.get(k, 0.0) for k in TIME_TERMS}
            k = max(deltas, key=deltas.get)
            line += (f"\n    loses {100 * (e.step / best.step - 1):.1f}% to #1, mostly on "
                     f"{TERM_NAMES[k]} (+{deltas[k]:.3g} s)")
        else:
            dom = max(s, key=s.get)
            line += f"\n    dominated by {TERM_NAMES[dom]}; memory {_gib(e.memory['total'])} GiB " \
                f"of {_gib(e.capacity)} (stage {e.memory.get('pp_rank', 0)} is the fullest)"
        out.append(line)
    out.append("rejected: " + "; ".join(f"{n} {why}" for why, n in res.rejected.most_common(6)))
    return "\n".join(out)


def no_fit(res: SearchResult) -> str:
    refused = [(why, n) for why, n in res.rejected.most_common()
               if why not in ("out of memory", "dominated (less recomputation fits)")]
    if refused and res.best_oom is None:        # all fit: training's rules refused them
        why, n = refused[0]
        return (f"no layout passes training's rules; most often refused ({n} layouts): "
                f"{why} ...")
    msg = "no layout fits in memory"
    if refused:
        msg += f" and passes training's rules (most often refused: {refused[0][0]} ...)"
    if res.best_oom is not None:
        e = res.best_oom
        mm = e.memory
        msg += (f"; the smallest ({e.layout.short()}, {e.layout.recompute} recompute, "
                f"{ZERO_NAMES[e.layout.zero]}) needs {_gib(mm['total'])} GiB of "
                f"{_gib(e.capacity)} (weights {_gib(mm['weights'])}, grads {_gib(mm['grads'])}, "
                f"optimizer {_gib(mm['optimizer'])}, activations {_gib(mm['activations'])}); "
                "add GPUs, allow --zero-stages 0,1,2,3, or shorten the sequence")
    return msg


def to_json(res: SearchResult, m: ModelConfig, seq: int, global_batch: int, cluster: Cluster,
            top: int, fp32: bool = False, opts: ModelOptions = ModelOptions()) -> str:
    return json.dumps({
        "model": {"params": ms.total_params(m), **dataclasses.asdict(m)},
        "seq_length": seq, "global_batch_size": global_batch,
        "cluster": {"num_gpus": cluster.num_gpus, "gpus_per_node": cluster.gpus_per_node,
                    **dataclasses.asdict(cluster.gpu),
                    "efficiency": dataclasses.asdict(cluster.eff)},
        "considered": res.considered, "search_seconds": res.seconds,
        "rejected": dict(res.rejected),
        "candidates": [dict(e.to_dict(cluster), command=shlex.join(
            ["pretrain_gpt.py", *winner_flags(e, m, seq, fp32, opts)]))
            for e in res.ranked[:top]],
    }, indent=2)


def planner_estimate(cfg: MegaliteConfig, gpu: str, gpus_per_node: int):
    """The planner's Estimate for exactly this config's layout (no search)."""
    layout = layout_from_config(cfg)
    cluster = make_cluster(cfg.world_size, gpus_per_node, gpu)
    opts = ModelOptions(fp32=not (cfg.optimizer.bf16 or cfg.optimizer.fp16),   # fp16: 2 B too
                        local_layers=cfg.model.transformer_impl == "local",
                        fp8="delayed" if cfg.model.fp8_format else None,  # TE's DelayedScaling
                        muon_ns_steps=cfg.optimizer.muon_num_ns_steps
                        if cfg.optimizer.optimizer == "muon" else 0,
                        ep_overlap=cfg.parallel.overlap_moe_expert_parallel_comm,
                        ep_overlap_rule="megalite",
                        ep_delay_wgrad=cfg.parallel.delay_wgrad_compute)
    return evaluate(cfg.model, cfg.model.seq_length, layout, cluster, opts), cluster, opts


def estimate_text(est, cluster, opts, seq: int) -> str:
    m, t = est.memory, est.times
    kernels = "megalite's local layers" if opts.local_layers else \
        "Transformer Engine's fused kernels"
    L = est.layout
    mem = "  ".join(f"{k} {m[k] / GiB:.1f}" for k in ("weights", "grads", "optimizer",
                                                      "activations") if k in m)
    parts = "  ".join(f"{k} {t[k]:.3f}" for k in ("compute", "imbalance", "bubble", "tp", "cp",
                                                  "ep", "pp", "dp", "optimizer") if t.get(k))
    lines = [f"planner estimate ({cluster.gpu.name}, {kernels}, "
             f"{'fp32' if opts.fp32 else 'bf16'}, "
             f"{ZERO_NAMES[L.zero]}, recompute {L.recompute}):",
             f"  memory per GPU (most loaded rank, GiB): {mem}  total {m['total'] / GiB:.1f} of "
             f"{est.capacity / GiB:.1f} usable ({cluster.gpu.memory_bytes / GiB:.1f} per GPU, "
             f"headroom {opts.headroom:.2f})",
             f"  step time {est.step:.3f} s ({parts}); {est.tflops:.0f} TFLOP/s per GPU, "
             f"MFU {100 * est.mfu(cluster):.1f}%, "
             f"{L.global_batch * seq / est.step / 1e6:.2f} M tokens/s"]
    return "\n".join(lines)
