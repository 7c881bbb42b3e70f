"""Self-attention with grouped query heads split over tensor-parallel ranks.

``linear_qkv`` is one column-parallel matmul whose output rows are grouped per query
group: [q_g0 (heads_per_group*d), k_g0 (d), v_g0 (d), q_g1, ...].  A contiguous chunk of
that layout is whole query groups, so TP rank r simply owns groups
[r*G/tp, (r+1)*G/tp) together with their query heads -- no all-to-all, no duplication.

The three linears and core attention are slots of a spec (``transformer/spec.py``).
Core attention owns the q/k/v layout: it declares ``qkv_format`` and ``SelfAttention``
hands it q, k, v in that layout (views of the qkv output where possible):

  * ``"bhsd"``: q [b, np, s, d], k and v [b, ng, s, d]; returns [b, np, s, d]
  * ``"sbhd"``: q [s, b, np, d], k and v [s, b, ng, d]; returns [s, b, np, d]
    (Megatron's and TE's layout; context-parallel attention splits s here)

np / ng are this rank's query heads / key-value groups; query head j reads group
j // (np/ng).  Core attention is its own module so it can be recomputed alone.

Model switches on the way: ``--add-qkv-bias`` (a bias on linear_qkv alone, Qwen2) and
``--qk-layernorm`` (the ``q_layernorm`` / ``k_layernorm`` slots normalize each head's q
and k over the head dimension before RoPE, Qwen3).  The head dimension is
``--kv-channels``, independent of hidden / heads.

Llama 4's switches, per layer: ``--attention-chunk-size`` (chunked local attention on the
layers that rotate, handed to core attention as documents: ``attention_masks.LayerMask``),
``--qk-l2-norm`` (q and k of the rotating layers scaled to unit RMS after RoPE, as
transformers' ``Llama4TextL2Norm``) and ``--attn-temperature-tuning`` (the NoPE layers' queries
times ``rotary.query_temperature`` of their positions).
"""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import score_mods
from megalite.tensor_parallel.random import DrawsFromTracker
from megalite.transformer.attention_kernels import core_attention_kernel, unfused_attention
from megalite.transformer.attention_masks import LayerMask
from megalite.transformer.softmax_denominator import build_denominator_logits
from megalite.transformer.projection_norm import build_projection_qk_norms, norm_qkv_projection
from megalite.transformer.rotary import apply_rotary
from megalite.transformer.spec import AttnMaskType, build_module
from megalite.transformer.qk_logits import max_logit_per_head, record_max

# SDPA's enable_gqa arrived in torch 2.5; older versions expand k/v instead.
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)
QKV_FORMATS = ("bhsd", "sbhd")


def split_qkv(qkv: torch.Tensor, r: int, dim: int):
    """q [.., r, ..], k and v (``dim`` dropped): views of the grouped qkv output.  One split,
    so backward writes the qkv gradient with one concatenation; three slices would each fill
    a zero qkv-sized gradient, copy into it and add the three up."""
    q, k, v = torch.split(qkv, [r, 1, 1], dim=dim)
    return q, k.squeeze(dim), v.squeeze(dim)


