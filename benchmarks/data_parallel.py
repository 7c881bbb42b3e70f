#!/usr/bin/env python
"""Data-parallel strategies side by side (issue 12), on gloo processes of this machine:

* comm  -- elements per step per DP rank, measured by megalite.comm's counters (FSDP2: by hooking
  the collectives it calls) over theory for Psi parameters: DDP all-reduce Psi; ZeRO-1/2
  reduce-scatter Psi + all-gather Psi; FSDP2 all-gather 2 Psi + reduce-scatter Psi per
  micro-batch (the root unit is gathered once: it stays gathered for backward);
* memory -- bytes per rank of weights, gradients and optimizer states kept between steps, at
  DP = 1, 2, 4 for DDP, ZeRO-1, ZeRO-2 and FSDP2, next to the planner's prediction for the
  same layout (``planner.memory.state_bytes``); then the peak of live CPU tensor bytes of a
  step per rank (``training.tensor_memory_meter``) next to ``planner.step_peak``;
* overlap -- step time on 2 processes with --overlap-grad-reduce off and on (median of
  alternating steps), and a timeline of one overlapped step (Chrome trace + SVG) showing
  the bucket reductions starting while backward still runs;
* compose -- FSDP2 with PP (1F1B, interleaved, zero bubble), CP, EP, TP x PP and hybrid
  sharding (HSDP, FSDP2 and the distributed optimizer), issue 26: per rank, the data-parallel
  collectives of one step measured by the counters next to the theory from the rank's real
  FSDP units (``fsdp2.expected_collectives``) and the planner's prediction, then the step's
  peak of live tensor bytes next to ``planner.step_peak``;
* build -- the peak of live tensor bytes while a rank builds and parallelizes its model,
  DDP next to FSDP2 (built on meta, only the shards allocated) and FSDP2 built whole first.

    python benchmarks/data_parallel.py [comm memory build overlap compose]
                                       [--svg docs/img/dp_overlap.svg]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--vocab-size", "256", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--mock-data", "--lr", "1e-3",
         "--train-iters", "100", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--eval-iters", "0", "--micro-batch-size", "1"]
STRATEGIES = {"DDP": [], "ZeRO-1": ["--use-distributed-optimizer"],
              "ZeRO-2": ["--use-distributed-optimizer", "--overlap-grad-reduce"],
              "FSDP2": ["--use-torch-fsdp2"]}
ZERO = {"DDP": 0, "ZeRO-1": 1, "ZeRO-2": 2, "FSDP2": 3}


def _trainer(flags, world):
    import torch.distributed as torch_dist

    from megalite.cli.arguments import parse_args
    from megalite.parallel_state import ParallelState, RankGrid
    from megalite.training.loop import Trainer

    cfg = parse_args(["--world-size", str(world), *MODEL, *flags])
    grid = RankGrid.from_config(cfg)
    state = ParallelState.build(grid, 0, create_groups=False) if world == 1 else \
        ParallelState.build(grid, torch_dist.get_rank())
    trainer = Trainer(cfg, state, "cpu")
    trainer.setup()
    return trainer


def _bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _state_bytes(trainer) -> dict:
    """Weights / grads / optimizer kept between steps on this rank, measured on tensors."""
    s, opt = trainer.strategy, trainer.optimizer
    params = [p for c in trainer.model_chunks for p in c.parameters()]
    if s.sharded_buffers:
        grads = [b.grad_shard if b.keep_shard_only else b.grad_data for b in s.sharded_buffers]
    elif s.__class__.__name__ == "FSDP2Strategy":
        grads = [p.grad for p in s.params]
    else:
        grads = [s.grad(p) for p in s.params]
    moments = [v for st in opt.inner.state.values() for k, v in st.items()
               if k in ("exp_avg", "exp_avg_sq")]
    masters = [m for m in opt.masters if all(m is not p for p in params)] if opt.bf16 else []
    return {"weights": _bytes(params), "grads": _bytes(grads),
            "optimizer": _bytes(masters + moments)}


# -- comm ---------------------------------------------------------------------------------
def comm_rank(world):
    from megalite import comm

    rows = []
    for name, flags in STRATEGIES.items():
        trainer = _trainer(flags + ["--global-batch-size", str(world)], world)
        it = trainer.data_iterator(trainer.train_ds, 0)
        for _ in range(2):
            comm.counter.reset()
            trainer.train_step(it)
        c = comm.counter.snapshot()
        psi = sum(p.numel() for p in trainer.strategy.params)
        get = lambda k: c.get(k, {}).get("elements", 0)        # noqa: E731
        if name == "DDP":
            meas = {"all-reduce": get("dp-cp/all_reduce") - 2}   # minus token count + loss
            theory = {"all-reduce": psi}
        elif name == "FSDP2":
            meas = {"all-gather": get("dp-cp/all_gather"),
                    "reduce-scatter": get("dp-cp/reduce_scatter")}
            theory = {"all-gather": 2 * psi, "reduce-scatter": psi}
        else:
            meas = {"reduce-scatter": get("dp-cp/reduce_scatter"),
                    "all-gather": get("dp-cp/all_gather")}
            theory = {"reduce-scatter": psi, "all-gather": psi}
        rows.append((name, psi, meas, theory))
    return rows


def run_comm(pool, world):
    print(f"\n== communication per step per DP rank, DP={world}, 1 micro-batch per rank ==")
    print(f"{'strategy':8s} {'Psi':>8s}  {'op':15s} {'measured':>10s} {'theory':>10s} {'ratio':>7s}")
    for name, psi, meas, theory in pool.run(world, comm_rank, world)[0]:
        for op, m in meas.items():
            print(f"{name:8s} {psi:8d}  {op:15s} {m:10d} {theory[op]:10d} {m / theory[op]:7.3f}")
    print("(ZeRO: buffers padded to a multiple of DP per bucket; FSDP2: dim 0 padded to DP "
          "per parameter, the root unit gathered once per micro-batch, not twice)")


# -- memory -------------------------------------------------------------------------------
# ZeRO-2's full-size gradient is live one bucket at a time: buckets of ~20k elements here
# (the default, 40M, would make this model one bucket).  Only ZeRO-2 reads the flag.
MEMORY_FLAGS = ["--ddp-bucket-size", "20000"]


def metered_steps(flags, world, steps=3, before_step=None):
    """Build a trainer and run ``steps`` steps under the tensor-memory meter (started before
    the model is built, so every live tensor is counted); ``before_step(i)`` runs before
    step i.  Returns the trainer, the peak of each step and the meter's stale-free count."""
    from megalite.training.tensor_memory_meter import TensorMemoryMeter

    meter = TensorMemoryMeter().start()
    try:
        trainer = _trainer(flags, world)
        it = trainer.data_iterator(trainer.train_ds, 0)
        for i in range(steps):
            if before_step is not None:
                before_step(i)
            with meter.window(f"step{i + 1}"):
                trainer.train_step(it)
    finally:
        result = meter.stop()
    return trainer, [result.windows[f"step{i + 1}"] for i in range(steps)], result.stale_frees


