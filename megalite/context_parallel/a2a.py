"""All-to-all context parallelism (``--cp-comm-type a2a``, DeepSpeed-Ulysses).

Before attention one all-to-all trades sequence for heads: each CP rank sends every other
rank that rank's share of its heads (q, k and v packed in one message) for its own tokens,
and receives its heads for every token.  Attention then runs on the whole sequence with
np/CP query heads (ng/CP K/V heads, so GQA is kept), and a second all-to-all trades the
output back.  Backward runs the same two all-to-alls on the gradients (an all-to-all is its
own adjoint), so there are 2 all-to-alls forward and 2 backward per attention.

Tokens arrive as the rank-ordered concatenation of the load-balanced chunks
(``load_balance.py``); they are put in sequence order for the causal mask and back after.
Needs the (TP-local) head and K/V-head counts divisible by CP (``validation.py``).
Packed documents (``--reset-attention-mask``) and sliding windows (``--window-size``): the
whole sequence is here, so the mask (``transformer/attention_masks.keep``) is one boolean
SDPA mask, as without CP.  A softmax denominator term (``softmax_offset``): this rank's
block of the heads takes its block of the logits into the unfused kernel (SDPA has none).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megalite import comm
from megalite.config import score_mods
from megalite.context_parallel.load_balance import gathered_order
from megalite.context_parallel.max_logits import head_block
from megalite.context_parallel.ring import check_cp_attention_args, work
from megalite.transformer.attention_kernels import unfused_attention
from megalite.transformer.attention_masks import LayerMask
from megalite.transformer.softmax_denominator import build_denominator_logits
from megalite.transformer.qk_logits import max_logit_per_head, record_max
from megalite.transformer.spec import AttnMaskType

# SDPA's enable_gqa arrived in torch 2.5 (transformer/attention.py has the same fallback)
SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


class AllToAll(torch.autograd.Function):
    """x [CP, ...]: slice j goes to CP rank j; the output's slice j came from rank j.  The
    same exchange is its own adjoint, so backward runs it on the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return exchange(x, group)

    @staticmethod
    def backward(ctx, grad):
        return exchange(grad, ctx.group), None


def exchange(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()       # (empty_like would copy a transposed input's strides)
    return comm.all_to_all_single(torch.empty(x.shape, dtype=x.dtype, device=x.device), x, group)


class UlyssesAttention(nn.Module):
    """Core attention that all-to-alls heads for sequence over CP (layout ``bhsd``)."""
    qkv_format = "bhsd"

    def __init__(self, model_cfg, comm_groups, *, layer_number: int = 0,
                 attn_mask_type: AttnMaskType = AttnMaskType.causal,
                 softmax_scale: Optional[float] = None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None):
        super().__init__()
        check_cp_attention_args(model_cfg, attn_mask_type, "all-to-all attention")
        self.group = comm_groups.cp
        heads = model_cfg.num_attention_heads // comm_groups.tp.size
        groups = model_cfg.resolved_query_groups() // comm_groups.tp.size
        assert heads % self.group.size == 0 and groups % self.group.size == 0, (
            f"rule 'all-to-all CP splits heads over TP x CP' (cli/features.py): this rank's "
            f"heads ({heads}) and query groups ({groups}), CP {self.group.size}")
        self.layer_number = layer_number
        self.is_causal = attn_mask_type == AttnMaskType.causal
        self.mask = LayerMask(model_cfg, layer_number)       # --window-size on this layer
        self.score_mods = score_mods.active(model_cfg)   # whole sequence: any applies
        build_denominator_logits(self, model_cfg, comm_groups)   # softmax_offset or None
        self.scale = softmax_scale if softmax_scale is not None else \
            1.0 / math.sqrt(k_channels or model_cfg.resolved_kv_channels())
        self._order = None
        # --qk-clip: this step's largest logit per local head (context_parallel/max_logits.py)
        self.record_max_logits = getattr(model_cfg, "qk_clip", False)
        self.max_logits: Optional[torch.Tensor] = None

    def _orders(self, seq: int, device):
        if self._order is None or self._order[0].numel() != seq:
            order = gathered_order(seq, self.group.size, device)
            self._order = (order, torch.argsort(order))
        return self._order

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``document_ids`` [b, S]: the whole sequence's documents (``--reset-attention-mask``)."""
        cp = self.group.size
        b, h, s, d = q.shape
        g, dv = k.shape[1], v.shape[-1]
        hq, hk = h // cp, g // cp
        # [b, heads, s, d] -> [b, cp, heads/cp * s * d] per tensor, q|k|v packed per rank
        # (flattened, so K and V may have other head dims than Q: Multi-Latent Attention)
        parts = [t.reshape(b, cp, -1) for t in (q, k, v)]
        sizes = [t.shape[-1] for t in parts]
        y = AllToAll.apply(torch.cat(parts, dim=2).transpose(0, 1), self.group)
        order, inverse = self._orders(cp * s, q.device)        # y: [cp (src), b, packed]

        def whole_sequence(t, heads, dim):                     # [b, heads/cp, S, dim]
            t = t.reshape(cp, b, heads, s, dim).permute(1, 2, 0, 3, 4)
            return t.reshape(b, heads, cp * s, dim).index_select(2, inverse)   # in order

        qy, ky, vy = y.split(sizes, dim=-1)
        qf, kf, vf = whole_sequence(qy, hq, d), whole_sequence(ky, hk, d), \
            whole_sequence(vy, hk, dv)
        pos = torch.arange(cp * s, device=q.device)
        mask = self.mask.keep(pos, pos, self.is_causal, document_ids,
                              document_ids)                            # [b|1, S, S] or None
        work.add(qf, kf, self.is_causal, mask)
        if self.record_max_logits and self.training:    # this rank's block of the heads
            self.max_logits = record_max(self.max_logits, head_block(
                max_logit_per_head(qf, kf, self.scale, self.is_causal), h, self.group.rank))
        o = self._attend(qf, kf, vf, mask, hq, hk)                  # [b, h/cp, S, dv]
        o = o.index_select(2, order)                               # rank order again
        o = o.reshape(b, hq, cp, s, dv).permute(2, 0, 1, 3, 4)      # [cp (dst), b, h/cp, s, dv]
        o = AllToAll.apply(o, self.group)                          # [cp (head block), ...]
        return o.permute(1, 0, 2, 3, 4).reshape(b, h, s, dv)

    def _attend(self, qf, kf, vf, mask, hq: int, hk: int) -> torch.Tensor:
        """Attention of this rank's heads over the whole sequence: SDPA, or the unfused
        kernel with this rank's block of the denominator logits and the score mods
        (config/score_mods.py: Gemma 2's cap)."""
        if self.softmax_offset is not None or self.score_mods:
            r = self.group.rank
            extra = None if self.softmax_offset is None else \
                self.softmax_offset[r * hq:(r + 1) * hq]
            return unfused_attention(qf, kf, vf, causal=self.is_causal and mask is None,
                                     scale=self.scale, keep_mask=mask, denominator_logits=extra,
                                     score_mods=self.score_mods)
        if hq != hk and not SDPA_HAS_GQA:                         # torch < 2.5
            kf, vf = (t.repeat_interleave(hq // hk, dim=1) for t in (kf, vf))
        gqa = {"enable_gqa": True} if hq != hk and SDPA_HAS_GQA else {}
        masks = {"is_causal": self.is_causal} if mask is None else {"attn_mask": mask[:, None]}
        return F.scaled_dot_product_attention(qf, kf, vf, scale=self.scale, **masks, **gqa)
