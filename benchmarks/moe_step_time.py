#!/usr/bin/env python
"""MoE training step at EP=1 vs a dense model with the same active parameters, in one run.

The MoE model has 8 experts of hidden size F, top-2; the dense one has an MLP of hidden size
2F, so each token goes through the same number of expert (MLP) weights and the same FLOPs,
apart from the router.  Both train on mock data, one process, fp32; the steps alternate so
machine load hits both alike.  Prints the median step times and their ratio (target <= 1.5).

    python benchmarks/moe_step_time.py [--steps 20]
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

from megalite.arguments import parse_args  # noqa: E402
from megalite.parallel_state import ParallelState, RankGrid  # noqa: E402
from megalite.training.loop import Trainer  # noqa: E402

H, F = 256, 512
BASE = ["--world-size", "1", "--num-layers", "4", "--hidden-size", str(H),
        "--num-attention-heads", "8", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
        "--seq-length", "256", "--micro-batch-size", "8", "--global-batch-size", "8",
        "--mock-data", "--vocab-size", "1024", "--train-iters", "1000", "--lr", "1e-3",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0"]
MODELS = {
    "dense (MLP 2F)": ["--ffn-hidden-size", str(2 * F)],
    "MoE 8 x F, top-2": ["--num-experts", "8", "--moe-router-topk", "2",
                         "--moe-ffn-hidden-size", str(F), "--moe-aux-loss-coeff", "1e-2"],
}


def trainer_for(flags):
    cfg = parse_args(BASE + flags)
    trainer = Trainer(cfg, ParallelState.build(RankGrid(1), 0, create_groups=False), "cpu")
    trainer.setup()
    return trainer, trainer.data_iterator(trainer.train_ds, 0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    runs = {name: trainer_for(flags) for name, flags in MODELS.items()}
    params = {name: sum(p.numel() for c in t.model_chunks for p in c.parameters())
              for name, (t, _) in runs.items()}
    times = {name: [] for name in runs}
    for step in range(args.warmup + args.steps):
        for name, (trainer, it) in runs.items():
            t0 = time.perf_counter()
            trainer.train_step(it)
            if step >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    dense, moe = med["dense (MLP 2F)"], med["MoE 8 x F, top-2"]
    print(f"one fp32 training step, 1 process, {8 * 256} tokens, h={H}, 4 layers")
    for name in runs:
        print(f"{name:>18}: {1000 * med[name]:8.1f} ms/step  ({params[name] / 1e6:.2f} M params)")
    print(f"{'MoE / dense':>18}: {moe / dense:8.2f}x  (target <= 1.5)")


if __name__ == "__main__":
    main()
