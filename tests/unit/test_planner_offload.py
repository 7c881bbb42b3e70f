"""Megatron's CPU offloading in the planner (megalite/planner/host_offload.py): the share of
the optimizer state --optimizer-cpu-offload puts on the host, the step time its transfers and
CPU Adam add, the layouts --cpu-offloading allows, every flag mistake one line, and the
published measurements (megalite/planner/published_offload.py) the model is held to."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from megalite.commands.plan import main as plan_main
from megalite.planner import calibration
from megalite.planner.estimate import ModelOptions, estimate
from megalite.planner.hardware import make_cluster
from megalite.planner.host_offload import HOST_BYTES_PER_PARAM
from megalite.planner.layout import Layout
from megalite.planner import model_spec as ms
from megalite.planner.published_offload import FIT_ROW, compare_all, fit_cpu_adam

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["--recipe", "llama3-8b", "--num-gpus", "8", "--global-batch-size", "64"]
PINNED = ["--tp", "2", "--pp", "1", "--micro-batch-sizes", "1", "--recompute", "none",
          "--zero-stages", "1", "--top", "1", "--json"]


def _plan(*args):
    exe = shutil.which("megalite", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "megalite.cli"]
    return subprocess.run(cmd + ["plan", *BASE, *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def _in_process(capsys, *args):
    """``megalite plan`` behind the same boundary, in this process (no start-up cost):
    (exit status, stdout, stderr)."""
    try:
        status = plan_main([*BASE, *args])
    except SystemExit as exc:
        status = exc.code
    got = capsys.readouterr()
    return status, got.out, got.err


def _best(capsys, *args, outside=False):
    if outside:
        got = _plan(*PINNED, *args)
        assert got.returncode == 0, got.stderr
        out = got.stdout
    else:
        status, out, err = _in_process(capsys, *PINNED, *args)
        assert status == 0, err
    return json.loads(out)["candidates"][0]


def test_optimizer_offload_moves_the_state_to_the_host_and_prices_the_host_step(capsys):
    """The flags docs/planner.md shows: half the shard's fp32 master and moments leave the
    GPU; the step grows by the offloaded parameters' transfers and CPU Adam, less with the
    transfers overlapped."""
    flags = ["--use-precision-aware-optimizer", "--optimizer-cpu-offload"]
    half = _best(capsys, *flags, "--optimizer-offload-fraction", "0.5", outside=True)
    none = _best(capsys, *flags, "--optimizer-offload-fraction", "0")
    full = _best(capsys, *flags)                           # Megatron's default: 1.0
    over = _best(capsys, *flags, "--overlap-cpu-optimizer-d2h-h2d")
    mem = {k: c["memory_bytes"] for k, c in (("0", none), ("half", half), ("1", full))}
    params = mem["0"]["optimizer"] // 12                   # fp32 master + two fp32 moments
    assert params == pytest.approx(8.03e9 / 8, rel=0.01)   # the TP2 x DP4 shard of 8B
    assert mem["half"]["optimizer"] == pytest.approx(0.5 * mem["0"]["optimizer"], rel=1e-6)
    assert mem["1"]["optimizer"] == 0
    assert mem["0"]["total"] - mem["half"]["total"] == mem["0"]["optimizer"] // 2 // 12 * 12
    assert mem["1"]["host"] == params * HOST_BYTES_PER_PARAM
    t0, t1, to = (c["times_s"] for c in (none, full, over))
    bw = make_cluster(8).gpu.host_gbps * 1e9 * make_cluster(8).eff.link
    cpu = params * calibration.CPU_ADAM_SECONDS_PER_PARAM
    assert t1["optimizer_offload"] == pytest.approx(cpu + params * 8 / bw, rel=1e-6)
    assert to["optimizer_offload"] == pytest.approx(max(cpu, params * 4 / bw), rel=1e-6)
    assert t0["optimizer_offload"] == 0.0
    assert t1["step"] > to["step"] > t0["step"]
    # the GPU's own Adam runs only what stays there
    assert t1["optimizer"] - t1["optimizer_offload"] < t0["optimizer"]


@pytest.mark.parametrize("args, flag", [
    (["--optimizer-cpu-offload"], "--use-precision-aware-optimizer"),
    (["--optimizer-offload-fraction", "0.5"], "--optimizer-cpu-offload"),
    (["--overlap-cpu-optimizer-d2h-h2d"], "--optimizer-cpu-offload"),
    (["--use-precision-aware-optimizer", "--optimizer-cpu-offload",
      "--optimizer-offload-fraction", "1.5"], "--optimizer-offload-fraction"),
    (["--use-precision-aware-optimizer", "--optimizer-cpu-offload", "--zero-stages", "0,3"],
     "--zero-stages"),
    (["--use-precision-aware-optimizer", "--optimizer-cpu-offload", "--exp-avg-dtype", "bf16"],
     "--exp-avg-dtype"),
    (["--use-precision-aware-optimizer", "--optimizer-cpu-offload", "--fp8-recipe",
      "tensorwise", "--fp8-param-gather"], "--fp8-recipe delayed"),
    (["--cpu-offloading-num-layers", "4", "--pp", "2"], "--pp 1"),
    (["--cpu-offloading-num-layers", "4", "--recompute", "full"], "--recompute none"),
    (["--cpu-offloading-num-layers", "4", "--cuda-graph-impl", "local"], "--cuda-graph-impl"),
    (["--cpu-offloading-num-layers", "32"], "at most 31"),
    (["--cpu-offloading-num-layers", "-1"], "--cpu-offloading-num-layers must be >= 0"),
])
def test_each_offload_mistake_is_one_line_naming_the_flag(args, flag, capsys):
    """In process behind the command's boundary (the first also as a user runs it)."""
    status, out, err = _in_process(capsys, *args)
    assert status == 2 and out == ""
    line, = err.strip().splitlines()
    assert flag in line, line
    if args == ["--optimizer-cpu-offload"]:
        bad = _plan(*args)
        assert (bad.returncode, bad.stdout, bad.stderr) == (2, out, err)