def memory_rank(world):
    import torch.distributed as torch_dist

    from megalite.planner import model_spec as ms
    from megalite.planner.layout import layout_from_config
    from megalite.planner.memory import Precision, layout_state_bytes
    from megalite.planner.step_peak import predict_step_peak

    rank = torch_dist.get_rank() if world > 1 else 0
    out = []
    for name, flags in STRATEGIES.items():
        trainer, steps, stale = metered_steps(
            flags + MEMORY_FLAGS + ["--global-batch-size", str(world)], world)
        cfg = trainer.cfg
        L = layout_from_config(cfg)
        params = ms.stage_params(cfg.model, 0, L.tp, L.pp, L.vpp, L.etp, L.ep, *L.stage_split)
        kept = layout_state_bytes(params, L, Precision.bf16() if cfg.optimizer.bf16
                                  else Precision.fp32())
        out.append({"name": name, "kept": _state_bytes(trainer), "kept_planner": kept,
                    "first_peak": steps[0].peak_bytes, "peak": steps[-1].peak_bytes,
                    "start": steps[-1].start_bytes, "stale": stale,
                    "predicted": predict_step_peak(cfg, rank)})
        del trainer
    return out


def run_memory(pool):
    print("\n== bytes per rank kept between steps (fp32: 4 B weights, 4 B grads, 8 B Adam) ==")
    print(f"{'DP':>2s} {'strategy':8s} {'what':9s} {'measured':>10s} {'planner':>10s} "
          f"{'meas/plan':>9s}")
    peaks = {}
    for world in (1, 2, 4):
        res = pool.run(world, memory_rank, world)
        peaks[world] = res
        for r in res[0]:
            for k in ("weights", "grads", "optimizer"):
                m, p = r["kept"][k], r["kept_planner"][k]
                print(f"{world:2d} {r['name']:8s} {k:9s} {m:10d} {p:10d} {m / p:9.3f}")
    print("\n== peak live CPU tensor bytes of one step, per rank (tensor-memory meter), next to "
          "the planner's step peak ==")
    print(f"{'DP':>2s} {'strategy':8s} {'rank':>4s} {'1st step':>10s} {'peak':>10s} "
          f"{'planner':>10s} {'meas/plan':>9s}  planner's peak phase and its parts")
    for world, res in peaks.items():
        for rank, rows in enumerate(res):
            for r in rows:
                p = r["predicted"]
                parts = " ".join(f"{k[:4]} {p[k]}" for k in
                                 ("weights", "grads", "optimizer", "activations", "transient"))
                print(f"{world:2d} {r['name']:8s} {rank:4d} {r['first_peak']:10d} {r['peak']:10d} "
                      f"{p['total']:10d} {r['peak'] / p['total']:9.3f}  {p['peak_phase']}: "
                      f"{parts}" + (f" (stale frees {r['stale']})" if r["stale"] else ""))
    print("(peak: the third step's; the first ZeRO-2 step reduces every bucket after backward, "
          "its whole gradient is live once.  Measured: torch's CPU allocator events through "
          "the profiler, from before the model is built; planner: planner.step_peak)")


