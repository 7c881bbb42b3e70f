"""The planner against published runs (docs/planner.md, "Planner vs published"; the rows are
megalite/planner/published_runs.py, the constants megalite/planner/calibration.py).

Issue 29's bar: predicted throughput within 10% on every row and a mean absolute error of
at most 5% on the rows the constants were not fitted on, the Llama 3 405B and MoE rows
among them; constants fitted on at most a third of the rows.
"""
import math
import os
import subprocess
import sys

import pytest

from megalite.planner import calibration
from megalite.planner import memory as mem
from megalite.planner.hardware import make_cluster
from megalite.planner.layout import Layout
from megalite.planner.published import (compare, compare_all, compare_run, constants,
                                        fit_constants, same_parallel_layout)
from megalite.planner.published_runs import BY_NAME, OVERLAP_RUNS, RUNS

OVERLAP_BY_NAME = {r.name: r for r in OVERLAP_RUNS}

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CAL = set(calibration.calibration_row_names())


@pytest.fixture(scope="module")
def rows():
    return {c.run.name: c for c in compare_all(with_search=False)}


def test_every_row_names_its_source_layout_and_batch():
    assert len(RUNS) == len(BY_NAME) >= 29
    for r in RUNS:
        L = Layout(world=r.num_gpus, global_batch=r.global_batch, **r.layout)
        assert r.source and r.value > 0 and r.metric in ("hw_tflops", "model_tflops",
                                                         "tokens_per_gpu")
        assert L.tp * L.cp * L.pp * L.dp == r.num_gpus, r.name
        assert r.global_batch % L.dp == 0 and r.seq_length > 0
        assert r.flops in ("full", "causal") and r.precision


def test_constants_fitted_on_at_most_a_third_of_the_rows_and_reproducible():
    assert len(CAL) <= len(RUNS) / 3 and CAL <= set(BY_NAME)
    fitted = {k for keys in calibration.CALIBRATION_ROWS for k in keys}
    assert fitted == set(calibration.CONSTANTS)
    # The Llama 3 405B and MoE rows are never fitted on.
    assert not [n for n in CAL if n.startswith("llama3") or BY_NAME[n].layout.get("ep", 1) > 1
                or "mixtral" in n or "qwen" in n or "deepseek" in n]
    got = fit_constants(rounds=2)
    for k, v in got.items():        # the written values are the fit, rounded to 3 digits
        assert v == pytest.approx(getattr(calibration, k), rel=2e-3), k


# Rows of issue 40 (Blackwell, MXFP8 / NVFP4, HybridEP) the model misses the 10% bar on,
# with the error measured when they were added and what the model lacks for them
# (docs/planner.md, "Where it is off").  strict: a row that starts passing must leave.
KNOWN_MISSES = {
    "bridge25-70b-gb300-fsdp": "+14%: FSDP over the NVL72 domain with 20 layers' "
    "activations offloaded to Grace (hidden behind compute in the model)",
    "bridge26-dsv3-b300": "+22% (+25% before the dispatch syncs' idle, +37% before EP "
    "overlap needed VPP under PP): HGX B300 at 1.1 kW against the GB300-fitted constant, "
    "PP8 over 8 nodes' NICs",
    "bridge26-qwen3-30b-h100": "+30% (+42% before the dispatch syncs' idle): FP8 current "
    "scaling on fine-grained experts, eager (the BF16 run of the same shape with graphs "
    "of the router and preprocessing is 244 TFLOP/s, the FP8 row 203)",
    "bridge26-gptoss-120b-gb300": "+45% (tokens/s): GPT-OSS priced 1.5-1.8x too fast on "
    "every Blackwell part, BF16 rows too (docs/planner.md, 'GPT-OSS 120B'); no sourced term",
    "bridge26-gptoss-120b-gb200": "+39% (tokens/s): as above",
    "bridge26-gptoss-120b-b300": "+84% (tokens/s): as above, and B300's constant is GB300's",
    "maxtext-llama2-7b-8gpu": "+16%: JAX / XLA (2024) against the Megatron-fitted H100 "
    "constant; minimal_flash's elementwise recomputation and fp32 weights not priced",
}


@pytest.mark.parametrize("name", [pytest.param(r.name, marks=pytest.mark.xfail(
    strict=True, reason=KNOWN_MISSES[r.name])) if r.name in KNOWN_MISSES else r.name
    for r in RUNS])
def test_predicted_within_10_percent(rows, name):
    c = rows[name]
    assert abs(c.error) <= 0.10, f"{name}: predicted {c.predicted:.0f}, published " \
                                 f"{c.run.value:g} ({100 * c.error:+.1f}%)"


