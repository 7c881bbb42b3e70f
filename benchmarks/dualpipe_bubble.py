"""Simulated bubble and peak in-flight memory per schedule against the formulas, side by side.

For p in {2, 4, 8} and several micro-batch counts m, every schedule's blocking program
(``pipeline_schedules.plan``: what the executor runs) is replayed at unit costs (F = B = W = 1 per
chunk op) and compared with the registry's formulas (the planner's): the bubble fraction
(idle / compute, and the planner's ``bubble_time`` over one rank's work) and the peak
micro-batches of activations a rank holds (the worst rank).  No torch, a second or two.

    python benchmarks/dualpipe_bubble.py [--pp 2 4 8] [--micro-batches-per-pp 2 3 4]
"""
from __future__ import annotations

import argparse
import os
import sys
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.config import pipeline_program as P  # noqa: E402
from megalite.config import pipeline_schedules as S  # noqa: E402

UNIT = {k: Fraction(1) for k in "FBW"}
ROWS = (("1f1b", 1), ("interleaved", 2), ("zero-bubble", 1), ("dualpipev", 2), ("zbv", 2))


def _formula_bubble(name: str, p: int, m: int, v: int) -> Fraction:
    """Bubble fraction from the registry's ``bubble_time`` (the planner's formula) at unit
    costs: a rank's work per micro-batch is v chunks x (F + B + W), its forward v x F."""
    work, fwd = 3 * v, v
    return Fraction(S.get_schedule(name).bubble_time(p, v, work, 0, fwd)) / (m * work)


def _peak(program, rank) -> int:
    held = peak = 0
    for op in program[rank]:
        held += {"F": 1, "BW": -1, "W": -1}.get(op.kind, 0)
        peak = max(peak, held)
    return peak


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--micro-batches-per-pp", type=int, nargs="+", default=[2, 3, 4])
    a = ap.parse_args(argv)
    print(f"{'schedule':<12} {'p':>2} {'m':>3} | {'bubble sim':>10} {'formula':>8} | "
          f"{'peak mb sim':>11} {'formula':>8}")
    ok = True
    for p in a.pp:
        for k in a.micro_batches_per_pp:
            m = k * p
            for name, v in ROWS:
                spec = S.get_schedule(name)
                program = S.plan(name, p, m, v)
                sim = Fraction(P.simulate(program, UNIT).bubble_fraction).limit_denominator(10**6)
                want = _formula_bubble(name, p, m, v)
                peaks = [Fraction(_peak(program, r), v) for r in range(p)]
                want_peak = [Fraction(spec.in_flight(p, m, v, r)).limit_denominator(100)
                             for r in range(p)]
                match = sim == want and peaks == want_peak
                ok &= match
                print(f"{name:<12} {p:>2} {m:>3} | {float(sim):>9.2%} {float(want):>8.2%} | "
                      f"{float(max(peaks)):>11.2f} {float(max(want_peak)):>8.2f}"
                      f"{'' if match else '   (differs)'}")
    print("every schedule matches its formulas" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
