"""Who the hang diagnosis blames when group members disagree at an op number: the member
whose program changed (it departs from its own previous iterations), in a group of two as
in a larger one.  Dumps are written by the recorder itself, one recorder per rank, with the
test hook applied to one of them (the issue's case: a data-parallel all-gather of the
distributed optimizer dropped by one of two members)."""
import faulthandler
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from megalite import comm
from megalite.cli.arguments import parse_args
from megalite.diagnostics.collective_check import check_collectives, report_text
from megalite.comm import flight_recorder as fr
from megalite.diagnostics import hang_dumps
from megalite.diagnostics.hang_folder import Fatal, load_fatal
from megalite.diagnostics.hang_diagnosis import Diagnosis, diagnose_folder
from megalite.parallel_state import Group
from megalite.training.loop import Trainer


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


# -- a rank the backend aborts --------------------------------------------------------------

ABORTING_RANK = r'''
import os, sys
import torch
import torch.distributed as dist
from megalite import comm
from megalite.comm import flight_recorder as fr
from megalite.diagnostics import hang_dumps
from megalite.parallel_state import Group

rec = fr.FlightRecorder(rank=0)
rec.meta, rec.dump_dir = {"run_id": "run-1"}, sys.argv[1]
record = hang_dumps.FatalRecord()
record.open(rec)
dist.all_reduce = lambda *a, **k: os.abort()    # the backend's own abort, from C++
comm.all_reduce(torch.ones(1), Group("dp-cp", [0, 1], None, 0))
'''


