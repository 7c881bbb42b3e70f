"""The flight recorder (what megalite.comm notes per op, with megalite call sites), the test hooks,
and the hang diagnosis on dumps built with the recorder itself (one process, no groups)."""
import json
import os
import time

import pytest
import torch

from megalite import comm
from megalite.comm import flight_recorder as fr
from megalite.diagnostics.hang_diagnosis import diagnose_folder, load_dumps
from megalite.parallel_state import Group
from megalite.tensor_parallel.mappings import copy_to_tp_region


class Tracing(fr.FlightRecorder):
    fake = True           # record, do not communicate


@pytest.fixture
def recorder():
    rec = Tracing(capacity=None)
    old = fr.install(rec)
    saved = (fr.site.iteration, fr.site.phase, fr.site.step, fr.site.where)
    yield rec
    fr.install(old)
    fr.site.iteration, fr.site.phase, fr.site.step, fr.site.where = saved


def test_ops_carry_group_sequence_shapes_and_megalite_call_sites(recorder):
    tp = Group("tp", [0, 1], None, 0)
    pp = Group("pp", [0, 2], None, 0)
    fr.site.iteration, fr.site.phase, fr.site.step = 3, "forward-backward", "F mb 1"
    x = torch.ones(4, 2, requires_grad=True)
    with fr.module_site("layer 5", "attention"):
        y = copy_to_tp_region(x, tp)               # all-reduce in backward
        comm.all_reduce(torch.ones(3), tp)
    fr.site.step = "BW mb 1"
    y.sum().backward()                              # the backward keeps the forward's frames
    comm.batch_send_recv([(torch.ones(2, 3), 2)], [(torch.empty(2, 3), 2)], pp,
                         keys=["act mb 1", "grad mb 0"])
    a, b, c = [e.to_json() for e in recorder.entries]
    assert (a["op"], a["seq"], a["group"], a["shapes"]) == ("all_reduce", 1, "tp[0,1]", [[3]])
    assert a["where"] == "layer 5 attention" and a["it"] == 3 and a["step"] == "F mb 1"
    assert (b["seq"], b["shapes"], b["where"], b["step"]) == (2, [[4, 2]], "layer 5 attention",
                                                             "BW mb 1")
    assert c["op"] == "p2p" and c["parts"] == [["send", 2, [2, 3], 1, "act mb 1"],
                                               ["recv", 2, [2, 3], 1, "grad mb 0"]]
    assert all(e["t1"] is not None for e in (a, b, c))
    assert fr.site.where == ()


def test_ring_buffer_keeps_the_last_n_and_zero_switches_it_off():
    rec = Tracing(capacity=3)
    old = fr.install(rec)
    try:
        g = Group("dp", [0, 1], None, 0)
        for _ in range(5):
            comm.all_reduce(torch.ones(1), g)
        assert [e.seq for e in rec.entries] == [3, 4, 5]
        fr.install(Tracing(capacity=0))
        comm.all_reduce(torch.ones(1), g)
        assert not fr.recorder.enabled and not fr.recorder.entries
    finally:
        fr.install(old)


def test_fault_hook_skips_the_nth_op_of_an_iteration(recorder):
    recorder.faults = fr.parse_faults("skip:rank=0,iteration=2,group=tp,op=all_reduce,nth=2")
    tp = Group("tp", [0, 1], None, 0)
    for it in (1, 2):
        fr.site.iteration = it
        for _ in range(3):
            comm.all_reduce(torch.ones(1), tp)
    assert [(e.iteration, e.seq) for e in recorder.entries] == [(1, 1), (1, 2), (1, 3),
                                                                (2, 4), (2, 5)]
    with pytest.raises(ValueError, match="MEGALITE_FAULT_INJECT"):
        fr.parse_faults("drop:rank=1")


# -- dumps and the diagnosis ------------------------------------------------------------------

def _rank_recorder(rank, folder, run="run-1"):
    rec = fr.FlightRecorder(capacity=100, rank=rank)
    rec.dump_dir = str(folder)
    rec.meta = {"run_id": run, "world_size": 4, "peers": {str(r): ["elsewhere", 1] for r in
                                                          range(4)}, "backend": "gloo"}
    return rec


def _collective(rec, group, complete=True, **where):
    fr.site.iteration, fr.site.phase = where.get("it", 3), where.get("phase", "forward-backward")
    e = rec.begin("all_reduce", group, torch.ones(8))
    if complete:
        rec.end(e)
    return e


