#!/usr/bin/env python
"""One training step (forward, backward, AdamW) of megalite's GPT vs transformers' Llama.

Same config, same weights (copied through the HF exporter), same machine, fp32.  The two
steps are alternated so drift in machine load affects both equally; the median of
``--reps`` steps is reported as tokens/s and the megalite / HF ratio; the median of the
per-repetition ratios (adjacent steps see the same machine load) is printed too.

    python benchmarks/step_time.py [--hidden 256 --layers 4 --seq 256 --batch 4 ...]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    from megalite.checkpointing.hf import megalite_to_hf_state_dict
    from megalite.config import MegaliteConfig, ModelConfig
    from megalite.models.gpt import build_model, single_rank_state

    m = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.ffn,
                    num_attention_heads=args.heads, group_query_attention=args.kv_heads != args.heads,
                    num_query_groups=args.kv_heads, seq_length=args.seq, vocab_size=args.vocab,
                    normalization="RMSNorm", norm_epsilon=1e-6, position_embedding_type="rope",
                    swiglu=True, untie_embeddings_and_output_weights=True, add_bias_linear=False,
                    hidden_dropout=0.0, attention_dropout=0.0, transformer_impl="local")
    cfg = MegaliteConfig(model=m)
    ours = build_model(cfg, single_rank_state())
    full = {n: p.detach()[:args.vocab] if "word" in n or "output" in n else p.detach()
            for n, p in ours.named_parameters()}
    hf_cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
                         rms_norm_eps=1e-6, tie_word_embeddings=False)
    hf_cfg._attn_implementation = "sdpa"
    theirs = LlamaForCausalLM(hf_cfg)
    theirs.load_state_dict(megalite_to_hf_state_dict(full, dataclasses.asdict(m)))
    return ours, theirs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=688)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ours, theirs = build(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    shifted = torch.roll(ids, -1, dims=1)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-4)

    def step_ours():
        opt_ours.zero_grad(set_to_none=True)
        loss = ours(ids, labels=shifted).mean()
        loss.backward()
        opt_ours.step()
        return loss.item()

    def step_theirs():
        opt_theirs.zero_grad(set_to_none=True)
        loss = theirs(input_ids=ids, labels=ids).loss
        loss.backward()
        opt_theirs.step()
        return loss.item()

    first = (step_ours(), step_theirs())
    for _ in range(args.warmup - 1):
        step_ours(), step_theirs()
    times = {"megalite": [], "hf": []}
    for _ in range(args.reps):
        for name, fn in (("megalite", step_ours), ("hf", step_theirs)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    tokens = args.batch * args.seq
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"config: hidden={args.hidden} ffn={args.ffn} layers={args.layers} heads={args.heads} "
          f"kv_heads={args.kv_heads} vocab={args.vocab} seq={args.seq} batch={args.batch} fp32, "
          f"{torch.get_num_threads()} threads, {args.reps} reps (median)")
    print(f"first-step loss: megalite {first[0]:.5f}  hf {first[1]:.5f}")
    for k in ("megalite", "hf"):
        print(f"{k:>9}: {med[k] * 1e3:8.1f} ms/step  {tokens / med[k]:10.0f} tokens/s")
    paired = statistics.median(h / m for h, m in zip(times["hf"], times["megalite"]))
    print(f"ratio megalite/hf (tokens/s): {med['hf'] / med['megalite']:.3f}x  "
          f"(median of per-repetition ratios: {paired:.3f}x)")


if __name__ == "__main__":
    main()
