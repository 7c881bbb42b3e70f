"""``--dry-run``: the rank layout and the planner's memory and step time for this exact run,
at its real world size, without creating a process group.

A recipe's dry run (``pretrain_gpt.py --config launch/recipes/X.yaml --dry-run``) runs at the
recipe's published GPU count on its GPU unless ``--world-size`` / ``--gpu`` say otherwise.  When
the planner predicts the most loaded rank will not fit, the dry run fails (exit status 2) with
the numbers, before anyone waits for 2,048 nodes.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import List, Sequence

from megalite.config import ConfigError, MegaliteConfig
from megalite.parallel_state import ORDER, RankGrid
from megalite.cli.recipes import RecipeInfo, flag_value, read_recipe_info
from megalite.data import build_tokenizer_from_config
from megalite.diagnostics.collective_check import check_collectives, report_text
from megalite.planner import model_spec as ms
from megalite.planner.estimate import ModelOptions
from megalite.planner.hardware import make_cluster
from megalite.planner.layout import ZERO_NAMES, layout_from_config
from megalite.planner.search import evaluate

GiB = 1024 ** 3
FULL_LISTING_MAX_WORLD = 64      # up to here every group of every kind is listed too
LAYOUT_GROUPS = ("tp", "cp", "dp", "pp", "ep", "expert-tp", "expert-dp")


def ranks_text(ranks: List[int], limit: int = 8) -> str:
    """``0-7``, ``0,1024,...,15360 (stride 1024)``, or the list itself when short."""
    if len(ranks) == 1:
        return str(ranks[0])
    steps = {b - a for a, b in zip(ranks, ranks[1:])}
    if len(steps) == 1:
        step = steps.pop()
        if step == 1:
            return f"{ranks[0]}-{ranks[-1]}"
        if len(ranks) > 3:
            return f"{ranks[0]},{ranks[1]},...,{ranks[-1]} (stride {step})"
    if len(ranks) <= limit:
        return ",".join(map(str, ranks))
    return ",".join(map(str, ranks[:limit - 1])) + f",...,{ranks[-1]}"


def layout_table(cfg: MegaliteConfig, gpus_per_node: int) -> str:
    """One line per parallel dimension: size, how many groups, the first group, and how many
    nodes one group spans (TP inside a node, PP and DP across nodes is what you want)."""
    grid = RankGrid.from_config(cfg)
    world = cfg.world_size
    nodes = -(-world // gpus_per_node)
    d, e = grid.dims["dense"], grid.dims["expert"]
    lines = [f"world {world} = {nodes} node{'s' if nodes > 1 else ''} x {gpus_per_node} "
             f"GPUs: TP{d['tp']} CP{d['cp']} PP{d['pp']} DP{d['dp']}"
             + (f" VPP{grid.vpp}" if grid.vpp > 1 else "")
             + (f" | experts: ETP{e['tp']} EP{e['ep']} EDP{e['dp']}" if cfg.model.num_experts
                else "") + f"  (rank order {ORDER})",
             f"  {'group':<10}{'size':>6}{'groups':>8}  {'first group':<34}one group spans"]
    for name in LAYOUT_GROUPS:
        if name.startswith(("ep", "expert")) and not cfg.model.num_experts:
            continue
        groups = grid.groups(name)
        first = groups[0]
        span = len({r // gpus_per_node for r in first})
        lines.append(f"  {name:<10}{len(first):>6}{len(groups):>8}  {ranks_text(first):<34}"
                     f"{span} node{'s' if span > 1 else ''}")
    return "\n".join(lines)


def planner_estimate(cfg: MegaliteConfig, gpu: str, gpus_per_node: int):
    """The planner's Estimate for exactly this config's layout (no search)."""
    layout = layout_from_config(cfg)
    cluster = make_cluster(cfg.world_size, gpus_per_node, gpu)
    opts = ModelOptions(fp32=not (cfg.optimizer.bf16 or cfg.optimizer.fp16),   # fp16: 2 B too
                        local_layers=cfg.model.transformer_impl == "local",
                        fp8="delayed" if cfg.model.fp8_format else None,  # TE's DelayedScaling
                        muon_ns_steps=cfg.optimizer.muon_num_ns_steps
                        if cfg.optimizer.optimizer == "muon" else 0)
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


def dry_run(cfg: MegaliteConfig, argv: Sequence[str], batch_lines: str) -> int:
    """Print the layout and the estimate; ``ConfigError`` (exit 2) when it cannot fit."""
    info: RecipeInfo = read_recipe_info(flag_value(argv, "--config"))
    gpu = flag_value(argv, "--gpu") or info.gpu
    gpn = int(flag_value(argv, "--gpus-per-node") or info.gpus_per_node)
    head = f"recipe {info.name}"
    if info.twin_of:
        head += f": CPU-scale twin of {info.twin_of}"
    elif info.source:
        head += f": {info.source}"
    preset = flag_value(argv, "--model-preset") or info.model
    cfg = _with_tokenizer_vocab(cfg)
    print(head if info.path else "dry run (no recipe file)")
    print(f"model{' ' + preset if preset else ''}: {ms.describe(cfg.model)}")
    print(layout_table(cfg, gpn))
    if cfg.world_size <= FULL_LISTING_MAX_WORLD:
        print(RankGrid.from_config(cfg).describe())
    print(batch_lines)
    est, cluster, opts = planner_estimate(cfg, gpu, gpn)
    print(estimate_text(est, cluster, opts, cfg.model.seq_length))
    if not est.fits and not (info.path or flag_value(argv, "--gpu")):
        # no recipe and no --gpu: the hardware is the planner's guess, so warn, don't fail
        print(f"warning: the planner predicts {est.memory['total'] / GiB:.1f} GiB on the most "
              f"loaded rank, over the {est.capacity / GiB:.1f} GiB usable of a "
              f"{cluster.gpu.name} (assumed; give --gpu to check against yours)")
        if cfg.training.check_collectives:
            print_collective_check(cfg)
        return 0
    if not est.fits:
        raise ConfigError(
            f"does not fit: the planner predicts {est.memory['total'] / GiB:.1f} GiB on the most "
            f"loaded rank, over the {est.capacity / GiB:.1f} GiB usable of a {cluster.gpu.name}; "
            f"see 'megalite plan' for layouts that fit (docs/launching.md, \"Recipes\")")
    print(f"fits: {est.memory['total'] / GiB:.1f} of {est.capacity / GiB:.1f} GiB usable")
    if cfg.training.check_collectives:
        print_collective_check(cfg)
    return 0


def print_collective_check(cfg: MegaliteConfig, family=None) -> None:
    """``--check-collectives``: trace and check every rank's collectives (or one class
    representative's each, past 64 ranks); ``ConfigError`` (exit 2) when they disagree."""
    def progress(done, total):
        if total > 8 and (done == total or done % max(1, total // 8) == 0):
            print(f"> collective check: traced {done}/{total} ranks", file=sys.stderr,
                  flush=True)

    run = check_collectives(cfg, family=family, progress=progress)
    print(report_text(run, cfg.world_size))
    if not run.verdict.ok:
        raise ConfigError(f"the collective check found {len(run.verdict.problems)} "
                          f"problem(s), listed above: this layout would hang at launch")


def _with_tokenizer_vocab(cfg: MegaliteConfig) -> MegaliteConfig:
    """The vocabulary size from the tokenizer files when ``--vocab-size`` is absent (a
    Megatron script gives ``--vocab-file``/``--merge-file`` instead): validation has already
    checked the files exist; without any, the planner cannot size the embedding."""
    d = cfg.data
    if cfg.model.vocab_size is not None:
        return cfg
    if not d.tokenizer_type:
        raise ConfigError("--dry-run needs the vocabulary size: give --vocab-size or a tokenizer")

    tok = build_tokenizer_from_config(d)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                              vocab_size=tok.vocab_size))
