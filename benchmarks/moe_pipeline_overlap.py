#!/usr/bin/env python
"""MoE at EP 2 x PP 2 on 4 CPU processes (gloo): step time, exposed all-to-all and exposed
pipeline p2p per step for each schedule, side by side in one run.

Exposed all-to-all = the wall time ranks spend inside the MoE dispatch / combine
all-to-alls (the flight recorder's start and end of every ``all_to_all`` of the step, the
worst rank); exposed p2p = ``PipelineExecutor.p2p_wait_s`` (DualPipeV waits only where a
message is read; ``dualpipev:blocking`` runs the same program with blocking batches).
Every all-to-all is blocking in megalite today: the F&B pairs do not yet run one
micro-batch's all-to-all beside the other's compute, so this table is the baseline an
overlapped F&B would hide (the planner's ``--ep-overlap`` models that:
benchmarks/moe_overlap_prediction.py).

    python benchmarks/moe_pipeline_overlap.py [--iters 3] [--micro-batches 8]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipeline_bubble import mock_micro_batches  # noqa: E402


def _run(name: str, args: dict):
    import time

    import torch
    import torch.distributed as dist

    from megalite.config import MegaliteConfig, ModelConfig, ParallelConfig
    from megalite.comm import flight_recorder as fr
    from megalite.models.stages import build_model_chunks
    from megalite.parallel_state import ParallelState, RankGrid
    from megalite.pipeline_parallel.schedules import run_schedule

    torch.set_num_threads(1)
    schedule, _, mode = name.partition(":")
    m = args["micro_batches"]
    cfg = MegaliteConfig(
        model=ModelConfig(num_layers=4, hidden_size=args["hidden"], num_attention_heads=8,
                          seq_length=args["seq"], vocab_size=1000, hidden_dropout=0.0,
                          attention_dropout=0.0, normalization="RMSNorm",
                          position_embedding_type="rope", swiglu=True, add_bias_linear=False,
                          num_experts=8, moe_router_topk=2,
                          moe_ffn_hidden_size=args["hidden"]),
        parallel=ParallelConfig(pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                                pipeline_schedule=schedule),
        world_size=4)
    cfg.training.micro_batch_size = args["mbs"]
    cfg.training.global_batch_size = args["mbs"] * m * 2          # DP 2
    state = ParallelState.build(RankGrid.from_config(cfg), dist.get_rank())
    chunks = build_model_chunks(cfg, state)
    batches, forward_step = mock_micro_batches(args, m, seed=dist.get_rank() % 2)
    rows = []
    for i in range(args["iters"] + 1):               # iteration 0 warms up
        for c in chunks:
            c.zero_grad(set_to_none=False)
        dist.barrier()
        fr.recorder.entries.clear()
        t0 = time.perf_counter()
        ex = run_schedule(schedule, forward_step, batches, chunks, state, cfg,
                          async_p2p=False if mode == "blocking" else None)
        step = time.perf_counter() - t0
        a2a = sum(e.t1 - e.t0 for e in fr.recorder.entries
                  if e.op == "all_to_all" and e.t1 is not None)
        if i:
            rows.append((step, a2a, ex.p2p_wait_s))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3, help="measured iterations (best kept)")
    ap.add_argument("--schedules", default="1f1b,zero-bubble,dualpipev,dualpipev:blocking")
    a = ap.parse_args(argv)
    from megalite.testing import WorkerPool

    args = dict(micro_batches=a.micro_batches, hidden=a.hidden, seq=a.seq, mbs=a.mbs,
                iters=a.iters)
    pool = WorkerPool(4, timeout_s=900)
    out = []
    try:
        for name in a.schedules.split(","):
            per_rank = pool.run(_run, name, args)
            best = min(range(a.iters), key=lambda i: max(r[i][0] for r in per_rank))
            out.append((name, *(max(r[best][k] for r in per_rank) for k in range(3))))
    finally:
        pool.close()
    print(f"MoE EP2 x PP2 (DP 2), 8 experts top-2, hidden {a.hidden}, seq {a.seq}, "
          f"micro-batch {a.mbs}, m = {a.micro_batches}; CPU gloo, 1 thread per rank; best of "
          f"{a.iters} iterations, worst rank")
    print(f"{'schedule':<20} {'step ms':>9} {'exposed a2a ms':>15} {'share':>6} "
          f"{'exposed p2p ms':>15}")
    for name, step, a2a, p2p in out:
        print(f"{name:<20} {1e3 * step:>9.1f} {1e3 * a2a:>15.1f} {a2a / step:>6.1%} "
              f"{1e3 * p2p:>15.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
