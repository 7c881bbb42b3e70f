"""``megalite plan`` with training's overlap flags (--overlap-moe-expert-parallel-comm,
--delay-wgrad-compute), as a user runs it, and what the planner prices for them."""
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from megalite.cli.arguments import parse_args
from megalite.config.pipeline_schedules import plan
from megalite.config.pipeline_program import simulate
from megalite.planner import memory as mem
from megalite.planner import model_spec as ms
from megalite.planner.estimate import ModelOptions, ep_overlap_applies, estimate, memory_of
from megalite.planner.hardware import make_cluster
from megalite.planner.layout import Layout
from megalite.planner.report import planner_estimate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIXTRAL_16 = ("--recipe", "mixtral-8x7b", "--num-gpus", "16", "--global-batch-size", "64",
              "--tp", "2", "--pp", "1", "--ep", "8", "--etp", "1", "--recompute", "full",
              "--micro-batch-sizes", "1")


def _plan(*args):
    return subprocess.run([sys.executable, "-m", "megalite.planner", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def _best(out):
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["candidates"][0]


def test_plan_takes_pretrain_gpts_overlap_flags():
    """The flags pretrain_gpt.py takes change the predicted step of a MoE run (and, PP 1
    pairing consecutive micro-batches, its activations); the planner's old --ep-overlap is
    the same switch; --delay-wgrad-compute alone is training's one-line
    refusal (its ``requires=``), exit status 2."""
    off = _best(_plan(*MIXTRAL_16, "--json"))
    on = _best(_plan(*MIXTRAL_16, "--json", "--overlap-moe-expert-parallel-comm"))
    assert on["layout"] == off["layout"]
    assert on["times_s"]["ep"] < off["times_s"]["ep"]
    assert on["times_s"]["step"] < off["times_s"]["step"]
    assert on["times_s"]["compute"] == off["times_s"]["compute"]
    # the dispatch syncs idle the GPU only where no other micro-batch runs beside them
    assert 0 < on["times_s"]["moe_sync"] < off["times_s"]["moe_sync"]
    assert on["memory_bytes"]["activations"] > off["memory_bytes"]["activations"]
    assert "--overlap-moe-expert-parallel-comm" in on["command"].split()
    assert "--overlap-moe-expert-parallel-comm" not in off["command"].split()
    alias = _best(_plan(*MIXTRAL_16, "--json", "--ep-overlap"))
    assert alias["times_s"] == on["times_s"]
    bad = _plan(*MIXTRAL_16, "--delay-wgrad-compute")
    assert bad.returncode == 2 and bad.stdout == ""
    line, = bad.stderr.strip().splitlines()
    assert "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm" in line


def _held_peak(events, rank: int) -> int:
    """Most (micro-batch, chunk)s whose forward has started and whose backward (BW, or W)
    has not ended, over the simulated timeline of ``rank``."""
    start, end = {}, {}
    for e in events:
        if e.rank != rank:
            continue
        if e.kind == "F":
            start[(e.mb, e.chunk)] = e.start
        elif e.kind in ("BW", "W"):
            end[(e.mb, e.chunk)] = e.end
    return max(sum(start[k] <= t < end[k] for k in start) for t in start.values())


@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("m", [3, 8])
def test_combined_1f1b_in_flight_is_the_simulated_peak(p, m):
    """The planner's memory model counts what the simulated combined 1F1B holds: one
    micro-batch more than 1F1B (up to m), PP 1 included; the plain count is the plain
    program's peak (the measure is the same)."""
    L = Layout(world=p, pp=p, micro_batch=1, global_batch=m)
    assert L.num_micro_batches == m
    paired = simulate(plan("1f1b", p, m, 1, overlap=True)).events
    plain = simulate(plan("1f1b", p, m, 1)).events
    for r in range(p):
        assert mem.in_flight(L, r, paired=True) == _held_peak(paired, r)
        assert mem.in_flight(L, r) == _held_peak(plain, r)
        assert mem.in_flight(L, r, paired=True) == min(mem.in_flight(L, r) + 1, m)
    delayed = simulate(plan("1f1b", p, m, 1, overlap=True, delay=True)).events
    assert [_held_peak(delayed, r) for r in range(p)] == \
        [mem.in_flight(L, r, paired=True) for r in range(p)]


def test_megalite_runs_the_overlap_on_combined_1f1b_megatron_on_interleaving():
    """Whose rule (``ModelOptions.ep_overlap_rule``): Megatron-Core pairs F&B at PP > 1
    only interleaved, megalite only where the schedule pairs them (combined 1F1B,
    DualPipeV).  The megalite run hides the all-to-alls on plain 1F1B and holds one
    micro-batch more there."""
    m = replace(ms.recipe("mixtral-8x7b"), num_layers=4)
    cl = make_cluster(16, 8, "h100-80gb")
    plain = Layout(world=16, ep=8, pp=2, micro_batch=1, global_batch=64)
    inter = replace(plain, vpp=2, schedule="interleaved")
    megatron = ModelOptions(ep_overlap=True, moe_routing="balanced")
    megalite = replace(megatron, ep_overlap_rule="megalite")
    off = ModelOptions(moe_routing="balanced")
    assert ep_overlap_applies(plain, megalite) and not ep_overlap_applies(plain, megatron)
    assert ep_overlap_applies(inter, megatron) and not ep_overlap_applies(inter, megalite)
    assert estimate(m, plain, 4096, cl, megalite).times["ep"] < \
        estimate(m, plain, 4096, cl, off).times["ep"]
    assert estimate(m, inter, 4096, cl, megalite).times["ep"] == \
        pytest.approx(estimate(m, inter, 4096, cl, off).times["ep"])
    held = memory_of(m, plain, 4096, cl, megalite).memory["activations"]
    assert held > memory_of(m, plain, 4096, cl, megatron).memory["activations"]
    assert memory_of(m, plain, 4096, cl, megatron).memory == memory_of(m, plain, 4096, cl,
                                                                        off).memory


def test_plan_refuses_the_overlap_where_training_does():
    """The search validates each layout with the flags the megalite run would have, so
    training's rules pick: a dense model at PP 1 has no F&B pairs to overlap (one line
    naming the flag, exit status 2), at PP 2 combined 1F1B runs."""
    dense = ("--recipe", "gpt-1.7b", "--num-gpus", "8", "--global-batch-size", "64",
             "--overlap-moe-expert-parallel-comm")
    bad = _plan(*dense, "--pp", "1")
    assert bad.returncode == 2              # (the search's header is on stdout)
    line, = bad.stderr.strip().splitlines()
    assert "training's rules" in line and "--overlap-moe-expert-parallel-comm" in line
    best = _best(_plan(*dense, "--pp", "2", "--json"))
    assert best["layout"]["schedule"] == "1f1b"


def test_a_runs_dry_run_estimate_prices_its_combined_1f1b():
    """pretrain_gpt.py --dry-run's planner estimate (report.planner_estimate) reads the run's
    own flags: at PP 2 without virtual stages megalite runs the overlap as combined 1F1B,
    so the all-to-alls hide and one more micro-batch is held."""
    flags = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
             "--seq-length", "2048", "--max-position-embeddings", "2048", "--vocab-size",
             "32000", "--num-experts", "8", "--moe-router-topk", "2",
             "--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
             "--micro-batch-size", "1", "--global-batch-size", "16", "--train-iters", "1",
             "--mock-data", "--lr", "1e-4", "--bf16", "--world-size", "8", "--dry-run"]
    off, _, _ = planner_estimate(parse_args(flags), "h100-80gb", 8)
    on, _, opts = planner_estimate(parse_args(flags + ["--overlap-moe-expert-parallel-comm"]),
                                   "h100-80gb", 8)
    assert opts.ep_overlap and opts.ep_overlap_rule == "megalite"
    assert on.times["ep"] < off.times["ep"]
    assert on.memory["activations"] > off.memory["activations"]