ISSUE_40 = ("bridge25-", "bridge26-")


def test_held_out_mean_absolute_error_at_most_5_percent(rows):
    """Issue 29's rows; issue 40's per hardware and per dispatcher below."""
    held = [abs(c.error) for n, c in rows.items() if n not in CAL and
            not n.startswith(ISSUE_40)]
    assert len(held) >= 2 * len(CAL)
    assert sum(held) / len(held) <= 0.05
    for n in CAL:                                      # the fit itself is exact
        assert abs(rows[n].error) < 0.005


def _group_mean(rows, key, value) -> float:
    got = [abs(c.error) for n, c in rows.items() if n not in CAL and key(c) == value]
    assert got, value
    return sum(got) / len(got)


# Groups whose held-out mean is above 5% today (the rows above are why).
GROUP_MISSES = {"h100-80gb", "gb300-nvl72", "gb200-nvl72", "b300", "hybridep", "alltoall",
                "deepep"}


@pytest.mark.parametrize("group", [pytest.param(g, marks=pytest.mark.xfail(
    strict=True, reason="held-out mean above 5% (KNOWN_MISSES)")) if g in GROUP_MISSES
    else g for g in ("a100-80gb", "h100-80gb", "b200", "gb200-nvl72", "gb300-nvl72", "b300",
                     "alltoall", "deepep", "hybridep")])
def test_held_out_mean_per_hardware_and_dispatcher(rows, group):
    if group in ("alltoall", "deepep", "hybridep"):
        mean = _group_mean({n: c for n, c in rows.items() if c.model.num_experts},
                           lambda c: c.opts.moe_dispatcher, group)
    else:
        mean = _group_mean(rows, lambda c: c.run.gpu, group)
    assert mean <= 0.05, f"{group}: {100 * mean:.1f}%"


def test_fitted_rows_are_at_most_a_third_of_each_hardware():
    for gpu in {r.gpu for r in RUNS}:
        mine = [r.name for r in RUNS if r.gpu == gpu]
        assert len([n for n in mine if n in CAL]) <= len(mine) / 3, gpu


def test_flop_conventions_of_the_sources(rows):
    """Bridge counts causal attention (half the scores), Llama 3 / PaLM the full matrix,
    Narayanan et al. the recomputation too."""
    c = rows["bridge-llama3-70b"]
    from megalite.planner.published import model_flops
    full = model_flops(c.model, 8192, 128, "full")
    causal = model_flops(c.model, 8192, 128, "causal")
    assert 1.05 < full / causal < 1.15
    n = rows["gpt-1t"]
    assert model_flops(n.model, 2048, 1, "hw", "full") / model_flops(n.model, 2048, 1,
                                                                     "full") == \
        pytest.approx(4 / 3, rel=0.02)


def test_memory_shown_next_to_the_published_figures(rows):
    stated = [c for c in rows.values() if c.run.memory_gib is not None]
    assert len(stated) >= 9
    for c in stated:
        assert 0 < c.memory_gib and math.isfinite(c.memory_gib)


# ---- the planner's own picks ----------------------------------------------------------

def test_narayanan_rows_published_layout_among_the_candidates():
    for name in ("gpt-1.7b", "gpt-76.1b", "gpt-1t"):
        c = compare(name)
        assert c.rank is not None and c.gap <= 0.05, (name, c.rank, c.gap)


def test_llama3_16k_pick_is_the_published_layout():
    """With Llama 3's sharded gradients (ZeRO-2) the pick is TP8 CP1 PP16 DP128 with Meta's
    split (VPP 8, embedding and loss counted as layers) and no recomputation."""
    c = compare("llama3-405b-8k-16384gpu")
    L = c.pick.layout
    assert c.rank == 1 and same_parallel_layout(L, c.run, c.as_run.layout)
    assert (L.vpp, L.accounts, L.recompute, L.zero) == (8, (True, True), "none", 2)


def test_llama3_16k_needs_sharded_grads_to_skip_recompute():
    run = BY_NAME["llama3-405b-8k-16384gpu"]
    m = compare_run(run, False).model
    base = dict(run.layout, world=run.num_gpus, global_batch=run.global_batch)
    cap = int(make_cluster(run.num_gpus).gpu.memory_bytes * 0.9)
    zero1 = mem.peak_rank_memory(m, Layout(**dict(base, zero=1)), 8192, mem.Precision.bf16(4))
    zero2 = mem.peak_rank_memory(m, Layout(**dict(base, zero=2)), 8192, mem.Precision.bf16(4))
    assert zero1["total"] > cap >= zero2["total"]


