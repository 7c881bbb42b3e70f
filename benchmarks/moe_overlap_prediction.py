#!/usr/bin/env python
"""The planner's predicted effect of the EP all-to-all overlap on the MoE recipes it holds
(Megatron-Bridge's Qwen3-235B-A22B and DeepSeek-V3 rows, megalite/planner/published_runs.py),
side by side with Megatron-Core's published figure for Qwen3-235B: 245 -> 276 TFLOP/s per
H100 (+12.7%) from ``--overlap-moe-expert-parallel-comm --delay-wgrad-compute``.

With the overlap on, the planner counts the exposed all-to-all of a steady-state pipeline
slot as max(0, all-to-all - compute of the paired micro-batch) (``planner/estimate.py``,
``ModelOptions.ep_overlap``); the warm-up / cool-down share runs alone and stays exposed.
Each row is estimated at its published layout twice, overlap off and on, every other
switch as the row has it.   Run: python benchmarks/moe_overlap_prediction.py
"""
from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.planner.published import compare_run  # noqa: E402
from megalite.planner.published_runs import BY_NAME  # noqa: E402

ROWS = ("bridge-qwen3-235b-a22b", "bridge-deepseek-v3")
MEGATRON_CLAIM = (245.0, 276.0)        # Qwen3-235B per H100, overlap off -> on


def _with_overlap(run, on: bool):
    return dataclasses.replace(run, options=dict(run.options, ep_overlap=on))


def main(argv=None) -> int:
    print("| row | published (overlap on) | predicted, overlap off | predicted, overlap on | "
          "change | exposed all-to-all per step off -> on (s) | step off -> on (s) |")
    print("|---|---|---|---|---|---|---|")
    for name in ROWS:
        run = BY_NAME[name]
        off, on = (compare_run(_with_overlap(run, flag), with_search=False)
                   for flag in (False, True))
        ep = [c.as_run.times["ep"] for c in (off, on)]
        step = [c.as_run.step for c in (off, on)]
        print(f"| {name} | {run.value:g} | {off.predicted:.0f} | {on.predicted:.0f} | "
              f"{100 * (on.predicted / off.predicted - 1):+.1f}% | {ep[0]:.2f} -> {ep[1]:.2f} | "
              f"{step[0]:.2f} -> {step[1]:.2f} |")
    a, b = MEGATRON_CLAIM
    print(f"| Megatron-Core, Qwen3-235B (published) | | {a:g} | {b:g} | "
          f"{100 * (b / a - 1):+.1f}% | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
