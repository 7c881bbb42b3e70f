#!/usr/bin/env python
"""What the flight recorder costs per training iteration (issue 28), on the reference config
of benchmarks/step_time.py with TP=2 (two gloo processes, so there are collectives to note).

Two measurements in one run:

1. The recorder's own work per op, timed in-process: ``begin`` + ``end`` (the entry, the
   group's sequence number, the call site) plus the layer's ``module_site`` push and pop --
   times the ops one rank issues per iteration, counted by tracing that rank's real step
   (``collective_check.trace``).  That product is the cost per iteration.
2. End to end: ``pretrain_gpt.py`` under torchrun, alternating ``--flight-recorder-size 0``
   (off), the default (on) and the default with ``--hang-watchdog-seconds 60`` (on + the
   watchdog thread), median time per iteration of each.  The difference is far below the
   run-to-run noise of a shared CPU, which is why (1) is printed too.

    python benchmarks/flight_recorder_cost.py [--iters 8] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from step_time import add_reference_config  # noqa: E402
from tp_scaling import model_flags  # noqa: E402

MODES = {"off": ["--flight-recorder-size", "0"], "on": [],
         "on + watchdog": ["--hang-watchdog-seconds", "60"]}


def per_op_seconds(n: int = 20000) -> float:
    """begin + end of one all-reduce entry and one module_site, as megalite.comm and a layer do."""
    import torch

    from megalite.comm import flight_recorder as fr
    from megalite.parallel_state import Group

    rec = fr.FlightRecorder()
    group = Group("tp", [0, 1], None, 0)
    x = torch.empty(256, 8, 256)
    site = fr.module_site("layer 3", "attention")
    fr.site.iteration, fr.site.phase, fr.site.step = 5, "forward-backward", "F mb 1"
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            with site:
                rec.end(rec.begin("all_reduce", group, x))
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def ops_per_iteration(a) -> dict:
    """Collectives and p2p batches each rank of the TP=2 run issues in one iteration."""
    from megalite.cli.arguments import parse_args
    from megalite.diagnostics.collective_check.trace import trace_rank
    from megalite.training.loop import Trainer

    cfg = parse_args(["--world-size", "2", *model_flags(a), "--tensor-model-parallel-size",
                      "2"])
    return {r: len(trace_rank(cfg, Trainer, r)) for r in (0, 1)}


def run(a, mode: str, out_dir: str, tag: str) -> float:
    metrics = os.path.join(out_dir, f"{tag}.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "pretrain_gpt.py", *model_flags(a), "--tensor-model-parallel-size", "2",
           "--metrics-file", metrics, *MODES[mode]]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT})
    if p.returncode:
        raise SystemExit(f"{tag} failed:\n{p.stderr[-3000:]}")
    recs = [json.loads(line) for line in open(metrics) if '"elapsed_ms"' in line]
    return statistics.median(r["elapsed_ms"] / 1e3 for r in recs[a.warmup:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_reference_config(ap)
    ap.add_argument("--iters", type=int, default=8, help="iterations per run")
    ap.add_argument("--warmup", type=int, default=2, help="iterations dropped per run")
    ap.add_argument("--repeats", type=int, default=2, help="alternated off / on rounds")
    a = ap.parse_args(argv)
    if a.iters <= a.warmup:
        ap.error(f"--iters {a.iters} must exceed --warmup {a.warmup}")
    print(f"reference config: hidden {a.hidden}, {a.layers} layers, {a.heads} heads / "
          f"{a.kv_heads} KV, FFN {a.ffn}, vocab {a.vocab}, seq {a.seq}, batch {a.batch}, "
          f"fp32, TP=2 on 2 gloo processes")
    op_cost = per_op_seconds()
    ops = ops_per_iteration(a)
    steps = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as out:
        for r in range(a.repeats):
            for mode in MODES:
                steps[mode].append(run(a, mode, out, f"{mode.replace(' ', '')}_{r}"))
                print(f"  {mode:<14} run {r}: {1e3 * steps[mode][-1]:.1f} ms/iteration",
                      flush=True)
    step = {m: statistics.median(v) for m, v in steps.items()}
    per_iter = op_cost * max(ops.values())
    print(f"recorder work per op (begin + end + module_site): {1e6 * op_cost:.2f} us; "
          f"ops per iteration per rank: {ops[0]} (rank 0), {ops[1]} (rank 1)")
    print(f"cost per iteration: {1e6 * per_iter:.0f} us = {100 * per_iter / step['off']:.4f}% "
          f"of the {1e3 * step['off']:.1f} ms step")
    print("end to end (median ms/iteration): " + ", ".join(
        f"{m} {1e3 * s:.1f}" for m, s in step.items()) +
        f"; on/off {step['on'] / step['off']:.4f}, on+watchdog/off "
        f"{step['on + watchdog'] / step['off']:.4f} (run-to-run noise dominates)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
