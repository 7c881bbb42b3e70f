"""Per-iteration overhead (issue 18, item 3): threads per process, gradients without a
zeroing pass, one-call norm and clip with the old numerics, metrics written per log line."""
import copy
import json

import pytest
import torch

from megalite.optimizer.lr_schedule import StepSettings
from megalite.cli.arguments import parse_args
from megalite.distributed.data_parallel import build_data_parallel
from megalite.parallel_state import ParallelState, RankGrid
from megalite.training import loop
from megalite.training.metrics import TrainingLogger


def _cfg(extra=()):
    return parse_args(["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
                       "--seq-length", "8", "--mock-data", "--vocab-size", "10", "--lr", "0.1",
                       "--train-iters", "1", *extra])


@pytest.mark.parametrize("local,world,expect", [("2", 4, 4), (None, 2, 4), ("8", 8, 1),
                                                ("1", 16, 8)])
def test_threads_are_usable_cores_over_local_processes(monkeypatch, local, world, expect):
    monkeypatch.setattr(loop.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    before = torch.get_num_threads()
    try:
        line = loop.set_cpu_threads(world)
        assert torch.get_num_threads() == expect
        assert line.startswith(f"> torch threads per process: {expect} (8 usable cores / ")
    finally:
        torch.set_num_threads(before)


def _grads(chunk):
    return [p.grad.clone() for p in chunk.parameters()]


def test_ddp_zero_grad_sets_none_and_matches_the_accumulating_reference():
    """fp32 DDP: grads are handed over (None after zero_grad); two micro-batches give the
    gradients of a plain torch loop that zeroes in place (bitwise from equal parameters), and
    the one-call norm, the clip and the fused AdamW update follow it within float rounding."""
    torch.manual_seed(0)
    chunk = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.GELU(), torch.nn.Linear(16, 3),
                                torch.nn.LayerNorm(3))
    ref = copy.deepcopy(chunk)
    s = build_data_parallel([chunk], _cfg(["--clip-grad", "0.05", "--weight-decay", "0"]),
                            ParallelState.build(RankGrid(1), 0, create_groups=False))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    for p in ref.parameters():
        p.grad = torch.zeros_like(p)
    for step in range(3):
        s.zero_grad()
        assert all(p.grad is None for p in chunk.parameters())
        for p in ref.parameters():
            p.grad.zero_()
        for mb in range(2):
            x = torch.randn(5, 4)
            chunk(x).pow(2).sum().backward()
            ref(x).pow(2).sum().backward()
        for a, b in zip(_grads(chunk), _grads(ref)):
            if step == 0:           # same parameters: handing over == adding into zeros
                assert torch.equal(a, b)
            else:                   # the norms' rounding moved the parameters by ulps
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        s.finish_grad_sync()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, foreach=False).item()
        got = s.step(StepSettings(1e-2))
        assert got == pytest.approx(want, rel=1e-6) and want > 0.05     # the clip acts
        for a, b in zip(_grads(chunk), _grads(ref)):     # clipped in place, one foreach
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        opt.step()
        for a, b in zip(chunk.parameters(), ref.parameters()):
            # AdamW amplifies ulp-level gradient differences where |g| is near eps
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _record(it):
    return {"iteration": it, "train_iters": 5, "consumed_samples": it, "lm_loss": 1.0 / it,
            "lr": 1e-3, "grad_norm": 0.5, "elapsed_ms": 1.0, "tokens_per_sec": 1.0,
            "tflops_per_device": 0.0, "mfu": 0.0, "peak_mem_bytes": 0}


def test_metrics_file_is_written_per_log_line_in_whole_records(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    cfg = _cfg(["--metrics-file", str(path), "--log-interval", "3", "--no-progress-bar"])
    logger = TrainingLogger(cfg, True, 5)
    lines = lambda: [json.loads(l)["iteration"] for l in path.read_text().splitlines()]
    logger.log_train(_record(1))        # iteration 1 always prints: flushed
    assert lines() == [1]
    logger.log_train(_record(2))        # held
    assert lines() == [1]
    logger.log_train(_record(3))        # a log line: 2 and 3 written together
    assert lines() == [1, 2, 3]
    logger.log_train(_record(4))
    logger.log_eval(4, 2.0)             # evaluations flush what is held
    assert lines() == [1, 2, 3, 4, 4]
    logger.log_train(_record(5))
    logger.close()                      # and so does the end of the run
    assert lines() == [1, 2, 3, 4, 4, 5]
    assert path.read_text().endswith("\n")
