"""A run's FLOPs and peak come from the planner's model and table, with the same numbers
the training side computed on its own before they were merged (exactly, not approximately)."""
import os
import subprocess
import sys

import pytest
import torch

from megalite.config import MegaliteConfig, ModelConfig
from megalite.planner import flops as fl
from megalite.planner.hardware import GPU_PRESETS, datasheet_peak_flops
from megalite.training import flops as tf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def closed_form_flops_per_token(cfg) -> float:
    """The training side's former formula, kept here as the reference: 3 x forward, forward
    per layer QKV 2h(nq+2ng)d + scores/context 4·s·nq·d + projection 2h·nq·d + MLP (top-k
    experts + router on MoE layers), plus the logits 2hV at the TP-padded vocabulary."""
    m = cfg.model
    h, s, L = m.hidden_size, m.seq_length, m.num_layers
    d, nq, ng = m.resolved_kv_channels(), m.num_attention_heads, m.resolved_query_groups()
    mats = 3 if m.swiglu else 2
    attn = 2 * h * (nq + 2 * ng) * d + 4 * s * nq * d + 2 * h * nq * d
    dense_mlp = 2 * h * m.resolved_ffn_hidden_size() * mats
    if m.num_experts:
        f = m.moe_ffn_hidden_size or m.resolved_ffn_hidden_size()
        moe_mlp = 2 * h * f * mats * m.moe_router_topk + 2 * h * m.num_experts
        n_moe = len([i for i in range(L) if i % m.moe_layer_freq == 0])
        mlp_total = n_moe * moe_mlp + (L - n_moe) * dense_mlp
    else:
        mlp_total = L * dense_mlp
    return 3.0 * (L * attn + mlp_total + 2 * h * cfg.padded_vocab_size)


def run_cfg(tp=1, **model):
    cfg = MegaliteConfig(world_size=tp, model=ModelConfig(**model))
    cfg.parallel.tensor_model_parallel_size = tp
    cfg.training.global_batch_size = 16
    return cfg


CASES = {
    "gpt": dict(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=1000,
                seq_length=128),
    "llama-gqa": dict(num_layers=6, hidden_size=96, num_attention_heads=8,
                      group_query_attention=True, num_query_groups=2, swiglu=True,
                      vocab_size=50257, seq_length=256),
    "moe-every-2nd": dict(num_layers=6, hidden_size=64, num_attention_heads=4, swiglu=True,
                          num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=48,
                          moe_layer_freq=2, vocab_size=32000, seq_length=64),
    "gpt3-175b": dict(num_layers=96, hidden_size=12288, num_attention_heads=96,
                      vocab_size=50257, seq_length=2048),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tp", [1, 8])
def test_run_flops_equal_former_training_formula(name, tp):
    cfg = run_cfg(tp, **CASES[name])
    assert tf.flops_per_token(cfg) == closed_form_flops_per_token(cfg)
    assert tf.flops_per_iteration(cfg) == closed_form_flops_per_token(cfg) * 16 * \
        cfg.model.seq_length


def test_run_and_planner_differ_only_in_vocab_padding():
    """The planner counts the vocabulary padded for TP = 1; a run at TP = 8 pads further."""
    cfg = run_cfg(8, **CASES["llama-gqa"])
    m = cfg.model
    planner = fl.iteration_flops(m, m.seq_length, 16)["model"]
    run = tf.flops_per_iteration(cfg)
    extra_rows = cfg.padded_vocab_size - m.padded_vocab_size(1)
    assert extra_rows > 0
    assert run - planner == pytest.approx(3 * 2 * m.hidden_size * extra_rows * 16 * m.seq_length)


def test_one_datasheet_table_for_presets_and_devices():
    former = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12,
              "B200": 2250e12, "L40S": 362e12, "A10": 125e12}
    for name, peak in (("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                       ("NVIDIA A10G", 125e12), ("NVIDIA L40S", 362e12),
                       ("NVIDIA B200", 2250e12), ("NVIDIA H800", 989e12)):
        got, key = datasheet_peak_flops(name)
        assert got == peak == former[key]
    assert datasheet_peak_flops("Tesla T4") == (989e12, None)
    assert {k: g.peak_tflops for k, g in GPU_PRESETS.items()} == {
        "a100-40gb": 312.0, "a100-80gb": 312.0, "h100-80gb": 989.0, "h200-141gb": 989.0,
        "b200": 2250.0, "b300": 2250.0, "gb200-nvl72": 2500.0, "gb300-nvl72": 2500.0}
    assert datasheet_peak_flops("NVIDIA GB200")[0] == 2500e12     # not B200's


def test_device_peak_flops(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert tf.device_peak_flops("cuda") == (989e12, "H200 bf16 datasheet")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some Future GPU")
    assert tf.device_peak_flops("cuda") == (989e12, "unknown GPU, H100 assumed")
    peak, source = tf.device_peak_flops("cpu")
    assert peak > 0 and source == "measured fp32 GEMM, best of 5"


def test_planner_flop_model_imports_neither_torch_nor_distributed():
    code = ("import sys, megalite.planner.flops, megalite.planner.hardware; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
