"""The elastic choices asserted directly, at cases with competing candidates (a bug every
layout shares passes the cross-layout tests): which snapshot a restart takes (the newest
iteration every old rank's state covers, strictly newer than the disk marker; a rank's own
file before a replica; readers sharing a folder take turns), that ``resume_source`` asks
for a snapshot newer than the marker's iteration, which holder sends each region of a
re-laid-out tensor, and the spare line of the fitted world."""
import types

import pytest

from megalite.cli.arguments import parse_args
from megalite.elastic import resume, snapshot_restore
from megalite.elastic.snapshot import file_name, parse_name
from megalite.elastic.snapshot_restore import SnapshotPlan, choose, intersect, transfer_plan


def _f(it, rank, kind, world=4, gen="aaaaaaaa"):
    return parse_name(file_name("0123456789", it, gen, rank, world, kind))


def test_snapshot_choice_prefers_the_newest_complete_iteration_over_older_complete_ones():
    a = [_f(it, r, "own") for it in (4, 6, 8) for r in (0, 1)]
    b = [_f(it, r, "own") for it in (4, 6) for r in (2, 3)] + [_f(8, 2, "own")]
    held = [("A", a), ("B", b)]
    assert choose(held, newer_than=-1).iteration == 6          # 8 lacks old rank 3
    assert choose(held + [("C", [_f(8, 3, "replica")])], newer_than=-1).iteration == 8
    assert choose(held, newer_than=5).iteration == 6           # strictly newer than disk
    assert choose(held, newer_than=6) is None
    assert choose(held, newer_than=3).iteration == 6


def test_a_ranks_own_file_is_read_before_its_replica_and_readers_take_turns():
    # node A (new ranks 0-2, one folder) holds old ranks 0-3's own files and old rank
    # 4-5's replicas; node B (new rank 3) holds old ranks 4-5 and replicas of 0-1
    a = [_f(5, r, "own", world=6) for r in range(4)] + \
        [_f(5, r, "replica", world=6) for r in (4, 5)]
    b = [_f(5, r, "own", world=6) for r in (4, 5)] + \
        [_f(5, r, "replica", world=6) for r in (0, 1)]
    plan = choose([("A", a), ("A", a), ("A", a), ("B", b)], newer_than=-1)
    assert (plan.iteration, plan.old_world, plan.from_replicas) == (5, 6, 0)
    readers = {old: new for old, new, _ in plan.assign}
    assert readers == {0: 0, 1: 1, 2: 2, 3: 0, 4: 3, 5: 3}       # A: old % 3
    names = {old: name for old, _, name in plan.assign}
    assert all(names[r].endswith(".own.pt") for r in range(6))
    # node B lost: old ranks 4 and 5 come from A's replicas
    lost = choose([("A", a), ("A", a), ("A", a)], newer_than=-1)
    assert lost.from_replicas == 2 and {o: n for o, n, _ in lost.assign}[5] == 2
    assert "(2 of 6 old ranks' shards from replicas)" in lost.describe()


def test_resume_asks_for_a_snapshot_newer_than_the_disk_marker(tmp_path, monkeypatch):
    save = tmp_path / "save"
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("40")
    asked = []
    plan = SnapshotPlan(41, "g", 2, ((0, 0, "x"), (1, 1, "y")), 0)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setattr(resume, "_snapshots_on", lambda cfg: True)
    monkeypatch.setattr(snapshot_restore, "find_snapshot",
                        lambda cfg, newer_than: asked.append(newer_than) or found)
    cfg = types.SimpleNamespace(checkpoint=types.SimpleNamespace(load="pre", save=str(save)),
                                parallel=types.SimpleNamespace(elastic=False))
    found = plan
    src = resume.resume_source(cfg)
    assert (src.kind, src.snapshot, src.own_run, asked) == ("snapshot", plan, True, [40])
    found = None                                  # none newer: the disk checkpoint
    assert resume.resume_source(cfg).path == str(save) and asked[-1] == 40
    cfg.checkpoint.save = str(tmp_path / "absent")
    assert resume.resume_source(cfg).path == "pre" and asked[-1] == -1
    (tmp_path / "bare").mkdir()                   # a folder without a marker: none either
    cfg.checkpoint.save = str(tmp_path / "bare")
    assert resume.resume_source(cfg).path == "pre" and asked[-1] == -1


