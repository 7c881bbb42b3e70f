"""ZB-V (``--pipeline-schedule zbv``): its compute order (``order_zbv``) complete, its
registered programs FIFO and deadlock-free (training and forward-only), and the registry's
planner formulas (bubble, peak in-flight, unpaired forwards) against the simulator and the
order for p in {2, 4, 8} and several micro-batch counts."""
from fractions import Fraction

import pytest

from megalite.cli.arguments import parse_args
from megalite.config import ConfigError
from megalite.config import pipeline_program as P
from megalite.config import pipeline_schedules as S
from megalite.config.pipeline_orders import order_zbv

import test_dualpipe_simulator as dualpipe_simulator

UNIT = {k: Fraction(1) for k in "FBW"}
CASES = [(p, m) for p in (2, 4, 8) for m in (2 * p - 1, 2 * p, 3 * p, 4 * p + 3)]


@pytest.mark.parametrize("p,m", CASES)
def test_zbv_order_is_complete_deadlock_free_with_its_bubble_and_peak(p, m):
    orders = [order_zbv(p, m, r) for r in range(p)]
    for order in orders:
        assert sorted((o.kind, o.mb, o.chunk) for o in order) == sorted(
            (k, mb, c) for k in "FBW" for mb in range(m) for c in (0, 1))
    res = P.simulate(P.build_program(orders, p, 2, vshape=True), UNIT)
    # measured: (p - 1) units idle per rank (torch's order is not the paper's ideal 0)
    assert {res.makespan - busy for busy in res.busy} == {p - 1}
    for order in orders:
        held = peak = 0
        for op in order:
            held += {"F": 1, "W": -1}.get(op.kind, 0)
            peak = max(peak, held)
        assert peak == 2 * p      # 2p chunk-micro-batches = p micro-batches, as 1F1B's rank 0


def test_zbv_needs_2p_minus_1_micro_batches():
    with pytest.raises(ValueError, match="at least 2 x pipeline size - 1"):
        order_zbv(4, 6, 0)


@pytest.mark.parametrize("p,m", CASES)
def test_registered_programs_are_fifo_deadlock_free_and_match_the_formulas(p, m):
    spec = S.get_schedule("zbv")
    assert spec.min_micro_batches(p) == 2 * p - 1 and spec.vshape and spec.split_backward
    for forward_only in (False, True):
        program = S.plan("zbv", p, m, 2, forward_only)
        P.check_fifo(program, p)
        P.simulate(program)
        # the bottom of the V is handed over locally: the last rank sends itself nothing
        assert all(dst != p - 1 for op in program[p - 1] for _, dst in op.sends)
    program = S.plan("zbv", p, m, 2)
    res = P.simulate(program, UNIT)
    idle = {res.makespan - busy for busy in res.busy}
    # the planner's bubble time, in units of one rank's work (2 chunks x (F + B + W))
    assert idle == {spec.bubble_time(p, 2, 6, 0, 2)} == {p - 1}
    assert Fraction(res.bubble_fraction).limit_denominator(10 ** 6) == Fraction(p - 1, 6 * m)
    for r, prog in enumerate(program):
        ops = [op for op in prog if op.kind != "comm"]
        held = peak = 0
        for op in ops:
            held += {"F": 1, "W": -1}.get(op.kind, 0)
            peak = max(peak, held)
        assert peak / 2 == spec.in_flight(p, m, 2, r)
        alone = sum(a.kind == "F" and b.kind not in ("B", "BW") for a, b in zip(ops, ops[1:]))
        assert alone == spec.unpaired_forwards(p, m, 2, r) == 2 * p - 1


@pytest.mark.parametrize("f,b", [(1, 1), (1, 2), (2, 3), (1, 3)])
def test_bubble_formula_is_the_dependency_only_idle_when_b_and_w_cost_at_least_f(f, b):
    """With B = W >= F the dependency-only timing (what asynchronous p2p approaches) idles
    (p - 1) B per rank whatever m; a rank's work is 2 (F + 2B), its forward part 2F."""
    costs = {"F": Fraction(f), "B": Fraction(b), "W": Fraction(b)}
    spec = S.get_schedule("zbv")
    for p in (2, 4, 8):
        for m in (2 * p - 1, 3 * p):
            times = P.ideal_times(S.compute_orders("zbv", p, m, 2), p, 2, costs, vshape=True)
            end = max(t[-1][1] for t in times)
            idle = {end - sum(e - s for s, e in t) for t in times}
            assert idle == {spec.bubble_time(p, 2, 2 * (f + 2 * b), 0, 2 * f)}, (p, m, idle)


# DualPipeV's flags (test_dualpipe_simulator.py) with the schedule swapped
_FLAGS = ["zbv" if f == "dualpipev" else f for f in dualpipe_simulator._FLAGS]


def test_the_flag_implies_the_v_and_refuses_too_few_micro_batches_in_one_line():
    cfg = parse_args(_FLAGS + ["--global-batch-size", "7"])
    assert cfg.parallel.virtual_stages(8) == 2 and cfg.parallel.pipeline_vshape
    with pytest.raises(ConfigError, match="zbv needs at least 7 micro-batches.*--global-batch"):
        parse_args(_FLAGS + ["--global-batch-size", "6"])


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev", "interleaved"])
def test_a_chunked_schedule_at_pp_1_asks_for_pipeline_ranks(schedule):
    """Not "drop --num-virtual-stages-per-pipeline-rank", which the user did not give."""
    flags = _FLAGS[:_FLAGS.index("--world-size")] + ["--pipeline-schedule", schedule]
    with pytest.raises(ConfigError, match=f"--pipeline-schedule {schedule} runs model chunks on "
                       "several pipeline ranks: it needs --pipeline-model-parallel-size > 1"):
        parse_args(flags + ["--global-batch-size", "8"])
