"""Every ordering of the hang diagnosis, each at a case where it matters: dumps written by
hand (the format of ``flight_recorder``) with competing candidates -- two terminal ranks
waited on by different numbers of ranks, ties, two stuck collectives, several ops a dead
rank completed, two runs in one folder, two mismatching ops, deviations at the threshold.
(tests/unit/test_flight_recorder.py builds single-cause dumps with the recorder itself.)"""
import json

from megalite.diagnostics.hang_diagnosis import Diagnosis, diagnose, load_dumps


def _op(group, seq, t0, t1=None, it=3, phase="forward-backward", step="", where="",
        op="all_reduce", shape=(8,)):
    return dict(op=op, seq=seq, group=group, t0=t0, t1=t1, it=it, phase=phase, step=step,
                where=where, shapes=[list(shape)], dtype="float32", waiting=t1 is None)


def _dumps(world, groups, entries, time=100.0, run="run-1", skip=()):
    """{rank: dump}: ``groups`` {label: ranks}, ``entries`` {rank: [op, ...]}; a rank's
    issued count per group is its highest sequence number there."""
    out = {}
    for r in range(world):
        if r in skip:
            continue
        mine = {label: dict(ranks=ranks, seq=max([e["seq"] for e in entries.get(r, [])
                                                  if e["group"] == label] or [0]))
                for label, ranks in groups.items() if r in ranks}
        out[r] = dict(rank=r, time=time, run_id=run, world_size=world, peers={}, groups=mine,
                      entries=[dict(e) for e in entries.get(r, [])], reason="watchdog: test")
    return out


def _two_dead_ranks(big_dead=5, small_dead=1):
    """Ranks 2-5 (a dp group) wait on ``big_dead``; ranks 0-1 (tp) wait on ``small_dead``.
    Neither dead rank dumped; each completed op #1 with its group."""
    big = [r for r in range(2, 6)]
    small = [0, 1]
    groups = {"tp[0,1]": small, "dp[2-5]": big}
    entries = {}
    for r in small:
        if r != small_dead:
            entries[r] = [_op("tp[0,1]", 1, 1.0, 2.0), _op("tp[0,1]", 2, 5.0)]
    for r in big:
        if r != big_dead:
            entries[r] = [_op("dp[2-5]", 1, 1.0, 3.0), _op("dp[2-5]", 2, 9.0)]
    return _dumps(6, groups, entries, skip=(big_dead, small_dead))


def test_causes_are_most_waited_on_first_not_by_rank():
    d = Diagnosis(_two_dead_ranks(big_dead=5, small_dead=1))
    assert [r for r, _ in d.causes()] == [5, 1]          # 3 ranks wait on 5, one on 1
    text = d.report()
    assert text.index("cause: rank 5") < text.index("cause: rank 1")


def test_causes_waited_on_equally_are_in_rank_order():
    groups = {"tp[0,1]": [0, 1], "tp[2,3]": [2, 3]}
    entries = {0: [_op("tp[0,1]", 1, 1.0, 2.0), _op("tp[0,1]", 2, 5.0)],
               2: [_op("tp[2,3]", 1, 1.0, 2.0), _op("tp[2,3]", 2, 4.0)]}
    d = Diagnosis(_dumps(4, groups, entries, skip=(3, 1)))
    assert [r for r, _ in d.causes()] == [1, 3]


def test_stuck_collectives_are_listed_oldest_first():
    text = diagnose(_two_dead_ranks())
    stuck = text[text.index("stuck (2):"):]
    assert stuck.index("all_reduce #2 on tp[0,1]") < stuck.index("all_reduce #2 on dp[2-5]")
    # the dp one (since t0 9.0) is the newer: listed second although it has more waiters


def test_what_a_dead_rank_did_last_is_the_newest_op_its_peers_completed_with_it():
    groups = {"tp[0,1]": [0, 1], "dp[1,2]": [1, 2]}
    entries = {0: [_op("tp[0,1]", 1, 1.0, 7.0, where="layer 9"), _op("tp[0,1]", 2, 8.0)],
               2: [_op("dp[1,2]", 1, 1.0, 3.0, where="layer 4"), _op("dp[1,2]", 2, 8.5)]}
    text = diagnose(_dumps(3, groups, entries, skip=(1,)))
    assert "last op it completed (as rank 0 recorded it): all_reduce #1 on tp[0,1]" in text
    assert "layer 9" in text and "layer 4" not in text.split("stuck")[0]


def test_an_alive_cause_shows_its_newest_completed_op():
    """Rank 1 dumped in no collective: its last completed op is the one that ended last,
    not the last one listed."""
    groups = {"tp[0,1]": [0, 1], "pp[1,2]": [1, 2]}
    entries = {0: [_op("tp[0,1]", 1, 1.0, 2.0), _op("tp[0,1]", 2, 6.0)],
               1: [_op("pp[1,2]", 1, 1.0, 5.0, where="late"),
                   _op("tp[0,1]", 1, 1.5, 2.0, where="early")],
               2: [_op("pp[1,2]", 1, 1.0, 5.0)]}
    text = diagnose(_dumps(3, groups, entries))
    assert "cause: rank 1 -- it was in no collective" in text
    (line,) = [x for x in text.splitlines() if "its last completed op" in x]
    assert "all_reduce #1 on pp[1,2]" in line and ", late (" in line


