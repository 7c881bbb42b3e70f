"""Elastic pieces that need no cluster: the re-layout rule (megalite/cli/elastic_fit.py),
where a restart takes its state from (resume.py), the launcher's exit status and
rendezvous defaults (launch.py), and the goodput model (planner/goodput.py)."""
import math
import types

import pytest

from megalite.cli.arguments import parse_args
from megalite.config import ConfigError
from megalite.elastic import launch, relayout, resume
from megalite.planner import goodput

TWIN = ["--config", "launch/recipes/twins/gpt3-175b.yaml", "--pipeline-model-parallel-size",
        "1"]


def _cfg(world, *flags):
    return parse_args([*TWIN, "--world-size", str(world), *flags])


def test_world_that_fits_keeps_the_layout_and_dp_follows_the_world(capsys):
    cfg = _cfg(4, "--elastic")
    assert (cfg.world_size, cfg.data_parallel_size, cfg.num_micro_batches) == (4, 2, 4)
    assert "elastic start: world 4: TP2 CP1 PP1 DP2, 4 micro-batches of 1 per DP rank, " \
           "global batch 8" in capsys.readouterr().out
    cfg = _cfg(2, "--elastic")
    assert (cfg.data_parallel_size, cfg.num_micro_batches, cfg.training.global_batch_size) == \
        (1, 8, 8)


def test_world_that_does_not_fit_trains_its_largest_fitting_part(capsys):
    cfg = _cfg(6, "--elastic")          # DP3 does not divide the global batch of 8
    assert (cfg.world_size, cfg.launched_world_size, cfg.data_parallel_size) == (4, 6, 2)
    line = capsys.readouterr().out.strip()
    assert line.startswith("> elastic: world 6 does not fit the layout (--global-batch-size "
                           "(8) is not divisible"), line
    assert line.endswith("the largest world that does, 4, trains (TP2 CP1 PP1 DP2, 4 "
                         "micro-batches of 1 per DP rank, global batch 8) and ranks 4-5 wait "
                         "as spares"), line
    assert _cfg(3, "--elastic", "--tensor-model-parallel-size", "1").world_size == 2


def test_without_elastic_a_misfit_world_is_the_usual_error():
    with pytest.raises(ConfigError, match="not divisible by --micro-batch-size"):
        _cfg(6)


def test_no_world_fits_is_one_line_naming_the_minimum():
    with pytest.raises(ConfigError, match=r"world size 1 is not divisible .*--elastic: no "
                       r"smaller world fits this layout either; raise the minimum number of "
                       r"nodes"):
        _cfg(1, "--elastic")


def test_elastic_needs_an_explicit_global_batch():
    with pytest.raises(ConfigError, match="--elastic needs --global-batch-size"):
        parse_args(["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
                    "--seq-length", "8", "--vocab-size", "16", "--mock-data", "--elastic",
                    "--train-iters", "1"])


def _ckpt(c, load=None, save=None, elastic=False):
    return types.SimpleNamespace(checkpoint=types.SimpleNamespace(load=load, save=save,
                                                                  snapshot_interval=0),
                                 parallel=types.SimpleNamespace(elastic=elastic))


