"""The Hugging Face families as a user meets them: a tiny random transformers model
(Llama 3.2 with llama3 RoPE scaling and tied embeddings, Mistral, Qwen2 with qkv biases,
Qwen3 with q/k norms and YaRN, Phi-3, SmolLM3, OLMo 2, Qwen2-MoE and Qwen3-MoE with a dense
and an MoE layer)
converted with tools/checkpoint/convert.py (written for TP2, the Qwen families for TP2 x PP2),
evaluated by ``pretrain_gpt.py --use-checkpoint-args --skip-train`` (``pretrain_moe.py`` for
the MoE families) at TP1 and (torchrun) TP2 -- and EP2 for the MoE families -- on a .bin
dataset, gives transformers' loss on the same tokens (rel <= 1e-5); converted back to
Hugging Face, transformers reproduces the logits.

The valid split is one document of 4 windows; 2 evaluation iterations of 2 samples see each
window once, so the loss is the mean over those 4 windows whatever their order.  After the
conversion the two evaluations and the export run side by side (independent processes and
files), which keeps the wall time near the CPU time on 2 cores.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hf_families import (FAMILIES, MOE_FAMILIES, SEQ, VOCAB, hf_loss, rel,  # noqa: E402
                         save_hf_model)

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
CONVERT = os.path.join(ROOT, "tools", "checkpoint", "convert.py")
WINDOWS = 4
EXPORT_AS = {"mistral": ["--hf-architecture", "MistralForCausalLM"],
             "phi3": ["--hf-architecture", "Phi3ForCausalLM"]}
# the layout convert.py writes (the runs reshard it on load): TP2, and TP2 x PP2 for the two
# families whose layers carry new tensors (qkv biases, q/k norms)
TARGET = {f: ["--target-pipeline-model-parallel-size", "2"]
          for f in ("qwen2", "qwen3", *MOE_FAMILIES)}
# evaluation layouts: (processes, flags); MoE with TP needs SP (Megatron's rule)
LAYOUTS = {"tp1": (1, []), "tp2": (2, ["--tensor-model-parallel-size", "2"])}
MOE_LAYOUTS = {"tp1": (1, []),
               "tp2": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
               "ep2": (2, ["--expert-model-parallel-size", "2",     # DP2: 1 sample a rank
                           "--micro-batch-size", "1"])}


def _eval(family, load, data, metrics, layout):
    procs, flags = layout
    entry = "pretrain_moe.py" if family in MOE_FAMILIES else "pretrain_gpt.py"
    run = [entry, "--use-checkpoint-args", "--skip-train", "--load", load,
           "--data-path", data, "--split", "0,100,0", "--seq-length", str(SEQ),
           "--micro-batch-size", "2", "--global-batch-size", "2", "--eval-iters", "2",
           "--train-iters", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size",
           str(VOCAB), "--lr", "1e-4", "--device", "cpu", "--metrics-file", metrics, *flags]
    if procs == 1:
        return [PY, *run]
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
            *run]


def _finish(proc, cmd):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"{cmd}\nSTDOUT:\n{out[-3000:]}\nSTDERR:\n{err[-3000:]}"
    return out


def _start(cmd):
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _valid_loss(path):
    rows = [json.loads(line) for line in open(path)]
    return [r for r in rows if r.get("split") == "valid"][-1]["lm_loss"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_converted_family_gives_transformers_loss_at_tp1_tp2_ep2_and_exports_back(tmp_path,
                                                                                  family):
    from megalite.data.indexed_dataset import write_documents

    hf_dir, ckpt, back = (str(tmp_path / n) for n in ("hf", "ckpt", "back"))
    ref = save_hf_model(family, hf_dir)
    tokens = np.random.default_rng(7).integers(0, VOCAB, size=WINDOWS * SEQ + 1)
    data = write_documents(str(tmp_path / "data"), [tokens.tolist()], np.int32)
    windows = torch.from_numpy(np.stack([tokens[i * SEQ:(i + 1) * SEQ + 1]
                                         for i in range(WINDOWS)])).long()
    expected = hf_loss(ref, windows)

    cmd = [PY, CONVERT, "--source-format", "hf", "--target-format", "megalite",
           "--load-dir", hf_dir, "--save-dir", ckpt, "--target-tensor-parallel-size", "2",
           *TARGET.get(family, [])]
    assert "TP=2" in _finish(_start(cmd), cmd)
    layouts = MOE_LAYOUTS if family in MOE_FAMILIES else LAYOUTS
    cmds = {name: _eval(family, ckpt, data, str(tmp_path / f"{name}.jsonl"), layout)
            for name, layout in layouts.items()}
    cmds["export"] = [PY, CONVERT, "--source-format", "megalite", "--target-format", "hf",
                      "--load-dir", ckpt, "--save-dir", back, *EXPORT_AS.get(family, [])]
    procs = {name: _start(cmd) for name, cmd in cmds.items()}
    outs = {name: _finish(proc, cmds[name]) for name, proc in procs.items()}
    assert "model flags from the checkpoint" in outs["tp1"]
    for layout in layouts:
        loss = _valid_loss(str(tmp_path / f"{layout}.jsonl"))
        print(f"{family} {layout}: loss {loss:.7f}, transformers {expected:.7f}, rel "
              f"{abs(loss - expected) / expected:.1e}")
        assert abs(loss - expected) <= 1e-5 * expected, (family, layout, loss, expected)

    exported = getattr(transformers, FAMILIES[family][1]).from_pretrained(back).eval()
    assert exported.config.architectures == [FAMILIES[family][1]]
    ids = windows[:, :-1]
    with torch.no_grad():
        err = rel(exported(ids).logits, ref(ids).logits)
    print(f"{family} exported: logits rel {err:.1e}")
    assert err <= 1e-5
