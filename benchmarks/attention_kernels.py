#!/usr/bin/env python
"""Core attention on CPU: SDPA (the flash kernel torch picks) against megalite's unfused
kernel, forward + backward of one layer, per shape and dtype, alternated call by call.

This is the measurement behind ``--attention-backend auto``'s rule
(``megalite/transformer/attention_kernels.py``: unfused on CPU up to
``UNFUSED_MAX_SEQ[dtype]``): the last column says which kernel ``auto`` runs, and it should
be the faster one on the machine the rule was measured on.

    python benchmarks/attention_kernels.py [--threads 2] [--reps 10]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megalite.transformer.attention_kernels import (core_attention_kernel,  # noqa: E402
                                                    unfused_attention)

# (batch, query heads, kv groups, sequence, head dim): the baby GPT, the step-time reference
# config, and longer sequences at the same tokens per step
SHAPES = [(12, 4, 4, 64, 32), (8, 8, 4, 128, 32), (8, 8, 4, 256, 32), (4, 8, 4, 512, 32),
          (2, 8, 4, 1024, 64), (1, 8, 4, 2048, 64)]


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                          enable_gqa=k.shape[1] != q.shape[1])


def unfused(q, k, v):
    return unfused_attention(q, k, v, causal=True)


def best_times(kernels, shape, dtype, reps):
    """Fastest forward and backward time of each kernel, alternating kernels every call."""
    b, h, g, s, d = shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, s, d, generator=gen).to(dtype).requires_grad_(True)
    k, v = (torch.randn(b, g, s, d, generator=gen).to(dtype).requires_grad_(True)
            for _ in range(2))
    grad = torch.randn(b, h, s, d, generator=gen).to(dtype)
    best = {name: [float("inf"), float("inf")] for name in kernels}
    for rep in range(reps + 2):
        for name, fn in kernels.items():
            t0 = time.perf_counter()
            out = fn(q, k, v)
            t1 = time.perf_counter()
            out.backward(grad)
            t2 = time.perf_counter()
            if rep >= 2:                                   # two warm-up rounds
                best[name] = [min(best[name][0], t1 - t0), min(best[name][1], t2 - t1)]
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all CPUs)")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; fastest of "
          f"{args.reps} calls, ms, forward + backward = total")
    print(f"{'b x heads/groups x s x d':<26}{'dtype':<10}{'SDPA (flash)':>26}"
          f"{'unfused':>26}{'unfused/SDPA':>14}  auto")
    for shape in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            best = best_times({"sdpa": sdpa, "unfused": unfused}, shape, dtype, args.reps)
            cells = [f"{1e3 * f:.2f} + {1e3 * bw:.2f} = {1e3 * (f + bw):.2f}"
                     for f, bw in best.values()]
            ratio = sum(best["unfused"]) / sum(best["sdpa"])
            b, h, g, s, d = shape
            auto = core_attention_kernel("auto", "cpu", s, dtype)
            print(f"{f'{b} x {h}/{g} x {s} x {d}':<26}{str(dtype)[6:]:<10}{cells[0]:>26}"
                  f"{cells[1]:>26}{ratio:>14.2f}  {auto}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
