"""ZB-V's compute order (``order_zbv``, not yet in the schedule registry): complete, placed
by the generic V-shape placement without deadlock, and its simulated idle time and peak
in-flight chunk-micro-batches at unit costs for p in {2, 4, 8}."""
from fractions import Fraction

import pytest

from megalite.config import pipeline_program as P
from megalite.config.pipeline_orders import order_zbv

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
