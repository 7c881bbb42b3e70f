#!/usr/bin/env python
"""Training-step speed on CPU: megalite (fp32, --bf16, each with and without the fused
output layer + loss, and each precision's best with ``--compile``) against Hugging Face
Llama (fp32, and under bf16 autocast; each with SDPA and with its eager attention).

Reference config by default (issue 18): hidden 256, 4 layers, 8 heads / 4 KV heads, FFN
688, vocabulary 32000, sequence 256, batch 8 (about 143 GFLOP per step).  megalite runs
its real training step (``Trainer.train_step``: mock data, schedule, DDP strategy, AdamW;
under ``--bf16`` bf16 weights with fp32 main grads and master weights); HF runs
forward/backward/``torch.optim.AdamW`` on the same initial weights.  All modes alternate
step by step, so drift in machine load touches each alike; medians are reported.

Printed: the CPU model and its matmul-relevant flags, tokens/s per mode, each mode's ratio
to HF's BEST mode, and the efficiency: (sum of the step's matmul FLOPs / the machine's
best matmul rate on those same shapes, fp32 or bf16, measured in this run) / step time.

The machine must be quiet: this process's CPU time / wall time / threads over the timed
steps is checked, and below ``--min-cpu-share`` the script refuses to report (exit 3)
unless ``--allow-contended`` (development only: the ratios still mean something, the
absolute figures do not).

    python benchmarks/step_time.py [--threads 2] [--reps 5] [--allow-contended]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

FLAGS_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                     "amx_tile", "amx_bf16", "amx_int8")
# HF's attention: SDPA, and its explicit ("eager") path, which is faster on CPU at short
# sequences in bf16 (as megalite's unfused kernel): HF's best is the best of all four
HF_MODES = {"hf fp32": (False, "sdpa"), "hf bf16-autocast": (True, "sdpa"),
            "hf fp32 eager": (False, "eager"), "hf bf16-autocast eager": (True, "eager")}


def cpu_description() -> str:
    info, flags = {}, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in info:
                    info[key] = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    have = [f for f in FLAGS_OF_INTEREST if f in flags]
    return (f"{info.get('model name', 'unknown CPU')} (family {info.get('cpu family', '?')} "
            f"model {info.get('model', '?')}); {os.cpu_count()} CPUs visible; "
            f"matmul flags: {' '.join(have) or 'none'}")


def megalite_flags(args, bf16: bool, fused: bool, compiled: bool = False) -> list:
    flags = ["--world-size", "1", "--num-layers", str(args.layers),
             "--hidden-size", str(args.hidden), "--ffn-hidden-size", str(args.ffn),
             "--num-attention-heads", str(args.heads), "--group-query-attention",
             "--num-query-groups", str(args.kv_heads), "--seq-length", str(args.seq),
             "--max-position-embeddings", str(args.seq), "--vocab-size", str(args.vocab),
             "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
             "--position-embedding-type", "rope", "--swiglu",
             "--untie-embeddings-and-output-weights", "--disable-bias-linear",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--transformer-impl", "local",
             "--mock-data", "--micro-batch-size", str(args.batch),
             "--global-batch-size", str(args.batch), "--lr", "1e-4", "--weight-decay", "0.0",
             "--train-iters", str(args.warmup + args.reps + 2), "--eval-iters", "0",
             "--no-progress-bar", "--seed", "1234"]
    return flags + (["--bf16"] if bf16 else []) + \
        (["--cross-entropy-loss-fusion"] if fused else []) + (["--compile"] if compiled else [])


def build_megalite(args, bf16: bool, fused: bool, compiled: bool = False):
    from megalite.cli.arguments import parse_args
    from megalite.parallel_state import ParallelState, RankGrid
    from megalite.training.loop import Trainer

    cfg = parse_args(megalite_flags(args, bf16, fused, compiled))
    trainer = Trainer(cfg, ParallelState.build(RankGrid(1), 0, create_groups=False), "cpu")
    trainer.setup()
    iterator = trainer.data_iterator(trainer.train_ds, 0)
    return lambda: trainer.train_step(iterator)["lm_loss"], trainer


def build_hf(args, megalite_model, autocast: bool, attention: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    from megalite.checkpointing.hf import megalite_to_hf_state_dict

    full = {n: p.detach().float()[:args.vocab] if "word" in n or "output" in n
            else p.detach().float() for n, p in megalite_model.named_parameters()}
    hf_cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.ffn, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         max_position_embeddings=args.seq, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, attention_dropout=0.0)
    hf_cfg._attn_implementation = attention
    model = LlamaForCausalLM(hf_cfg)
    model.load_state_dict(megalite_to_hf_state_dict(
        full, dataclasses.asdict(megalite_model.model_cfg)))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(0))

    def step():
        opt.zero_grad(set_to_none=True)
        if autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss.item()
    return step


def step_matmuls(args) -> list:
    """(count, batch, m, k, n) of every matmul of one training step (forward and both
    backward GEMMs of each linear; attention's q k^T and p v with their four backward
    products, counted in full as the usual 6ND-style FLOP formulas do)."""
    n_tok, h, d = args.batch * args.seq, args.hidden, args.hidden // args.heads
    qkv = (args.heads + 2 * args.kv_heads) * d
    linears = [(h, qkv), (args.heads * d, h), (h, 2 * args.ffn), (args.ffn, h)]
    out = []
    for k, n in linears:
        out += [(args.layers, 1, n_tok, k, n), (args.layers, 1, n_tok, n, k),
                (args.layers, 1, n, n_tok, k)]
    out += [(1, 1, n_tok, h, args.vocab), (1, 1, n_tok, args.vocab, h),
            (1, 1, args.vocab, n_tok, h)]
    bh, s = args.batch * args.heads, args.seq
    out += [(3 * args.layers, bh, s, d, s), (3 * args.layers, bh, s, s, d)]
    return out


def best_matmul_time(shapes, reps: int = 3):
    """(total FLOPs, seconds of the step's matmuls at the best rate per shape of fp32 and
    bf16, {dtype: seconds if all ran in that dtype})."""
    flops, best_total, per_dtype = 0.0, 0.0, {"fp32": 0.0, "bf16": 0.0}
    for count, batch, m, k, n in shapes:
        flops += count * batch * 2.0 * m * k * n
        times = {}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            a = torch.randn(batch, m, k).to(dtype).squeeze(0)
            b = torch.randn(batch, k, n).to(dtype).squeeze(0)
            torch.matmul(a, b)
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                torch.matmul(a, b)
                ts.append(time.perf_counter() - t0)
            times[name] = min(ts)
            per_dtype[name] += count * times[name]
        best_total += count * min(times.values())
    return flops, best_total, per_dtype


def add_reference_config(ap: argparse.ArgumentParser) -> None:
    """Issue 18's reference config (a small Llama with a 32k vocabulary) as flags."""
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=688)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_reference_config(ap)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all CPUs)")
    ap.add_argument("--modes", default="all",
                    help="comma-separated subset of: megalite fp32, megalite bf16, "
                         "megalite fp32 fused, megalite bf16 fused, megalite fp32 compiled, "
                         "megalite bf16 fused compiled, " + ", ".join(HF_MODES))
    ap.add_argument("--min-cpu-share", type=float, default=0.75,
                    help="refuse to report below this CPU time / wall time / threads")
    ap.add_argument("--allow-contended", action="store_true",
                    help="report even on a busy machine (development; absolute figures lie)")
    args = ap.parse_args(argv)
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    print(f"CPU: {cpu_description()}")
    print(f"config: hidden={args.hidden} ffn={args.ffn} layers={args.layers} "
          f"heads={args.heads} kv_heads={args.kv_heads} vocab={args.vocab} seq={args.seq} "
          f"batch={args.batch}; {threads} threads; torch {torch.__version__}; "
          f"{args.reps} reps after {args.warmup} warm-up (median)")

    wanted = None if args.modes == "all" else {m.strip() for m in args.modes.split(",")}
    steps = {}
    ref_trainer = None
    # --compile (each layer through torch.compile/inductor) only where it is each precision's
    # best: fp32 unfused, bf16 with the fused loss.  Its compile time falls in the warm-up.
    for bf16, fused, compiled in ((False, False, False), (False, True, False),
                                  (True, False, False), (True, True, False),
                                  (False, False, True), (True, True, True)):
        name = (f"megalite {'bf16' if bf16 else 'fp32'}{' fused' if fused else ''}"
                f"{' compiled' if compiled else ''}")
        if wanted is None or name in wanted or (ref_trainer is None and not bf16):
            steps[name], trainer = build_megalite(args, bf16, fused, compiled)
            ref_trainer = ref_trainer or trainer
    for name, (autocast, attention) in HF_MODES.items():
        if wanted is None or name in wanted:
            steps[name] = build_hf(args, ref_trainer.model_chunks[0], autocast, attention)
    if wanted is not None:
        steps = {k: v for k, v in steps.items() if k in wanted}

    last = {}
    for _ in range(args.warmup):
        for name, fn in steps.items():
            last[name] = fn()
    times = {name: [] for name in steps}
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(args.reps):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            last[name] = fn()
            times[name].append(time.perf_counter() - t0)
    share = (time.process_time() - cpu0) / ((time.perf_counter() - wall0) * threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load check: this process got {share:.0%} of {threads} threads' wall time "
          f"(minimum {args.min_cpu_share:.0%}); 1-minute load average {load:.1f}")
    if share < args.min_cpu_share:
        if not args.allow_contended:
            print(f"REFUSED: the machine is contended (CPU share {share:.0%} < "
                  f"{args.min_cpu_share:.0%}): step times would not be this CPU's; rerun "
                  f"on a quiet machine (or pass --allow-contended for development)",
                  file=sys.stderr)
            return 3
        print("CONTENDED (--allow-contended): compare the ratios only, not absolute figures")
    flops, roofline_s, per_dtype = best_matmul_time(step_matmuls(args))

    tokens = args.batch * args.seq
    med = {k: statistics.median(v) for k, v in times.items()}
    hf = [m for m in HF_MODES if m in med]
    hf_best = min(hf, key=med.get) if hf else None
    print(f"matmul FLOPs per step: {flops / 1e9:.1f} G; at the best measured rate per shape "
          f"they take {roofline_s * 1e3:.1f} ms ({flops / roofline_s / 1e9:.1f} GFLOP/s); "
          f"all-fp32 {per_dtype['fp32'] * 1e3:.1f} ms, all-bf16 {per_dtype['bf16'] * 1e3:.1f} ms")
    print(f"{'mode':<30}{'ms/step':>10}{'tokens/s':>11}{'vs HF best':>12}{'efficiency':>12}"
          f"{'last loss':>11}")
    for name in steps:
        ratio = f"{med[hf_best] / med[name]:.2f}x" if hf_best else "-"
        print(f"{name:<30}{med[name] * 1e3:10.1f}{tokens / med[name]:11.0f}{ratio:>12}"
              f"{roofline_s / med[name]:12.1%}{last[name]:11.4f}")
    ours = [m for m in med if m.startswith("megalite")]
    if ours and hf_best:
        best = min(ours, key=med.get)
        paired = statistics.median(h / o for h, o in zip(times[hf_best], times[best]))
        print(f"megalite best ({best}) / HF best ({hf_best}): {med[hf_best] / med[best]:.2f}x "
              f"tokens/s (median of per-repetition ratios {paired:.2f}x; target >= 1.5x); "
              f"efficiency {roofline_s / med[best]:.1%} (target >= 50%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
