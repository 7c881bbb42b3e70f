"""``pretrain_gpt.py`` as a Megatron user runs it with ``--fp16``, ``--rampup-batch-size``
and ``--apply-layernorm-1p``: Megatron's log fields (loss scale, number of skipped
iterations, the ramp's global batch size), the metrics file, and a resume that keeps the
scaler state and the ramp; and every MLP activation, as ``--activation`` and as Megatron's
switch."""
import json
import math
import os
import subprocess
import sys

from megalite.config.activations import ACTIVATIONS

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


ACT_FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--mock-data", "--vocab-size", "64", "--lr", "1e-3",
             "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
             "--log-interval", "1", "--eval-iters", "0", "--device", "cpu", "--no-progress-bar"]


def _losses(tmp_path, tag, extra):
    metrics = tmp_path / f"{tag}.jsonl"
    p = subprocess.run([sys.executable, "pretrain_gpt.py", *ACT_FLAGS, "--metrics-file",
                        str(metrics), *extra], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(x)["lm_loss"] for x in metrics.read_text().splitlines()
            if "split" not in json.loads(x)]


def test_every_activation_trains_and_megatron_switches_spell_it(tmp_path):
    """Each registry entry with a Megatron switch (--swiglu, --squared-relu) trains through
    pretrain_gpt.py as Megatron's switch, and runs the very model --activation NAME builds
    (trained in this process: the same losses); the default, gelu, trains in every other
    e2e test.  Two switches at once are one line naming both, exit 2 (not the first switch
    winning)."""
    from cpu_trainer import build_cpu_trainer, train_steps  # (tests/ is on sys.path)

    losses = {}
    for name, a in ACTIVATIONS.items():
        if not a.flag:
            continue
        switch = "--" + a.flag.replace("_", "-")
        losses[name] = _losses(tmp_path, a.flag, [switch])
        assert len(losses[name]) == 2 and all(math.isfinite(x) for x in losses[name])
        named = train_steps(build_cpu_trainer(ACT_FLAGS + ["--activation", name], 1), 2)
        assert all(abs(x - y) <= 1e-6 * abs(y) for x, y in zip(named, losses[name])), name
    assert len({tuple(v) for v in losses.values()}) == len(losses)   # different models
    switches = ["--" + a.flag.replace("_", "-") for a in ACTIVATIONS.values() if a.flag]
    if len(switches) >= 2:
        p = subprocess.run([sys.executable, "pretrain_gpt.py", *ACT_FLAGS, *switches[::-1]],
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
        line = p.stderr.strip().splitlines()[-1]
        assert all(s in line for s in switches), line
