#!/usr/bin/env python
"""Every launch recipe at its published scale, side by side: the layout, the planner's
predicted memory on the most loaded GPU against what is usable, step time, TFLOP/s and MFU,
and how long the dry run took (no process group is created).

Run: python benchmarks/recipes_dry_run.py   (the Markdown table goes into docs/launching.md)
"""
from __future__ import annotations

import os
import sys
import time

from megalite.cli.arguments import parse_args
from megalite.cli.recipes import read_recipe_info, recipe_files
from megalite.planner.report import planner_estimate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1024 ** 3


def main() -> int:
    print("| recipe | GPUs | layout | memory GiB (usable) | fits | step s | TFLOP/s | MFU | "
          "dry run s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in recipe_files(os.path.join(ROOT, "launch", "recipes")):
        if os.sep + "twins" + os.sep in path:
            continue
        start = time.perf_counter()
        info = read_recipe_info(path)
        cfg = parse_args(["--config", path, "--dry-run"])
        est, cluster, _ = planner_estimate(cfg, info.gpu, info.gpus_per_node)
        took = time.perf_counter() - start
        L = est.layout
        layout = f"TP{L.tp} CP{L.cp} PP{L.pp}" + (f" VPP{L.vpp}" if L.vpp > 1 else "") + \
            f" DP{L.dp}" + (f" EP{L.ep}/ETP{L.etp}" if L.ep > 1 else "")
        print(f"| {info.name} | {cfg.world_size} {cluster.gpu.name} | {layout} | "
              f"{est.memory['total'] / GiB:.1f} ({est.capacity / GiB:.1f}) | "
              f"{'yes' if est.fits else 'NO'} | {est.step:.2f} | {est.tflops:.0f} | "
              f"{100 * est.mfu(cluster):.1f}% | {took:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
