#!/usr/bin/env python
"""The attention work document masks and sliding windows remove, side by side.

1. The planner's count (``megalite/planner/flops.py``): attention-core forward FLOPs of one
   Llama-3-8B-shaped layer (32 heads of 128) per 8k sequence, causal vs 8 equal documents
   (``--reset-attention-mask``) vs a 4k / 1k window (``--window-size``) and both, against
   the pairs the real mask keeps (``transformer/attention_masks.keep``).
2. Ring attention (``context_parallel/ring.py``): the block pairs each CP rank computes and
   skips for that mask at CP 2, 4, 8 (the rule ring attention applies, forward and backward:
   ``_blocks``: chunk pairs), with the kept pairs per rank (the load balance).
   Llama 4's chunks of 2048 (``--attention-chunk-size``, as documents) too, and the
   planner's share of the attention core the Scout preset's chunks keep at 8k-128k.
3. The local kernel on this CPU: forward + backward of SDPA causal vs SDPA with the boolean
   document mask vs one causal SDPA call per document (varlen-style), at 2k tokens.

    python benchmarks/attention_masks.py [--seq 8192] [--documents 8] [--reps 3]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megalite.context_parallel.ring import _blocks  # noqa: E402
from megalite.planner.flops import attention_work_fraction  # noqa: E402
from megalite.transformer.attention_masks import chunk_documents, keep  # noqa: E402

HEADS, HEAD_DIM = 32, 128


def equal_documents(seq: int, documents: int) -> torch.Tensor:
    return (torch.arange(seq) // (seq // documents))[None]           # [1, seq]


def core_flops(seq: int, fraction: float) -> float:
    """Forward q k^T and p v of one layer over one sequence, causal pairs x ``fraction``
    (the count that halves the full s^2: Megatron's causal convention)."""
    return 4.0 * HEADS * HEAD_DIM * seq * (seq + 1) / 2 * fraction


def planner_table(seq: int, documents: int):
    pos = torch.arange(seq)
    docs = equal_documents(seq, documents)
    causal_pairs = seq * (seq + 1) / 2
    print(f"1. attention core, one layer of {HEADS}x{HEAD_DIM} heads, one sequence of {seq}")
    print(f"{'mask':<28}{'planner TFLOP':>14}{'saved':>8}{'kept pairs (mask)':>20}")
    for name, window, n in (("causal", None, 1), (f"{documents} documents", None, documents),
                            ("window 4096", 4095, 1), ("window 1024", 1023, 1),
                            (f"{documents} documents + window 1024", 1023, documents)):
        frac = attention_work_fraction(seq, window, n)
        mask = keep(pos, pos, True, docs if n > 1 else None, docs if n > 1 else None, window)
        kept = causal_pairs if mask is None else float(mask.sum())
        assert abs(kept / causal_pairs - frac) < 1e-9, (name, kept / causal_pairs, frac)
        print(f"{name:<28}{core_flops(seq, frac) / 1e12:>14.4f}{1 - frac:>8.1%}"
              f"{kept / causal_pairs:>19.1%}")


def llama4_table():
    """The planner's attention core of the llama-4-scout preset (chunks of 8192 on 3 of 4
    layers) relative to the same model without chunks."""
    import dataclasses

    from megalite.cli.presets import preset_model
    from megalite.planner.flops import kind_forward_flops

    m = preset_model("llama-4-scout")
    plain = dataclasses.replace(m, attention_chunk_size=None)
    kept = {seq: kind_forward_flops(m, True, seq)["core"] /
            kind_forward_flops(plain, True, seq)["core"] for seq in (8192, 32768, 131072)}
    cells = [f"{seq // 1024}k {share:.3f}" for seq, share in kept.items()]
    print("   llama-4-scout attention core kept by its chunks (planner): " + ", ".join(cells))


def ring_table(seq: int, documents: int):
    docs = equal_documents(seq, documents)
    print(f"\n2. ring attention block pairs per rank (computed/skipped), {seq} tokens")
    for name, d, window in ((f"{documents} documents", docs, None), ("window 1024", None, 1023),
                            # Llama 4's chunked attention: fixed-length documents
                            ("chunks 2048", chunk_documents(None, seq, 2048, 1), None)):
        for cp in (2, 4, 8):
            c = seq // (2 * cp)
            rows, kept = [], []
            for rank in range(cp):
                done = skipped = pairs = 0
                for step in range(cp):
                    blocks, skip = _blocks(step, rank, cp, True, c, d, window, "cpu")
                    skipped += skip
                    done += len(blocks)
                    pairs += sum(int(b[3].sum()) for b in blocks)
                rows.append(f"{done}/{skipped}")
                kept.append(pairs)
            spread = max(kept) / max(1, min(kept))
            print(f"  {name:<14} CP{cp}: {' '.join(rows):<40} kept pairs max/min {spread:.2f}")


def _time(fn, reps):
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def kernel_table(documents: int, reps: int):
    seq, b, h, d = 2048, 1, 8, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, seq, d, generator=g).requires_grad_(True) for _ in range(3))
    docs = equal_documents(seq, documents)
    pos = torch.arange(seq)
    mask = keep(pos, pos, True, docs, docs)[:, None]
    n = seq // documents

    def run(f):
        def go():
            out = f()
            out.sum().backward()
        return go

    causal = run(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    masked = run(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    split = run(lambda: torch.cat([F.scaled_dot_product_attention(
        q[:, :, i:i + n], k[:, :, i:i + n], v[:, :, i:i + n], is_causal=True)
        for i in range(0, seq, n)], dim=2))
    print(f"\n3. local kernel, forward + backward, {b}x{h}x{seq}x{d} fp32, {documents} "
          f"documents, {torch.get_num_threads()} threads (ms, best of {reps})")
    for name, fn in (("SDPA causal (no mask)", causal), ("SDPA + boolean mask", masked),
                     ("SDPA per document", split)):
        print(f"  {name:<24}{_time(fn, reps):>9.1f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--documents", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    planner_table(a.seq, a.documents)
    llama4_table()
    ring_table(a.seq, a.documents)
    kernel_table(a.documents, a.reps)


if __name__ == "__main__":
    main()
