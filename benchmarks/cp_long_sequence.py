#!/usr/bin/env python
"""Long sequences on CPU: one rank at CP=1 vs CP ranks (ring and all-to-all), peak memory.

A tiny Llama-style model trains ``--iters`` iterations on one ``--seq``-token sequence
(mock data, fp32, gloo).  Per rank it reports the peak bytes held for backward (every saved
tensor, followed live as ``megalite plan --validate-run`` does) and the growth of the
process's resident high-water mark during the steps (``VmHWM`` after resetting it), side
by side with the ratio to CP=1, plus the losses (they must agree).

    python benchmarks/cp_long_sequence.py [--seq 8192 --cp 4 --iters 2 --layers 2 ...]
"""
from __future__ import annotations

import argparse
import time


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def measure(argv, iters: int) -> dict:
    """Runs on every rank: ``iters`` training steps, peak saved bytes and RSS growth."""
    import torch
    import torch.distributed as torch_dist

    from megalite.cli.arguments import parse_args
    from megalite.parallel_state import ParallelState, RankGrid
    from megalite.commands.validate_run import LiveSaved
    from megalite.training.loop import Trainer

    cfg = parse_args(argv)
    world = cfg.world_size
    grid = RankGrid.from_config(cfg)
    state = ParallelState.build(grid, torch_dist.get_rank() if world > 1 else 0,
                                create_groups=world > 1)
    trainer = Trainer(cfg, state, "cpu")
    trainer.setup()
    it = trainer.data_iterator(trainer.train_ds, 0)
    live = LiveSaved([p for c in trainer.model_chunks for p in c.parameters()])
    try:                                          # reset the resident high-water mark
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    before = _rss_bytes("VmRSS")
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(live.pack, live.unpack):
        losses = [trainer.train_step(it)["lm_loss"] for _ in range(iters)]
    return dict(losses=losses, saved=live.peak, rss=_rss_bytes("VmHWM") - before,
                seconds=(time.perf_counter() - t0) / iters)


def run(world: int, argv, iters: int) -> list:
    from megalite.testing import WorkerPool

    pool = WorkerPool(world, timeout_s=1800)
    try:
        return pool.run(measure, ["--world-size", str(world), *argv], iters)
    finally:
        pool.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--comm-types", default="p2p,a2a")
    args = ap.parse_args(argv)
    model = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
             "--num-attention-heads", str(args.heads), "--group-query-attention",
             "--num-query-groups", str(args.kv_heads), "--seq-length", str(args.seq),
             "--max-position-embeddings", str(args.seq), "--vocab-size", str(args.vocab),
             "--mock-data", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
             "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-3",
             "--train-iters", str(args.iters), "--eval-iters", "0",
             "--micro-batch-size", "1", "--global-batch-size", "1"]
    rows = [("CP=1", run(1, model, args.iters))]
    for kind in args.comm_types.split(","):
        flags = ["--context-parallel-size", str(args.cp), "--cp-comm-type", kind]
        rows.append((f"CP={args.cp} {kind}", run(args.cp, model + flags, args.iters)))
    base_saved, base_rss = rows[0][1][0]["saved"], rows[0][1][0]["rss"]
    mib = 1 << 20
    print(f"seq {args.seq}, {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
          f"({args.kv_heads} K/V), fp32, {args.iters} iteration(s), micro-batch 1")
    print(f"{'layout':<12} {'loss (per iteration)':<28} {'saved/rank MiB':>15} {'x CP=1':>7} "
          f"{'RSS growth/rank MiB':>20} {'x CP=1':>7} {'s/iter':>7}")
    for name, ranks in rows:
        saved = max(r["saved"] for r in ranks)
        rss = max(r["rss"] for r in ranks)
        loss = " ".join(f"{x:.6f}" for x in ranks[-1]["losses"])
        print(f"{name:<12} {loss:<28} {saved / mib:>15.1f} {saved / base_saved:>7.3f} "
              f"{rss / mib:>20.1f} {rss / base_rss:>7.3f} {ranks[0]['seconds']:>7.2f}")


if __name__ == "__main__":
    main()
