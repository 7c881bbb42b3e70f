"""The Hugging Face families whose layers differ from Llama's -- Phi-3 (fused qkv and
gate/up weights), SmolLM3 (NoPE layers), OLMo 2 (post-norm, q/k norm over the whole
projection, whose mean square spans the TP shards), Gemma 2 and Gemma 3 (sandwich (1 + w)
norms, soft-caps, windows shorter than the sequence, two RoPE bases), gpt-oss (sinks, a
window on layer 0, biased experts: also EP2) -- through ``convert.py`` both ways and
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
NEW = ("phi3", "smollm3", "olmo2", "gemma2", "gemma3",
       "gpt_oss")
WINDOWS = 4
LAYOUTS = {"tp2": ["--tensor-model-parallel-size", "2"],
           "pp2": ["--pipeline-model-parallel-size", "2"]}
# Llama 4 (chunks, NoPE temperature, L2 q/k, top-1 input-scaled MoE) and GLM-4.5 (partial
# rotary, q/k/v biases, DeepSeek-style router): TP2, PP2 and EP2 (EXTRA_LAYOUTS)
NEW += ("llama4", "glm4_moe")


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


# Gemma 2/3's pieces trained from scratch -- (1 + w) sandwich norms and q/k norms, scaled
# embedding, GeGLU, own softmax scale, a window on every other layer with its own RoPE base,
# linear RoPE on the others, final soft-cap -- at TP2 with SP and the fused loss (the cap on
# vocabulary shards, chunk by chunk),
# CP2 ring and all-to-all, PP2 x VPP2 with full recompute and FSDP2 give the single process's
# losses
GEMMA_TRAIN = ["--num-layers", "4"] + [
    f for f in TRAIN[2:TRAIN.index("--norm-placement")] if f != "--swiglu"] + [
    "--eval-iters", "0", "--global-batch-size", "4", "--micro-batch-size", "2",
    "--init-method-std", "0.05", "--activation", "geglu", "--apply-layernorm-1p",
    "--norm-placement", "sandwich",
    "--qk-layernorm", "--scale-embeddings", "--softmax-scale", "0.3", "--window-size", "3,0",
    "--window-attn-skip-freq", "2", "--rotary-base-local", "100",
    "--rotary-seq-len-interpolation-factor", "4", "--final-logit-softcapping", "2"]
GEMMA_LAYOUTS = {
    "tp2-sp-fused-loss": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                          "--cross-entropy-loss-fusion", "--cross-entropy-chunk-tokens", "5"],
    "cp2-ring": ["--context-parallel-size", "2"],
    "cp2-a2a": ["--context-parallel-size", "2", "--cp-comm-type", "a2a"],
    "pp2-vpp2-recompute": ["--pipeline-model-parallel-size", "2",
                           "--num-layers-per-virtual-pipeline-stage", "1",
                           "--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1"],
    "fsdp2": ["--use-torch-fsdp2"]}


# Gemma 2 (both soft-caps) under all-to-all CP, Gemma 3 (two RoPE bases) under ring CP, with
# sequences longer than their windows: transformers' loss too
EXTRA_LAYOUTS = {"gemma2": {"cp2-a2a": ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]},
                 "gemma3": {"cp2-ring": ["--context-parallel-size", "2"]},
                 # gpt-oss (sinks split over TP, experts with biases: expert-TP 1, EP2)
                 "gpt_oss": {"tp2": LAYOUTS["tp2"] + ["--sequence-parallel",
                                                      "--expert-tensor-parallel-size", "1"],
                             "ep2": ["--expert-model-parallel-size", "2",
                                     "--micro-batch-size", "1"]}}
EXTRA_LAYOUTS.update({f: dict(ep2=["--expert-model-parallel-size", "2",
                                   "--micro-batch-size", "1"],                # DP2
                              tp2=LAYOUTS["tp2"] + ["--sequence-parallel"])   # experts: SP
                      for f in ("llama4", "glm4_moe")})


def family_layouts(family: str) -> dict:
    """The layouts a family's converted checkpoint is evaluated at."""
    return {**LAYOUTS, **EXTRA_LAYOUTS.get(family, {})}