def test_the_newest_run_in_a_folder_wins_over_an_older_one_with_more_dumps(tmp_path):
    old = _two_dead_ranks()                       # run-1: 4 dumps, at time 100
    new = _dumps(2, {"tp[0,1]": [0, 1]}, {0: [_op("tp[0,1]", 1, 1.0)]}, time=200.0,
                 run="run-2", skip=(1,))
    for r, d in old.items():
        (tmp_path / f"rank{r}.json").write_text(json.dumps(d))
    (tmp_path / "rank0.json").write_text(json.dumps(new[0]))     # rank 0 restarted
    (tmp_path / "rank9.json").write_text(json.dumps(dict(old[2], time=150.0)))
    dumps = load_dumps([str(tmp_path)])
    assert sorted(dumps) == [0] and dumps[0]["run_id"] == "run-2"


def test_a_mismatch_names_the_first_differing_op():
    """Ranks 0 and 1 disagree at #2 and #3 of their group: the first (#2) is named."""
    groups = {"tp[0,1]": [0, 1]}
    a = [_op("tp[0,1]", 1, 1, 2), _op("tp[0,1]", 2, 3, 4, shape=(4,)),
         _op("tp[0,1]", 3, 5, 6, shape=(2,)), _op("tp[0,1]", 4, 7)]
    b = [_op("tp[0,1]", 1, 1, 2), _op("tp[0,1]", 2, 3, 4, shape=(5,)),
         _op("tp[0,1]", 3, 5, 6, shape=(3,)), _op("tp[0,1]", 4, 7)]
    d = Diagnosis(_dumps(2, groups, {0: a, 1: b}))
    ((r0, r1, text),) = d.mismatches()
    assert (r0, r1) == (0, 1) and "tp[0,1] op #2" in text and "[4 float32]" in text


def _iteration(rank, it, skip_first, dp_done):
    """One iteration of a rank: two ops on its own group, then a dp all-reduce (completed
    in iteration 2, waited in by all but the last rank in iteration 3); ``skip_first``
    drops the first op (the rank left its program)."""
    ops = [_op(f"solo{rank}", 2 * it - 3 + k, 10.0 * it + k, 10.0 * it + k + 0.5, it=it,
               where=where) for k, where in enumerate(("attention", "mlp"))]
    if skip_first:
        ops = ops[1:]
    return ops + [_op("dp[all]", it - 1, 10.0 * it + 5, 10.0 * it + 6 if dp_done else None,
                      it=it, phase="grad sync")]


def _deviating(world, n_deviating):
    groups = {"dp[all]": list(range(world)), **{f"solo{r}": [r] for r in range(world)}}
    entries = {r: _iteration(r, 2, False, True) + _iteration(r, 3, r < n_deviating, False)
               for r in range(world)}
    entries[world - 1] = entries[world - 1][:-1]       # the last rank never enters dp #2
    return _dumps(world, groups, entries)


def test_deviations_are_kept_up_to_half_of_the_alive_ranks_and_dropped_past_it():
    found = Diagnosis(_deviating(8, 4)).deviations()
    assert [r for r, _ in found] == [0, 1, 2, 3]
    assert "rank 0 left its program at iteration 3: its op 1 there is all_reduce #4 on " \
        "solo0" in found[0][1] and "in iteration 2 it was all_reduce #1 on solo0" in found[0][1]
    assert Diagnosis(_deviating(8, 5)).deviations() == []        # a change of program
    assert [r for r, _ in Diagnosis(_deviating(4, 2)).deviations()] == [0, 1]   # max(2, ...)
    assert Diagnosis(_deviating(4, 3)).deviations() == []


def test_a_stale_dump_does_not_say_what_a_dead_rank_did_last():
    """Rank 2's dump is stale (rank 0 completed pp #2 with it, which the dump had not
    issued); its newer op with the dead rank 1 is not evidence: rank 0's is."""
    groups = {"tp[0,1]": [0, 1], "dp[1,2]": [1, 2], "pp[0,2]": [0, 2]}
    entries = {0: [_op("tp[0,1]", 1, 1.0, 7.0, where="by rank 0"),
                   _op("pp[0,2]", 1, 1.0, 2.0), _op("pp[0,2]", 2, 3.0, 4.0),
                   _op("tp[0,1]", 2, 8.0)],
               2: [_op("pp[0,2]", 1, 1.0, 2.0), _op("dp[1,2]", 1, 5.0, 9.0, where="stale")]}
    d = Diagnosis(_dumps(3, groups, entries, skip=(1,)))
    assert d.ranks[2].stale and not d.alive(2)
    e, by = d.last_seen(1)
    assert (by, e["where"]) == (0, "by rank 0")


def test_a_rank_waits_in_its_newest_pending_op():
    """Rank 0 has an older op still pending (issued asynchronously) and waits in a newer
    one: the newer one is where it is stuck, on the rank that never entered it."""
    groups = {"tp[0,1]": [0, 1], "dp[0,2]": [0, 2]}
    entries = {0: [_op("tp[0,1]", 1, 1.0), _op("dp[0,2]", 1, 2.0)],
               1: [_op("tp[0,1]", 1, 1.0)],
               2: []}
    d = Diagnosis(_dumps(3, groups, entries))
    assert d.ranks[0].current["group"] == "dp[0,2]"
    assert [r for r, _ in d.causes()] == [2]
