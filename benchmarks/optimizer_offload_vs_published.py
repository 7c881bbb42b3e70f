#!/usr/bin/env python
"""The planner's optimizer CPU offload (megalite/planner/host_offload.py) against the
published measurements (megalite/planner/published_offload.py): Megatron-Bridge's
Qwen3-30B-A3B on two H100 nodes at 25 / 50 / 75 / 100% offload and 100% overlapped, and
NeMo-RL's Qwen3-0.6B on one H100.

For each offloaded run: the step time the offload adds and the GPU memory it frees, as
the planner predicts them and as measured, each against the same source's run without
offload; the host memory the planner says it takes.  The constant CPU_ADAM_SECONDS_PER_PARAM
was fitted on the row marked "fit"; the error is summarised over the held-out rest.  Then
each source's own run without offload, predicted and measured, for what the model says
about the rest of the step.   Run: python benchmarks/optimizer_offload_vs_published.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.planner import calibration  # noqa: E402
from megalite.planner.published_offload import FIT_ROW, SERIES, compare_all  # noqa: E402


def main() -> int:
    rows = compare_all()
    print(f"CPU Adam: {calibration.CPU_ADAM_SECONDS_PER_PARAM * 1e9:.3f} ns per offloaded "
          f"parameter of a rank (fitted on {FIT_ROW[0]} {FIT_ROW[1]})\n")
    print("| run | offload | step measured s | added measured s | added predicted s | error "
          "| GPU memory freed measured | predicted | error | host GiB (planner) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    held = []
    for c in rows:
        fit = (c.series.name, c.label) == FIT_ROW
        unit = "GB" if c.series.memory_unit == 1e9 else "GiB"
        saved = c.measured_saved
        mem_err = f"{100 * (c.saved_predicted / saved - 1):+.1f}%" if saved else "-"
        print(f"| {c.series.name} | {c.label}{' (fit)' if fit else ''} | {c.measured_s:.3f} | "
              f"{c.added_measured:.3f} | {c.added_predicted:.3f} | {100 * c.added_error:+.1f}% "
              f"| {saved:.2f} {unit} | {c.saved_predicted:.2f} {unit} | {mem_err} | "
              f"{c.host_gib:.1f} |")
        if not fit:
            held.append(c)
    errs = [abs(c.added_error) for c in held]
    print(f"\nheld-out added step time: {len(held)} rows, mean |error| "
          f"{100 * sum(errs) / len(errs):.1f}%, max {100 * max(errs):.1f}%, within 10%: "
          f"{sum(e <= 0.10 for e in errs)}/{len(errs)}")
    mems = [abs(c.saved_predicted / c.measured_saved - 1) for c in rows if c.measured_saved]
    print(f"GPU memory freed: {len(mems)} rows, mean |error| {100 * sum(mems) / len(mems):.1f}%, "
          f"within 10%: {sum(e <= 0.10 for e in mems)}/{len(mems)}")
    print("\nwithout offload, the whole step (what the model says about the rest):")
    for s in SERIES:
        base = next(c.base for c in rows if c.series is s)
        unit = "GB" if s.memory_unit == 1e9 else "GiB"
        mem = f"; memory {base.memory['total'] / s.memory_unit:.1f} {unit} predicted, " \
              f"{s.baseline_memory} measured" if s.baseline_memory else ""
        print(f"  {s.name}: step {base.step:.3f} s predicted, {s.baseline_s:.3f} measured "
              f"({100 * (base.step / s.baseline_s - 1):+.0f}%){mem}")
        print(f"    assumed: {s.assumed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
