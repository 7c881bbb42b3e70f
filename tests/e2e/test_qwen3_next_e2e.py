"""Qwen3-Next (Gated DeltaNet hybrid) as a user meets it: tools/checkpoint/convert.py imports
a Qwen3NextForCausalLM folder, ``pretrain_gpt.py --use-checkpoint-args --skip-train`` gives
transformers' loss on the same tokens (rel <= 1e-5), and the model's flags as docs/models.md
writes them train with ``--reset-attention-mask`` (packed documents); the CPU twin of the
qwen3-next-80b-a3b recipe through launch/run_local.sh (long tier) gives the single process's
losses.  (tests/distributed/test_hf_families_dist.py holds it to transformers at TP2, PP2 and
EP2.)"""
import json
import os
import subprocess
import sys

import numpy as np
import torch
import yaml

from hf_families import VOCAB, hf_loss, save_hf_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
CONVERT = os.path.join(ROOT, "tools", "checkpoint", "convert.py")
TWIN = "launch/recipes/twins/qwen3-next-80b-a3b.yaml"
SEQ, WINDOWS = 80, 4
# docs/models.md, "Qwen3-Next": the switches of the hybrid
FLAGS = ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "4",
         "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
         "--linear-key-head-dim", "8", "--linear-value-head-dim", "8",
         "--attention-output-gate", "--qk-layernorm", "--apply-layernorm-1p",
         "--rotary-percent", "0.25"]


def _run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, **kw)
    assert p.returncode == 0, f"{cmd}\nSTDOUT:\n{p.stdout[-3000:]}\nSTDERR:\n{p.stderr[-3000:]}"
    return p.stdout


def _rows(path):
    return [json.loads(line) for line in open(path)]


def test_qwen3_next_converts_evaluates_as_transformers_and_trains_packed(tmp_path):
    from megalite.data.indexed_dataset import write_documents

    ref = save_hf_model("qwen3_next", str(tmp_path / "hf"))
    tokens = np.random.default_rng(7).integers(0, VOCAB, size=WINDOWS * SEQ + 1)
    data = write_documents(str(tmp_path / "data"), [tokens.tolist()], np.int32)
    windows = torch.from_numpy(np.stack([tokens[i * SEQ:(i + 1) * SEQ + 1]
                                         for i in range(WINDOWS)])).long()
    ckpt = str(tmp_path / "mg")
    _run([PY, CONVERT, "--source-format", "hf", "--target-format", "megalite",
          "--load-dir", str(tmp_path / "hf"), "--save-dir", ckpt])
    metrics = str(tmp_path / "eval.jsonl")
    _run([PY, "pretrain_gpt.py", "--use-checkpoint-args", "--skip-train", "--load", ckpt,
          "--data-path", data, "--split", "0,100,0", "--seq-length", str(SEQ),
          "--micro-batch-size", "2", "--global-batch-size", "2", "--eval-iters", "2",
          "--train-iters", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size",
          str(VOCAB), "--lr", "1e-4", "--device", "cpu", "--metrics-file", metrics])
    loss = [r for r in _rows(metrics) if r.get("split") == "valid"][-1]["lm_loss"]
    expected = hf_loss(ref, windows)
    print(f"qwen3_next pretrain_gpt.py eval: loss {loss:.7f}, transformers {expected:.7f}")
    assert abs(loss - expected) <= 1e-5 * expected

    # packed documents: NullTokenizer's EOD (vocab - 1) ends each, the DeltaNet state restarts
    docs = [list(np.random.default_rng(i).integers(0, VOCAB - 1, size=n)) + [VOCAB - 1]
            for i, n in enumerate((30, 50, 70, 90, 40))]
    packed = write_documents(str(tmp_path / "packed"), docs, np.int32)
    train = str(tmp_path / "train.jsonl")
    _run([PY, "pretrain_gpt.py", "--num-layers", "4", "--hidden-size", "32",
          "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
          "--kv-channels", "16", "--seq-length", str(SEQ), "--normalization", "RMSNorm",
          "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope", *FLAGS,
          "--data-path", packed, "--split", "100,0,0", "--tokenizer-type", "NullTokenizer",
          "--vocab-size", str(VOCAB), "--reset-attention-mask", "--reset-position-ids",
          "--eod-mask-loss", "--micro-batch-size", "2", "--global-batch-size", "2",
          "--train-iters", "3", "--eval-iters", "0", "--lr", "3e-3", "--device", "cpu",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--metrics-file", train])
    losses = [r["lm_loss"] for r in _rows(train) if "split" not in r]
    assert len(losses) == 3 and all(np.isfinite(losses)), losses


def test_qwen3_next_twin_with_run_local_matches_one_process(tmp_path):
    env = dict(os.environ, MEGALITE_PYTHON=PY)
    short = ["--train-iters", "3", "--global-batch-size", "4"]
    out = _run(["bash", "launch/run_local.sh", TWIN, *short,
                "--metrics-file", str(tmp_path / "twin.jsonl")], env=env)
    assert "[run_local] 4 process(es)" in out
    one = yaml.safe_load(open(os.path.join(ROOT, TWIN)))
    one.pop("parallel")
    (tmp_path / "one.yaml").write_text(yaml.safe_dump(one))
    _run([PY, "pretrain_gpt.py", "--config", str(tmp_path / "one.yaml"), "--world-size", "1",
          *short, "--metrics-file", str(tmp_path / "one.jsonl")])
    twin = [r["lm_loss"] for r in _rows(tmp_path / "twin.jsonl") if "split" not in r]
    ref = [r["lm_loss"] for r in _rows(tmp_path / "one.jsonl") if "split" not in r]
    print(f"qwen3-next twin: {twin}, one process: {ref}")
    assert len(twin) == len(ref) == 3
    assert abs(twin[0] - ref[0]) <= 1e-5 * ref[0]
    assert all(abs(a - b) <= 1e-4 * b for a, b in zip(twin, ref)), (twin, ref)
