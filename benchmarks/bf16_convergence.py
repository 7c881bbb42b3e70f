#!/usr/bin/env python
"""Does ``--bf16`` converge like fp32?  Both train the same small Llama-style model on the
bundled corpus (data/tinyshakespeare.txt, character level) from the same seed and data
order, step by step alternately (so both see the same machine load), and the losses after
``--iters`` iterations are compared.  Target (issue 18): within 2% of fp32's.

The loss "after N iterations" is the validation loss over ``--eval-iters`` fixed batches
(the same batches for both), and, as a second view, the mean training loss of the last 20
iterations.  Also printed: each mode's median step time and the start-up probe's matmul
rates (training/precision.py), which say whether bf16 is fast on this CPU at all.

    python benchmarks/bf16_convergence.py [--iters 300] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.abspath(os.path.dirname(__file__)))
sys.path.insert(0, ROOT)


def prepare(out: str) -> tuple:
    corpus = os.path.join(ROOT, "data", "tinyshakespeare.txt")
    py = sys.executable
    subprocess.run([py, "-m", "megalite.data.train_tokenizer", "--input", corpus,
                    "--model-prefix", os.path.join(out, "chars"), "--type", "char"],
                   check=True, capture_output=True)
    prefix = os.path.join(out, "shakespeare_char")
    vocab = os.path.join(out, "chars.json")
    subprocess.run([py, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", corpus,
                    "--output-prefix", prefix, "--tokenizer-type", "CharacterTokenizer",
                    "--tokenizer-model", vocab], check=True, capture_output=True)
    return prefix + "_text_document", vocab


def flags(args, data_prefix, vocab, bf16: bool) -> list:
    return ["--world-size", "1", "--num-layers", "4", "--hidden-size", "128",
            "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
            "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
            "--disable-bias-linear", "--untie-embeddings-and-output-weights",
            "--hidden-dropout", "0", "--attention-dropout", "0",
            "--seq-length", "128", "--micro-batch-size", "8", "--global-batch-size", "16",
            "--train-iters", str(args.iters), "--lr", "3e-3", "--min-lr", "3e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "20", "--weight-decay", "0.1",
            "--adam-beta2", "0.99", "--clip-grad", "1.0", "--data-path", data_prefix,
            "--split", "95,5,0", "--tokenizer-type", "CharacterTokenizer",
            "--tokenizer-model", vocab, "--eval-iters", str(args.eval_iters),
            "--no-progress-bar", "--seed", str(args.seed),
            "--attention-backend", args.attention_backend] + (["--bf16"] if bf16 else [])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--eval-iters", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--attention-backend", default="auto",
                    help="both precisions' core attention (auto: unfused at this length on CPU)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all CPUs)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)

    from megalite.cli.arguments import parse_args
    from megalite.parallel_state import ParallelState, RankGrid
    from megalite.training.loop import Trainer
    from megalite.training.precision import format_precision, resolve_precision

    with tempfile.TemporaryDirectory() as tmp:
        data_prefix, vocab = prepare(tmp)
        runs = {}
        for name, bf16 in (("fp32", False), ("bf16", True)):
            cfg = parse_args(flags(args, data_prefix, vocab, bf16))
            trainer = Trainer(cfg, ParallelState.build(RankGrid(1), 0, create_groups=False),
                              "cpu")
            trainer.setup()
            runs[name] = {"trainer": trainer, "it": trainer.data_iterator(trainer.train_ds, 0),
                          "losses": [], "times": []}
        _, probe = resolve_precision(parse_args(flags(args, data_prefix, vocab, False)
                                                + ["--precision", "auto"]))
        for _ in range(args.iters):
            for run in runs.values():
                t0 = time.perf_counter()
                run["losses"].append(run["trainer"].train_step(run["it"])["lm_loss"])
                run["times"].append(time.perf_counter() - t0)
        for run in runs.values():
            run["valid"] = run["trainer"].evaluate(run["trainer"].valid_ds, args.eval_iters)

    print(f"bundled corpus (tinyshakespeare, characters); Llama-style 4 layers, hidden 128, "
          f"seq 128, global batch 16; {args.iters} iterations, seed {args.seed}; "
          f"{torch.get_num_threads()} threads")
    print(format_precision(probe))
    for name, run in runs.items():
        print(f"{name}: valid loss {run['valid']:.4f}  mean train loss of the last 20 "
              f"{statistics.mean(run['losses'][-20:]):.4f}  first {run['losses'][0]:.4f}  "
              f"median step {statistics.median(run['times']) * 1e3:.1f} ms")
    v = runs["bf16"]["valid"] / runs["fp32"]["valid"]
    t = statistics.mean(runs["bf16"]["losses"][-20:]) / statistics.mean(runs["fp32"]["losses"][-20:])
    speed = statistics.median(runs["fp32"]["times"]) / statistics.median(runs["bf16"]["times"])
    print(f"bf16 / fp32 loss after {args.iters} iterations: valid {v:.4f} ({abs(v - 1):.2%} off), "
          f"train {t:.4f} ({abs(t - 1):.2%} off); target within 2%: "
          f"{'MET' if abs(v - 1) <= 0.02 else 'NOT MET'}; bf16 step {speed:.2f}x fp32's speed")
    return 0 if abs(v - 1) <= 0.02 else 1


if __name__ == "__main__":
    sys.exit(main())
