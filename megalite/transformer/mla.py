"""Multi-Latent Attention (DeepSeek-V2/V3; Megatron-Core's ``MLASelfAttention``).

Queries and keys/values pass through low-rank latents, and position information travels in
a separate, decoupled RoPE part:

    q    = q_up(norm(q_down(x)))            [heads, qk_head_dim + rope]   (or q_proj(x))
    c, r = kv_down(x)                       [kv_lora_rank] and [rope] (one head, shared)
    k, v = kv_up(norm(c))                   [heads, qk_head_dim] and [heads, v_head_dim]
    key  = [k ; rope(r) for every head],   query = [q_nope ; rope(q_pe)]
    out  = proj(softmax(query key^T * scale) v)

``scale`` is 1/sqrt(qk_head_dim + rope), times YaRN's mscale(factor, mscale_all_dim)^2
when the rope part is YaRN-scaled (DeepSeek-V3).  The latent norms exist with
``--qk-layernorm`` (Megatron's meaning; DeepSeek's models always have them).

Tensor parallelism splits the heads: the up projections are column-parallel and the output
projection row-parallel.  The down projections are small and every head needs their whole
output, so they are duplicated on every TP rank (``DuplicatedLinear``, as Megatron's TE
spec); with sequence parallelism they and the latent norms run on the rank's sequence shard
(their weight gradients are summed over TP) and the up projections gather the sequence.
The shared rope key ``r`` is gathered from the sequence shards with SP, and without SP it
is copied into the TP region (its gradient, which each rank only has for its own heads, is
summed in backward).

Core attention receives the expanded q, k [b, heads/tp, s, qk + rope] and v [b, heads/tp,
s, v_head_dim] in its ``qkv_format``, so context parallelism is the same spec choice as for
standard attention: its ring (p2p) and all-to-all carry the *expanded* K/V
(docs/models_mla_mtp.md says why).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import nn

from megalite.tensor_parallel.mappings import copy_to_tp_region, gather_from_sp_region
from megalite.transformer.attention import QKV_FORMATS
from megalite.transformer.rotary import RotaryEmbedding, apply_rotary, yarn_get_mscale
from megalite.transformer.spec import AttnMaskType, build_module

def mla_softmax_scale(model_cfg) -> float:
    """1/sqrt(qk + rope), times mscale(factor, mscale_all_dim)^2 when the rope part is YaRN
    (DeepSeek-V3; Megatron's ``MLASelfAttention.softmax_scale``)."""
    m = model_cfg
    scale = 1.0 / math.sqrt(m.qk_head_dim + m.qk_pos_emb_head_dim)
    if m.mla_rope_kind() == "yarn":
        scale *= yarn_get_mscale(m.rotary_scaling_factor, m.mscale_all_dim) ** 2
    return scale


def mla_rotary(model_cfg) -> RotaryEmbedding:
    """The rotary embedding of MLA's rope part (``--qk-pos-emb-head-dim`` wide; ``--rope-type``
    rope or yarn with the YaRN flags, ``transformer/rotary.py``)."""
    return RotaryEmbedding.from_config(model_cfg, model_cfg.qk_pos_emb_head_dim,
                                       model_cfg.mla_rope_kind())


class MLASelfAttention(nn.Module):
    """The self-attention slot's MLA choice: [s(/tp), b, h] -> [s(/tp), b, h]."""

    def __init__(self, model_cfg, comm_groups, *, submodules, sequence_parallel: bool,
                 layer_number: int, attn_mask_type: AttnMaskType = AttnMaskType.causal,
                 device=None, dtype=None):
        super().__init__()
        m = model_cfg
        tp = comm_groups.tp
        assert m.num_attention_heads % tp.size == 0, (   # validation refused anything else
            f"rule 'heads split over TP' (cli/features.py): heads {m.num_attention_heads}, "
            f"TP {tp.size}")
        self.tp_group = tp
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.local_heads = m.num_attention_heads // tp.size
        self.qk_dim, self.rope_dim, self.v_dim = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
        self.kv_lora_rank = m.kv_lora_rank
        heads, h, std = m.num_attention_heads, m.hidden_size, m.init_method_std
        q_head = self.qk_dim + self.rope_dim
        sp = self.sequence_parallel
        kw = dict(device=device, dtype=dtype)
        column = dict(tp_group=tp, bias=False, sequence_parallel=sp, init_std=std, **kw)
        duplicated = dict(tp_group=tp, bias=False, sequence_parallel=sp, init_std=std, **kw)

        def norm(slot, size):
            return build_module(slot, m, size, sp, **kw) if m.qk_layernorm else None

        self.linear_q_proj = self.linear_q_down_proj = self.q_layernorm = None
        self.linear_q_up_proj = None
        if m.q_lora_rank is None:
            self.linear_q_proj = build_module(submodules.linear_q_proj, h, heads * q_head,
                                              **column)
        else:
            self.linear_q_down_proj = build_module(submodules.linear_q_down_proj, h,
                                                   m.q_lora_rank, **duplicated)
            self.q_layernorm = norm(submodules.q_layernorm, m.q_lora_rank)
            self.linear_q_up_proj = build_module(submodules.linear_q_up_proj, m.q_lora_rank,
                                                 heads * q_head, **column)
        self.linear_kv_down_proj = build_module(submodules.linear_kv_down_proj, h,
                                                m.kv_lora_rank + self.rope_dim, **duplicated)
        self.kv_layernorm = norm(submodules.kv_layernorm, m.kv_lora_rank)
        self.linear_kv_up_proj = build_module(submodules.linear_kv_up_proj, m.kv_lora_rank,
                                              heads * (self.qk_dim + self.v_dim), **column)
        self.core_attention = build_module(
            submodules.core_attention, m, comm_groups, layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            softmax_scale=mla_softmax_scale(m), k_channels=q_head, v_channels=self.v_dim)
        self.qkv_format = getattr(self.core_attention, "qkv_format", None)
        if self.qkv_format not in QKV_FORMATS:
            raise ValueError(f"core attention {type(self.core_attention).__name__} must declare "
                             f"qkv_format, one of {QKV_FORMATS}; got {self.qkv_format!r}")
        self.linear_proj = build_module(
            submodules.linear_proj, heads * self.v_dim, h, tp_group=tp, bias=m.add_bias_linear,
            sequence_parallel=sp, input_is_parallel=True,
            init_std=std / (2.0 * m.num_layers) ** 0.5, **kw)   # Megatron's scaled output init

    def _shared_rope_key(self, k_pe: torch.Tensor) -> torch.Tensor:
        """The rope key [s, b, rope] every local head uses, from this rank's [s(/tp), b, rope]."""
        if self.sequence_parallel:
            return gather_from_sp_region(k_pe, self.tp_group)
        return copy_to_tp_region(k_pe, self.tp_group)

    def forward(self, hidden: torch.Tensor,
                rotary: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        docs = {} if document_ids is None else {"document_ids": document_ids}
        if self.linear_q_proj is not None:
            q = self.linear_q_proj(hidden)
        else:
            q_latent = self.linear_q_down_proj(hidden)
            if self.q_layernorm is not None:
                q_latent = self.q_layernorm(q_latent)
            q = self.linear_q_up_proj(q_latent)                          # [s, b, lh*(qk+r)]
        kv_latent, k_pe = self.linear_kv_down_proj(hidden).split(
            [self.kv_lora_rank, self.rope_dim], dim=-1)
        if self.kv_layernorm is not None:
            kv_latent = self.kv_layernorm(kv_latent)
        kv = self.linear_kv_up_proj(kv_latent)                           # [s, b, lh*(qk+v)]
        k_pe = self._shared_rope_key(k_pe)                               # [s, b, r]
        s, b = q.shape[:2]
        lh = self.local_heads
        # bhsd views: [b, lh, s, d]
        q = q.view(s, b, lh, self.qk_dim + self.rope_dim).permute(1, 2, 0, 3)
        k_nope, v = kv.view(s, b, lh, self.qk_dim + self.v_dim).permute(1, 2, 0, 3).split(
            [self.qk_dim, self.v_dim], dim=-1)
        q_nope, q_pe = q.split([self.qk_dim, self.rope_dim], dim=-1)
        k_pe = k_pe.view(s, b, 1, self.rope_dim).permute(1, 2, 0, 3)     # [b, 1, s, r]
        if rotary is not None:
            cos, sin = rotary                                            # [b|1, 1, s, r]
            q_pe = apply_rotary(q_pe, cos, sin)
            k_pe = apply_rotary(k_pe, cos, sin)
        query = torch.cat([q_nope, q_pe], dim=-1)
        key = torch.cat([k_nope, k_pe.expand(b, lh, s, self.rope_dim)], dim=-1)
        if self.qkv_format == "sbhd":
            ctx = self.core_attention(*(t.permute(2, 0, 1, 3) for t in (query, key, v)), **docs)
            return self.linear_proj(ctx.reshape(s, b, lh * self.v_dim))
        ctx = self.core_attention(query, key, v, **docs)                 # [b, lh, s, v]
        return self.linear_proj(ctx.permute(2, 0, 1, 3).reshape(s, b, lh * self.v_dim))
