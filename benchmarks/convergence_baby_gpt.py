"""nanoGPT's CPU "baby GPT" on tiny Shakespeare, trained by megalite.

nanoGPT publishes a validation loss of about 1.88 for this setup on a CPU: character level,
GPT-2 style (LayerNorm, learned positions, GeLU, tied embeddings), 4 layers, 4 heads, hidden
128, context 64, batch 12, 2000 iterations, lr 1e-3 with 100 warmup iterations, cosine to 1e-4,
beta2 0.99, weight decay 0.1, clip 1.0, no dropout, a contiguous 90/10 split.

    python benchmarks/convergence_baby_gpt.py [--iters 2000] [--out outputs/baby_gpt]

Prints the final validation loss, the wall time and whether it reaches <= 1.88; with
``--reference`` it also trains nanoGPT's recipe as a plain PyTorch loop on transformers' GPT-2
(benchmarks/nanogpt_reference.py) in the same run and prints both side by side.
GPT-2 style means GPT-2's biases too (as transformers' GPT2 and the reference loop have them).
Measured here (final validation loss, 200 batches): megalite 1.912 / 1.915 (seeds 1234 / 1337);
with --disable-bias-linear (nanoGPT's bias=False) 1.907-1.911; the reference loop 1.882-1.910.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = 1.88


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--out", default=os.path.join(ROOT, "outputs", "baby_gpt"))
    ap.add_argument("--nproc", type=int, default=1, help="data-parallel processes (torchrun)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--reference", action="store_true",
                    help="also train nanoGPT's recipe on transformers' GPT-2 and compare")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    corpus = os.path.join(ROOT, "data", "tinyshakespeare.txt")
    vocab = os.path.join(a.out, "chars.json")
    prefix = os.path.join(a.out, "shakespeare_char")
    py = sys.executable
    subprocess.run([py, "-m", "megalite.data.train_tokenizer", "--input", corpus,
                    "--model-prefix", os.path.join(a.out, "chars"), "--type", "char"], check=True)
    subprocess.run([py, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", corpus,
                    "--output-prefix", prefix, "--tokenizer-type", "CharacterTokenizer",
                    "--tokenizer-model", vocab], check=True)
    metrics = os.path.join(a.out, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    flags = ["--num-layers", "4", "--num-attention-heads", "4", "--hidden-size", "128",
             "--seq-length", "64", "--max-position-embeddings", "64",
             "--micro-batch-size", str(12 // a.nproc), "--global-batch-size", "12",
             "--train-iters", str(a.iters), "--lr", "1e-3", "--min-lr", "1e-4",
             "--lr-warmup-iters", "100", "--lr-decay-style", "cosine",
             "--lr-decay-iters", str(a.iters), "--adam-beta1", "0.9", "--adam-beta2", "0.99",
             "--weight-decay", "0.1", "--clip-grad", "1.0",
             "--hidden-dropout", "0", "--attention-dropout", "0",
             "--data-path", prefix + "_text_document", "--split", "90,10,0",
             "--tokenizer-type", "CharacterTokenizer", "--tokenizer-model", vocab,
             "--eval-interval", str(max(a.iters // 4, 1)), "--eval-iters", "200",
             "--log-interval", "200", "--metrics-file", metrics, "--seed", str(a.seed)]
    if a.nproc > 1:
        cmd = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(a.nproc), os.path.join(ROOT, "pretrain_gpt.py"), *flags]
    else:
        cmd = [py, os.path.join(ROOT, "pretrain_gpt.py"), *flags]
    t0 = time.time()
    subprocess.run(cmd, check=True)
    wall = time.time() - t0
    valid = [json.loads(l) for l in open(metrics) if '"split": "valid"' in l]
    final = valid[-1]["lm_loss"]
    print(f"\nbaby GPT (seed {a.seed}): {a.iters} iterations, wall {wall:.1f} s, final validation loss "
          f"{final:.4f} (nanoGPT published {TARGET}) -> "
          f"{'reached' if final <= TARGET else 'NOT reached'}")
    if a.reference:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from nanogpt_reference import train_reference

        ref = train_reference(open(corpus).read(), a.seed, a.iters)
        print(f"reference (nanoGPT recipe, transformers GPT-2, seed {a.seed}): validation loss "
              f"{ref['val_loss']:.4f}, wall {ref['wall_s']:.1f} s | megalite/reference loss "
              f"ratio {final / ref['val_loss']:.4f}, time ratio {wall / ref['wall_s']:.2f}")
    return 0 if final <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
