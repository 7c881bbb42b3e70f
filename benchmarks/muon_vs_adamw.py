#!/usr/bin/env python
"""Muon vs AdamW on the bundled corpus (data/tinyshakespeare.txt, character level): the same
small Llama-style model, seed and batches (the same tokens), a small learning-rate sweep for
each optimizer; prints the training loss at equal tokens for every run and both best runs
side by side, the validation loss at the end, and draws all loss curves in one plot.

"Best" is the lowest validation loss after ``--iters`` iterations; the loss at a token count
is the mean training loss of the 10 iterations up to it (one batch is noisy).  Muon steps
the weight matrices, AdamW (same lr) the embeddings, output layer and norms
(optimizer/muon.py).

    python benchmarks/muon_vs_adamw.py [--iters 100] [--out muon_vs_adamw.png]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.abspath(os.path.dirname(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bf16_convergence import prepare  # noqa: E402  (the character-level corpus)

SWEEP = {"adam": (1e-3, 3e-3, 1e-2), "muon": (3e-3, 1e-2, 3e-2)}
GLOBAL_BATCH, SEQ = 16, 64


def flags(args, data_prefix, vocab, optimizer: str, lr: float) -> list:
    return ["--world-size", "1", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
            "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
            "--disable-bias-linear", "--untie-embeddings-and-output-weights",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--seq-length", str(SEQ),
            "--micro-batch-size", str(GLOBAL_BATCH), "--global-batch-size", str(GLOBAL_BATCH),
            "--train-iters", str(args.iters), "--lr", str(lr), "--min-lr", str(lr / 10),
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "10", "--weight-decay", "0.1",
            "--adam-beta2", "0.99", "--clip-grad", "1.0", "--data-path", data_prefix,
            "--split", "95,5,0", "--tokenizer-type", "CharacterTokenizer",
            "--tokenizer-model", vocab, "--eval-iters", str(args.eval_iters),
            "--no-progress-bar", "--seed", str(args.seed), "--optimizer", optimizer]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--eval-iters", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all CPUs)")
    ap.add_argument("--out", default="muon_vs_adamw.png", help="the plot (PNG)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)

    # after the thread count is set (as benchmarks/bf16_convergence.py)
    from megalite.cli.arguments import parse_args
    from megalite.parallel_state import ParallelState, RankGrid
    from megalite.training.loop import Trainer

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        data_prefix, vocab = prepare(tmp)
        for optimizer, lrs in SWEEP.items():
            for lr in lrs:
                cfg = parse_args(flags(args, data_prefix, vocab, optimizer, lr))
                trainer = Trainer(cfg, ParallelState.build(RankGrid(1), 0, create_groups=False),
                                  "cpu")
                trainer.setup()
                it = trainer.data_iterator(trainer.train_ds, 0)
                losses, times = [], []
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    losses.append(trainer.train_step(it)["lm_loss"])
                    times.append(time.perf_counter() - t0)
                runs[(optimizer, lr)] = {
                    "losses": losses, "step_ms": statistics.median(times) * 1e3,
                    "valid": trainer.evaluate(trainer.valid_ds, args.eval_iters)}

    tokens = GLOBAL_BATCH * SEQ
    print(f"bundled corpus (tinyshakespeare, characters); Llama-style 2 layers, hidden 64, "
          f"GQA 4/2, seq {SEQ}, global batch {GLOBAL_BATCH} ({tokens} tokens/iteration); "
          f"{args.iters} iterations, cosine lr to lr/10, seed {args.seed}, "
          f"{torch.get_num_threads()} threads")
    marks = [i for i in range(10, args.iters + 1, max(10, args.iters // 6))]

    def at(run, i):
        return statistics.mean(run["losses"][i - 10:i])
    print(f"{'optimizer':>9} {'lr':>7} {'valid':>7} {'step ms':>8}  train loss at tokens: "
          + " ".join(f"{i * tokens:>7}" for i in marks))
    for (optimizer, lr), run in runs.items():
        print(f"{optimizer:>9} {lr:>7.0e} {run['valid']:>7.4f} {run['step_ms']:>8.1f}  "
              f"{'':21}" + " ".join(f"{at(run, i):>7.4f}" for i in marks))
    best = {o: min(((o2, lr) for o2, lr in runs if o2 == o), key=lambda k: runs[k]["valid"])
            for o in SWEEP}
    print("best of each sweep at equal tokens:")
    print(f"{'tokens':>8} " + " ".join(f"{o} (lr {lr:.0e})".rjust(18) for o, lr in best.values()))
    for i in marks:
        print(f"{i * tokens:>8} " + " ".join(f"{at(runs[k], i):>18.4f}" for k in best.values()))
    print("validation loss after all tokens: " + ", ".join(
        f"{o} {runs[k]['valid']:.4f}" for o, k in best.items()))

    import matplotlib    # optional dependency ([plot] extra): only this benchmark draws
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"adam": "tab:blue", "muon": "tab:red"}
    for (optimizer, lr), run in runs.items():
        is_best = best[optimizer] == (optimizer, lr)
        smooth = [statistics.mean(run["losses"][max(0, i - 9):i + 1]) for i in range(args.iters)]
        ax.plot([(i + 1) * tokens for i in range(args.iters)], smooth, color=colors[optimizer],
                lw=2.2 if is_best else 0.9, alpha=1.0 if is_best else 0.45,
                label=f"{'AdamW' if optimizer == 'adam' else 'Muon'} lr {lr:.0e}")
    ax.set_xlabel("tokens")
    ax.set_ylabel("training loss (mean of 10 iterations)")
    ax.set_title("Muon vs AdamW, bundled corpus (characters)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