def _aborted_rank(tmp_path):
    """Rank 0 of run-1 dies of SIGABRT inside comm.all_reduce (a subprocess)."""
    p = subprocess.run([sys.executable, "-c", ABORTING_RANK, str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == -6, p.stderr
    return (tmp_path / fr.fatal_name(0)).read_text()


def test_an_aborted_rank_leaves_its_last_words_and_is_the_victim_of_the_rank_that_left(
        tmp_path):
    """Rank 1 drops the loss all-reduce of iteration 3 (the hook) and goes on; rank 0's
    all-reduce receives rank 1's next op and the backend aborts rank 0 (gloo: "Received data
    size doesn't match expected size").  The dead rank is recorded as killed inside its
    all-reduce, and rank 1 -- which left its program -- comes first."""

    words = _aborted_rank(tmp_path)
    assert words.startswith("megalite fatal-signal record: run run-1 rank 0 pid ")
    assert "Fatal Python error: Aborted" in words and "megalite/comm/__init__.py" in words
    fatal = load_fatal([str(tmp_path)], "run-1")
    assert fatal[0].collective == "all_reduce" and fatal[0].caller.startswith("<string>:")
    assert load_fatal([str(tmp_path)], "another run") == {}

    _dump(1, "skip:rank=1,iteration=3,group=dp-cp,op=all_reduce", 2, 3, tmp_path)
    text = diagnose_folder([str(tmp_path)])
    causes = [l for l in text.splitlines() if l.startswith("cause:")]
    assert causes[0].startswith("cause: rank 1 -- it left its own program") and \
        "rank 0 then died inside a collective" in causes[0], text
    assert causes[1].startswith("cause: rank 0 -- no dump: it died of a signal: Aborted") \
        and "inside comm.all_reduce" in causes[1] and "rank00000.fatal.txt" in causes[1] \
        and "a victim of rank 1's departure" in causes[1], text
    assert "evidence: rank 1 left its program at iteration 3" in text, text


def test_the_launcher_prints_the_diagnosis_only_when_a_rank_died_of_a_signal_unprinted(
        tmp_path):

    dumps, note = tmp_path / "dumps", tmp_path / "note"
    dumps.mkdir()
    _dump(1, "skip:rank=1,iteration=3,group=dp-cp,op=all_reduce", 2, 3, dumps)
    note.write_text(f"run-1\n{dumps}\n")
    assert hang_dumps.diagnosis_after_exit(str(note)) is None      # nobody died of a signal
    _aborted_rank(dumps)
    text = hang_dumps.diagnosis_after_exit(str(note))
    assert text is not None and "cause: rank 1 -- it left its own program" in text
    assert (dumps / "diagnosis.txt").read_text() == text + "\n"
    assert hang_dumps.diagnosis_after_exit(str(note)) is None      # printed once


def test_the_fatal_record_is_removed_when_the_rank_ends_otherwise(tmp_path):
    """No litter: a rank that did not die of a signal leaves no record, nor a folder made
    for it; faulthandler is back to what the user had."""


    was = faulthandler.is_enabled()
    rec = fr.FlightRecorder(rank=3)
    rec.meta, rec.dump_dir = {"run_id": "run-1"}, str(tmp_path / "new")
    record = hang_dumps.FatalRecord()
    record.open(rec)
    assert (tmp_path / "new" / fr.fatal_name(3)).exists() and faulthandler.is_enabled()
    record.close()
    assert not (tmp_path / "new").exists() and faulthandler.is_enabled() == was


# -- before launch ---------------------------------------------------------------------------

@pytest.mark.parametrize("iteration", [1, 3])
def test_the_pre_launch_check_names_the_rank_that_left_its_program(monkeypatch, iteration):
    """TP2 x DP2 with the distributed optimizer; rank 2 drops its data-parallel all-gather.
    The check traces the neighbouring iteration for the ranks a problem names: rank 2's
    program departs from its own, rank 0's does not (iteration 1 has no previous one: the
    next is the reference)."""
    monkeypatch.setenv(fr.FAULT_ENV, f"skip:rank=2,iteration={iteration},group=dp-cp,"
                                     "op=all_gather")
    cfg = parse_args(["--world-size", "4", "--num-layers", "2", "--hidden-size", "32",
                      "--num-attention-heads", "4", "--seq-length", "16", "--mock-data",
                      "--vocab-size", "100", "--lr", "1e-3", "--micro-batch-size", "1",
                      "--global-batch-size", "2", "--train-iters", "10",
                      "--tensor-model-parallel-size", "2", "--use-distributed-optimizer"])
    run = check_collectives(cfg, Trainer)
    assert [r for r, _ in run.verdict.causes] == [2], run.verdict.causes
    ref = iteration - 1 if iteration > 1 else 2
    assert f"in iteration {ref} it is all_gather" in run.verdict.causes[0][1]
    text = report_text(run, 4)
    assert "  cause: rank 2 -- it left its own program: its op " in text, text


def test_a_peer_that_left_outranks_one_still_running_without_a_dump(tmp_path):
    """Printed early (the rank that failed first did not wait for blocked peers): rank 0
    has no dump yet but its process runs; rank 1 left its program.  Rank 1 comes first."""
    _dump(1, "skip:rank=1,iteration=3,group=dp-cp,op=all_gather", 3, 1, tmp_path)
    d = json.loads((tmp_path / fr.dump_name(1)).read_text())
    d["peers"] = {"0": [socket.gethostname(), os.getpid()]}     # a live process
    d["world_size"] = 2
    (tmp_path / fr.dump_name(1)).write_text(json.dumps(d))
    text = diagnose_folder([str(tmp_path)])
    causes = [l for l in text.splitlines() if l.startswith("cause:")]
    assert causes[0].startswith("cause: rank 1 -- it left its own program") and \
        "rank 0 had not dumped yet" in causes[0], text
    assert causes[1].startswith("cause: rank 0 -- no dump: running but wrote no dump") and \
        causes[1].endswith("a victim of rank 1's departure"), text


def test_a_killed_rank_whose_op_in_flight_differs_from_its_stage_mates_is_the_one_that_left():
    """Both members of ep[0,1] died inside their all-to-all; rank 1's op in flight (from
    its fatal record) is the combine where rank 2 and 3 (same program, other peers) issued
    the dispatch under that number: rank 1 left, rank 0 is a victim."""
    def a2a(seq, where, t1=1.0):
        return dict(op="all_to_all", seq=seq, group="ep[2,3]", t0=0.5, t1=t1, it=3,
                    phase="forward-backward", step="F mb 0", where=where, shapes=[[8, 4]],
                    dtype="float32", waiting=t1 is None)
    live = {r: dict(rank=r, time=1.0, run_id="x", world_size=4, peers={}, grid={"pp": 1},
                    groups={"ep[2,3]": dict(ranks=[2, 3], seq=3),
                            "dp[0-3]": dict(ranks=[0, 1, 2, 3], seq=1)},
                    entries=[a2a(1, "layer 0 mlp dispatch"), a2a(2, "layer 0 mlp combine"),
                             dict(a2a(1, "", None), op="all_reduce", group="dp[0-3]",
                                  phase="grad sync", step="", shapes=[[4]])],
                    reason="SIGTERM") for r in (2, 3)}

    def dead(rank, where):
        e = dict(a2a(1, where, None), group="ep[0,1]")
        return Fatal(rank, "x", "Aborted", "all_to_all_single", "megalite/moe/x.py:1 f",
                     fr.fatal_name(rank), e)
    d = Diagnosis(live, {0: dead(0, "layer 0 mlp dispatch"),
                         1: dead(1, "layer 0 mlp combine")})
    assert [r for r, _ in d.dead_departures()] == [1]
    causes = d.causes()
    assert causes[0][0] == 1 and causes[0][1].startswith("it left its own program"), causes
    assert "rank 0 then died inside a collective" in causes[0][1], causes
    assert causes[1][0] == 0 and causes[1][1].endswith("a victim of rank 1's departure")
