"""Who the hang diagnosis blames when group members disagree at an op number: the member
whose program changed (it departs from its own previous iterations), in a group of two as
in a larger one.  Dumps are written by the recorder itself, one recorder per rank, with the
test hook applied to one of them (the issue's case: a data-parallel all-gather of the
distributed optimizer dropped by one of two members)."""
import json

from megalite import comm
from megalite.diagnostics import flight_recorder as fr
from megalite.diagnostics.hang_diagnosis import Diagnosis, diagnose_folder
from megalite.parallel_state import Group

import torch


class Tracing(fr.FlightRecorder):
    fake = True           # record, do not communicate


def _iteration(it, dp, last_op=None):
    """One training iteration's ops on ``dp``: the loss-token count, the gradients'
    reduce-scatter, the parameters' all-gather (``last_op`` ops only)."""
    fr.site.iteration = it
    ops = [("loss tokens", lambda: comm.all_reduce(torch.ones(1, dtype=torch.float64), dp)),
           ("grad sync", lambda: comm.reduce_scatter_tensor(torch.empty(4), torch.ones(8), dp)),
           ("optimizer", lambda: comm.all_gather_into_tensor(torch.empty(8), torch.ones(4),
                                                              dp))]
    for phase, run in ops[:last_op]:
        fr.site.phase = phase
        run()


def _dump(rank, faults, iterations, last_op, tmp_path):
    """Rank ``rank`` runs ``iterations`` whole iterations, then ``last_op`` ops of the next;
    its newest op is left waiting (the hang) and the dump written."""
    rec = Tracing(capacity=None, rank=rank, faults=fr.parse_faults(faults))
    old = fr.install(rec)
    saved = (fr.site.iteration, fr.site.phase)
    try:
        dp = Group("dp-cp", [0, 1], None, rank)
        for it in range(1, iterations + 1):
            _iteration(it, dp)
        _iteration(iterations + 1, dp, last_op)
        rec.entries[-1].t1, rec.entries[-1].waiting = None, True
        rec.meta = {"run_id": "run-1", "world_size": 2, "peers": {}}
        rec.dump_dir = str(tmp_path)
        rec.dump("watchdog: test")
    finally:
        fr.install(old)
        fr.site.iteration, fr.site.phase = saved
    return json.loads((tmp_path / fr.dump_name(rank)).read_text())


def test_in_a_two_member_group_the_member_that_dropped_an_op_is_named(tmp_path):
    """Rank 1 skips the all-gather of iteration 3 and waits in iteration 4's first op, which
    has the all-gather's number: rank 0 (whose program is what it ran every iteration) is
    the victim, rank 1 the cause -- whatever the rank order."""
    for dropper in (1, 0):
        other = 1 - dropper
        _dump(other, None, 2, 3, tmp_path)                          # waits in the all-gather
        _dump(dropper, f"skip:rank={dropper},iteration=3,group=dp-cp,op=all_gather", 3, 1,
              tmp_path)                                         # went on to iteration 4
        text = diagnose_folder([str(tmp_path)])
        cause = next(l for l in text.splitlines() if l.startswith("cause:"))
        assert cause.startswith(f"cause: rank {dropper} -- ") and "left its own program" in \
            cause, text
        assert f"evidence: rank {dropper} left its program at iteration 3: it went on to " \
            "iteration 4 after 2 ops; in iteration 2 op 3 was all_gather" in text, text
        assert f"cause: rank {other}" not in text, text


def test_a_dump_keeps_the_two_iterations_before_the_current_one(tmp_path):
    """A rank that dropped an op and went on has the departure in a whole iteration: the
    dump must hold the iteration before that one too."""
    d = _dump(0, None, 5, 1, tmp_path)
    assert sorted({e["it"] for e in d["entries"]}) == [4, 5, 6]
    assert d["previous_iteration_whole"]


def test_a_program_change_shared_by_most_ranks_is_not_a_departure(tmp_path):
    """Every rank's iteration 2 differs from its first (say a first-iteration extra op):
    not evidence; a later departure of one rank still is."""
    def op(seq, it, t1=1.0, shape=(8,)):
        return dict(op="all_reduce", seq=seq, group="dp[0-3]", t0=0.5, t1=t1, it=it,
                    phase="grad sync", step="", where="", shapes=[list(shape)],
                    dtype="float32", waiting=t1 is None)
    entries = {}
    for r in range(4):
        ops = [op(1, 1, shape=(2,)), op(2, 1), op(3, 2), op(4, 3)]
        if r == 3:                      # drops nothing, adds an op in iteration 3
            ops = [op(1, 1, shape=(2,)), op(2, 1), op(3, 2), op(4, 3, shape=(5,)), op(5, 3)]
        ops[-1].update(t1=None, waiting=True)
        entries[r] = ops
    dumps = {r: dict(rank=r, time=1.0, run_id="x", world_size=4, peers={},
                     groups={"dp[0-3]": dict(ranks=[0, 1, 2, 3], seq=entries[r][-1]["seq"])},
                     entries=entries[r], reason="watchdog: test") for r in range(4)}
    found = Diagnosis(dumps).deviations()
    assert [r for r, _ in found] == [3] and "iteration 3" in found[0][1], found
