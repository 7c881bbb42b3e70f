"""--check-collectives in one process: each rank's program comes from its real training step
on meta tensors; the check compares groups, pairs pipeline messages and simulates progress.
Small worlds here (the 64-rank and 16,384-rank checks are benchmarks/collective_check_scale.py)."""
import pytest

from megalite.cli.arguments import parse_args
from megalite.diagnostics.collective_check import check_collectives, report_text
from megalite.diagnostics.collective_check.check import Checker, by_pipeline_rank, every_rank
from megalite.diagnostics.collective_check.trace import Op, trace_rank
from megalite.parallel_state import RankGrid
from megalite.training.loop import Trainer

TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--mock-data", "--vocab-size", "100", "--lr", "1e-3",
        "--micro-batch-size", "1", "--train-iters", "10", "--attention-dropout", "0",
        "--hidden-dropout", "0"]


def _cfg(world, *flags):
    return parse_args(["--world-size", str(world), *TINY, *flags])


def test_every_rank_and_representatives_agree_on_a_tp_pp_vpp_cp_dp_layout(monkeypatch):
    """16 ranks; the test hook makes rank 5 drop a sequence-parallel all-gather, so the
    representatives (rank 5 singled out) must find what tracing every rank finds."""
    cfg = _cfg(16, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
               "--num-layers-per-virtual-pipeline-stage", "1", "--context-parallel-size", "2",
               "--sequence-parallel", "--use-distributed-optimizer", "--global-batch-size", "4")
    kinds = {op.kind for op in trace_rank(cfg, Trainer, 5)}
    assert {"tp", "cp", "pp", "dp-cp"} <= kinds, kinds
    monkeypatch.setenv("MEGALITE_FAULT_INJECT",
                       "skip:rank=5,iteration=1,group=tp,op=all_gather,nth=3")
    full = check_collectives(cfg, Trainer, mode="every-rank")
    reps = check_collectives(cfg, Trainer, mode="representatives")
    assert full.verdict.ranks_traced == 16 and reps.verdict.ranks_traced == 5
    assert full.verdict.problems and full.verdict.problems == reps.verdict.problems, \
        (full.verdict.problems, reps.verdict.problems)
    first = full.verdict.problems[0]
    assert first.startswith("tp[4,5] op #7: rank 4 issues all_gather [4x1x32 float32] at "
                            "iteration 1, forward-backward, F mb 1, layer 0 attention; rank 5 "
                            "issues reduce_scatter"), first
    assert full.verdict.classes_hold is True, full.verdict.notes    # the hooked rank aside
    assert "(rank 5 left out: the test hook changes them)" in report_text(full, 16)


def test_moe_expert_parallel_layout_checks_out():
    cfg = _cfg(4, "--num-experts", "4", "--moe-router-topk", "2",
               "--expert-model-parallel-size", "2", "--global-batch-size", "4")
    run = check_collectives(cfg, Trainer)
    assert run.verdict.ok, run.verdict.problems
    ops = trace_rank(cfg, Trainer, 1)
    assert any(op.kind == "ep" and op.op == "all_to_all" for op in ops), \
        sorted({(op.kind, op.op) for op in ops})


def test_a_skipped_tp_collective_is_a_mismatch_naming_both_call_sites(monkeypatch):
    monkeypatch.setenv("MEGALITE_FAULT_INJECT",
                       "skip:rank=1,iteration=2,group=tp,op=all_reduce,nth=1")
    cfg = _cfg(2, "--tensor-model-parallel-size", "2", "--global-batch-size", "1")
    run = check_collectives(cfg, Trainer)
    assert not run.verdict.ok and run.iteration == 2
    (problem,) = run.verdict.problems
    assert problem.startswith("tp[0,1] op #1: rank 0 issues all_reduce"), problem
    assert problem.count("at iteration 2, forward-backward, F mb 0") == 2, problem


def _op(kind, group, seq):
    return Op(kind, group, "all_reduce", seq, ((4,),), "float32", f"{kind} #{seq}")


def test_simulation_finds_a_cross_group_deadlock():
    """Every group agrees op for op, but the four ranks wait on each other in a ring:
    0 in tp for 1, 1 in dp for 3, 3 in tp for 2, 2 in dp for 0."""
    grid = RankGrid(4, tp=2)                    # tp [0,1] [2,3]; dp [0,2] [1,3]
    tp01, tp23, dp02, dp13 = (0, 1), (2, 3), (0, 2), (1, 3)
    progs = {0: [_op("tp", tp01, 1), _op("dp", dp02, 1)],
             1: [_op("dp", dp13, 1), _op("tp", tp01, 1)],
             2: [_op("dp", dp02, 1), _op("tp", tp23, 1)],
             3: [_op("tp", tp23, 1), _op("dp", dp13, 1)]}
    verdict = Checker(grid, every_rank(4), progs).run()
    assert len(verdict.problems) == 1 and verdict.problems[0].startswith(
        "the programs deadlock: rank 0 waits in all_reduce [4 float32] at tp #1"), verdict.problems


@pytest.mark.parametrize("world,pp", [(8, 2), (16, 4)])
def test_pipeline_rank_classes(world, pp):
    grid = RankGrid(world, tp=2, pp=pp)
    classes = by_pipeline_rank(grid, singled_out={3})
    assert classes.of[3] == ("rank", 3) and classes.reps[("rank", 3)] == [3]
    stage = world // pp
    assert classes.reps[0] == [0, stage - 1] or 3 < stage
    assert {classes.of[r] for r in range(world) if r != 3} == set(range(pp))


def test_megalite_plan_checks_its_best_layout(capsys):
    from megalite.commands.plan import plan

    assert plan(["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                 "--vocab-size", "1000", "--seq-length", "64", "--num-gpus", "8",
                 "--global-batch-size", "16", "--top", "1", "--check-collectives"]) == 0
    out = capsys.readouterr().out
    assert "best layout as pretrain_gpt.py flags:" in out and "OK for all 8 ranks" in out, out


def test_check_collectives_needs_dry_run(capsys):
    from megalite.training.entry import main

    with pytest.raises(SystemExit) as exc:
        main(["--check-collectives", *TINY, "--global-batch-size", "1"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == "megalite: error: --check-collectives needs --dry-run"


def test_meta_values_reuses_a_write_only_when_it_leaves_the_layout():
    """An out= or in-place op on meta arguments is run once per argument key and later
    calls return the written argument; one that changes its argument's layout (t_) runs
    every time."""
    import torch

    from megalite.diagnostics.collective_check.meta_values import MetaValues

    with MetaValues():
        a, b = torch.empty(2, 3, device="meta"), torch.empty(1, 3, device="meta")
        out = torch.empty(2, 3, device="meta")
        for _ in range(2):
            assert torch.mul(a, b, out=out) is out and out.add_(b) is out
        with pytest.raises(RuntimeError):           # the cached key still checks shapes
            torch.mul(a, torch.empty(4, 3, device="meta"), out=out)
        x = torch.empty(2, 3, device="meta")
        for shape in ((3, 2), (2, 3), (3, 2)):
            assert x.t_() is x and tuple(x.shape) == shape
