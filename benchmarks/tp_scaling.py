#!/usr/bin/env python
"""Tensor parallelism across processes on one CPU (issue 18, item 7): TP=2 on two
one-thread processes against TP=1 on one two-thread process, same model, same batch.

Both run the real entry (``pretrain_gpt.py``; TP=2 under torchrun, gloo), so each process
gets torch threads = usable cores / local processes (``training.loop.set_cpu_threads``):
2 threads for TP=1 and 1 each for TP=2 on a 2-core machine. The runs alternate (A B A B
...); each reports the median of its per-iteration times (metrics file, warm-up iterations
dropped) as tokens/s. Target: TP=2 >= 0.8x TP=1.

Reference config (issue 18): Llama-style, hidden 256, 4 layers, 8 heads / 4 KV groups, FFN
688, vocab 32000, seq 256, batch 8, fp32. ``--sequence-parallel`` adds SP to the TP=2 run.

The figure needs the cores to itself: every run's CPU time / (wall x cores) is printed,
and when it is under ``--min-busy`` (default 0.7) the benchmark says the machine was
contended and exits with status 3 instead of reporting a ratio (``--force`` reports anyway,
marked unreliable).

    python benchmarks/tp_scaling.py [--iters 8] [--repeats 2] [--hidden 256] [--sequence-parallel]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from step_time import add_reference_config  # noqa: E402  (the same reference config flags)


def model_flags(a) -> list:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
            "--num-attention-heads", str(a.heads), "--group-query-attention",
            "--num-query-groups", str(a.kv_heads), "--ffn-hidden-size", str(a.ffn),
            "--vocab-size", str(a.vocab), "--seq-length", str(a.seq),
            "--max-position-embeddings", str(a.seq), "--normalization", "RMSNorm",
            "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", "--mock-data", "--lr", "1e-4",
            "--micro-batch-size", str(a.batch), "--global-batch-size", str(a.batch),
            "--train-iters", str(a.iters), "--hidden-dropout", "0", "--attention-dropout", "0",
            "--eval-iters", "0", "--log-interval", str(a.iters), "--no-progress-bar",
            "--seed", "1234", "--device", "cpu"]


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(a, tp: int, out_dir: str, tag: str) -> dict:
    """One training run; its median iteration time, losses and CPU time / wall."""
    metrics = os.path.join(out_dir, f"{tag}.jsonl")
    flags = model_flags(a) + ["--metrics-file", metrics]
    if tp > 1:
        flags += ["--tensor-model-parallel-size", str(tp)]
        if a.sequence_parallel:
            flags += ["--sequence-parallel"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(tp), "pretrain_gpt.py"]
    else:
        cmd = [sys.executable, "pretrain_gpt.py"]
    t0, c0 = time.time(), children_cpu()
    proc = subprocess.run(cmd + flags, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    wall, cpu = time.time() - t0, children_cpu() - c0
    if proc.returncode:
        raise SystemExit(f"{tag} failed:\n{proc.stderr[-3000:]}")
    recs = [json.loads(line) for line in open(metrics) if '"lm_loss"' in line]
    recs = [r for r in recs if "elapsed_ms" in r]
    steady = [r["elapsed_ms"] / 1e3 for r in recs[a.warmup:]]
    threads = [line for line in proc.stdout.splitlines() if "torch threads" in line]
    return {"step": statistics.median(steady), "loss": [r["lm_loss"] for r in recs],
            "busy": cpu / (wall * a.cores), "threads": threads[0] if threads else "?"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_reference_config(ap)
    ap.add_argument("--iters", type=int, default=8, help="iterations per run")
    ap.add_argument("--warmup", type=int, default=2, help="iterations dropped per run")
    ap.add_argument("--repeats", type=int, default=2, help="alternated TP=1 / TP=2 pairs")
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--min-busy", type=float, default=0.7)
    ap.add_argument("--force", action="store_true", help="report even when contended")
    a = ap.parse_args(argv)
    if a.iters <= a.warmup:
        ap.error(f"--iters {a.iters} must exceed --warmup {a.warmup}")
    a.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if a.cores < 2:
        ap.error("needs at least 2 usable cores")
    tokens = a.batch * a.seq
    print(f"config: hidden {a.hidden}, {a.layers} layers, {a.heads} heads / {a.kv_heads} KV, "
          f"FFN {a.ffn}, vocab {a.vocab}, seq {a.seq}, batch {a.batch}, fp32; {a.cores} usable "
          f"cores; {a.iters} iterations per run ({a.warmup} dropped), {a.repeats} alternated "
          f"pairs" + ("; TP=2 with sequence parallelism" if a.sequence_parallel else ""))
    results = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as out:
        for r in range(a.repeats):
            for tp in (1, 2):
                res = run(a, tp, out, f"tp{tp}_{r}")
                results[tp].append(res)
                print(f"  TP={tp} run {r}: {1e3 * res['step']:.1f} ms/iteration, "
                      f"{tokens / res['step']:.0f} tokens/s, CPU/wall/core {res['busy']:.2f} "
                      f"| {res['threads'].lstrip('> ')}", flush=True)
    l1, l2 = results[1][0]["loss"], results[2][0]["loss"]
    drift = max(abs(x - y) / abs(x) for x, y in zip(l1, l2))
    print(f"losses TP=1 vs TP=2: largest relative difference {drift:.2e} over {len(l1)} "
          f"iterations")
    tps = {tp: statistics.median(tokens / x["step"] for x in v) for tp, v in results.items()}
    ratios = [tokens / y["step"] / (tokens / x["step"])
              for x, y in zip(results[1], results[2])]
    busy = min(x["busy"] for v in results.values() for x in v)
    contended = busy < a.min_busy
    if contended and not a.force:
        print(f"REFUSED: the machine is contended (lowest CPU time / (wall x cores) "
              f"{busy:.2f} < {a.min_busy}); the TP=2/TP=1 ratio would measure the other "
              f"load, not megalite. Rerun on an idle machine (or --force).")
        return 3
    print(f"tokens/s: TP=1 (1 process x 2 threads) {tps[1]:.0f} | TP=2 (2 processes x 1 "
          f"thread) {tps[2]:.0f} | TP=2/TP=1 {tps[2] / tps[1]:.3f} (per-pair median "
          f"{statistics.median(ratios):.3f}); target >= 0.8"
          + ("  [UNRELIABLE: contended]" if contended else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
