#!/usr/bin/env python
"""Planner vs published: Narayanan et al. 2021 Table 1 and Llama 3 405B.

For each published run the planner searches the same model, cluster and batch with the
run's techniques (2021 rows: activation recomputation, no distributed optimizer, no
FlashAttention) and prints its pick, where the published TP/PP ranks, and the predicted
TFLOP/s per GPU of the published layout against the paper's figure.  Narayanan et al.
count hardware FLOPs (recomputation included), Llama 3 model FLOPs; each row uses its
paper's convention.  The Markdown output goes into docs/planner.md.
Run: python benchmarks/planner_vs_published.py
"""
from __future__ import annotations

import sys

from megalite.planner import model_spec as ms
from megalite.planner.published import compare


def describe(e) -> str:
    L = e.layout
    s = f"TP{L.tp} PP{L.pp}" + (f" VPP{L.vpp}" if L.vpp > 1 else "") + \
        (f" CP{L.cp}" if L.cp > 1 else "")
    return s + f" DP{L.dp} mbs{L.micro_batch}" + (" SP" if L.sp else "")


def main() -> int:
    print("| model | GPUs | batch | published | planner pick | published layout: rank "
          "(time vs pick) | published TFLOP/s | predicted | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in ms.NARAYANAN_2021 + ["llama3-405b"]:
        c = compare(name)
        pub = c.published
        batch = pub.get("global_batch_size") or f"{pub['global_batch_tokens'] // 2**20}M tok"
        shown = f"TP{pub['tp']} PP{pub['pp']}" + (f" CP{pub['cp']} DP{pub['dp']}" if "dp" in pub
                                                   else "")
        if c.best_published is None:
            print(f"| {name} | {pub['num_gpus']} | {batch} | {shown} | {describe(c.pick)} | "
                  f"does not fit | {pub['tflops_per_gpu']} | - | - |")
            continue
        as_run = c.as_run
        pred = as_run.hw_tflops if pub["source"].startswith("Narayanan") else as_run.tflops
        err = 100 * (pred / pub["tflops_per_gpu"] - 1)
        print(f"| {name} | {pub['num_gpus']} | {batch} | {shown} | {describe(c.pick)} | "
              f"{c.published_rank} (+{100 * c.gap:.1f}%) | {pub['tflops_per_gpu']} | "
              f"{pred:.0f} | {err:+.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