# -- build --------------------------------------------------------------------------------
# the layers hold most weights (as in a real model): the transient of the build, one
# parameter's full tensor or two, is small next to the whole model
BUILD_MODEL = ["--num-layers", "8", "--hidden-size", "256", "--ffn-hidden-size", "1024",
               "--vocab-size", "2048", "--seq-length", "32"]
BUILD_CASES = {"DDP": [], "FSDP2": ["--use-torch-fsdp2"]}


def build_rank(world):
    """Peak of live tensor bytes while this rank builds and parallelizes its model (the
    family's ``build_model_chunks``), per strategy; FSDP2 also built the way it was before
    the parallelize step built it on meta: whole on CPU, initialised, then sharded."""
    import torch.distributed as torch_dist

    from megalite.cli.arguments import parse_args
    from megalite.models.gpt import GPTModel
    from megalite.models.gpt_step import GPT_FAMILY
    from megalite.models.parallelize import parallelize_chunk, spec_choices
    from megalite.parallel_state import ParallelState, RankGrid
    from megalite.training.tensor_memory_meter import TensorMemoryMeter

    rank = torch_dist.get_rank() if world > 1 else 0
    out = []
    for name, flags in [*BUILD_CASES.items(), ("FSDP2 whole first", None)]:
        cfg = parse_args(["--world-size", str(world), *MODEL, *BUILD_MODEL,
                          *(flags if flags is not None else BUILD_CASES["FSDP2"])])
        grid = RankGrid.from_config(cfg)
        state = ParallelState.build(grid, rank, create_groups=world > 1)
        meter = TensorMemoryMeter().start()
        try:
            with meter.window("build"):
                if flags is not None:
                    chunks = GPT_FAMILY.build_model_chunks(cfg, state, "cpu")
                else:      # the old order: a whole chunk on CPU, initialised, then sharded
                    chunk = GPTModel(cfg, state, spec=spec_choices(cfg, state), device="cpu")
                    chunks = [parallelize_chunk(chunk, cfg, state, device="cpu")]
        finally:
            result = meter.stop()
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4
                    for c in chunks for p in c.parameters())
        whole = sum(math.prod(spec.full_shape) * 4     # fp32, DP only: TP-local = full
                    for c in chunks for _, _, spec in c.param_table.named(c))
        out.append({"name": name, "peak": result.windows["build"].peak_bytes,
                    "end": result.windows["build"].end_bytes, "local": local, "whole": whole})
        del chunks
    return out


