"""Model FLOPs per iteration (no recompute counted, as MFU is defined) and device peaks."""
from __future__ import annotations

import time

# Dense bf16 peak FLOP/s per device (vendor datasheets, no sparsity).
GPU_PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12,
                 "A800": 312e12, "B200": 2250e12, "L40S": 362e12, "A10": 125e12}


def flops_per_token(cfg) -> float:
    """Training FLOPs per token: 3 x forward (backward = 2 x forward), GQA/SwiGLU/MoE aware.

    Forward per layer per token: QKV 2h(nq+2ng)d, scores+context 4·s·nq·d, projection
    2h·nq·d, MLP 2h·f·(3 if gated else 2) times top-k for MoE layers (+ router 2hE);
    plus the output layer 2hV once.
    """
    m = cfg.model
    h, s, L = m.hidden_size, m.seq_length, m.num_layers
    d, nq, ng = m.resolved_kv_channels(), m.num_attention_heads, m.resolved_query_groups()
    mats = 3 if m.swiglu else 2
    attn = 2 * h * (nq + 2 * ng) * d + 4 * s * nq * d + 2 * h * nq * d
    dense_mlp = 2 * h * m.resolved_ffn_hidden_size() * mats
    if m.num_experts:
        f = m.moe_ffn_hidden_size or m.resolved_ffn_hidden_size()
        moe_mlp = 2 * h * f * mats * m.moe_router_topk + 2 * h * m.num_experts
        n_moe = sum(m.is_moe_layer(i) for i in range(L))
        mlp_total = n_moe * moe_mlp + (L - n_moe) * dense_mlp
    else:
        mlp_total = L * dense_mlp
    forward = L * attn + mlp_total + 2 * h * cfg.padded_vocab_size
    return 3.0 * forward


def flops_per_iteration(cfg) -> float:
    return flops_per_token(cfg) * cfg.training.global_batch_size * cfg.model.seq_length


_CPU_PEAK = None


def device_peak_flops(device: str) -> tuple[float, str]:
    """(peak FLOP/s, where the number comes from) for one device of this run."""
    global _CPU_PEAK
    import torch

    if device == "cuda":
        name = torch.cuda.get_device_name()
        for key, peak in GPU_PEAK_BF16.items():
            if key in name:
                return peak, f"{key} bf16 datasheet"
        return 989e12, "unknown GPU, H100 assumed"
    if _CPU_PEAK is None:  # one fp32 GEMM timed on this process's threads
        a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))  # global RNG untouched
        torch.mm(a, a)
        reps, t0 = 20, time.perf_counter()
        for _ in range(reps):
            torch.mm(a, a)
        _CPU_PEAK = reps * 2 * 512 ** 3 / (time.perf_counter() - t0)
    return _CPU_PEAK, "measured fp32 GEMM"
