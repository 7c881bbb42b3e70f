"""A Hugging Face Qwen2-MoE checkpoint as a user brings it: ``convert.py`` (a subprocess) to
megalite at TP1 and at TP2 x PP2 (uneven), ``pretrain_moe.py --use-checkpoint-args --skip-train``
evaluates it at TP1, TP2 (+SP) and EP2 and gets ``transformers``' loss on the same samples
(rel <= 1e-5); ``convert.py`` back to Hugging Face, ``transformers`` gives the original
logits.  The tiny model has a dense layer between two MoE layers, the un-normalized top-k
and the gated shared expert."""
import json
import os
import subprocess
import sys

import pytest
import torch

from qwen_moe_fixture import IDS, SEQ, hf_loss, hf_qwen_moe, rel  # noqa: E402 (tests/ on path)

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
CONVERT = os.path.join(ROOT, "tools", "checkpoint", "convert.py")
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
GBS = 4


def _run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, f"{cmd}\nSTDOUT:\n{p.stdout[-3000:]}\nSTDERR:\n{p.stderr[-3000:]}"
    return p.stdout


def _convert(src, dst, *flags, to="megalite"):
    source = "hf" if to == "megalite" else "megalite"
    return _run([PY, CONVERT, "--source-format", source, "--target-format", to,
                 "--load-dir", src, "--save-dir", dst, *flags])


def _eval_loss(tmp_path, ckpt, name, launcher, *layout):
    metrics = tmp_path / f"{name}.jsonl"
    out = _run([*launcher, "pretrain_moe.py", "--load", ckpt, "--use-checkpoint-args",
                "--skip-train", "--mock-data", "--seq-length", str(SEQ), "--micro-batch-size",
                "2", "--global-batch-size", str(GBS), "--eval-iters", "1", "--lr", "1e-3",
                "--device", "cpu", "--metrics-file", str(metrics), *layout])
    assert "model flags from the checkpoint" in out
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r for r in rows if r.get("split") == "valid"][-1]["lm_loss"]


def test_qwen2_moe_converts_evaluates_at_tp_ep_and_exports(tmp_path):
    src = str(tmp_path / "hf")
    ref = hf_qwen_moe(src, "qwen2_moe")
    expected = hf_loss(ref, GBS)
    tp1, tp2pp2 = str(tmp_path / "tp1"), str(tmp_path / "tp2pp2")
    _convert(src, tp1)
    _convert(src, tp2pp2, "--target-tensor-parallel-size", "2",
             "--target-pipeline-model-parallel-size", "2",
             "--target-decoder-first-pipeline-num-layers", "1")
    losses = {
        "tp1": _eval_loss(tmp_path, tp1, "tp1", [PY]),
        "tp2": _eval_loss(tmp_path, tp2pp2, "tp2", TORCHRUN, "--tensor-model-parallel-size",
                          "2", "--sequence-parallel"),
        "ep2": _eval_loss(tmp_path, tp1, "ep2", TORCHRUN, "--expert-model-parallel-size", "2"),
    }
    for name, loss in losses.items():
        assert abs(loss - expected) <= 1e-5 * expected, (name, loss, expected)
    out = str(tmp_path / "out")
    assert "Qwen2MoeForCausalLM" in _convert(tp2pp2, out, to="hf")
    again = transformers.Qwen2MoeForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert rel(again(IDS).logits, ref(IDS).logits) <= 1e-6