def test_resume_source_is_the_runs_own_newest_checkpoint_on_a_relaunch(tmp_path, monkeypatch):
    save = tmp_path / "save"
    for var in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    cfg = _ckpt(None, load="pretrained", save=str(save))
    assert resume.resume_source(cfg) == resume.ResumeSource("disk", "pretrained", False, "--load")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resume.resume_source(cfg).path == "pretrained"      # --save holds nothing yet
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("4")
    src = resume.resume_source(cfg)
    assert (src.path, src.own_run, src.reason) == (str(save), True, "torchrun restart 1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert resume.resume_source(cfg).reason == "SLURM requeue 2"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert resume.resume_source(cfg).path == "pretrained"
    assert resume.resume_source(_ckpt(None, save=str(save), elastic=True)).own_run
    assert resume.resume_source(_ckpt(None, save=str(save))) is None


def test_launcher_status_and_rendezvous_defaults():
    assert launch.exit_status(3) == 3 and launch.exit_status(-9) == 137
    conf = dict(kv.split("=") for kv in launch.merge_rdzv_conf("join_timeout=60").split(","))
    assert conf["join_timeout"] == "60" and conf["last_call_timeout"] == "2"
    assert int(conf["keep_alive_interval"]) * int(conf["keep_alive_max_attempt"]) <= 5
    f = types.SimpleNamespace
    failures = {0: f(timestamp=10, exitcode=-15), 1: f(timestamp=10, exitcode=1),
                2: f(timestamp=10, exitcode=3), 3: f(timestamp=11, exitcode=2)}
    assert launch.root_cause(failures)[0] == 2       # same second: the specific status
    assert launch.root_cause({0: f(timestamp=10, exitcode=-15),
                              1: f(timestamp=10, exitcode=1)})[0] == 1


def _inputs(**kw):
    base = dict(num_gpus=1000, failures_per_gpu_hour=1e-4, step_s=10.0,
                state_bytes_per_gpu=1e9, checkpoint_bytes=1e12, save_interval=None,
                save_stall_s=20.0, disk_load_s=10.0, snapshot_interval=1, snapshot_cost_s=0.1,
                peer_load_s=1.0, restart_s=30.0, miss_fraction=0.0)
    base.update(kw)
    return goodput.Inputs(**base)


def test_goodput_disk_policy_is_youngs_first_order_model():
    inp = _inputs()
    assert inp.mtbf_s == pytest.approx(36000.0)
    disk = goodput.disk_policy(inp)
    tau = round(math.sqrt(2 * 20.0 * 36000.0) / 10.0) * 10.0       # 1200 s: 120 iterations
    assert (disk.interval_iters, disk.interval_s) == (120, tau)
    per_failure = 30.0 + 10.0 + (tau + 20.0) / 2
    assert disk.useful == pytest.approx((1 - per_failure / 36000.0) * tau / (tau + 20.0))
    fixed = goodput.disk_policy(_inputs(save_interval=500))
    assert fixed.useful < disk.useful                 # Young's interval is the optimum


def test_goodput_snapshots_lose_half_an_iteration_per_failure():
    inp = _inputs()
    snap = goodput.snapshot_policy(inp)
    per_failure = 30.0 + 1.0 + (10.0 + 0.1) / 2
    assert snap.useful == pytest.approx((1 - per_failure / 36000.0) * 10.0 / 10.1)
    assert snap.lost_s == pytest.approx(5.05)
    missed = goodput.snapshot_policy(_inputs(miss_fraction=0.5))
    assert missed.useful < snap.useful and "disk every" in missed.name


def test_goodput_cli_defaults_to_llama3_and_rejects_bad_numbers(capsys):
    from megalite.cli.main import main

    assert main(["plan", "--goodput", "--step-time", "8", "--save-interval", "500"]) == 0
    out = capsys.readouterr().out
    assert "goodput at 16,384 GPUs: one interruption every 3.09 h (419 interruptions in 54 " \
           "days on 16,384 GPUs: Llama 3)" in out
    assert "disk checkpoints only, --save-interval 500" in out and "peer snapshots every 1 it" \
        in out
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--goodput", "--restart-time", "-1"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == "megalite: error: --restart-time must be >= 0"


def test_snapshot_choice_is_the_newest_complete_set_newer_than_disk():
    from megalite.elastic.snapshot import buddies, file_name, parse_name
    from megalite.elastic.snapshot_restore import choose

    def f(it, rank, kind, gen="aaaaaaaa", world=4):
        return parse_name(file_name("0123456789", it, gen, rank, world, kind))

    # node A (new ranks 0, 1 share a folder) survived; node B is gone.  Iteration 7 is
    # incomplete (old rank 3's replica never arrived): iteration 6 is the newest complete.
    node_a = [f(6, 0, "own"), f(6, 1, "own"), f(6, 2, "replica"), f(6, 3, "replica"),
              f(7, 0, "own"), f(7, 1, "own"), f(7, 2, "replica"),
              f(7, 3, "own", gen="bbbbbbbb")]      # another generation's never mixes in
    held = [("A", node_a), ("A", node_a), ("C", [])]
    plan = choose(held, newer_than=-1)
    assert (plan.iteration, plan.old_world, plan.from_replicas) == (6, 4, 2)
    assert [(old, reader) for old, reader, _ in plan.assign] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    assert choose(held, newer_than=6) is None          # the disk checkpoint is as new
    assert "(2 of 4 old ranks' shards from replicas)" in plan.describe()
    # buddies: the same local index on the next node; one node: none
    ident = ["n1", "n1", "n2", "n2", "n3", "n3"]
    assert [buddies(ident, r) for r in range(6)] == [(2, [4]), (3, [5]), (4, [0]), (5, [1]),
                                                     (0, [2]), (1, [3])]
    assert buddies(["n1", "n1"], 0) == (None, [])
    # uneven nodes (a world cut to its largest fitting part): every state still has one
    # copy on another node; some ranks keep two replicas, some none
    uneven = ["n1", "n1", "n1", "n2", "n2", "n2", "n3", "n3"]
    pairs = [buddies(uneven, r) for r in range(8)]
    assert [b for b, _ in pairs] == [3, 4, 5, 6, 7, 6, 0, 1]
    assert all(uneven[b] != uneven[r] for r, (b, _) in enumerate(pairs))
    assert sorted(s for _, srcs in pairs for s in srcs) == list(range(8))
    assert pairs[6][1] == [3, 5] and pairs[2][1] == []
