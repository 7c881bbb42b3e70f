#!/usr/bin/env python
"""How long a checkpoint stalls the training loop: synchronous save vs --async-save.

A GPT of about 130M parameters (12 layers x 768 hidden, vocabulary 32000) is trained one step so the
Adam moments exist, then saved with DCP twice per mode into fresh directories.  "stall" is
the time ``trainer.save()`` blocks the loop (sync: everything; async: copying this rank's
chunks to host memory), "total" the time until the checkpoint is complete on disk (marker
written); "load" the time to resume from it (manifest verified, DCP read).  One process.

    python benchmarks/checkpoint_save.py [--layers 12 --hidden 768 --vocab 32000 --reps 2]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    a = ap.parse_args()

    from megalite.cli.arguments import parse_args
    from megalite.parallel_state import ParallelState, RankGrid
    from megalite.training.loop import Trainer

    flags = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
             "--num-attention-heads", "12", "--seq-length", "64", "--mock-data",
             "--vocab-size", str(a.vocab), "--lr", "1e-4", "--train-iters", "10",
             "--global-batch-size", "1", "--micro-batch-size", "1", "--eval-iters", "0",
             "--world-size", "1", "--untie-embeddings-and-output-weights"]
    root = a.dir or tempfile.mkdtemp(prefix="megalite-ckpt-bench-")

    def trainer(extra):
        t = Trainer(parse_args(flags + extra), ParallelState.build(RankGrid(1), 0,
                                                                   create_groups=False), "cpu")
        t.setup()
        return t

    results = {}
    for mode in ("sync", "async"):
        t = trainer(["--save", os.path.join(root, mode)] +
                    (["--async-save"] if mode == "async" else []))
        params = sum(p.numel() for c in t.model_chunks for p in c.parameters())
        it = t.data_iterator(t.train_ds, 0)
        stalls, totals = [], []
        for _ in range(a.reps):
            t.train_step(it)
            t0 = time.perf_counter()
            t.save()
            stalls.append(time.perf_counter() - t0)
            t.finish_saves()
            totals.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        trainer(["--load", os.path.join(root, mode)])
        results[mode] = (statistics.median(stalls), statistics.median(totals),
                         time.perf_counter() - t0)
    size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in
               os.walk(os.path.join(root, "sync", f"iter_{a.reps:07d}")) for f in fs)
    print(f"model: {params / 1e6:.1f}M parameters; checkpoint {size / 2**20:.0f} MiB "
          f"(weights + Adam moments + RNG)")
    print(f"{'mode':<6} {'stall (s)':>10} {'total (s)':>10} {'load (s)':>9}")
    for mode, (stall, total, load) in results.items():
        print(f"{mode:<6} {stall:>10.3f} {total:>10.3f} {load:>9.3f}")
    print(f"stall ratio sync / async: {results['sync'][0] / results['async'][0]:.1f}x")
    if a.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