class DotProductAttention(DrawsFromTracker, nn.Module):
    """softmax(q k^T / sqrt(d)) v, layout ``bhsd``; causal or unmasked, inside documents
    with ``--reset-attention-mask``, inside a sliding window with ``--window-size``; the
    scores modified as config/score_mods.py says (``--attn-logit-softcapping``: the unfused
    kernel, then).

    The kernel is SDPA or the unfused path, by ``--attention-backend`` and, for ``auto``,
    by the device, dtype and length of each call (``attention_kernels.py``).

    Attention-probability dropout draws from the tracker's model-parallel state: the heads
    are split over TP, so every rank must drop different elements.  Runs on this rank's
    whole sequence, so it refuses context parallelism rather than attend to a fraction.
    """
    qkv_format = "bhsd"

    def __init__(self, model_cfg, comm_groups, *, layer_number: int = 0,
                 attn_mask_type: AttnMaskType = AttnMaskType.causal,
                 softmax_scale: Optional[float] = None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None):
        super().__init__()
        # softmax_scale: None = 1/sqrt(q's head dim); k/v_channels: read off the tensors here
        # (TE's kernel needs them up front)
        self.softmax_scale = softmax_scale
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise ValueError(f"local core attention supports causal and no_mask masks, "
                             f"not {attn_mask_type}")
        if comm_groups.cp.size > 1:
            raise ValueError("local core attention has no context parallelism (CP size "
                             f"{comm_groups.cp.size}); use a CP core-attention spec")
        self.dropout = model_cfg.attention_dropout
        self.layer_number = layer_number
        self.is_causal = attn_mask_type == AttnMaskType.causal
        self.backend = getattr(model_cfg, "attention_backend", "auto")
        self.score_mods = score_mods.active(model_cfg)   # config/score_mods.py
        self.mask = LayerMask(model_cfg, layer_number)       # --window-size on this layer
        build_denominator_logits(self, model_cfg, comm_groups)   # softmax_offset or None
        # --qk-clip: this step's largest logit per local head (transformer/qk_logits.py)
        self.record_max_logits = getattr(model_cfg, "qk_clip", False)
        self.max_logits: Optional[torch.Tensor] = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``document_ids`` [b, s] (``--reset-attention-mask``): a query attends only to keys
        of its own document; ``self.mask``: the layer's own rule (a window: only the last
        w + 1 keys; ``attention_masks.LayerMask``), as a boolean mask for SDPA and an
        additive one for the unfused kernel."""
        p = self.dropout if self.training else 0.0
        mask = None
        if document_ids is not None or self.mask.masks_alone:
            pos = torch.arange(q.shape[2], device=q.device)
            mask = self.mask.keep(pos, pos, self.is_causal, document_ids,
                                  document_ids)                          # [b|1, s, s]
        causal = self.is_causal and mask is None
        if self.record_max_logits and self.training:
            self.max_logits = record_max(self.max_logits, max_logit_per_head(
                q, k, self.softmax_scale, self.is_causal))
        fork = self.rng_tracker.fork() if p > 0 else contextlib.nullcontext()
        extra = self.softmax_offset      # the unfused kernel alone has a denominator term
        kernel = core_attention_kernel(self.backend, q.device.type, q.shape[2], q.dtype, p,
                                       score_mods=bool(self.score_mods) or extra is not None)
        scale = self.softmax_scale
        sdpa = dict(dropout_p=p, is_causal=causal, scale=scale)
        if mask is not None:
            sdpa["attn_mask"] = mask[:, None]                       # [b, 1, s, s]: all heads
        with fork:
            if kernel == "unfused":
                return unfused_attention(q, k, v, causal=causal, dropout_p=p, scale=scale,
                                         score_mods=self.score_mods, keep_mask=mask,
                                         denominator_logits=extra)
            if v.shape[-1] != q.shape[-1]:
                return self._padded_value(q, k, v, sdpa)
            if k.shape[1] == q.shape[1]:
                return F.scaled_dot_product_attention(q, k, v, **sdpa)
            if _SDPA_GQA:  # query heads share k/v heads inside the kernel: no copies
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **sdpa)
            rep = q.shape[1] // k.shape[1]
            b, g, s, d = k.shape
            k = k[:, :, None].expand(b, g, rep, s, d).reshape(b, g * rep, s, d)
            v = v[:, :, None].expand(b, g, rep, s, v.shape[-1]).reshape(b, g * rep, s, -1)
            return F.scaled_dot_product_attention(q, k, v, **sdpa)

    @staticmethod
    def _padded_value(q, k, v, sdpa: dict):
        """SDPA's flash kernel needs one head dim for q, k and v; Multi-Latent Attention's
        values are narrower.  Zero columns make v as wide as q (the extra output columns
        are zero and dropped), so the fused kernel -- O(s) memory, where its math fallback
        keeps the s x s probabilities -- still runs; the padding costs one v-sized copy."""
        dv = v.shape[-1]
        v = F.pad(v, (0, q.shape[-1] - dv))
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] and _SDPA_GQA else {}
        out = F.scaled_dot_product_attention(q, k, v, **sdpa, **gqa)
        return out[..., :dv]


class SelfAttention(nn.Module):
    """linear_qkv -> RoPE -> core_attention -> linear_proj, on [s, b, h]."""

    def __init__(self, model_cfg, comm_groups, *, submodules, sequence_parallel: bool,
                 layer_number: int, attn_mask_type: AttnMaskType = AttnMaskType.causal,
                 device=None, dtype=None):
        super().__init__()
        m = model_cfg
        tp = comm_groups.tp.size
        self.head_dim = m.resolved_kv_channels()
        self.num_heads, self.num_groups = m.num_attention_heads, m.resolved_query_groups()
        # validation refused anything else: rule "heads split over TP" (cli/features.py)
        # and check_attention_shape (heads by groups)
        assert self.num_heads % tp == 0 and self.num_groups % tp == 0 and \
            self.num_heads % self.num_groups == 0, \
            f"rule 'heads split over TP': heads {self.num_heads}, groups {self.num_groups}, TP {tp}"
        self.heads_per_group = self.num_heads // self.num_groups
        self.local_groups = self.num_groups // tp
        qkv_out = (self.num_heads + 2 * self.num_groups) * self.head_dim
        # --attention-output-gate (Qwen3-Next): each group's rows end with a gate per query
        # channel, [q_g, k_g, v_g, gate_g], so a TP shard is still whole groups
        self.output_gate = m.attention_output_gate
        if self.output_gate:
            qkv_out += self.num_heads * self.head_dim
        std = m.init_method_std
        kw = dict(tp_group=comm_groups.tp, bias=m.add_bias_linear,
                  sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.linear_qkv = build_module(submodules.linear_qkv, m.hidden_size, qkv_out,
                                       init_std=std, **dict(kw, bias=m.add_bias_linear or
                                                            m.add_qkv_bias))
        self.q_layernorm = self.k_layernorm = None
        self.qk_norm_over_projection = m.qk_layernorm and m.qk_layernorm_scope == "projection"
        if self.qk_norm_over_projection:         # OLMo 2 (transformer/projection_norm.py)
            self.q_layernorm, self.k_layernorm = build_projection_qk_norms(
                m, comm_groups.tp, device=device, dtype=dtype)
        elif m.qk_layernorm:
            if submodules.q_layernorm is None or submodules.k_layernorm is None:
                raise ValueError("--qk-layernorm: this attention spec has no q_layernorm / "
                                 "k_layernorm slots")
            self.q_layernorm, self.k_layernorm = (
                build_module(slot, m, self.head_dim, tp > 1, device=device, dtype=dtype)
                for slot in (submodules.q_layernorm, submodules.k_layernorm))
        # --softmax-scale (Gemma's query_pre_attn_scalar ** -0.5): every core attention
        # takes it, as Multi-Latent Attention's does
        scale = {} if m.softmax_scale is None else {"softmax_scale": m.softmax_scale}
        # Llama 4 (module docstring): this layer's masks given as documents (its chunk), L2
        # q/k norm epsilon, whether its queries take the NoPE temperature
        # (``rotary.query_scale``)
        self.layer_mask = LayerMask(m, layer_number)   # the masks given as documents
        self.cp_size = comm_groups.cp.size      # document ids span the whole sequence
        self.l2_norm_eps = m.norm_epsilon if m.qk_l2_norm and m.layer_uses_rotary(layer_number) \
            else None
        self.query_temperature = m.layer_query_temperature(layer_number) is not None
        self.core_attention = build_module(submodules.core_attention, m, comm_groups,
                                           layer_number=layer_number,
                                           attn_mask_type=attn_mask_type, **scale)
        self.qkv_format = getattr(self.core_attention, "qkv_format", None)
        if self.qkv_format not in QKV_FORMATS:
            raise ValueError(f"core attention {type(self.core_attention).__name__} must declare "
                             f"qkv_format, one of {QKV_FORMATS}; got {self.qkv_format!r}")
        self.linear_proj = build_module(
            submodules.linear_proj, self.num_heads * self.head_dim, m.hidden_size,
            input_is_parallel=True, init_std=std / (2.0 * m.num_layers) ** 0.5,
            **kw)  # Megatron's scaled output init

    def forward(self, hidden: torch.Tensor,
                rotary: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``document_ids`` [b, s] (whole sequence): core attention keeps each query inside
        its document (``transformer/attention_masks.py``); None: plain causal."""
        qkv = self.linear_qkv(hidden)             # [s, b, groups*(r+2)*d] (+ r*d: the gate)
        if self.output_gate:
            gate, qkv = self._split_gate(qkv)
            return self.linear_proj(self._attend(qkv, rotary, document_ids)
                                    * torch.sigmoid(gate))
        return self.linear_proj(self._attend(qkv, rotary, document_ids))

    def _split_gate(self, qkv: torch.Tensor):
        """--attention-output-gate: (gate [s, b, heads*d] in the context's layout, the
        q/k/v rows [s, b, groups*(r+2)*d])."""
        s, b = qkv.shape[:2]
        r, g, d = self.heads_per_group, self.local_groups, self.head_dim
        qkv, gate = qkv.view(s, b, g, 2 * r + 2, d).split([r + 2, r], dim=3)
        return gate.reshape(s, b, g * r * d), qkv.reshape(s, b, g * (r + 2) * d)

    def _attend(self, qkv: torch.Tensor, rotary, document_ids) -> torch.Tensor:
        """q/k/v rows -> the context [s, b, heads*d] before ``linear_proj``."""
        if self.qk_norm_over_projection:
            qkv = norm_qkv_projection(qkv, self.q_layernorm, self.k_layernorm,
                                      self.local_groups, self.heads_per_group, self.head_dim)
        document_ids = self.layer_mask.documents(document_ids, qkv.shape[0] * self.cp_size,
                                                 qkv.shape[1], qkv.device)
        docs = {} if document_ids is None else {"document_ids": document_ids}
        if self.qkv_format == "sbhd":
            return self._attend_sbhd(qkv, rotary, docs)
        s, b = qkv.shape[:2]
        r, g, d = self.heads_per_group, self.local_groups, self.head_dim
        qkv = qkv.view(s, b, g, r + 2, d).permute(1, 2, 3, 0, 4)      # [b, g, r+2, s, d]
        q, k, v = split_qkv(qkv, r, dim=2)                             # views
        q, k = self._norm_qk(q, k)
        if rotary is not None and rotary[0] is not None:  # rotation writes q, k contiguously
            cos, sin = rotary                                          # [b|1, 1, s, d]
            q = apply_rotary(q, cos.unsqueeze(1), sin.unsqueeze(1))
            k = apply_rotary(k, cos, sin)
        q, k = self._l2_norm_qk(q, k)
        if self.query_temperature:      # NoPE layer: [b|1, s] in fp32, as transformers
            q = (q * rotary.query_scale[:, None, None, :, None]).to(q.dtype)
        q = q.reshape(b, g * r, s, d)                                  # [b, heads, s, d]
        ctx = self.core_attention(q, k, v, **docs)                     # [b, heads, s, d]
        return ctx.permute(2, 0, 1, 3).reshape(s, b, g * r * d)

    def _norm_qk(self, q: torch.Tensor, k: torch.Tensor):
        """--qk-layernorm: each head's q and k normalized over the head dim (last)."""
        if self.q_layernorm is None or self.qk_norm_over_projection:
            return q, k
        return self.q_layernorm(q), self.k_layernorm(k)

    def _l2_norm_qk(self, q: torch.Tensor, k: torch.Tensor):
        """--qk-l2-norm on this layer: q, k / RMS over the head dim (last), in fp32."""
        if self.l2_norm_eps is None:
            return q, k
        return tuple((x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) +
                                              self.l2_norm_eps)).type_as(x) for x in (q, k))

    def _attend_sbhd(self, qkv, rotary, docs: dict) -> torch.Tensor:
        s, b = qkv.shape[:2]
        r, g, d = self.heads_per_group, self.local_groups, self.head_dim
        qkv = qkv.view(s, b, g, r + 2, d)
        q, k, v = split_qkv(qkv, r, dim=3)                                 # views
        q, k = self._norm_qk(q, k)
        if rotary is not None and rotary[0] is not None:
            cos, sin = (t.permute(2, 0, 1, 3) for t in rotary)         # [s, b|1, 1, d]
            q = apply_rotary(q, cos.unsqueeze(2), sin.unsqueeze(2))
            k = apply_rotary(k, cos, sin)
        q, k = self._l2_norm_qk(q, k)
        if self.query_temperature:
            q = (q * rotary.query_scale.t()[:, :, None, None, None]).to(q.dtype)
        ctx = self.core_attention(q.reshape(s, b, g * r, d), k, v, **docs)   # [s, b, heads, d]
        return ctx.reshape(s, b, g * r * d)