def _evals(ckpts, data):
    """Each family's valid loss at each layout, and the training losses of TRAIN (the last
    rank holds them)."""
    out = {}
    if torch_dist.get_rank() == 0:      # the single-process reference, on rank 0 alone
        out["train", "ref"] = train_steps(build_cpu_trainer(TRAIN, 1), STEPS)
        out["gemma", "ref"] = train_steps(build_cpu_trainer(GEMMA_TRAIN, 1), STEPS)
    torch_dist.barrier()
    for name, flags in GEMMA_LAYOUTS.items():
        out["gemma", name] = train_steps(build_cpu_trainer(GEMMA_TRAIN + flags, 2), STEPS)
    for name, flags in LAYOUTS.items():
        out["train", name] = train_steps(build_cpu_trainer(TRAIN + flags, 2), STEPS)
    for family, ckpt in ckpts.items():
        for name, flags in family_layouts(family).items():
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
                         "--target-tensor-parallel-size", "2",
                         *(["--target-expert-tensor-parallel-size", "1"] if f == "gpt_oss"
                           else [])] for f in NEW])
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
    gemma = results[0]["gemma", "ref"]
    assert len(set(gemma)) == STEPS
    for name in GEMMA_LAYOUTS:
        step1 = abs(losses["gemma", name][0] - gemma[0]) / gemma[0]
        worst = max(abs(a - b) / b for a, b in zip(losses["gemma", name], gemma))
        print(f"Gemma's pieces {name}: step 1 rel {step1:.1e}, {STEPS} steps max rel "
              f"{worst:.1e}")
        assert step1 <= 1e-5 and worst <= 1e-4, (name, losses["gemma", name], gemma)
    for family, ref in refs.items():
        expected = hf_loss(ref, windows)
        for name in family_layouts(family):
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


# Qwen3-Next (Gated DeltaNet hybrid): converted both ways and evaluated at TP2 (with SP: MoE
# needs it), PP2 (a DeltaNet layer on one stage, full attention on the other), EP2 and CP2
# (the DeltaNet state passed between the CP ranks); its switches trained from scratch at
# those layouts and FSDP2 with full recomputation give the single process's losses.  Sequences of 80 tokens:
# two chunks of the delta rule, so the state walks from chunk to chunk.
NEXT_LAYOUTS = {"tp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                "pp2": ["--pipeline-model-parallel-size", "2"],
                "ep2": ["--expert-model-parallel-size", "2"],
                "cp2": ["--context-parallel-size", "2"]}
NEXT_TRAIN_LAYOUTS = dict(NEXT_LAYOUTS, fsdp2_recompute=[
    "--use-torch-fsdp2", "--recompute-granularity", "full", "--recompute-method", "uniform"])
NEXT_SEQ = 80
NEXT_TRAIN = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
    "--seq-length", str(NEXT_SEQ), "--mock-data", "--vocab-size", "100", "--lr", "3e-3",
    "--train-iters", str(STEPS), "--hidden-dropout", "0", "--attention-dropout", "0",
    "--normalization", "RMSNorm", "--apply-layernorm-1p", "--swiglu", "--disable-bias-linear",
    "--position-embedding-type", "rope", "--rotary-percent", "0.25", "--qk-layernorm",
    "--attention-output-gate", "--experimental-attention-variant", "gated_delta_net",
    "--linear-attention-freq", "4", "--linear-num-key-heads", "2",
    "--linear-num-value-heads", "4", "--linear-key-head-dim", "8",
    "--linear-value-head-dim", "8", "--num-experts", "4", "--moe-router-topk", "2",
    "--moe-ffn-hidden-size", "16", "--moe-shared-expert-intermediate-size", "24",
    "--moe-shared-expert-gate", "--init-method-std", "0.05", "--eval-iters", "0",
    "--global-batch-size", "4", "--micro-batch-size", "2"]


