"""The Hugging Face families whose layers differ from Llama's -- Phi-3 (fused qkv and
gate/up weights), SmolLM3 (NoPE layers), OLMo 2 (post-norm, q/k norm over the whole
projection, whose mean square spans the TP shards) -- through ``convert.py`` both ways and
evaluated at TP2 and PP2 on gloo ranks, all in one launch: the loss equals transformers' on
the same tokens (rel <= 1e-5), and the exported folder gives transformers' logits; the
three switches trained together at TP2 and PP2 give the single process's losses (step 1
within 1e-5, docs/architecture.md#numerical-contract).  Llama 4 and GLM-4.5 (MoE) run at
TP2 (with SP, as experts need), PP2 and EP2.
(tests/unit/test_hf_families.py checks each one's import at TP1 in one process;
tests/e2e/test_hf_families_e2e.py runs every family through pretrain_gpt.py, long tier.)"""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import torch.distributed as torch_dist

from cpu_trainer import build_cpu_trainer, train_steps  # noqa: E402  (tests/ is on sys.path)
from hf_families import FAMILIES, SEQ, VOCAB, hf_loss, rel, save_hf_model  # noqa: E402

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONVERT = [sys.executable, os.path.join(ROOT, "tools", "checkpoint", "convert.py")]
NEW = ("phi3", "smollm3", "olmo2")
WINDOWS = 4
LAYOUTS = {"tp2": ["--tensor-model-parallel-size", "2"],
           "pp2": ["--pipeline-model-parallel-size", "2"]}
FAMILY_LAYOUTS = {f: LAYOUTS for f in NEW}
# Llama 4 (chunks, NoPE temperature, L2 q/k, top-1 input-scaled MoE) and GLM-4.5 (partial
# rotary, q/k/v biases, DeepSeek-style router): TP2, PP2 and EP2
NEW += ("llama4", "glm4_moe")
FAMILY_LAYOUTS.update({f: dict(LAYOUTS, ep2=["--expert-model-parallel-size", "2",
                                                  "--micro-batch-size", "1"],   # DP2
                                tp2=LAYOUTS["tp2"] + ["--sequence-parallel"])   # experts: SP
                       for f in ("llama4", "glm4_moe")})


# OLMo 2's and SmolLM3's switches trained from scratch: TP2 (the projection norm's
# all-reduced mean square, forward and backward) and PP2 give the single process's losses
STEPS = 3
TRAIN = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--seq-length", "16",
         "--mock-data", "--vocab-size", "100", "--lr", "3e-3", "--train-iters", str(STEPS),
         "--hidden-dropout", "0", "--attention-dropout", "0", "--normalization", "RMSNorm",
         "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
         "--norm-placement", "post", "--qk-layernorm", "--qk-layernorm-scope", "projection",
         "--no-rope-freq", "2", "--init-method-std", "0.05", "--eval-iters", "0",
         "--global-batch-size", "4", "--micro-batch-size", "2"]


def _evals(ckpts, data):
    """Each family's valid loss at each layout, and the training losses of TRAIN (the last
    rank holds them)."""
    out = {}
    if torch_dist.get_rank() == 0:      # the single-process reference, on rank 0 alone
        out["train", "ref"] = train_steps(build_cpu_trainer(TRAIN, 1), STEPS)
    torch_dist.barrier()
    for name, flags in LAYOUTS.items():
        out["train", name] = train_steps(build_cpu_trainer(TRAIN + flags, 2), STEPS)
    for family, ckpt in ckpts.items():
        for name, flags in FAMILY_LAYOUTS[family].items():
            trainer = build_cpu_trainer(
                ["--load", ckpt, "--use-checkpoint-args", "--skip-train", "--data-path", data,
                 "--split", "0,100,0", "--seq-length", str(SEQ), "--micro-batch-size", "2",
                 "--global-batch-size", "2", "--eval-iters", "2", "--train-iters", "1",
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), *flags], 2)
            out[family, name] = trainer.evaluate(trainer.valid_ds, 2)
    return out


def _run_all(cmds):
    procs = [subprocess.Popen(c, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for c in cmds]
    for cmd, p in zip(cmds, procs):
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, f"{cmd}\n{out[-2000:]}\n{err[-2000:]}"


def test_new_families_convert_both_ways_and_give_transformers_loss_at_tp2_pp2(tmp_path, dist):
    from megalite.data.indexed_dataset import write_documents

    tokens = np.random.default_rng(7).integers(0, VOCAB, size=WINDOWS * SEQ + 1)
    data = write_documents(str(tmp_path / "data"), [tokens.tolist()], np.int32)
    windows = torch.from_numpy(np.stack([tokens[i * SEQ:(i + 1) * SEQ + 1]
                                         for i in range(WINDOWS)])).long()
    refs = {f: save_hf_model(f, str(tmp_path / f"{f}_hf")) for f in NEW}
    ckpts = {f: str(tmp_path / f"{f}_mg") for f in NEW}
    _run_all([CONVERT + ["--source-format", "hf", "--target-format", "megalite", "--load-dir",
                         str(tmp_path / f"{f}_hf"), "--save-dir", ckpts[f],
                         "--target-tensor-parallel-size", "2"] for f in NEW])
    _run_all([CONVERT + ["--source-format", "megalite", "--target-format", "hf", "--load-dir",
                         ckpts[f], "--save-dir", str(tmp_path / f"{f}_back"),
                         "--hf-architecture", FAMILIES[f][1]] for f in NEW])
    results = dist.run(2, _evals, ckpts, data)
    losses, ref = results[-1], results[0]["train", "ref"]
    assert len(set(ref)) == STEPS                              # the weights move
    for name in LAYOUTS:
        step1 = abs(losses["train", name][0] - ref[0]) / ref[0]
        worst = max(abs(a - b) / b for a, b in zip(losses["train", name], ref))
        print(f"post-norm + projection q/k norm + NoPE {name}: step 1 rel {step1:.1e}, "
              f"{STEPS} steps max rel {worst:.1e}")
        assert step1 <= 1e-5 and worst <= 1e-4, (name, losses["train", name], ref)
    for family, ref in refs.items():
        expected = hf_loss(ref, windows)
        for name in FAMILY_LAYOUTS[family]:
            loss = losses[family, name]
            print(f"{family} {name}: loss {loss:.7f}, transformers {expected:.7f}, rel "
                  f"{abs(loss - expected) / expected:.1e}")
            assert abs(loss - expected) <= 1e-5 * expected, (family, name, loss, expected)
        back = getattr(transformers, FAMILIES[family][1]).from_pretrained(
            str(tmp_path / f"{family}_back")).eval()
        with torch.no_grad():
            err = rel(back(windows[:, :-1]).logits, ref(windows[:, :-1]).logits)
        print(f"{family} exported: logits rel {err:.1e}")
        assert back.config.architectures == [FAMILIES[family][1]] and err <= 1e-6
