#!/usr/bin/env python
"""The planner against published training runs (megalite/planner/published_runs.py):
Narayanan et al. 2021 Table 1, Llama 3 405B (Table 4), Megatron-Bridge's DGX-H100 FP8 rows
(Llama 3 8B / 70B / 3.1 405B, Qwen3-235B, DeepSeek-V3), Megatron-Core's Mixtral 8x7B,
torchtitan's Llama 3.1 8B / 70B / 405B on 500 W H100s, and Megatron-Bridge's Blackwell rows
(GB300 / GB200 / B200 / B300, FP8 / MXFP8 / NVFP4, HybridEP).

For each row it estimates the published layout with the run's software switches and
prints the predicted throughput in the source's unit and FLOP convention next to the
published figure; the rows that fitted calibration.py's constants are marked "cal", and
the error is summarised separately for them and for the held-out rest, and for the held-out
rows per hardware and per MoE dispatcher.  ``--explain ROW`` prints a row's step-time
terms next to the same layout with its dispatcher flipped and the expert GEMMs' small-K
curve off.  Then the memory figures the sources state, and the planner's own pick for each published setting with the
published layout's rank among its candidates.  The Markdown output goes into
docs/planner.md.   Run: python benchmarks/planner_vs_published.py [--no-search]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.planner import calibration, report  # noqa: E402
from megalite.planner.published import compare_all  # noqa: E402

UNIT = {"hw_tflops": "TFLOP/s (hw)", "model_tflops": "TFLOP/s", "tokens_per_gpu": "tok/s"}


def layout_text(L) -> str:
    parts = [f"TP{L.tp}", f"PP{L.pp}"] + ([f"VPP{L.vpp}"] if L.vpp > 1 else []) + \
        ([f"CP{L.cp}"] if L.cp > 1 else []) + ([f"EP{L.ep}"] if L.ep > 1 else []) + \
        [f"DP{L.dp}"]
    extra = ([f"mbs{L.micro_batch}"] + (["SP"] if L.sp else []) +
             ([{1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP"}[L.zero]] if L.zero else []) +
             ([f"rec-{L.recompute}" + (f"({L.recompute_layers})" if L.recompute_layers
                                        else "")] if L.recompute != "none" else []))
    return " ".join(parts + extra)


def group_by(rows, key) -> dict:
    out: dict = {}
    for c in rows:
        out.setdefault(key(c), []).append(c)
    return out


def explain(c) -> str:
    """The step-time terms of a row's published layout (seconds per step) next to the same
    layout with one MoE switch flipped each: NCCL's all-to-all against a flex dispatcher
    (DeepEP for a row modelled with NCCL), and the expert GEMMs without the small-inner-dimension curve (K0 = 0) --
    which term moved."""
    import dataclasses

    from megalite.planner import kernels
    from megalite.planner.published import as_run
    cols = [("as modelled", c.as_run.times)]
    if c.model.num_experts and c.as_run.layout.ep > 1:
        flip = "alltoall" if c.opts.moe_dispatcher != "alltoall" else "deepep"
        other = as_run(c.run, c.model, c.cluster,
                       dataclasses.replace(c.opts, moe_dispatcher=flip))
        cols.append((f"{c.opts.moe_dispatcher} -> {flip}", other.times))
    saved = kernels.INNER_K0_FP8
    kernels.INNER_K0_FP8 = 0.0
    try:
        cols.append(("K-curve off", as_run(c.run, c.model, c.cluster, c.opts).times))
    finally:
        kernels.INNER_K0_FP8 = saved
    keys = report.TIME_TERMS + ("fp8_cast", "step")
    base = cols[0][1]
    lines = [f"{c.run.name}: step-time terms (s per step; moved = switched - modelled)",
             "| term | " + " | ".join(n for n, _ in cols) + " |",
             "|---" * (len(cols) + 1) + "|"]
    for k in keys:
        cells = [f"{base.get(k, 0.0):.3f}"] + [
            f"{t.get(k, 0.0):.3f} ({t.get(k, 0.0) - base.get(k, 0.0):+.3f})"
            for _, t in cols[1:]]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-search", action="store_true", help="skip the planner's own picks")
    ap.add_argument("--explain", action="append", default=[], metavar="ROW",
                    help="print a row's step-time terms and which term its MoE switch moves "
                    "(repeatable)")
    args = ap.parse_args(argv)
    cal = set(calibration.calibration_row_names())
    rows = compare_all(with_search=not args.no_search)

    print("| run | GPUs | precision | published layout | unit | published | predicted | "
          "error | fit |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in rows:
        r = c.run
        print(f"| {r.name} | {r.num_gpus} ({r.gpu}) | {r.precision} | "
              f"{layout_text(c.as_run.layout)} | {UNIT[r.metric]} | {r.value:g} | "
              f"{c.predicted:.0f} | {100 * c.error:+.1f}% | "
              f"{'cal' if r.name in cal else 'held out'} |")

    def summary(name, group):
        errs = [abs(c.error) for c in group]
        worst = max(group, key=lambda c: abs(c.error))
        print(f"- {name}: {len(errs)} rows, mean |error| {100 * sum(errs) / len(errs):.1f}%, "
              f"max {100 * abs(worst.error):.1f}% ({worst.run.name}); within 10%: "
              f"{sum(e <= 0.10 for e in errs)}/{len(errs)}")

    print()
    summary("calibration rows", [c for c in rows if c.run.name in cal])
    held = [c for c in rows if c.run.name not in cal]
    summary("held-out rows", held)
    summary("held out, issue 40's 2026 rows (bridge25-/bridge26-)",
            [c for c in held if c.run.name.startswith(("bridge25-", "bridge26-"))])
    for tag, key in (("Llama 3 405B", "llama3-405b"), ("MoE", None)):
        group = [c for c in held if (c.model.num_experts if key is None
                                     else c.run.name.startswith(key))]
        summary(f"held out, {tag}", group)
    for tag, groups in (("hardware", group_by(held, lambda c: c.run.gpu)),
                        ("dispatcher", group_by([c for c in held if c.model.num_experts],
                                                lambda c: c.opts.moe_dispatcher))):
        for key, group in groups.items():
            summary(f"held out, {tag} {key}", group)
    for name in args.explain:
        print("\n" + explain(next(c for c in rows if c.run.name == name)))
    print("\nconstants (planner/calibration.py), each fitted on its rows:")
    for keys, names in calibration.CALIBRATION_ROWS.items():
        vals = ", ".join(f"{k} = {getattr(calibration, k):g}" for k in keys)
        print(f"- {vals}: {', '.join(names)}")

    print("\n| run | published memory | predicted (most loaded rank) | fits the model's "
          "usable memory |")
    print("|---|---|---|---|")
    for c in rows:
        if c.run.memory_gib is not None or not c.as_run.fits:
            pub = f"{c.run.memory_gib:g} GiB" if c.run.memory_gib is not None else "(ran)"
            print(f"| {c.run.name} | {pub} | {c.memory_gib:.1f} GiB | "
                  f"{'yes' if c.as_run.fits else 'no'} ({c.as_run.capacity / 2**30:.1f} "
                  "GiB usable) |")

    if args.no_search:
        return 0
    print("\n| run | planner pick | published layout: rank (step vs pick) | as run vs pick |")
    print("|---|---|---|---|")
    for c in rows:
        if c.pick is None:
            print(f"| {c.run.name} | nothing fits | - | - |")
            continue
        if c.rank:
            rank = f"{c.rank} ({100 * c.gap:+.1f}%)"
        else:
            rank = "not among the candidates that fit"
        print(f"| {c.run.name} | {layout_text(c.pick.layout)} | {rank} | "
              f"{100 * c.as_run_gap:+.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
