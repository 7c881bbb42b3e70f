"""A Qwen2 config with ``use_sliding_window: true`` (window 6 from layer 1 on, sequences of
16) as a user meets it: tools/checkpoint/convert.py imports it (no longer refused), and
``pretrain_gpt.py --use-checkpoint-args --skip-train`` gives transformers' loss on the same
tokens at TP1 and (torchrun) CP2 ring attention (rel <= 1e-5); converted back, transformers
reproduces the logits."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hf_families import COMMON, SEQ, VOCAB, hf_loss, rel  # noqa: E402

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
CONVERT = os.path.join(ROOT, "tools", "checkpoint", "convert.py")
WINDOWS = 4


def _run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, f"{cmd}\nSTDOUT:\n{p.stdout[-3000:]}\nSTDERR:\n{p.stderr[-3000:]}"
    return p.stdout


def _valid_loss(path):
    rows = [json.loads(line) for line in open(path)]
    return [r for r in rows if r.get("split") == "valid"][-1]["lm_loss"]


def test_qwen2_sliding_window_converts_and_gives_transformers_loss(tmp_path):
    from megalite.data.indexed_dataset import write_documents

    torch.manual_seed(0)
    config = transformers.Qwen2Config(**{**COMMON, "num_hidden_layers": 3},
                                      use_sliding_window=True, sliding_window=6,
                                      max_window_layers=1)
    ref = transformers.Qwen2ForCausalLM(config).eval()
    hf_dir, ckpt, back = (str(tmp_path / n) for n in ("hf", "ckpt", "back"))
    ref.save_pretrained(hf_dir)
    tokens = np.random.default_rng(7).integers(0, VOCAB, size=WINDOWS * SEQ + 1)
    data = write_documents(str(tmp_path / "data"), [tokens.tolist()], np.int32)
    windows = torch.from_numpy(np.stack([tokens[i * SEQ:(i + 1) * SEQ + 1]
                                         for i in range(WINDOWS)])).long()
    expected = hf_loss(ref, windows)

    _run([PY, CONVERT, "--source-format", "hf", "--target-format", "megalite",
          "--load-dir", hf_dir, "--save-dir", ckpt])
    run = ["pretrain_gpt.py", "--use-checkpoint-args", "--skip-train", "--load", ckpt,
           "--data-path", data, "--split", "0,100,0", "--seq-length", str(SEQ),
           "--micro-batch-size", "2", "--global-batch-size", "2", "--eval-iters", "2",
           "--train-iters", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size",
           str(VOCAB), "--lr", "1e-4", "--device", "cpu"]
    layouts = {"tp1": [PY, *run],
               "cp2": [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                       "2", *run, "--context-parallel-size", "2"]}
    for name, cmd in layouts.items():
        metrics = str(tmp_path / f"{name}.jsonl")
        _run([*cmd, "--metrics-file", metrics])
        loss = _valid_loss(metrics)
        print(f"qwen2 sliding window {name}: loss {loss:.7f}, transformers {expected:.7f}")
        assert abs(loss - expected) <= 1e-5 * expected, (name, loss, expected)

    _run([PY, CONVERT, "--source-format", "megalite", "--target-format", "hf",
          "--load-dir", ckpt, "--save-dir", back])
    exported = transformers.Qwen2ForCausalLM.from_pretrained(back).eval()
    assert exported.config.use_sliding_window and exported.config.sliding_window == 6
    assert exported.config.layer_types == ref.config.layer_types
    with torch.no_grad():
        assert rel(exported(windows[:, :-1]).logits, ref(windows[:, :-1]).logits) <= 1e-5
