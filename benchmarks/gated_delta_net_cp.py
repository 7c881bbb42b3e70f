#!/usr/bin/env python
"""Gated DeltaNet's state passing under context parallelism, measured against CP=1.

A model of Gated DeltaNet layers only (every layer linear attention, so the serial state
walk is the whole token mixer) trains ``--iters`` steps on ``--seq``-token sequences, fp32
on gloo, at CP=1 and at each ``--cp``; per layout it prints the step time and its ratio to
CP=1, the delta rule's time per step (forward, per rank), the bytes each rank sent over the
CP group per step (states + convolution tails, forward and backward) against the count
the walk predicts and the planner's (``planner.comm_model``), and the first loss (equal to CP=1's).  The walk is serial (rank r waits
for r - 1; context_parallel/delta_state.py): the delta rule takes as long at CP N as at
CP 1 while the projections, the convolution and the MLPs split N ways.

    python benchmarks/gated_delta_net_cp.py [--seq 2048 --cp 2,4 --iters 3 --layers 2 ...]
"""
from __future__ import annotations

import argparse
import time


def measure(argv, iters: int) -> dict:
    """Runs on every rank: step time, the recurrence's time, CP bytes sent per step."""
    import torch.distributed as torch_dist

    from megalite import comm
    from megalite.cli.arguments import parse_args
    from megalite.parallel_state import ParallelState, RankGrid
    from megalite.training.loop import Trainer
    from megalite.transformer.gated_delta_net import GatedDeltaNet

    cfg = parse_args(argv)
    world = cfg.world_size
    grid = RankGrid.from_config(cfg)
    state = ParallelState.build(grid, torch_dist.get_rank() if world > 1 else 0,
                                create_groups=world > 1)
    trainer = Trainer(cfg, state, "cpu")
    trainer.setup()
    spent = [0.0]
    for module in (m for c in trainer.model_chunks for m in c.modules()):
        if isinstance(module, GatedDeltaNet):
            inner = module._recurrence

            def timed(*a, _inner=inner):
                t = time.perf_counter()
                out = _inner(*a)
                spent[0] += time.perf_counter() - t
                return out
            module._recurrence = timed
    it = trainer.data_iterator(trainer.train_ds, 0)
    losses = [trainer.train_step(it)["lm_loss"]]          # warm-up step
    comm.counter.reset()
    spent[0] = 0.0
    t0 = time.perf_counter()
    losses += [trainer.train_step(it)["lm_loss"] for _ in range(iters)]
    seconds = (time.perf_counter() - t0) / iters
    sent = comm.counter.get("cp", "send")["bytes"] / iters
    from megalite.planner.comm_model import predict_comm_volume

    planner = predict_comm_volume(cfg, torch_dist.get_rank() if world > 1 else 0)
    return dict(losses=losses, seconds=seconds, recurrence=spent[0] / iters, sent=sent,
                planner=planner.get("cp/send", {}).get("bytes", 0))


def run(world: int, argv, iters: int) -> list:
    from megalite.testing import WorkerPool

    pool = WorkerPool(world, timeout_s=1800)     # CP=1 too: same threads per process
    try:
        return pool.run(measure, ["--world-size", str(world), *argv], iters)
    finally:
        pool.close()


def predicted_bytes(args, cp: int, rank: int) -> int:
    """Per step: each micro-batch, layer and direction (forward, backward) sends the state
    once per neighbour it hands to (rank 0 and the last rank: one hop each way, middle ranks
    two) and the convolution's (K - 1)-token tails to each neighbour."""
    b, hv, hk, d, K = args.micro_batch, args.value_heads, args.key_heads, args.head_dim, 4
    state = b * hv * d * d * 4
    tails = b * (2 * hk * d + hv * d) * (K - 1) * 4
    neighbours = (rank > 0) + (rank < cp - 1)
    hops = neighbours                   # state sends by this rank (up and/or down)
    micro = args.global_batch // args.micro_batch
    return 2 * micro * args.layers * (hops * state + neighbours * tails)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--cp", default="2")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--key-heads", type=int, default=2)
    ap.add_argument("--value-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--global-batch", type=int, default=1)
    args = ap.parse_args(argv)
    model = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
             "--num-attention-heads", "4", "--seq-length", str(args.seq), "--mock-data",
             "--vocab-size", "256", "--normalization", "RMSNorm", "--swiglu",
             "--disable-bias-linear", "--position-embedding-type", "rope",
             "--experimental-attention-variant", "gated_delta_net",
             "--linear-num-key-heads", str(args.key_heads),
             "--linear-num-value-heads", str(args.value_heads),
             "--linear-key-head-dim", str(args.head_dim),
             "--linear-value-head-dim", str(args.head_dim), "--hidden-dropout", "0",
             "--attention-dropout", "0", "--lr", "1e-3", "--train-iters", "100",
             "--eval-iters", "0", "--micro-batch-size", str(args.micro_batch),
             "--global-batch-size", str(args.global_batch)]
    one = run(1, model, args.iters)[0]
    print(f"Gated DeltaNet only, {args.layers} layers, hidden {args.hidden}, "
          f"{args.key_heads}/{args.value_heads} q-k/v heads of {args.head_dim}, seq {args.seq}, "
          f"fp32 on gloo ({args.iters} steps after one warm-up)")
    print(f"{'layout':8s} {'step s':>8s} {'vs CP1':>7s} {'rule fwd':>8s} {'vs CP1':>7s} "
          f"{'sent/rank MiB':>14s} {'predicted':>10s} {'planner':>8s} {'loss':>10s}")
    print(f"{'cp1':8s} {one['seconds']:8.3f} {1.0:7.2f} {one['recurrence']:8.3f} {1.0:7.2f} "
          f"{0.0:14.3f} {0.0:10.3f} {0.0:8.3f} {one['losses'][0]:10.6f}")
    for cp in (int(c) for c in args.cp.split(",")):
        rows = run(cp, model + ["--context-parallel-size", str(cp)], args.iters)
        step = max(r["seconds"] for r in rows)
        rule = max(r["recurrence"] for r in rows)
        sent = max(r["sent"] for r in rows) / 2 ** 20
        pred = max(predicted_bytes(args, cp, r) for r in range(cp)) / 2 ** 20
        planner = max(r["planner"] for r in rows) / 2 ** 20    # planner/comm_model.py
        print(f"{'cp' + str(cp):8s} {step:8.3f} {step / one['seconds']:7.2f} {rule:8.3f} "
              f"{rule / one['recurrence']:7.2f} {sent:14.3f} {pred:10.3f} {planner:8.3f} "
              f"{rows[-1]['losses'][0]:10.6f}")


if __name__ == "__main__":
    main()