def test_each_region_of_a_relaid_tensor_comes_from_one_holder():
    """A [4, 6] tensor written as two row halves; the new layout wants two column halves.
    Half 0 is held by ranks 0 and 2 (a DP copy), half 1 by rank 1."""
    top, bottom = ("w", (0, 0), (2, 6)), ("w", (2, 0), (2, 6))
    holders = {top: [0, 2], bottom: [1]}
    needs = [[("w", (0, 0), (4, 3))], [("w", (0, 3), (4, 3))], [("w", (0, 0), (4, 6))]]
    plan = transfer_plan(needs, holders, {top, bottom})
    assert sorted(plan) == sorted([
        (0, 0, 0, top, (0, 0), (2, 3)),       # rank 0 holds it: read locally
        (1, 0, 0, bottom, (2, 0), (2, 3)),
        (2, 1, 0, top, (0, 3), (2, 3)),       # rank 1 does not: holder 1 % 2 -> rank 2
        (1, 1, 0, bottom, (2, 3), (2, 3)),
        (2, 2, 0, top, (0, 0), (2, 6)),       # rank 2 holds the top half itself
        (1, 2, 0, bottom, (2, 0), (2, 6))])
    assert intersect((0, 0), (2, 6), (1, 4), (3, 3)) == ((1, 4), (1, 2))
    assert intersect((0, 0), (2, 6), (2, 0), (2, 6)) is None            # touching only


TWIN = ["--config", "launch/recipes/twins/gpt3-175b.yaml", "--pipeline-model-parallel-size",
        "1"]


def test_one_spare_rank_is_named_alone(capsys):
    cfg = parse_args([*TWIN, "--world-size", "5", "--elastic"])       # TP2: 5 does not fit
    assert (cfg.world_size, cfg.launched_world_size, cfg.num_micro_batches) == (4, 5, 4)
    assert capsys.readouterr().out.strip().endswith("and rank 4 waits as a spare")


@pytest.mark.parametrize("world,tp,fitted", [(7, 1, 6), (9, 1, 8), (7, 4, 4), (13, 4, 12)])
def test_the_fitted_world_is_the_largest_that_validates(world, tp, fitted):
    """7 -> 6 (24 / 6); 9 -> 8 (24 / 8), not 6; at TP4 the candidates step by 4 from the
    largest multiple below the world: 7 -> 4, 13 -> 12."""
    cfg = parse_args([*TWIN, "--world-size", str(world), "--elastic",
                      "--tensor-model-parallel-size", str(tp), "--global-batch-size", "24"])
    assert cfg.world_size == fitted


def test_a_spare_waits_until_rank_0_of_the_trainers_releases_it(monkeypatch, capsys):
    """The run-time half of the spares (tests/e2e/test_elastic_launch_e2e.py's misfit run,
    long tier): the handshake through the trainers' store, in one process."""
    import threading
    from datetime import timedelta

    import torch.distributed as torch_dist

    from megalite.elastic import relayout

    master = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                 timeout=timedelta(seconds=30))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(master.port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    done = []
    spare = threading.Thread(target=lambda: done.append(relayout.wait_as_spare(3, 2)),
                             daemon=True)      # a broken release must not hang pytest
    spare.start()
    cfg = types.SimpleNamespace(world_size=2, launched_world_size=3)
    key = f"megalite/attempt_2/{relayout.SPARES_RELEASED_KEY}"
    relayout.release_spares(cfg, rank=1)                    # only rank 0 releases
    relayout.release_spares(types.SimpleNamespace(world_size=3, launched_world_size=3), 0)
    spare.join(timeout=0.5)
    assert spare.is_alive() and not master.check([key])     # no spares: nothing released
    relayout.release_spares(cfg, rank=0)
    spare.join(timeout=30)
    assert done == [0] and master.check([key])
    assert "> rank 3: spare (the layout trains on ranks 0-1); waiting" in capsys.readouterr().out
