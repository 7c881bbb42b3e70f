"""``pretrain_gpt.py --step-batch-size-schedule`` as a Megatron user runs it: the global batch
steps up at the threshold (tokens, K/M/B/T suffixes), the metrics file and the log show
each iteration's batch, the lr schedule counts samples as Megatron's does (``--train-iters``:
decay over iterations x the last batch; ``--train-samples``: Megatron's iteration count), and
a resume keeps the schedule."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--mock-data", "--vocab-size", "64", "--lr", "1e-3",
         "--min-lr", "0", "--lr-decay-style", "linear", "--micro-batch-size", "2",
         # 2 samples until 0.064K = 64 tokens = 4 samples are consumed, then 4
         "--step-batch-size-schedule", "0:2", "0.064K:4",
         "--log-interval", "1", "--eval-iters", "0", "--device", "cpu", "--no-progress-bar"]


def _train(tmp_path, extra):
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "pretrain_gpt.py", *FLAGS, "--metrics-file", str(metrics), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [json.loads(x) for x in metrics.read_text().splitlines()]
    return p.stdout, [r for r in recs if "split" not in r]


def test_batch_steps_up_at_the_threshold_and_lr_counts_samples(tmp_path):
    out, recs = _train(tmp_path, ["--train-iters", "5", "--save", str(tmp_path / "ckpt"),
                                  "--save-interval", "3"])
    assert [r["global_batch_size"] for r in recs] == [2, 2, 4, 4, 4]
    assert [r["consumed_samples"] for r in recs] == [2, 4, 8, 12, 16]
    # Megatron: decay over --train-iters x the last batch (5 x 4 = 20 samples); iteration i
    # uses the lr at the samples consumed before it (0, 2, 4, 8, 12)
    assert [r["lr"] for r in recs] == pytest.approx([1e-3 * (1 - c / 20)
                                                     for c in (0, 2, 4, 8, 12)], rel=1e-6)
    assert "global batch size:     2" in out and "global batch size:     4" in out
    # resumed at iteration 3: the schedule, the batch and the lr go on as before
    _, again = _train(tmp_path, ["--train-iters", "5", "--load", str(tmp_path / "ckpt")])
    tail = [r for r in again if r["iteration"] > 3]
    assert [(r["global_batch_size"], r["consumed_samples"]) for r in tail] == [(4, 12), (4, 16)]
    for a, b in zip(recs[3:], tail):
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-9)
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-5 * a["lm_loss"]


def test_train_samples_counts_iterations_as_megatron(tmp_path):
    # 2, 2, 4 (consumed 8 < 9), 4 -> 12 >= 9: four iterations, the last ending past 9
    _, recs = _train(tmp_path, ["--train-samples", "9"])
    assert [r["global_batch_size"] for r in recs] == [2, 2, 4, 4]