def test_constants_move_the_rows_they_should():
    """The A100 constant leaves H100 rows alone and the other way round."""
    a = compare_run(BY_NAME["gpt-145.6b"], False, constants(SUSTAINED_H100=0.5)).predicted
    b = compare_run(BY_NAME["gpt-145.6b"], False).predicted
    assert a == pytest.approx(b)
    h = compare_run(BY_NAME["bridge-llama31-405b"], False, constants(SUSTAINED_A100=0.5))
    assert h.predicted == pytest.approx(compare_run(BY_NAME["bridge-llama31-405b"],
                                                    False).predicted)


def test_benchmark_prints_every_row_and_both_error_groups():
    out = subprocess.run([sys.executable, "benchmarks/planner_vs_published.py", "--no-search",
                          "--explain", "bridge26-dsv3-gb200"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    for r in RUNS:
        assert f"| {r.name} |" in out.stdout
    assert f"- calibration rows: {len(CAL)} rows" in out.stdout and \
        f"- held-out rows: {len(RUNS) - len(CAL)} rows" in out.stdout
    issue_40 = len([r for r in RUNS if r.name.startswith(ISSUE_40) and r.name not in CAL])
    assert f"- held out, issue 40's 2026 rows (bridge25-/bridge26-): {issue_40} rows" in \
        out.stdout
    for group in ("hardware gb300-nvl72", "hardware b200", "dispatcher hybridep"):
        assert f"- held out, {group}:" in out.stdout
    # the DeepEP-style row's terms: only the EP term (and what waits on it) moves
    assert "| term | as modelled | hybridep -> alltoall | K-curve off |" in out.stdout
    assert "| compute | " in out.stdout and "| ep | " in out.stdout
    assert "| titan-70b-256gpu-2d | 71.9 GiB |" in out.stdout
    # memory: runs that ran are listed only when predicted not to fit -- the three the
    # sources do not explain (docs/planner.md, "Memory of the Bridge runs"), not the nine
    # their quantized weights, unsaved expert outputs and bf16 moments bring in
    misfits = {l.split(" | ")[0][2:] for l in out.stdout.splitlines()
               if l.startswith("| ") and "| (ran) |" in l and " | no (" in l}
    assert misfits == {"bridge26-405b-gb200-fp8", "llama3-405b-8k-8192gpu",
                       "maxtext-llama2-7b-8gpu"}, misfits


# Megatron-Core's EP-overlap pair (published_runs.OVERLAP_RUNS, outside RUNS): both steps
# within 10% once DeepEP over the NICs hides only the measured share under the overlap
# (estimate.FLEX_RDMA_*; docs/planner.md, "The EP overlap against Megatron-Core's
# 245 -> 276").  The 2026 run of the same layout hides more than that.  strict: a fix shows.
OVERLAP_MISSES = {
    "zoo-qwen3-235b-deepep-overlap-2026": "-21% (+8% when the pairing alone decided): the "
    "2026 stack hides more than the 36.55% NVIDIA's Nsight comparison measured",
}


@pytest.mark.parametrize("name", [pytest.param(r.name, marks=pytest.mark.xfail(
    strict=True, reason=OVERLAP_MISSES[r.name])) if r.name in OVERLAP_MISSES else r.name
    for r in OVERLAP_RUNS])
def test_ep_overlap_pair_within_10_percent(name):
    c = compare_run(OVERLAP_BY_NAME[name], with_search=False)
    assert abs(c.error) <= 0.10, f"{name}: predicted {c.predicted:.0f}, published " \
                                 f"{c.run.value:g} ({100 * c.error:+.1f}%)"


def test_overlap_benchmark_prints_the_published_layout_off_and_on():
    out = subprocess.run([sys.executable, "benchmarks/moe_overlap_prediction.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| published TFLOP/s | 245 | 276 | +12.7% |" in out.stdout
    assert "| predicted TFLOP/s | " in out.stdout and "line rate" in out.stdout
    # the pair the measured overlap constants come from, with its sync-idle term
    assert "The constants' source (NVIDIA's Nsight comparison" in out.stdout
    assert "| published TFLOP/s | 244.039 | 287.305 | +17.7% |" in out.stdout
    assert "| predicted dispatch-sync idle (s) | " in out.stdout
    for name in ("bridge-qwen3-235b-a22b", "bridge-deepseek-v3"):
        assert f"| {name} |" in out.stdout
