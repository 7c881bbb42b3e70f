"""``--plot``: where each strategy stops being compute-bound, and what fills memory.

Left: per-step compute time (solid) and communication time (dashed) against the global
batch for FSDP alone, TP + FSDP and TP + PP + DP (each at its best layout for that batch).
FSDP moves 3x the weights every micro-batch whatever the batch, so its communication line
is flat and compute crosses it only at large batches; TP shrinks the weights each rank
moves and PP removes them from the DP collective, pushing the crossover to smaller
batches.  Right: memory breakdown of the top candidates against the usable capacity.
matplotlib is imported here only (Agg backend), so the planner never needs it otherwise.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, List

from megalite.config import ModelConfig
from megalite.planner.estimate import ModelOptions
from megalite.planner.hardware import GiB, Cluster
from megalite.planner.search import SearchResult, SearchSpace, divisors, search
from megalite.viz.pyplot import matplotlib_modules


def strategies(cluster: Cluster, m: ModelConfig) -> Dict[str, dict]:
    tp = min(cluster.gpus_per_node, m.num_attention_heads)
    while m.num_attention_heads % tp or m.resolved_query_groups() % tp:
        tp //= 2
    pps = [d for d in divisors(cluster.num_gpus) if d > 1]
    return {"FSDP only": dict(tp=[1], pp=[1], cp=[1], zero=(3,)),
            f"TP{tp} + FSDP": dict(tp=[tp], pp=[1], cp=[1], zero=(3,)),
            "TP + PP + DP (ZeRO-1)": dict(pp=pps, zero=(0, 1))}


def sweep(m: ModelConfig, seq: int, global_batch: int, cluster: Cluster, space: SearchSpace,
          opts: ModelOptions, points: int = 6) -> Dict[str, List[tuple]]:
    """(tokens per step, compute s, communication s) of each strategy's best layout."""
    batches = sorted({max(1, int(global_batch * 2.0 ** k)) for k in range(-3, points - 3)})
    out = {}
    for name, pins in strategies(cluster, m).items():
        rows = []
        for gbs in batches:
            res = search(m, seq, gbs, cluster, replace(space, **pins), opts)
            if res.ranked:
                t = res.ranked[0].times
                comm = t["tp"] + t["cp"] + t["ep"] + t["pp"] + t["dp_total"]
                rows.append((gbs * seq, t["compute"] + t["imbalance"], comm))
        out[name] = rows
    return out


def plot_plan(path: str, res: SearchResult, m: ModelConfig, seq: int, global_batch: int,
              cluster: Cluster, space: SearchSpace, opts: ModelOptions, top: int = 8) -> None:
    _, plt = matplotlib_modules()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    colors = ["tab:red", "tab:orange", "tab:blue", "tab:green"]
    for color, (name, rows) in zip(colors, sweep(m, seq, global_batch, cluster, space,
                                                 opts).items()):
        if not rows:
            continue
        x = [r[0] for r in rows]
        ax1.plot(x, [r[1] for r in rows], "-o", color=color, label=f"{name}: compute")
        ax1.plot(x, [r[2] for r in rows], "--s", color=color, label=f"{name}: communication")
    ax1.axvline(global_batch * seq, color="gray", lw=0.8, ls=":")
    ax1.set(xscale="log", yscale="log", xlabel="global batch (tokens per step)",
            ylabel="seconds per step",
            title=f"compute vs communication, {cluster.num_gpus} x {cluster.gpu.name}")
    ax1.legend(fontsize=7)
    ax1.grid(True, which="both", alpha=0.3)

    cands = res.ranked[:top]
    parts = ("weights", "grads", "optimizer", "activations")
    bottom = [0.0] * len(cands)
    for part, color in zip(parts, ("tab:blue", "tab:orange", "tab:green", "tab:purple")):
        vals = [e.memory[part] / GiB for e in cands]
        ax2.bar(range(len(cands)), vals, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    if cands:
        ax2.axhline(cands[0].capacity / GiB, color="red", ls="--", label="usable capacity")
    ax2.axhline(cluster.gpu.memory_bytes / GiB, color="black", lw=0.8, label="GPU memory")
    ax2.set_xticks(range(len(cands)))
    ax2.set_xticklabels([f"#{i + 1}\n{e.layout.short().replace(' ', chr(10))}"
                         for i, e in enumerate(cands)], fontsize=6)
    ax2.set(ylabel="GiB on the most loaded rank", title="memory of the top layouts")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
