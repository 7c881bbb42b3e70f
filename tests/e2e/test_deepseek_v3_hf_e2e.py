"""DeepSeek-V3 from Hugging Face and back, as a user runs it (docs/models_mla_mtp.md).

A tiny random ``DeepseekV3ForCausalLM`` with an MTP module (tests/deepseek_v3_fixture.py) ->
``tools/checkpoint/convert.py`` (TP2 x PP2 target, the dense layer alone on the first stage:
the last stage's files hold two MoE layers, the MTP module and its embedding copy) -> ``pretrain_gpt.py --use-checkpoint-args --skip-train`` at TP1,
TP2 + SP and EP2 gives transformers' validation loss on the same tokens (rel <= 1e-5);
exported back with convert.py, transformers reproduces the original logits and its
``MtpModel`` the original MTP logits.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from deepseek_v3_fixture import VOCAB, hf_deepseek_v3, hf_mtp_logits, rel  # noqa: E402

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
SEQ, MBS, GBS, EVAL_ITERS = 16, 2, 4, 2       # GBS: DP2 at EP2 (2 processes)
EVAL = ["--use-checkpoint-args", "--skip-train", "--mock-data", "--seq-length", str(SEQ),
        "--micro-batch-size", str(MBS), "--global-batch-size", str(GBS), "--eval-iters",
        str(EVAL_ITERS), "--lr", "1e-4", "--device", "cpu"]
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, f"{cmd}\nSTDOUT:\n{p.stdout[-3000:]}\nSTDERR:\n{p.stderr[-3000:]}"
    return p.stdout


def _validation_tokens():
    """The validation samples --skip-train evaluates (mock data; DP ranks split each global
    batch), as micro-batches of one process."""
    from megalite.data import build_train_valid_test_datasets
    from megalite.data.samplers import build_data_iterator

    _, valid, _ = build_train_valid_test_datasets(
        data_path=[], split="969, 30, 1", seq_length=SEQ, seed=1234,
        num_samples=(GBS, EVAL_ITERS * GBS, GBS), mock=True, vocab_size=VOCAB, cache_dir=None,
        eod_token=None, eod_mask_loss=False, sample_windows="packed")
    it = build_data_iterator(valid, 0, MBS, GBS, 0, 1, cyclic=True)
    return [next(it) for _ in range(EVAL_ITERS * GBS // MBS)]


def _eval_loss(metrics):
    return [json.loads(line) for line in open(metrics)][-1]["lm_loss"]


def test_deepseek_v3_converts_evaluates_and_exports(tmp_path):
    ref, mtp = hf_deepseek_v3(str(tmp_path / "hf"))
    with torch.no_grad():      # transformers' mean loss over the same tokens
        batches = _validation_tokens()
        losses = [torch.nn.functional.cross_entropy(
            ref(b["tokens"]).logits.reshape(-1, VOCAB), b["labels"].reshape(-1))
            for b in batches]
    expected = float(sum(losses) / len(losses))

    ckpt = str(tmp_path / "mg")
    out = _run([PY, "tools/checkpoint/convert.py", "--source-format", "hf", "--target-format",
                "megalite", "--load-dir", str(tmp_path / "hf"), "--save-dir", ckpt,
                "--target-tensor-parallel-size", "2", "--target-pipeline-model-parallel-size",
                "2", "--target-decoder-first-pipeline-num-layers", "1"])
    assert "--multi-latent-attention" in out and "--mtp-num-layers 1" in out
    got = {}
    for name, launch in (("tp1", [PY]), ("tp2_sp", [*TORCHRUN]), ("ep2", [*TORCHRUN])):
        layout = {"tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                  "ep2": ["--expert-model-parallel-size", "2"]}.get(name, [])
        metrics = str(tmp_path / f"{name}.jsonl")
        _run([*launch, "pretrain_gpt.py", "--load", ckpt, *EVAL, *layout,
              "--metrics-file", metrics])
        got[name] = _eval_loss(metrics)
    for name, loss in got.items():
        assert abs(loss - expected) <= 1e-5 * expected, (name, loss, expected)
    print(f"transformers {expected:.8f}; " + ", ".join(       # shown with -s
        f"{n} rel {abs(v - expected) / expected:.1e}" for n, v in got.items()))

    back = str(tmp_path / "hf_back")
    _run([PY, "tools/checkpoint/convert.py", "--source-format", "megalite", "--target-format",
          "hf", "--load-dir", ckpt, "--save-dir", back])
    again = transformers.DeepseekV3ForCausalLM.from_pretrained(back).eval()
    ids = batches[0]["tokens"]
    with torch.no_grad():
        logits_rel = rel(again(ids).logits, ref(ids).logits)
    assert logits_rel <= 1e-5
    from transformers.modeling_layers import MtpModel
    from safetensors.torch import load_file

    # transformers' MtpModel with the exported model.layers.3.* (its from_pretrained looks
    # for DeepSeek-V3's layer 61 only): renamed as its conversion does, experts fused
    head = MtpModel(again, 1).eval()
    sd = load_file(os.path.join(back, "model.safetensors"))
    mine, experts = {}, {}
    for k, t in sd.items():
        if not k.startswith("model.layers.3.") or "embed_tokens" in k or \
                "shared_head.head" in k:
            continue
        rest = k[len("model.layers.3."):]
        if ".experts." in rest:            # mlp.experts.{e}.{gate,up,down}_proj.weight
            e, kind = rest.split(".")[2], rest.split(".")[3]
            experts.setdefault(kind, {})[int(e)] = t
            continue
        if rest.startswith("shared_head.norm."):
            rest = "post_norm." + rest[len("shared_head.norm."):]
        elif rest.split(".")[0] not in ("enorm", "hnorm", "eh_proj"):
            rest = "mtp_block." + rest
        mine["layers.0." + rest] = t
    n = len(experts["down_proj"])
    mine["layers.0.mtp_block.mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([experts["gate_proj"][e], experts["up_proj"][e]]) for e in range(n)])
    mine["layers.0.mtp_block.mlp.experts.down_proj"] = torch.stack(
        [experts["down_proj"][e] for e in range(n)])
    missing, unexpected = head.load_state_dict(mine, strict=False)
    assert not unexpected and all("embed" in k or "shared_head" in k for k in missing), missing
    mtp_rel = rel(hf_mtp_logits(again, head, ids), hf_mtp_logits(ref, mtp, ids))
    print(f"exported: logits rel {logits_rel:.1e}, MTP logits rel {mtp_rel:.1e}")
    assert mtp_rel <= 1e-5
    assert torch.equal(sd["model.layers.1.mlp.gate.e_score_correction_bias"],
                       ref.model.layers[1].mlp.gate.e_score_correction_bias)
