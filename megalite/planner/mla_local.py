"""Multi-Latent Attention (MLA) and Multi-Token Prediction (MTP) FLOPs for the DeepSeek-V3
published row -- a LOCAL stand-in, swapped out once ModelConfig carries these features
(issue 25: ``multi_latent_attention``, ``q_lora_rank``, ``kv_lora_rank``, ``qk_head_dim``,
``qk_pos_emb_head_dim``, ``v_head_dim``, ``mtp_num_layers``; flops.py will count them).
Then: delete this module, ``ModelOptions.mla`` and the row's ``mla`` option, and point the
row at the real preset.  Only time and model FLOPs use it; memory still sees the stand-in
model's multi-head attention (docs/planner.md says by how much).

Per token, forward, multiply-add = 2 (Megatron-Bridge's ``num_floating_point_operations``):
  q:  q_lora x (h + a (qk + rope))      kv: kv_lora x (h + a (qk + v)) + h x rope
  out: a v x h                          core: a s (qk + rope) + a s v   (x2, full mask)
MTP: each of ``mtp_layers`` adds one more transformer layer (counted as a layer of the
stand-in model) and one more output-layer pass (the shared head), plus its 2h -> h
projection.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from megalite.config import ModelConfig
from megalite.planner import flops as fl


@dataclass(frozen=True)
class MlaShape:
    q_lora_rank: int
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    mtp_layers: int = 0


# DeepSeek-V3's config.json.
DEEPSEEK_V3 = MlaShape(1536, 512, 128, 64, 128, mtp_layers=1)


def attention_linear_flops(m: ModelConfig, mla: MlaShape) -> float:
    h, a = m.hidden_size, m.num_attention_heads
    qk = mla.qk_head_dim + mla.qk_pos_emb_head_dim
    return 2.0 * (mla.q_lora_rank * (h + a * qk)
                  + mla.kv_lora_rank * (h + a * (mla.qk_head_dim + mla.v_head_dim))
                  + h * mla.qk_pos_emb_head_dim + a * mla.v_head_dim * h)


def up_projection_flops(m: ModelConfig, mla: MlaShape) -> float:
    """The q and kv up-projections (Megatron's ``mla_up_proj`` recompute module)."""
    a = m.num_attention_heads
    return 2.0 * a * (mla.q_lora_rank * (mla.qk_head_dim + mla.qk_pos_emb_head_dim)
                      + mla.kv_lora_rank * (mla.qk_head_dim + mla.v_head_dim))


def kind_forward_flops(m: ModelConfig, moe: bool, seq: int, mla: MlaShape) -> Dict[str, float]:
    """flops.kind_forward_flops with MLA in place of the stand-in's attention."""
    base = fl.kind_forward_flops(m, moe, seq)
    h, a, g, d = m.hidden_size, m.num_attention_heads, m.resolved_query_groups(), \
        m.resolved_kv_channels()
    standard = 2 * h * (a + 2 * g) * d + 2 * a * d * h
    core = 2.0 * a * seq * (mla.qk_head_dim + mla.qk_pos_emb_head_dim + mla.v_head_dim)
    return {"linear": base["linear"] - standard + attention_linear_flops(m, mla),
            "core": core}


def mtp_head_flops(m: ModelConfig, mla: MlaShape) -> float:
    """Per token, forward: the MTP modules' extra output-layer passes and projections."""
    return mla.mtp_layers * (fl.logits_forward_flops(m) + 2.0 * 2 * m.hidden_size ** 2)


def model_flops(m: ModelConfig, seq: int, batch: int, mla: MlaShape, causal: bool) -> float:
    """Megatron-Bridge's count: MLA layers (the MTP layers among them), logits once per
    output pass; causal halves the score work."""
    tokens = float(seq) * batch
    total = 0.0
    for i in range(m.num_layers):
        f = kind_forward_flops(m, m.is_moe_layer(i), seq, mla)
        total += f["linear"] + f["core"] * (0.5 if causal else 1.0)
    total += fl.logits_forward_flops(m) * (1 + mla.mtp_layers)
    return 3.0 * tokens * total