def run_build(pool, worlds=(2, 4)):
    print("\n== peak live CPU tensor bytes while a rank builds its model (build + parallelize "
          "step), DDP next to FSDP2 ==")
    print(f"{'DP':>2s} {'rank':>4s} {'strategy':18s} {'build peak':>11s} {'kept':>11s} "
          f"{'own weights':>11s} {'whole model':>11s} {'peak/whole':>10s}")
    for world in worlds:
        for rank, rows in enumerate(pool.run(world, build_rank, world)):
            for r in rows:
                print(f"{world:2d} {rank:4d} {r['name']:18s} {r['peak']:11d} {r['end']:11d} "
                      f"{r['local']:11d} {r['whole']:11d} {r['peak'] / r['whole']:10.3f}")
    print("(FSDP2: the chunk is built on the meta device, fully sharded, then only this "
          "rank's shards are allocated and initialised -- the transient is a parameter's "
          "full tensor, drawn from its name-seeded generator, and its slice.  'FSDP2 whole "
          "first': the previous order, whole model initialised on CPU before fully_shard)")


# -- overlap ------------------------------------------------------------------------------
OVERLAP_MODEL = ["--num-layers", "8", "--hidden-size", "256", "--ffn-hidden-size", "1024",
                 "--seq-length", "128", "--global-batch-size", "4", "--ddp-bucket-size",
                 "400000"]


def overlap_rank(steps, trace_path):
    import torch.distributed as torch_dist

    times = {"off": [], "on": []}
    trainers, iters = {}, {}
    for mode, extra in (("off", []), ("on", ["--overlap-grad-reduce"])):
        flags = OVERLAP_MODEL + extra + (["--pipeline-timeline", trace_path] if mode == "on"
                                         else [])
        trainers[mode] = _trainer(MODEL + flags, 2)   # later flags win
        iters[mode] = trainers[mode].data_iterator(trainers[mode].train_ds, 0)
    for i in range(steps + 1):
        for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
            torch_dist.barrier()
            t0 = time.perf_counter()
            trainers[mode].train_step(iters[mode])
            if i:        # the first step learns the accumulation counts: not timed
                times[mode].append(time.perf_counter() - t0)
    return {m: statistics.median(v) for m, v in times.items()}


