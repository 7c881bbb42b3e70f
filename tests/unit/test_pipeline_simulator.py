"""The schedule simulator: exact bubble formulas, deadlock freedom, p2p pairing, memory."""
from fractions import Fraction

import pytest

from megalite.config import pipeline_orders as O
from megalite.config import pipeline_program as P
from megalite.config import pipeline_schedules as S


def _bubble(schedule, p, m, v=1, costs=P.UNIT_COSTS):
    return Fraction(P.simulate(S.plan(schedule, p, m, v), costs).bubble_fraction) \
        .limit_denominator(100000)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("mult", [1, 2, 3])
def test_1f1b_bubble_is_p_minus_1_over_m(p, mult):
    m = mult * p + (mult == 3)          # also a count that is not a multiple of p
    assert _bubble("1f1b", p, m) == Fraction(p - 1, m)


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("mult", [1, 2, 3])
def test_interleaved_bubble_is_p_minus_1_over_vm(p, v, mult):
    assert _bubble("interleaved", p, mult * p, v) == Fraction(p - 1, v * mult * p)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [2, 5, 8, 16])
def test_zero_bubble_beats_1f1b(p, m):
    zb, f1b = _bubble("zero-bubble", p, m), _bubble("1f1b", p, m)
    assert zb < f1b
    if m >= p:  # ZB-H1: (p-1)(F+B-W) idle against m(F+B+W) work
        assert zb == Fraction(p - 1, 3 * m)


def test_non_unit_costs():
    # 1F1B's fraction does not depend on the F:B ratio; ZB-H1 idles (p-1)(F+B-W)
    costs = {"F": 1, "B": 1, "W": 1}
    assert _bubble("1f1b", 4, 8, costs={"F": 1, "B": 2, "W": 1.5}) == Fraction(3, 8)
    assert _bubble("zero-bubble", 4, 8, costs=costs) == Fraction(3, 24)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved", 2), ("interleaved", 3),
                                        ("zero-bubble", 1)])
@pytest.mark.parametrize("forward_only", [False, True])
def test_programs_are_complete_fifo_and_deadlock_free(schedule, v, forward_only):
    for p in (2, 3, 4, 5, 8):
        for m in ((p, 2 * p) if schedule == "interleaved" else (1, p - 1 or 1, p, 2 * p + 1)):
            prog = S.plan(schedule, p, m, v, forward_only)
            P.check_fifo(prog, p)
            P.simulate(prog)                 # raises DeadlockError otherwise
            for r, ops in enumerate(prog):
                kinds = [(o.kind, o.mb, o.chunk) for o in ops if o.kind != "comm"]
                want = {("F", i, c) for i in range(m) for c in range(v)}
                if not forward_only:
                    if schedule == "zero-bubble":
                        want |= {(k, i, 0) for i in range(m) for k in ("B", "W")}
                    else:
                        want |= {("BW", i, c) for i in range(m) for c in range(v)}
                assert sorted(kinds) == sorted(want) and len(kinds) == len(want), (p, m, r)


def test_1f1b_order_and_in_flight_bound():
    p, m = 4, 8
    for r, order in enumerate(S.compute_orders("1f1b", p, m)):
        first_b = next(i for i, o in enumerate(order) if o.kind == "BW")
        assert first_b == p - r        # p-r-1 warm-up forwards, then one more F
        live = peak = 0
        for o in order:
            live += 1 if o.kind == "F" else -1
            peak = max(peak, live)
        assert peak == p - r


def test_zero_bubble_memory_capped_at_p():
    p, m = 4, 12
    for order in O.orders_zero_bubble(p, m):
        live = peak = 0
        for o in order:
            live += {"F": 1, "B": 0, "W": -1}[o.kind]
            peak = max(peak, live)
        assert peak <= p


def test_interleaved_needs_multiple_of_p():
    with pytest.raises(ValueError, match="multiple"):
        O.order_interleaved(4, 6, 2, 0)


def test_deadlock_detected():
    prog = [list(ops) for ops in S.plan("1f1b", 2, 2)]
    # rank 1 waits for a message rank 0 never sends
    bogus = P.Op("comm", recvs=((P.Msg("act", 99, 1), 0),))
    prog[1].insert(0, bogus)
    with pytest.raises(P.DeadlockError):
        P.simulate(prog)
    prog = [list(ops) for ops in S.plan("1f1b", 2, 3)]
    sends = [i for i, o in enumerate(prog[0]) if o.kind == "comm" and o.sends]
    a, b = sends[0], sends[1]
    prog[0][a], prog[0][b] = prog[0][b], prog[0][a]   # sends out of the receiver's order
    with pytest.raises(P.DeadlockError):
        P.check_fifo(prog, 2)
