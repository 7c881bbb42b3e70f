#!/usr/bin/env python
"""MoE at EP 2 x PP 2 on 4 CPU processes (gloo): step time, exposed all-to-all and exposed
pipeline p2p per step for each schedule, with and without the overlapped F&B execution,
side by side in one run.

Exposed all-to-all = the wall time a rank spends blocked in the MoE dispatch / combine
all-to-alls (``comm.overlap.stats``: a blocking all-to-all's whole call; an overlapped one's
wait after the other half of its F&B pair computed), the worst rank; exposed p2p =
``PipelineExecutor.p2p_wait_s`` (DualPipeV waits only where a message is read;
``dualpipev:blocking`` runs the same program with blocking batches).  ``:overlap`` rows run
``--overlap-moe-expert-parallel-comm`` (1F1B becomes combined 1F1B: one more warm-up
forward, every steady F paired with a B; DualPipeV runs its own pairs), ``:overlap+delay``
adds ``--delay-wgrad-compute``.  ``switches`` = hand-overs between paired halves per step
(0: nothing overlapped).  The planner's model of the same overlap:
benchmarks/moe_overlap_prediction.py.

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
    from megalite.comm import overlap
    from megalite.models.stages import build_model_chunks
    from megalite.parallel_state import ParallelState, RankGrid
    from megalite.pipeline_parallel.schedules import run_schedule

    torch.set_num_threads(1)
    schedule, _, mode = name.partition(":")
    overlapped = mode.startswith("overlap")
    m = args["micro_batches"]
    cfg = MegaliteConfig(
        model=ModelConfig(num_layers=4, hidden_size=args["hidden"], num_attention_heads=8,
                          seq_length=args["seq"], vocab_size=1000, hidden_dropout=0.0,
                          attention_dropout=0.0, normalization="RMSNorm",
                          position_embedding_type="rope", swiglu=True, add_bias_linear=False,
                          num_experts=8, moe_router_topk=2,
                          moe_ffn_hidden_size=args["hidden"]),
        parallel=ParallelConfig(pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                                pipeline_schedule=schedule,
                                overlap_moe_expert_parallel_comm=overlapped,
                                delay_wgrad_compute=mode == "overlap+delay"),
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
        overlap.stats.update(all_to_all_s=0.0, switches=0)
        t0 = time.perf_counter()
        ex = run_schedule(schedule, forward_step, batches, chunks, state, cfg,
                          async_p2p=False if mode == "blocking" else None)
        step = time.perf_counter() - t0
        if i:
            rows.append((step, overlap.stats["all_to_all_s"], ex.p2p_wait_s,
                         overlap.stats["switches"]))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3, help="measured iterations (best kept)")
    ap.add_argument("--schedules", default="1f1b,1f1b:overlap,1f1b:overlap+delay,zero-bubble,"
                    "dualpipev,dualpipev:blocking,dualpipev:overlap,dualpipev:overlap+delay")
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
            out.append((name, *(max(r[best][k] for r in per_rank) for k in range(4))))
    finally:
        pool.close()
    print(f"MoE EP2 x PP2 (DP 2), 8 experts top-2, hidden {a.hidden}, seq {a.seq}, "
          f"micro-batch {a.mbs}, m = {a.micro_batches}; CPU gloo, 1 thread per rank; best of "
          f"{a.iters} iterations, worst rank")
    print(f"{'schedule':<24} {'step ms':>9} {'exposed a2a ms':>15} {'share':>6} "
          f"{'exposed p2p ms':>15} {'switches':>9}")
    for name, step, a2a, p2p, switches in out:
        print(f"{name:<24} {1e3 * step:>9.1f} {1e3 * a2a:>15.1f} {a2a / step:>6.1%} "
              f"{1e3 * p2p:>15.1f} {switches:>9d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