def test_activation_offload_searches_only_what_megatron_runs_it_with(capsys):
    """--cpu-offloading-num-layers N alone turns the offload on (Megatron's arguments.py);
    the search keeps to PP 1 without recomputation, and the offloaded layers' activations
    leave the GPU."""
    status, out, err = _in_process(capsys, "--cpu-offloading-num-layers", "8", "--top", "50",
                                   "--json")
    assert status == 0, err
    cands = json.loads(out)["candidates"]
    assert cands and all(c["layout"]["pp"] == 1 and c["layout"]["recompute"] == "none"
                         for c in cands)
    text = _plan("--cpu-offloading-num-layers", "8", "--top", "1")
    assert text.returncode == 0 and "host memory the best layout offloads: " in text.stdout
    m, L = ms.recipe("llama3-8b"), Layout(world=8, tp=2, micro_batch=1, global_batch=64)
    base = estimate(m, L, 8192, make_cluster(8), ModelOptions())
    off = estimate(m, L, 8192, make_cluster(8), ModelOptions(cpu_offload_layers=8))
    assert off.memory["activations"] == pytest.approx(0.75 * base.memory["activations"],
                                                      rel=1e-6)
    assert off.memory["host"] == base.memory["activations"] - off.memory["activations"]


def test_offload_muon_and_a_bad_share_are_refused_in_the_api_too():
    with pytest.raises(ValueError, match="Muon"):
        ModelOptions(optimizer_offload=0.5, muon_ns_steps=5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        ModelOptions(optimizer_offload=2.0)


# Held-out published rows the model misses the 10% bar on (docs/planner.md, "Host
# offload"); strict: a row that starts passing must leave.
ADDED_MISSES = {("nemo-rl-qwen3-0.6b", "50%"): "+14%: one big CPU optimizer over a 0.6B "
                "model ran at 1.3 ns a parameter there, 1.5 on Bridge's hosts"}
FREED_MISSES = {("nemo-rl-qwen3-0.6b", "50%"): "the source's maximum sampled memory: 1.11 "
                "GiB at 50%, 4.71 at 100%, not linear in the share",
                ("nemo-rl-qwen3-0.6b", "50% overlap"): "as above: 0.59 GiB"}
ROWS = {(c.series.name, c.label): c for c in compare_all()}


def test_cpu_adam_constant_is_the_fit_on_its_one_row():
    assert fit_cpu_adam() == pytest.approx(calibration.CPU_ADAM_SECONDS_PER_PARAM, rel=1e-3)
    assert ROWS[FIT_ROW].added_error == pytest.approx(0.0, abs=1e-3)


def _marked(misses):
    return [pytest.param(k, marks=pytest.mark.xfail(strict=True, reason=misses[k]))
            if k in misses else k for k in ROWS if k != FIT_ROW]


@pytest.mark.parametrize("key", _marked(ADDED_MISSES))
def test_held_out_offload_step_time_within_10_percent(key):
    assert abs(ROWS[key].added_error) <= 0.10, ROWS[key].added_error


@pytest.mark.parametrize("key", _marked(FREED_MISSES))
def test_held_out_gpu_memory_freed_within_10_percent(key):
    c = ROWS[key]
    assert abs(c.saved_predicted / c.measured_saved - 1) <= 0.10