def _scenario(folder, drop=()):
    """TP [0,1] and [2,3]; rank 1 stops before its second TP all-reduce: rank 0 waits in
    it; ranks 2 and 3 wait in a dp all-reduce with 0 and 1."""
    recs = [_rank_recorder(r, folder) for r in range(4)]
    tp = [Group("tp", [0, 1], None, r) for r in (0, 1)] + \
        [Group("tp", [2, 3], None, r) for r in (2, 3)]
    dp = [Group("dp", [0, 2], None, 0), Group("dp", [1, 3], None, 1),
          Group("dp", [0, 2], None, 2), Group("dp", [1, 3], None, 3)]
    for r in range(4):
        _collective(recs[r], tp[r])
    _collective(recs[0], tp[0], complete=False)
    for r in (2, 3):
        _collective(recs[r], tp[r])
        _collective(recs[r], dp[r], complete=False, phase="grad sync")
    for r, rec in enumerate(recs):
        if r not in drop:
            rec.dump("watchdog: test")
    return recs


def test_diagnosis_names_the_rank_that_left_no_dump_and_where_it_was(tmp_path):
    _scenario(tmp_path, drop=(1,))
    text = diagnose_folder([str(tmp_path)])
    lines = text.splitlines()
    assert "3 current dumps (none from rank 1)" in lines[0], text
    assert lines[1].startswith("cause: rank 1 -- no dump: dead, stopped or unable to run "
                               "Python (pid 1 on elsewhere)"), text
    assert "last op it completed (as rank 0 recorded it): all_reduce #1 on tp[0,1]" in text
    assert "rank 0 waits for it in all_reduce #2 on tp[0,1] [8 float32] at iteration 3, " \
           "forward-backward" in text
    assert "rank 3 waits for it in all_reduce #1 on dp[1,3]" in text
    assert "all_reduce #1 on dp[0,2] [8 float32] at iteration 3, grad sync: waiting 2 (since" \
        in text and "never entered: 0 (its last op there is #0; it waits in all_reduce #2 on " \
        "tp[0,1] [8 float32])" in text, text


def test_a_dump_written_before_the_rank_went_on_is_stale(tmp_path):
    recs = _scenario(tmp_path, drop=(1,))
    old = _rank_recorder(1, tmp_path)
    old.dump("watchdog: an earlier stall")           # rank 1 had issued nothing on tp then ...
    data = json.load(open(tmp_path / "rank00001.json"))
    assert data["groups"] == {}
    text = diagnose_folder([str(tmp_path)])          # ... but rank 0 completed #1 with it
    assert "cause: rank 1 -- stale dump" in text, text
    assert len(load_dumps([str(tmp_path)])) == 4 and recs


def test_an_older_run_in_the_folder_is_ignored(tmp_path):
    other = _rank_recorder(1, tmp_path, run="run-0")
    other.dump("old")
    os.utime(tmp_path / "rank00001.json", (time.time() - 100, time.time() - 100))
    _scenario(tmp_path, drop=(1,))
    os.remove(tmp_path / "rank00001.json")
    other.dump("old")                                # an old run's file stays around
    data = json.load(open(tmp_path / "rank00001.json"))
    data["time"] -= 100
    json.dump(data, open(tmp_path / "rank00001.json", "w"))
    assert sorted(load_dumps([str(tmp_path)])) == [0, 2, 3]
    assert "cause: rank 1 -- no dump" in diagnose_folder([str(tmp_path)])


def test_nccl_ops_not_completed_on_the_gpu_count_as_waiting(tmp_path):
    """Under NCCL a collective returns once enqueued; torch's own trace (when on) says which
    completed.  Rank 0's second TP op returned but never completed on the GPU."""
    recs = [_rank_recorder(r, tmp_path) for r in (0, 1)]
    tp = [Group("tp", [0, 1], None, r) for r in (0, 1)]
    for r in (0, 1):
        _collective(recs[r], tp[r])
    _collective(recs[0], tp[0])                      # "completed" from Python's side
    for r in (0, 1):
        recs[r].meta.update(world_size=2, backend="nccl")
        snap = recs[r].snapshot("watchdog")
        for g in snap["groups"].values():
            g["torch"] = "3"
        snap["torch_fr"] = {"pg_status": {"3": {"last_completed_collective": 1}}}
        json.dump(snap, open(tmp_path / fr.dump_name(r), "w"))
    text = diagnose_folder([str(tmp_path)])
    assert "(issued, not completed on the GPU)" in text and "cause: rank 1" in text, text


@pytest.mark.parametrize("flags,message", [
    (["--flight-recorder-size", "-1"],
     "--flight-recorder-size must be a non-negative integer, got -1"),
    (["--hang-watchdog-seconds", "0"], "--hang-watchdog-seconds must be a positive number")])
def test_bad_recorder_flags_are_one_line(capsys, flags, message):
    from megalite.training.entry import main

    with pytest.raises(SystemExit) as exc:
        main(["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
              "--seq-length", "8", "--mock-data", "--vocab-size", "10", "--lr", "0.1",
              "--train-iters", "1", *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"megalite: error: {message}") and "\n" not in err, err
