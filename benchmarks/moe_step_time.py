#!/usr/bin/env python
"""MoE training step at EP=1 vs a dense model with the same active parameters, in one run.

The MoE model has 8 experts of hidden size F, top-2 (plus the router and its aux loss); the
dense one has a SwiGLU MLP of hidden size 2F (= top-k x F; no shared expert here), so each
token goes through the same number of MLP weights and the same MLP FLOPs.  Everything else
(attention, embeddings, optimizer, fp32) is identical.  Both train on mock data in one
process; the steps alternate MoE, dense, MoE, ... so machine load hits both alike.  Prints
the median step times, the median of the per-pair ratios (each MoE step over the dense step
next to it; wall clock, and process CPU time, which descheduling by other processes does
not inflate) and the machine load.  Target: MoE / dense <= 1.5.

Threads: ``--threads 1`` by default.  On a small shared machine a multi-threaded GEMM waits
at every barrier for a sibling thread that another process has descheduled, which
penalizes many medium GEMMs (the grouped experts) more than a few large ones; one thread
measures the work, not the scheduler.  Pass ``--threads 0`` to keep torch's default.

    python benchmarks/moe_step_time.py [--steps 20] [--runs 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megalite.cli.arguments import parse_args  # noqa: E402
from megalite.parallel_state import ParallelState, RankGrid  # noqa: E402
from megalite.training.loop import Trainer  # noqa: E402

H, F, E, K = 256, 512, 8, 2
BASE = ["--world-size", "1", "--num-layers", "4", "--hidden-size", str(H),
        "--num-attention-heads", "8", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
        "--seq-length", "256", "--micro-batch-size", "8", "--global-batch-size", "8",
        "--mock-data", "--vocab-size", "1024", "--train-iters", "1000", "--lr", "1e-3",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0"]
DENSE, MOE = f"dense (MLP {K}F)", f"MoE {E} x F, top-{K}"
MODELS = {
    DENSE: ["--ffn-hidden-size", str(K * F)],
    MOE: ["--num-experts", str(E), "--moe-router-topk", str(K),
          "--moe-ffn-hidden-size", str(F), "--moe-aux-loss-coeff", "1e-2"],
}


def trainer_for(flags):
    cfg = parse_args(BASE + flags)
    trainer = Trainer(cfg, ParallelState.build(RankGrid(1), 0, create_groups=False), "cpu")
    trainer.setup()
    return trainer, trainer.data_iterator(trainer.train_ds, 0)


def active_mlp_params_per_token(name: str) -> int:
    """Weights one token's MLP pass multiplies with (router included for MoE)."""
    if name == DENSE:
        return 3 * H * K * F
    return K * 3 * H * F + H * E


def measure(runs, steps: int, warmup: int):
    """Wall-clock and process CPU time of each step, the models alternating."""
    wall = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    for step in range(warmup + steps):
        for name, (trainer, it) in runs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            trainer.train_step(it)
            if step >= warmup:
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    return wall, cpu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--runs", type=int, default=1, help="repeat the measurement this often")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    runs = {name: trainer_for(flags) for name, flags in MODELS.items()}
    params = {name: sum(p.numel() for c in t.model_chunks for p in c.parameters())
              for name, (t, _) in runs.items()}
    print(f"one fp32 training step, 1 process, {8 * 256} tokens, h={H}, 4 layers, "
          f"{torch.get_num_threads()} torch thread(s), {os.cpu_count()} cores, "
          f"{args.steps} alternating steps per run")
    for name in runs:
        print(f"{name:>18}: {params[name] / 1e6:.2f} M params, "
              f"{active_mlp_params_per_token(name) / 1e6:.3f} M active MLP params per token")
    ratios = []
    for r in range(args.runs):
        load = os.getloadavg()[0]
        times, cpu = measure(runs, args.steps, args.warmup)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        pair = statistics.median(m / d for m, d in zip(times[MOE], times[DENSE]))
        cpu_pair = statistics.median(m / d for m, d in zip(cpu[MOE], cpu[DENSE]))
        ratios.append(pair)
        print(f"run {r + 1}: load avg {load:.1f} -> {os.getloadavg()[0]:.1f}; "
              + ", ".join(f"{name} {1000 * med[name]:.1f} ms" for name in runs)
              + f"; MoE / dense: median of pair ratios {pair:.2f}x (wall), "
                f"{cpu_pair:.2f}x (process CPU time), ratio of medians "
                f"{med[MOE] / med[DENSE]:.2f}x")
    print(f"MoE / dense over {args.runs} run(s): "
          + ", ".join(f"{x:.2f}x" for x in ratios) + "  (target <= 1.5)")


if __name__ == "__main__":
    main()
