"""``megalite plan --goodput``: the expected fraction of useful time under failures, for
disk checkpoints alone and for in-memory peer snapshots (plus disk for durability).

The model is first-order (Young 1974, Daly 2006): failures arrive at random with a mean
time between failures M for the whole job; every failure costs the restart, the state load
and the work since the last saved state (on average half an interval, the save included);
saving stalls training for its exposed cost.  Per unit of wall time:

    useful = (1 - cost_per_failure / M) * interval / (interval + stall)

For disk-only the interval is ``--save-interval`` or Young's optimum sqrt(2 * stall * M).
With snapshots every ``--snapshot-interval`` iterations, a failure loses half a snapshot
interval and restores from the survivors' memory; only the fraction
``--snapshot-miss-fraction`` (a node and its buddy lost at once) falls back to disk, whose
checkpoints then follow Young's interval for those failures alone.

Defaults: Llama 3's interruptions (Dubey et al. 2024, section 3.3.4: 419 unexpected
interruptions in 54 days of 405B pre-training on 16,384 H100s), the step time and state
size the planner predicts for a recipe (launch/recipes/llama3-405b.yaml), Llama 3's storage
(Tectonic, 2 TB/s sustained), and a 30 s restart (issue 27's target) for both policies.
Every assumption is a flag and is printed.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import List, Optional

from megalite.config import ConfigError
from megalite.cli.arguments import OneLineErrorParser
from megalite.cli.arguments import parse_args
from megalite.cli.recipes import read_recipe_info
from megalite.planner.report import planner_estimate

LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16384
GB = 1e9


@dataclass
class Inputs:
    num_gpus: int
    failures_per_gpu_hour: float
    step_s: float
    state_bytes_per_gpu: float      # what one rank saves: its weights and optimizer shard
    checkpoint_bytes: float         # one checkpoint of the whole job (one model replica)
    save_interval: Optional[int]    # disk, iterations; None: Young's optimum
    save_stall_s: float             # training stops this long per disk checkpoint
    disk_load_s: float
    snapshot_interval: int
    snapshot_cost_s: float          # exposed cost of one snapshot
    peer_load_s: float
    restart_s: float                # failure -> new workers ready (detect, re-form, start)
    miss_fraction: float            # failures the snapshots cannot restore

    @property
    def mtbf_s(self) -> float:
        return 3600.0 / (self.failures_per_gpu_hour * self.num_gpus)


@dataclass
class Policy:
    name: str
    interval_s: float               # between saved states
    interval_iters: float
    stall_s: float                  # per saved state
    lost_s: float                   # mean work lost per failure
    recovery_s: float               # restart + load per failure
    useful: float


def useful_fraction(interval_s: float, stall_s: float, per_failure_s: float,
                    mtbf_s: float) -> float:
    return max(0.0, 1.0 - per_failure_s / mtbf_s) * interval_s / (interval_s + stall_s)


def young_interval_s(stall_s: float, mtbf_s: float) -> float:
    return math.sqrt(2.0 * stall_s * mtbf_s)


def disk_policy(inp: Inputs) -> Policy:
    if inp.save_interval:
        iters = float(inp.save_interval)
        name = f"disk checkpoints only, --save-interval {inp.save_interval}"
    else:
        iters = max(1.0, round(young_interval_s(inp.save_stall_s, inp.mtbf_s) / inp.step_s))
        name = "disk checkpoints only, Young's interval"
    interval = iters * inp.step_s
    lost = (interval + inp.save_stall_s) / 2
    recovery = inp.restart_s + inp.disk_load_s
    return Policy(name, interval, iters, inp.save_stall_s, lost, recovery,
                  useful_fraction(interval, inp.save_stall_s, recovery + lost, inp.mtbf_s))


def snapshot_policy(inp: Inputs) -> Policy:
    """Snapshots every ``snapshot_interval`` iterations; disk checkpoints only for the
    failures the snapshots miss, at Young's interval for those (``--save-interval`` when
    given; none counted when no failure is missed: they are then for durability alone)."""
    k = inp.snapshot_interval
    interval = k * inp.step_s
    lost_snap = (interval + inp.snapshot_cost_s) / 2
    rec_snap = inp.restart_s + inp.peer_load_s
    m = inp.miss_fraction
    disk_every = inp.save_interval * inp.step_s if inp.save_interval else \
        young_interval_s(inp.save_stall_s, inp.mtbf_s / m) if m > 0 else math.inf
    disk_lost = (disk_every + inp.save_stall_s) / 2 if m > 0 else 0.0
    disk_rec = inp.restart_s + inp.disk_load_s
    per_failure = (1 - m) * (rec_snap + lost_snap) + m * (disk_rec + disk_lost)
    useful = useful_fraction(interval, inp.snapshot_cost_s, per_failure, inp.mtbf_s)
    if math.isfinite(disk_every):
        useful *= disk_every / (disk_every + inp.save_stall_s)
        disk = f"disk every {_dur(disk_every)}"
    else:
        disk = "disk for durability only"
    return Policy(f"peer snapshots every {k} it, {disk}", interval, k, inp.snapshot_cost_s,
                  (1 - m) * lost_snap + m * disk_lost, (1 - m) * rec_snap + m * disk_rec,
                  useful)


def _dur(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"


def report(inp: Inputs, step_source: str, failure_source: str) -> str:
    disk = disk_policy(inp)
    snap = snapshot_policy(inp)
    lines = [f"goodput at {inp.num_gpus:,} GPUs: one interruption every {_dur(inp.mtbf_s)} "
             f"({failure_source})",
             f"step {inp.step_s:.3f} s ({step_source}); state {inp.state_bytes_per_gpu / GB:.2f}"
             f" GB per GPU, {inp.checkpoint_bytes / 1e12:.2f} TB per checkpoint",
             f"assumed: restart {_dur(inp.restart_s)}; disk save stall "
             f"{_dur(inp.save_stall_s)}, load {_dur(inp.disk_load_s)}; snapshot cost "
             f"{inp.snapshot_cost_s:.3f} s each, peer restore {_dur(inp.peer_load_s)}, "
             f"{100 * inp.miss_fraction:.0f}% of failures beyond the snapshots",
             f"  {'policy':<52}{'saved every':>22}{'stall':>10}{'lost/failure':>14}"
             f"{'recovery':>11}{'useful':>9}"]
    for p in (disk, snap):
        every = f"{p.interval_iters:g} it ({_dur(p.interval_s)})"
        lines.append(f"  {p.name:<52}{every:>22}{_dur(p.stall_s):>10}{_dur(p.lost_s):>14}"
                     f"{_dur(p.recovery_s):>11}{100 * p.useful:>8.2f}%")
    lines.append(f"snapshots {'gain' if snap.useful >= disk.useful else 'lose'} "
                 f"{100 * abs(snap.useful - disk.useful):.2f} points of useful time "
                 f"({abs(snap.useful - disk.useful) * inp.num_gpus:,.0f} GPUs' worth)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="megalite plan --goodput", allow_abbrev=False,
                           help_hint="megalite plan --goodput --help",
                           description="Expected useful time under failures: disk checkpoints "
                           "only vs in-memory peer snapshots (docs/fault_tolerance.md).")
    p.add_argument("--goodput", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--recipe", default="launch/recipes/llama3-405b.yaml",
                   help="recipe file whose planner step time and state size are used")
    p.add_argument("--num-gpus", type=int, help="job size (default: the recipe's)")
    p.add_argument("--gpus-per-node", type=int, help="default: the recipe's")
    p.add_argument("--gpu", help="default: the recipe's")
    p.add_argument("--step-time", type=float, help="seconds per iteration (default: planner)")
    f = p.add_argument_group("failures (default: Llama 3 405B's)")
    f.add_argument("--interruptions", type=float, default=LLAMA3_INTERRUPTIONS)
    f.add_argument("--days", type=float, default=LLAMA3_DAYS)
    f.add_argument("--observed-gpus", type=int, default=LLAMA3_GPUS,
                   help="GPUs the interruptions were counted on")
    f.add_argument("--mtbf-hours", type=float, help="the job's MTBF instead of the rate above")
    d = p.add_argument_group("disk checkpoints")
    d.add_argument("--save-interval", type=int, help="iterations (default: Young's optimum)")
    d.add_argument("--disk-write-gbps", type=float, default=2000.0,
                   help="aggregate GB/s (default 2000: Llama 3's Tectonic, sustained)")
    d.add_argument("--disk-read-gbps", type=float, default=2000.0)
    d.add_argument("--save-stall", type=float, help="seconds a save stalls training "
                   "(default: checkpoint bytes / --disk-write-gbps)")
    s = p.add_argument_group("peer snapshots")
    s.add_argument("--snapshot-interval", type=int, default=1, help="iterations (default 1)")
    s.add_argument("--snapshot-cost", type=float, help="exposed seconds per snapshot: a run's "
                   "'> snapshot:' log line measures it (the stall on the training thread); "
                   "default: state per GPU / --host-copy-gbps, none of it overlapped")
    s.add_argument("--host-copy-gbps", type=float, default=25.0,
                   help="device-to-host GB/s per GPU (default 25)")
    s.add_argument("--peer-gbps", type=float, default=50.0,
                   help="GB/s per GPU to fetch a lost shard's replica (default 50: 400 Gb/s)")
    s.add_argument("--snapshot-miss-fraction", type=float, default=0.0,
                   help="failures that take a node and its buddy at once (default 0)")
    r = p.add_argument_group("recovery")
    r.add_argument("--restart-time", type=float, default=30.0,
                   help="seconds from a failure to new workers ready (default 30)")
    return p


def _positive(args, *names):
    for name in names:
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {v}")


def inputs_from_args(argv: List[str]):
    args = build_parser().parse_args(argv)
    _positive(args, "num_gpus", "gpus_per_node", "step_time", "interruptions", "days",
              "observed_gpus", "mtbf_hours", "save_interval", "disk_write_gbps",
              "disk_read_gbps", "snapshot_interval", "host_copy_gbps", "peer_gbps")
    for name in ("save_stall", "snapshot_cost", "restart_time"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
    if not 0 <= args.snapshot_miss_fraction <= 1:
        raise ConfigError("--snapshot-miss-fraction must be in [0, 1]")
    est, cfg = _planner(args)
    gpus = cfg.world_size
    layout = est.layout
    weights, optim = est.memory["weights"], est.memory["optimizer"]
    per_gpu = weights + optim
    ckpt = weights * layout.dense_model_ranks + optim * gpus   # one model replica
    if args.mtbf_hours:
        rate = 1.0 / (args.mtbf_hours * gpus)
        failure_source = f"MTBF {args.mtbf_hours:g} h given"
    else:
        rate = args.interruptions / (args.days * 24.0 * args.observed_gpus)
        failure_source = (f"{args.interruptions:g} interruptions in {args.days:g} days on "
                          f"{args.observed_gpus:,} GPUs" +
                          (": Llama 3" if (args.interruptions, args.days, args.observed_gpus)
                           == (LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS) else ""))
    step = args.step_time or est.step
    step_source = "given" if args.step_time else f"planner, {args.recipe} at {gpus:,} GPUs"
    inp = Inputs(
        num_gpus=gpus, failures_per_gpu_hour=rate, step_s=step, state_bytes_per_gpu=per_gpu,
        checkpoint_bytes=ckpt, save_interval=args.save_interval,
        save_stall_s=args.save_stall if args.save_stall is not None else
        ckpt / (args.disk_write_gbps * GB),
        disk_load_s=ckpt / (args.disk_read_gbps * GB),
        snapshot_interval=args.snapshot_interval,
        snapshot_cost_s=args.snapshot_cost if args.snapshot_cost is not None else
        per_gpu / (args.host_copy_gbps * GB),
        peer_load_s=per_gpu / (args.peer_gbps * GB), restart_s=args.restart_time,
        miss_fraction=args.snapshot_miss_fraction)
    return inp, step_source, failure_source


def _planner(args):
    """The planner's estimate for the recipe at the requested size."""
    info = read_recipe_info(args.recipe)
    flags = ["--config", args.recipe, "--dry-run", "--mock-data"]
    if args.num_gpus:
        flags += ["--world-size", str(args.num_gpus)]
    cfg = parse_args(flags)
    est, _, _ = planner_estimate(cfg, args.gpu or info.gpu,
                                 args.gpus_per_node or info.gpus_per_node)
    return est, cfg


def main(argv: Optional[List[str]] = None, out=None) -> int:
    inp, step_source, failure_source = inputs_from_args(list(argv or []))
    print(report(inp, step_source, failure_source), file=out or sys.stdout)
    return 0