def svg_timeline(trace_path: str, out: str) -> None:
    """The last recorded iteration of a --pipeline-timeline trace as an SVG: compute (F/BW)
    on one row, bucket reductions (launch -> wait returned) on the row below."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    last = max(e["args"].get("iteration", 1) for e in events)
    events = [e for e in events if e["args"].get("iteration", 1) == last and e["pid"] == 0]
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    width, scale = 900, 860 / (t1 - t0)
    colors = {"F": "#4C72B0", "BW": "#55A868", "comm": "#DD8452"}
    rows = sorted({e["name"] for e in events if e["cat"] == "comm"},
                  key=lambda n: int(n.split()[-1]))
    height = 60 + 18 * len(rows)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             'font-family="sans-serif" font-size="11">',
             f'<text x="20" y="14">one DP=2 step with --overlap-grad-reduce (rank 0, '
             f'{(t1 - t0) / 1e3:.0f} ms): compute, then one row per gradient bucket '
             '(bar = launch to wait returned)</text>']
    for e in events:
        x = 20 + (e["ts"] - t0) * scale
        w = max(1.0, e["dur"] * scale)
        if e["cat"] == "comm":
            y, color = 42 + 18 * rows.index(e["name"]), colors["comm"]
        else:
            y, color = 22, colors.get(e["cat"], "#999")
        parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="16" fill="{color}" '
                     f'stroke="white"><title>{e["name"]} {e["dur"] / 1e3:.1f} ms</title></rect>')
        if w > 40:
            parts.append(f'<text x="{x + 3:.1f}" y="{y + 12}" fill="white">{e["name"]}</text>')
    parts.append("</svg>")
    with open(out, "w") as f:
        f.write("\n".join(parts))


def run_overlap(pool, steps, svg):
    import tempfile

    trace = os.path.join(tempfile.mkdtemp(), "dp_overlap_trace.json")
    res = pool.run(2, overlap_rank, steps, trace)
    off = statistics.median(r["off"] for r in res)
    on = statistics.median(r["on"] for r in res)
    print(f"\n== step time, 2 processes, DP=2, {steps} steps each (median) ==")
    print(f"overlap off: {1e3 * off:.1f} ms   overlap on: {1e3 * on:.1f} ms   "
          f"on/off: {on / off:.3f}   (cores: {os.cpu_count()})")
    if svg:
        svg_timeline(trace, svg)
        print(f"timeline: {trace} (Chrome trace), {svg}")


# -- compose (issue 26) -------------------------------------------------------------------
FSDP, PP2 = ["--use-torch-fsdp2"], ["--pipeline-model-parallel-size", "2"]
HYBRID = ["--num-distributed-optimizer-instances", "2"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
       "--moe-aux-loss-coeff", "1e-2"]
COMPOSE = {   # name: (world, flags); GBS 4: two micro-batches per rank at DP 2
    "FSDP2 x PP2 1F1B": (4, FSDP + PP2),
    "FSDP2 x PP2 interleaved": (4, FSDP + PP2 + ["--num-virtual-stages-per-pipeline-rank", "2"]),
    "FSDP2 x PP2 zero-bubble": (4, FSDP + PP2 + ["--pipeline-schedule", "zero-bubble"]),
    "FSDP2 x CP2": (4, FSDP + ["--context-parallel-size", "2"]),
    "FSDP2 x EP2 (MoE)": (4, FSDP + MOE + ["--expert-model-parallel-size", "2"]),
    "FSDP2 x TP2 x PP2": (8, FSDP + PP2 + ["--tensor-model-parallel-size", "2",
                                            "--sequence-parallel"]),
    "HSDP 2x2 FSDP2": (4, FSDP + HYBRID + ["--global-batch-size", "8"]),
    "HSDP 2x2 dist-opt": (4, ["--use-distributed-optimizer"] + HYBRID +
                          ["--global-batch-size", "8"]),
}
def dp_traffic(key: str) -> bool:
    """The data-parallel strategy's gathers and reductions (not the loss / norm scalars)."""
    group, op = key.split("/")
    return (group.startswith(("dp-cp", "expert-dp")) and op in ("all_gather", "reduce_scatter")) \
        or group.endswith("-replicate")


