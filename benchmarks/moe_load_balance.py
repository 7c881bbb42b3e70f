#!/usr/bin/env python
"""Load balance of an MoE model on the bundled corpus, side by side in one run: the aux loss,
DeepSeek-V3's expert bias (no aux loss) and no balancing at all.

Trains the same small 8-expert top-2 model three times on tiny Shakespeare (sentencepiece
BPE, as launch/demo.sh) with Megatron's Mixtral settings for the router (softmax over the
top-k, aux-loss coefficient 1e-2; DeepSeek-V3's sigmoid scores for the bias run), plus the
aux loss at 10x that coefficient to show how the result depends on it.  The
measure is max/mean tokens per expert of the worst MoE layer over each global batch of 1024
tokens, smoothed by a moving mean over the last 10 iterations (one batch is a small, noisy
sample: even uniform routing gives about 1.1); the raw per-batch value is printed too.
Prints the curve, the first iteration from which the moving mean stays below 1.3, and
writes outputs/moe_load_balance.png.  One torch thread (the machine is shared).

    python benchmarks/moe_load_balance.py [--iters 300]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megalite.cli.arguments import parse_args  # noqa: E402
from megalite.parallel_state import ParallelState, RankGrid  # noqa: E402
from megalite.training.loop import Trainer  # noqa: E402

RUNS = {
    "aux loss 1e-2 (default)": ["--moe-aux-loss-coeff", "1e-2"],
    "expert bias (no aux loss)": ["--moe-router-load-balancing-type", "none",
                                  "--moe-router-enable-expert-bias", "--moe-router-score-function",
                                  "sigmoid", "--moe-router-bias-update-rate", "1e-2"],
    "no balancing": ["--moe-router-load-balancing-type", "none"],
    "aux loss 1e-1 (10x default)": ["--moe-aux-loss-coeff", "1e-1"],
}


def prepare_data(out: str) -> tuple:
    tok = os.path.join(out, "tokenizer.model")
    prefix = os.path.join(out, "shakespeare")
    if not os.path.isfile(tok):
        subprocess.run([sys.executable, "-m", "megalite.data.train_tokenizer", "--input",
                        os.path.join(ROOT, "data", "tinyshakespeare.txt"), "--model-prefix",
                        tok[:-len(".model")], "--vocab-size", "1024", "--type", "bpe"],
                       check=True, cwd=ROOT, capture_output=True)
    if not os.path.isfile(prefix + "_text_document.idx"):
        subprocess.run([sys.executable, "tools/preprocess_data.py", "--input",
                        os.path.join(ROOT, "data", "tinyshakespeare.txt"), "--output-prefix",
                        prefix, "--tokenizer-type", "SentencePieceTokenizer",
                        "--tokenizer-model", tok, "--append-eod"],
                       check=True, cwd=ROOT, capture_output=True)
    return tok, prefix + "_text_document"


def train(flags, iters, tok, data) -> list:
    cfg = parse_args(["--world-size", "1", "--num-layers", "2", "--hidden-size", "64",
                      "--num-attention-heads", "4", "--normalization", "RMSNorm",
                      "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
                      "--seq-length", "64", "--micro-batch-size", "16",
                      "--global-batch-size", "16", "--train-iters", str(iters), "--lr", "3e-3",
                      "--lr-warmup-iters", "10", "--hidden-dropout", "0",
                      "--attention-dropout", "0", "--num-experts", "8", "--moe-router-topk",
                      "2", "--moe-ffn-hidden-size", "64", "--data-path", data,
                      "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tok,
                      "--split", "95,5,0", "--eval-iters", "0", *flags])
    trainer = Trainer(cfg, ParallelState.build(RankGrid(1), 0, create_groups=False), "cpu")
    trainer.setup()
    it = trainer.data_iterator(trainer.train_ds, 0)
    return [trainer.train_step(it) for _ in range(iters)]


WINDOW = 10


def moving_mean(ratios, window=WINDOW):
    return [sum(ratios[max(0, i - window + 1):i + 1]) / len(ratios[max(0, i - window + 1):i + 1])
            for i in range(len(ratios))]


def settled_below(ratios, bound=1.3, window=WINDOW):
    """First iteration from which the moving mean stays below ``bound``."""
    means = moving_mean(ratios, window)
    for i in range(len(means)):
        if all(m < bound for m in means[i:]):
            return i + 1
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--out", default=os.path.join(ROOT, "outputs", "moe_bench"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    tok, data = prepare_data(args.out)
    curves = {}
    for name, flags in RUNS.items():
        rows = train(flags, args.iters, tok, data)
        curves[name] = ([r["moe_load_balance"] for r in rows], [r["lm_loss"] for r in rows])
    marks = [i for i in (1, 10, 25, 50, 75, 100, 125, 150, 175, 200, 225, 250, 275, 300)
             if i <= args.iters]
    print(f"max/mean tokens per expert (worst of 2 MoE layers, per global batch of "
          f"{16 * 64} tokens, top-2 of 8 experts): {WINDOW}-iteration moving mean (raw)")
    print(f"{'iteration':>10} " + " ".join(f"{n:>26}" for n in curves))
    smooth = {n: moving_mean(c[0]) for n, c in curves.items()}
    for i in marks:
        print(f"{i:>10} " + " ".join(f"{f'{smooth[n][i - 1]:.3f} ({c[0][i - 1]:.3f})':>26}"
                                     for n, c in curves.items()))
    print(f"{'lm loss':>10} " + " ".join(f"{c[1][-1]:>26.3f}" for c in curves.values()))
    print(f"{'< 1.3 from':>10} " + " ".join(f"{str(settled_below(c[0])):>26}"
                                            for c in curves.values()))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, (ratios, _) in curves.items():
            line, = ax.plot(range(1, len(ratios) + 1), smooth[name], lw=1.5, label=name)
            ax.plot(range(1, len(ratios) + 1), ratios, lw=0.5, alpha=0.35,
                    color=line.get_color())
        ax.axhline(1.3, color="gray", ls="--", lw=0.8)
        ax.set_xlabel("iteration")
        ax.set_ylabel(f"max / mean tokens per expert ({WINDOW}-iteration mean)")
        ax.legend()
        fig.tight_layout()
        path = os.path.join(ROOT, "outputs", "moe_load_balance.png")
        fig.savefig(path, dpi=110)
        print(f"curve: {path}")
    except ImportError:
        pass


if __name__ == "__main__":
    main()