def _next_evals(ckpt, data):
    from megalite import comm
    from megalite.planner.comm_model import predict_comm_volume

    out = {}
    if torch_dist.get_rank() == 0:
        out["train", "ref"] = train_steps(build_cpu_trainer(NEXT_TRAIN, 1), STEPS)
    torch_dist.barrier()
    for name, flags in NEXT_TRAIN_LAYOUTS.items():
        trainer = build_cpu_trainer(NEXT_TRAIN + flags, 2)
        comm.counter.reset()
        out["train", name] = train_steps(trainer, STEPS)
        # the CP group's bytes per step: measured, and as the planner counts them
        out["cp bytes", name] = (comm.counter.get("cp", "send")["bytes"] / STEPS,
                                 predict_comm_volume(trainer.cfg, torch_dist.get_rank())
                                 .get("cp/send", {}).get("bytes", 0))
    for name, flags in NEXT_LAYOUTS.items():
        trainer = build_cpu_trainer(
            ["--load", ckpt, "--use-checkpoint-args", "--skip-train", "--data-path", data,
             "--split", "0,100,0", "--seq-length", str(NEXT_SEQ), "--micro-batch-size", "1",
             "--global-batch-size", "2", "--eval-iters", "2", "--train-iters", "1",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), *flags], 2)
        out["hf", name] = trainer.evaluate(trainer.valid_ds, 2)
    return out


def test_qwen3_next_converts_both_ways_and_gives_transformers_loss_at_tp2_pp2_ep2_cp2(
        tmp_path, dist):
    from megalite.data.indexed_dataset import write_documents

    tokens = np.random.default_rng(7).integers(0, VOCAB, size=WINDOWS * NEXT_SEQ + 1)
    data = write_documents(str(tmp_path / "data"), [tokens.tolist()], np.int32)
    windows = torch.from_numpy(np.stack([tokens[i * NEXT_SEQ:(i + 1) * NEXT_SEQ + 1]
                                         for i in range(WINDOWS)])).long()
    ref = save_hf_model("qwen3_next", str(tmp_path / "hf"))
    ckpt = str(tmp_path / "mg")
    _run_all([CONVERT + ["--source-format", "hf", "--target-format", "megalite", "--load-dir",
                         str(tmp_path / "hf"), "--save-dir", ckpt,
                         "--target-tensor-parallel-size", "2"]])
    _run_all([CONVERT + ["--source-format", "megalite", "--target-format", "hf", "--load-dir",
                         ckpt, "--save-dir", str(tmp_path / "back"),
                         "--hf-architecture", "Qwen3NextForCausalLM"]])
    results = dist.run(2, _next_evals, ckpt, data)
    losses, steps = results[-1], results[0]["train", "ref"]
    assert len(set(steps)) == STEPS
    for name in NEXT_TRAIN_LAYOUTS:
        step1 = abs(losses["train", name][0] - steps[0]) / steps[0]
        worst = max(abs(a - b) / b for a, b in zip(losses["train", name], steps))
        print(f"Qwen3-Next switches {name}: step 1 rel {step1:.1e}, {STEPS} steps max rel "
              f"{worst:.1e}")
        assert step1 <= 1e-5 and worst <= 1e-4, (name, losses["train", name], steps)
    # the planner's CP sends at CP2 (linear_attention_cost.py: three DeltaNet layers' state
    # walk, ring attention's K/V for the fourth) are the bytes the ranks sent
    sent = [r["cp bytes", "cp2"] for r in results]
    print(f"Qwen3-Next cp2: CP bytes sent per step and rank, measured / planner {sent}")
    assert all(got == planned > 0 for got, planned in sent), sent
    expected = hf_loss(ref, windows)
    for name in NEXT_LAYOUTS:
        loss = losses["hf", name]
        print(f"qwen3_next {name}: loss {loss:.7f}, transformers {expected:.7f}, rel "
              f"{abs(loss - expected) / expected:.1e}")
        assert abs(loss - expected) <= 1e-5 * expected, (name, loss, expected)
    back = transformers.Qwen3NextForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    with torch.no_grad():
        err = rel(back(windows[:, :-1]).logits, ref(windows[:, :-1]).logits)
    print(f"qwen3_next exported: logits rel {err:.1e}")
    assert err <= 1e-6
