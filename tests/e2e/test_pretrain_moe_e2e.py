"""pretrain_moe.py as a user runs it: torchrun, 2 processes at EP=2 with the MoE defaults;
per-layer aux loss, z-loss, tokens per expert and max/mean load in the console and the
metrics file; the loss plot; the expert bias in the checkpoint; then a resume from that checkpoint at EP=1 (the expert
chunks re-laid out)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--mock-data", "--vocab-size", "100", "--swiglu",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3",
         "--lr-warmup-iters", "1", "--moe-z-loss-coeff", "1e-3", "--log-interval", "1",
         "--moe-router-enable-expert-bias",
         "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, f"{cmd}\nSTDOUT:\n{p.stdout[-3000:]}\nSTDERR:\n{p.stderr[-3000:]}"
    return p.stdout


def test_pretrain_moe_ep2_logs_expert_loads_and_resumes_at_ep1(tmp_path):
    metrics, ckpt = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = _run([*torchrun, "pretrain_moe.py", *FLAGS, "--expert-model-parallel-size", "2",
                "--train-iters", "4", "--save", str(ckpt), "--metrics-file", str(metrics),
                "--loss-plot", str(tmp_path / "loss.png")])
    assert "iteration        4/       4" in out and "moe aux loss" in out
    assert "moe load max/mean" in out
    train = [r for r in map(json.loads, metrics.read_text().splitlines())
             if "split" not in r]                        # training lines (not the memory report)
    assert [r["iteration"] for r in train] == [1, 2, 3, 4]
    for r in train:
        for n in (0, 1):   # 8 experts (the MoE default), top-2: every pair counted once
            counts = r[f"moe_layer_{n}_tokens_per_expert"]
            assert len(counts) == 8 and sum(counts) == 4 * 32 * 2
            assert r[f"moe_layer_{n}_load_balance"] == max(counts) / (sum(counts) / 8)
            assert r[f"moe_layer_{n}_aux_loss"] > 0 and r[f"moe_layer_{n}_z_loss"] > 0
        assert abs(r["moe_aux_loss"] - r["moe_layer_0_aux_loss"] - r["moe_layer_1_aux_loss"]) \
            <= 1e-6 * r["moe_aux_loss"]
    assert (tmp_path / "loss.png").stat().st_size > 1000
    out = _run([PY, "pretrain_moe.py", *FLAGS, "--train-iters", "6", "--load", str(ckpt),
                "--override-opt_param-scheduler",      # a longer run: its own lr schedule
                "--metrics-file", str(tmp_path / "resumed.jsonl")])
    resumed = [r for r in map(json.loads, (tmp_path / "resumed.jsonl").read_text().splitlines())
               if "split" not in r]
    assert [r["iteration"] for r in resumed] == [5, 6]
    assert abs(resumed[0]["lm_loss"] - train[-1]["lm_loss"]) < 0.5
    meta = json.loads((ckpt / "iter_0000004" / "metadata.json").read_text())
    bias = meta["extra"]["moe_expert_bias"]          # the expert bias is kept and moved
    assert sorted(bias) == ["0", "1"] and any(b != 0 for b in bias["0"])
