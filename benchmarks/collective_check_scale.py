#!/usr/bin/env python
"""``--check-collectives`` at scale (issue 28): time and peak memory of the pre-launch check.

* 64 ranks, checked twice each -- every rank traced, and pipeline-rank representatives --
  to show the representatives' verdict agrees with the exhaustive one and that every rank's
  program equals its class's: a dense layout TP2 PP4 VPP2 CP2 (DP4 at 64 ranks; DP2 would
  be 32) and an MoE layout with EP4 (TP2 PP2 DP16; experts ETP1 EP4 EDP8).  Small model shapes (the ranks' programs, not the
  model size, are what is checked).
* The dense layout again with the test hook making rank 37 drop one TP all-gather: both
  modes must report the same problem (the hooked rank is a class of its own).
* The published recipes at their GPU counts, with representatives: Llama-3 405B (TP8 CP1 PP16
  VPP8 DP128 = 16,384 ranks), Mixtral 8x22B (128), Qwen3-235B-A22B (256) and DeepSeek-V3
  (1,024).

Each case runs in a fresh process (its own peak memory); each line ends with the
machine's load average before and after the case (other jobs' share of the cores).

    python benchmarks/collective_check_scale.py [--cases dense64,moe64,llama3-405b,...]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--vocab-size", "1000", "--mock-data", "--lr", "1e-4", "--train-iters", "10",
         "--micro-batch-size", "1", "--hidden-dropout", "0", "--attention-dropout", "0"]
CASES = {
    "dense64": ["--world-size", "64", *SMALL, "--num-layers", "8",
                "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
                "--num-layers-per-virtual-pipeline-stage", "1", "--context-parallel-size", "2",
                "--sequence-parallel", "--use-distributed-optimizer",
                "--global-batch-size", "16"],
    "moe64": ["--world-size", "64", *SMALL, "--num-layers", "4",
              "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
              "--sequence-parallel", "--num-experts", "8", "--moe-router-topk", "2",
              "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1",
              "--global-batch-size", "16"],
    "llama3-405b": ["--config", "launch/recipes/llama3-405b.yaml", "--mock-data"],
    "mixtral-8x22b": ["--config", "launch/recipes/mixtral-8x22b.yaml", "--mock-data"],
    "qwen3-235b-a22b": ["--config", "launch/recipes/qwen3-235b-a22b.yaml", "--mock-data"],
    "deepseek-v3": ["--config", "launch/recipes/deepseek-v3.yaml", "--mock-data"],
}
CASES["dense64-skip"] = CASES["dense64"]      # rank 37 drops a TP all-gather (test hook)
ENV = {"dense64-skip": {"MEGALITE_FAULT_INJECT":
                        "skip:rank=37,iteration=1,group=tp,op=all_gather,nth=5"}}
BOTH = ("every-rank", "representatives")
MODES = {"dense64": BOTH, "moe64": BOTH, "dense64-skip": BOTH}


def one(case: str, mode: str) -> dict:
    """Run the check in this process; what the parent prints."""
    sys.path.insert(0, ROOT)
    from megalite.cli.arguments import parse_args
    from megalite.diagnostics.collective_check import check_collectives
    from megalite.training.loop import Trainer

    cfg = parse_args([*CASES[case], "--dry-run", "--check-collectives"])
    run = check_collectives(cfg, Trainer, mode=mode)
    v = run.verdict
    return {"case": case, "mode": v.mode, "world": cfg.world_size, "ok": v.ok,
            "problems": v.problems, "traced": v.ranks_traced, "classes": len(v.ops_per_rank),
            "ops": [min(v.ops_per_rank.values()), max(v.ops_per_rank.values())],
            "groups": v.groups_checked, "classes_hold": v.classes_hold,
            "seconds": run.seconds, "peak_mib": run.peak_rss_bytes / 2 ** 20,
            "cpu_seconds": _cpu_seconds()}


def _cpu_seconds() -> float:
    """This process's and its tracing workers' CPU time (wall time on a shared machine
    measures the other jobs too)."""
    import resource

    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--one", nargs=2, metavar=("CASE", "MODE"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(one(a.one[0], None if a.one[1] == "auto" else a.one[1])))
        return 0
    verdicts = {}
    for case in a.cases.split(","):
        for mode in MODES.get(case, ("auto",)):
            load = os.getloadavg()[0]
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", case, mode],
                               cwd=ROOT, capture_output=True, text=True,
                               env={**os.environ, "PYTHONPATH": ROOT, **ENV.get(case, {})})
            if p.returncode:
                print(f"{case} {mode}: FAILED\n{p.stderr[-3000:]}")
                return 1
            r = json.loads(p.stdout.strip().splitlines()[-1])
            verdicts.setdefault(case, []).append((r["ok"], tuple(r["problems"])))
            hold = {True: "; every rank equals its class", False: "; classes DIFFER",
                    None: ""}[r["classes_hold"]]
            print(f"{case:<16} {r['world']:>6} ranks  {r['mode']:<15} traced {r['traced']:>3} "
                  f"({r['classes']} classes, {r['ops'][0]}-{r['ops'][1]} ops/rank, "
                  f"{r['groups']} group patterns)  {'OK' if r['ok'] else 'PROBLEMS'}{hold}  "
                  f"{r['seconds']:.1f} s ({r.get('cpu_seconds', 0):.0f} s CPU), peak "
                  f"{r['peak_mib']:.0f} MiB, load {load:.1f} -> {os.getloadavg()[0]:.1f}",
                  flush=True)
            for problem in r["problems"]:
                print(f"    {problem}")
    for case, found in verdicts.items():
        if len(found) > 1:
            print(f"{case}: every-rank and representatives verdicts "
                  f"{'agree' if len(set(found)) == 1 else 'DISAGREE'}"
                  f" ({'OK' if found[0][0] else f'the same {len(found[0][1])} problem(s)'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