def compose_rank(names, world):
    """Per case: this rank's data-parallel collectives of the third step (measured, from
    the units, planned) and each step's peak of live tensor bytes next to the planner's."""
    import torch.distributed as torch_dist

    from megalite import comm
    from megalite.distributed.fsdp2 import expected_collectives
    from megalite.planner.comm_model import predict_comm_volume
    from megalite.planner.step_peak import predict_step_peak

    rank = torch_dist.get_rank()
    out = []
    for name in names:
        flags = COMPOSE[name][1]
        gbs = [] if "--global-batch-size" in flags else ["--global-batch-size", "4"]
        trainer, steps, _ = metered_steps(flags + gbs, world,
                                          before_step=lambda i: comm.counter.reset())
        cfg = trainer.cfg
        measured = {k: v["elements"] for k, v in comm.counter.snapshot().items()
                    if dp_traffic(k)}
        planned = {k: v["elements"] for k, v in predict_comm_volume(cfg, rank).items()}
        units = expected_collectives(trainer.model_chunks, cfg.num_micro_batches,
                                     cfg.parallel.pp > 1) if cfg.parallel.use_torch_fsdp2 \
            else {}
        out.append({"name": name, "measured": measured, "units": units,
                    "planned": {k: planned.get(k, 0) for k in measured},
                    "peak": steps[-1].peak_bytes, "predicted": predict_step_peak(cfg, rank)})
        del trainer
    return out


def run_compose(pool, only=None):
    names = [n for n in COMPOSE if only is None or n in only]
    print("\n== FSDP2 / HSDP compositions: data-parallel elements per step per rank ==")
    print(f"{'case':24s} {'rank':>4s} {'group/op':28s} {'measured':>9s} {'units':>9s} "
          f"{'planner':>9s} {'m/units':>7s} {'m/plan':>7s}")
    from megalite.testing import WorkerPool

    results = {}
    for world in sorted({COMPOSE[n][0] for n in names}):
        # the tensor meter makes a step slow (profiler): a pool with a long timeout
        own = WorkerPool(world, timeout_s=1800)
        try:
            for name in [n for n in names if COMPOSE[n][0] == world]:
                results[name] = [rows[0] for rows in own.run(compose_rank, [name], world)]
        finally:
            own.close()
    for name in names:
        for rank, r in enumerate(results[name]):
            for key in sorted(r["measured"]):
                m, u, p = r["measured"][key], r["units"].get(key, 0), r["planned"][key]
                ratio = f"{m / u:7.3f}" if u else "    n/a"
                print(f"{name:24s} {rank:4d} {key:28s} {m:9d} {u:9d} {p:9d} {ratio} "
                      f"{m / p if p else float('nan'):7.3f}")
    print("(units: what FSDP2 must send for the rank's real units, dim 0 padded; n/a: the "
          "distributed optimizer's own buffers.  With PP one all-gather and one reduce-"
          "scatter per parameter per step; HSDP all-reduces each reduced shard across "
          "instances)")
    print("\n== peak live CPU tensor bytes of the third step, per rank, next to the planner's "
          "step peak ==")
    print(f"{'case':24s} {'rank':>4s} {'peak':>10s} {'planner':>10s} {'meas/plan':>9s}  "
          "planner's peak phase and its parts")
    for name in names:
        for rank, r in enumerate(results[name]):
            p = r["predicted"]
            parts = " ".join(f"{k[:4]} {p[k]}" for k in
                             ("weights", "grads", "optimizer", "activations", "transient"))
            print(f"{name:24s} {rank:4d} {r['peak']:10d} {p['total']:10d} "
                  f"{r['peak'] / p['total']:9.3f}  {p['peak_phase']}: {parts}")


def main(argv=None):
    from megalite.testing import PoolManager

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("parts", nargs="*",
                    default=["comm", "memory", "build", "overlap", "compose"])
    ap.add_argument("--cases", nargs="*", default=None, help="compose: only these cases")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--svg", default=None, help="write the overlap timeline as SVG here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    pool = PoolManager()
    try:
        if "comm" in args.parts:
            run_comm(pool, 2)
            run_comm(pool, 4)
        if "memory" in args.parts:
            run_memory(pool)
        if "build" in args.parts:
            run_build(pool)
        if "overlap" in args.parts:
            run_overlap(pool, args.steps, args.svg)
        if "compose" in args.parts:
            run_compose(pool, args.cases)
    finally:
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
