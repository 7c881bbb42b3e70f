"""One process, --overlap-grad-reduce: the start-up memory report (planner's step peak for
this layout + the peak of live tensor bytes measured by the tensor meter in the second step,
within 10%) reaches the log and the metrics file once, loss readers skip it;
the --pipeline-timeline trace holds the F/BW events and one "reduce k" per bucket, the first
launched before the last backward ended; and a parameter accumulating after its bucket was
launched is an error, not a silent wrong sum."""
import json

import pytest
import torch

from megalite.cli.arguments import parse_args
from megalite.parallel_state import ParallelState, RankGrid
from megalite.planner.layout import layout_from_config
from megalite.planner.step_peak import predict_step_peak
from megalite.training.loop import Trainer
from megalite.training.metrics import TrainingLogger

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--vocab-size", "100", "--mock-data", "--lr", "1e-3",
         "--train-iters", "3", "--eval-iters", "0", "--global-batch-size", "4",
         "--micro-batch-size", "2", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--overlap-grad-reduce", "--ddp-bucket-size", "3000", "--no-progress-bar"]


def _trainer(tmp_path, extra=(), metered=False):
    cfg = parse_args(["--world-size", "1", *FLAGS, "--metrics-file", str(tmp_path / "m.jsonl"),
                      "--pipeline-timeline", str(tmp_path / "t.json"), *extra])
    state = ParallelState.build(RankGrid(1), 0, create_groups=False)
    trainer = Trainer(cfg, state, "cpu")
    if metered:                            # as pretrain(): metered from before the build
        trainer.memory_reporter.start()
    trainer.setup()
    return trainer


def test_memory_report_and_bucket_timeline(tmp_path, capsys):
    trainer = _trainer(tmp_path, metered=True)
    logger = TrainingLogger(trainer.cfg, True, trainer.train_iters)
    trainer.train(logger)
    logger.close()
    recs = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    mem = [r for r in recs if r.get("split") == "memory"]
    assert len(mem) == 1 and mem[0]["iteration"] == 2 and mem[0]["measured_by"] == "tensor meter"
    want = predict_step_peak(trainer.cfg, 0)
    assert mem[0]["predicted_bytes"] == {**{k: int(want[k]) for k in
                                            ("weights", "grads", "optimizer", "activations",
                                             "transient", "total")},
                                         "peak_phase": want["peak_phase"]}
    n = sum(p.numel() for p in trainer.strategy.params)
    assert mem[0]["predicted_bytes"]["grads"] == 4 * n           # DP = 1, fp32 DDP
    peaks = mem[0]["step_peak_bytes"]
    assert set(peaks) == {"1", "2"} and mem[0]["measured_peak_bytes"] == peaks["2"]
    # the first step has no Adam state until its end: its peak is lower
    assert peaks["1"] < peaks["2"]
    ratio = peaks["2"] / want["total"]
    assert 0.9 <= ratio <= 1.1, ratio
    assert trainer.memory_reporter.meter is None                 # stopped after the report
    assert "> memory (rank 0): predicted peak (" in capsys.readouterr().out
    assert len([r for r in recs if "split" not in r]) == 3       # training lines unchanged
    from megalite.viz.loss_curve import plot_loss_curve     # noqa: F401 (readers skip it)
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    last = [e for e in events if e.get("ph") == "X" and e["args"].get("iteration") == 3]
    reduces = [e for e in last if e["name"].startswith("reduce")]
    bw_end = max(e["ts"] + e["dur"] for e in last if e["cat"] == "BW")
    assert len(reduces) == len(trainer.strategy.scheduler.buckets) > 2
    assert min(e["ts"] for e in reduces) < bw_end     # launched while backward still ran


def test_zero_stage_of_the_flags():
    base = ["--world-size", "2", *FLAGS[:FLAGS.index("--overlap-grad-reduce")]]
    assert layout_from_config(parse_args(base)).zero == 0
    assert layout_from_config(parse_args(base + ["--use-distributed-optimizer"])).zero == 1
    assert layout_from_config(parse_args(base + ["--use-distributed-optimizer",
                                                 "--overlap-grad-reduce"])).zero == 2
    assert layout_from_config(parse_args(base + ["--use-torch-fsdp2"])).zero == 3


def test_late_accumulation_is_an_error(tmp_path):
    trainer = _trainer(tmp_path)
    it = trainer.data_iterator(trainer.train_ds, 0)
    trainer.train_step(it)                      # learns one accumulation per micro-batch
    s = trainer.strategy
    s.zero_grad()
    p = s.params[-1]                             # in the first bucket launched
    for _ in range(trainer.cfg.num_micro_batches):
        (p.float().sum() * 0).backward()
    with pytest.raises(RuntimeError, match="after its bucket's reduction started"):
        (p.float().sum() * 0).backward()
    assert torch.isfinite(s.grad(p)).all()
