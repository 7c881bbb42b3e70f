"""``pretrain_gpt.py`` as a Megatron user runs it with ``--fp16``, ``--rampup-batch-size``
and ``--apply-layernorm-1p``: Megatron's log fields (loss scale, number of skipped
iterations, the ramp's global batch size), the metrics file, and a resume that keeps the
scaler state and the ramp."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--mock-data", "--vocab-size", "64", "--lr", "1e-3",
         "--lr-warmup-samples", "4", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--rampup-batch-size", "2", "2", "4", "--fp16", "--initial-loss-scale",
         str(2.0 ** 22), "--loss-scale-window", "2", "--apply-layernorm-1p",
         "--log-interval", "1", "--eval-iters", "0", "--device", "cpu", "--no-progress-bar"]


def _train(tmp_path, samples, extra=()):
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "pretrain_gpt.py", *FLAGS, "--train-samples", str(samples),
           "--metrics-file", str(metrics), "--save", str(tmp_path / "ckpt"), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [json.loads(x) for x in metrics.read_text().splitlines()]
    return p.stdout, [r for r in recs if "split" not in r]


def test_fp16_ramp_layernorm1p_log_metrics_and_resume(tmp_path):
    out, recs = _train(tmp_path, 24)
    # ramp 2 -> 4 by 2 over 4 samples: 2, 2, 4 (consumed 8 > 4), then 4 x 4 (24 samples)
    assert [r["global_batch_size"] for r in recs] == [2, 2, 4, 4, 4, 4, 4]
    assert [r["consumed_samples"] for r in recs] == [2, 4, 8, 12, 16, 20, 24]
    skipped = [r["skipped_iter"] for r in recs]
    assert skipped[0] == 1 and 0 in skipped, skipped
    for r in recs:
        assert (r["grad_norm"] is None) == bool(r["skipped_iter"])
    assert recs[0]["loss_scale"] == 2.0 ** 22 and recs[1]["loss_scale"] <= 2.0 ** 21
    assert "global batch size:     2" in out and "global batch size:     4" in out
    assert f"loss scale: {recs[0]['loss_scale']:.1f} | number of skipped iterations:   1" in out
    assert "--apply-layernorm-1p" not in out     # a working flag: not in the no-effect list
    out2, recs2 = _train(tmp_path, 32, ["--load", str(tmp_path / "ckpt"),   # a longer run:
                                        "--override-opt_param-scheduler"])  # its schedule
    assert f"(iteration {len(recs)})" in out2
    assert [r["iteration"] for r in recs2] == list(range(1, len(recs) + 3))
    resumed = recs2[len(recs):]
    assert [r["global_batch_size"] for r in resumed] == [4, 4]
    assert resumed[0]["consumed_samples"] == 28
    (tmp_path / "straight").mkdir()
    _, straight = _train(tmp_path / "straight", 32)    # the same run, uninterrupted
    assert len(straight) == len(recs2)
    for a, b in zip(straight[len(recs):], resumed):
        assert (a["loss_scale"], a["skipped_iter"], a["lr"], a["global_batch_size"]) == \
            (b["loss_scale"], b["skipped_iter"], b["lr"], b["global_batch_size"])
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-5 * a["lm_loss"]
