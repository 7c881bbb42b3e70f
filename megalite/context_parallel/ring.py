"""Ring attention (``--cp-comm-type p2p``): K/V blocks travel around the CP ring.

Each CP rank holds its load-balanced tokens (``load_balance.py``: chunks r and 2CP-1-r).
In CP steps every rank sees every other rank's K/V: at step i rank r holds the K/V of
rank (r - i) mod CP, and while it computes attention on that block it is already sending
it to r + 1 and receiving the next from r - 1 (``comm.batch_send_recv_async``).  Block
outputs merge exactly by the log-sum-exp rule.  Only the K/V heads travel (GQA); K and V
may have different head dims (Multi-Latent Attention sends its expanded K and V).

Causal masking with the 2CP chunk layout needs only three kinds of block pair:
  * step 0 (own K/V): a plain causal mask on the local tokens (they are in order);
  * K/V of an earlier rank (src < r): all local queries vs the K/V's first chunk, no mask
    (its second chunk lies after both local chunks and is skipped);
  * K/V of a later rank (src > r): the local second chunk vs both K/V chunks, no mask
    (the local first chunk precedes them both and is skipped).
Every rank computes the same amount: 2 chunk-pairs per step.

Packed documents (``--reset-attention-mask``, ``document_ids`` of the whole sequence) and
sliding windows (``--window-size``): each (local chunk, received chunk) pair the causal
rule leaves is its own block, masked to the pairs kept (``transformer/attention_masks.keep``,
on the true sequence positions of both sides); a block with none kept (no shared document,
or keys all outside the window) is skipped, forward and backward (``work.skipped`` counts
them).  The
chunk layout is unchanged, so the causal load balance holds as before; the work skipped
depends on where the documents end.

A softmax denominator term (``softmax_offset``): it joins the merged log-sum-exp once, after
the last block (``transformer/softmax_denominator.fold``); backward's block formulas then use
that final LSE and output unchanged, and the term's gradient comes from them alone.

Score modifications (config/score_mods.py: Gemma 2's soft-cap) act on each block's scores
(``block_attention``), forward and backward: they are elementwise, so blocks still merge.

Backward sends K/V around the ring again (CP - 1 transfers), with a dK/dV accumulator that
travels with them and is back at its owner after CP transfers.  Forward keeps only q, k, v,
the output and the LSE (fp32 for 16-bit inputs).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from megalite import comm
from megalite.config import score_mods
from megalite.context_parallel.block_attention import (accum_dtype, block_backward,
                                                       block_flops, block_forward, merge)
from megalite.context_parallel.load_balance import token_indices
from megalite.context_parallel.max_logits import ring_keys
from megalite.transformer.attention_masks import LayerMask
from megalite.transformer.softmax_denominator import (build_denominator_logits,
                                                       denominator_grad, fold)
from megalite.transformer.qk_logits import max_logit_per_head, record_max
from megalite.transformer.spec import AttnMaskType


class AttentionWork:
    """Forward attention work of this process: matmul FLOPs computed and FLOPs of unmasked
    (query, key) pairs; tests check that CP ranks are balanced."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.computed = self.useful = self.blocks = self.skipped = 0

    def add(self, q, k, causal: bool, mask=None):
        """``mask``: the block's boolean keep-mask [b, sq, sk] when documents mask it."""
        flops = block_flops(q, k)
        self.blocks += 1
        self.computed += flops
        sq, sk = q.shape[2], k.shape[2]
        if mask is not None:
            self.useful += flops * int(mask.sum()) // mask.numel()
        else:
            self.useful += flops * (sk * (sk + 1) // 2 + (sq - sk) * sk) // (sq * sk) \
                if causal else flops


work = AttentionWork()


def _ring_peers(group):
    r, n = group.rank, group.size
    return group.ranks[(r + 1) % n], group.ranks[(r - 1) % n]


def _pairs(step: int, rank: int, cp: int, causal: bool, c: int):
    """(query slice, key slice, masked) of the block pair at ``step``, or None when every
    pair of it is masked.  Slices index the local sequence (two chunks of ``c`` tokens)."""
    every = slice(None)
    if not causal:
        return every, every, False
    src = (rank - step) % cp
    if step == 0:
        return every, every, True
    if src < rank:
        return every, slice(0, c), False
    return slice(c, None), every, False


def _blocks(step: int, rank: int, cp: int, causal: bool, c: int, docs, layer_mask, device):
    """([(query slice, key slice, causal, keep-mask)] computed at ``step``, block pairs
    skipped).  Without a mask (``docs`` None, ``layer_mask`` masking nothing alone) the one
    pair of ``_pairs``, keep-mask None.  With one (``docs`` [b, S]: the documents of the
    whole sequence; ``layer_mask``: this layer's ``attention_masks.LayerMask``, a sliding
    window) each (local chunk, received chunk) pair the causal rule leaves is its own
    block, skipped when its mask keeps nothing."""
    if docs is None and not layer_mask.masks_alone:
        return [(*_pairs(step, rank, cp, causal, c), None)], 0
    s = 2 * c * cp
    q_idx = token_indices(s, cp, rank, device)
    k_idx = token_indices(s, cp, (rank - step) % cp, device)
    blocks, skipped = [], 0
    for qs in (slice(0, c), slice(c, 2 * c)):
        for ks in (slice(0, c), slice(c, 2 * c)):
            q_pos, k_pos = q_idx[qs], k_idx[ks]
            if causal and k_pos[0] > q_pos[-1]:
                continue                            # after every query: not a causal pair
            mask = layer_mask.keep(q_pos, k_pos, causal,
                                   None if docs is None else docs[:, q_pos],
                                   None if docs is None else docs[:, k_pos])
            if bool(mask.any()):
                blocks.append((qs, ks, causal, mask))
            else:
                skipped += 1
    return blocks, skipped


def _split_kv(kv: torch.Tensor, dk: int):
    """The K and V parts of a ring message [b, ng, s, dk + dv] (views)."""
    return kv[..., :dk], kv[..., dk:]


class RingAttentionFunction(torch.autograd.Function):
    """q [b, np, s, d], k [b, ng, s, d], v [b, ng, s, dv] (this rank's 2 chunks) ->
    [b, np, s, dv].  K and V travel as one message, concatenated along the head dim."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale: float, causal: bool, docs, layer_mask,
                extra=None, mods=()):
        cp, rank = group.size, group.rank
        nxt, prv = _ring_peers(group)
        c = q.shape[2] // 2
        dk = k.shape[-1]
        kv = torch.cat([k, v], dim=-1)                             # the message: K/V heads
        acc = accum_dtype(q.dtype)
        out = torch.zeros((*q.shape[:3], v.shape[-1]), dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        for step in range(cp):
            pending = None
            if step < cp - 1:
                incoming = torch.empty_like(kv)
                pending = comm.batch_send_recv_async([(kv, nxt)], [(incoming, prv)], group)
            blocks, skipped = _blocks(step, rank, cp, causal, c, docs, layer_mask, q.device)
            work.skipped += skipped
            for qs, ks, masked, mask in blocks:
                k_now, v_now = _split_kv(kv, dk)
                qb, kb, vb = q[:, :, qs], k_now[:, :, ks], v_now[:, :, ks]
                work.add(qb, kb, masked, mask)
                blk_out, blk_lse = block_forward(qb, kb, vb, scale, masked, mask, mods)
                merge(out[:, :, qs], lse[:, :, qs], blk_out.to(acc), blk_lse)
            if pending is not None:
                pending.wait()
                kv = incoming
        out, lse = fold(out, lse, extra)                 # the denominator term, once
        out = out.to(q.dtype)
        ctx.extra, ctx.mods = extra, mods
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.causal, ctx.docs, ctx.layer_mask = group, scale, causal, docs, \
            layer_mask
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale, causal, docs, layer_mask = ctx.group, ctx.scale, ctx.causal, ctx.docs, \
            ctx.layer_mask
        cp, rank = group.size, group.rank
        nxt, prv = _ring_peers(group)
        c = q.shape[2] // 2
        dout = dout.contiguous()
        acc = lse.dtype
        delta = (dout.to(acc) * out.to(acc)).sum(-1)               # rowsum(dO * O)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk_dim = k.shape[-1]
        kv = torch.cat([k, v], dim=-1)
        dkv_pending = dkv_in = None
        for step in range(cp):
            kv_pending = None
            if step < cp - 1:
                incoming = torch.empty_like(kv)
                kv_pending = comm.batch_send_recv_async([(kv, nxt)], [(incoming, prv)], group)
            blocks, _ = _blocks(step, rank, cp, causal, c, docs, layer_mask, q.device)
            grads = []
            for qs, ks, masked, mask in blocks:
                k_now, v_now = _split_kv(kv, dk_dim)
                dq_b, dk_b, dv_b = block_backward(dout[:, :, qs], q[:, :, qs], k_now[:, :, ks],
                                                  v_now[:, :, ks], lse[:, :, qs],
                                                  delta[:, :, qs], scale, masked, mask,
                                                  ctx.mods)
                dq[:, :, qs] += dq_b
                grads.append((ks, dk_b, dv_b))
            # the dK/dV accumulator of the K/V held now arrives from the previous rank
            if dkv_pending is not None:
                dkv_pending.wait()
                dkv = dkv_in
            else:
                dkv = torch.zeros_like(kv)
            dk_acc, dv_acc = _split_kv(dkv, dk_dim)
            for ks, dk_b, dv_b in grads:
                dk_acc[:, :, ks] += dk_b
                dv_acc[:, :, ks] += dv_b
            dkv_in = torch.empty_like(dkv)
            dkv_pending = comm.batch_send_recv_async([(dkv, nxt)], [(dkv_in, prv)], group)
            if kv_pending is not None:
                kv_pending.wait()
                kv = incoming
        dkv_pending.wait()                                          # our own K/V's grads
        dk, dv = _split_kv(dkv_in, dk_dim)
        d_extra = denominator_grad(ctx.extra, lse, delta) if ctx.needs_input_grad[8] else None
        return dq.to(q.dtype), dk, dv, None, None, None, None, None, d_extra, None


class RingAttention(nn.Module):
    """Core attention over the CP ring (layout ``bhsd``); a slot of the submodule spec."""
    qkv_format = "bhsd"

    def __init__(self, model_cfg, comm_groups, *, layer_number: int = 0,
                 attn_mask_type: AttnMaskType = AttnMaskType.causal,
                 softmax_scale: Optional[float] = None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None):
        super().__init__()
        check_cp_attention_args(model_cfg, attn_mask_type, "ring attention")
        self.group = comm_groups.cp
        self.layer_number = layer_number
        self.is_causal = attn_mask_type == AttnMaskType.causal
        self.scale = softmax_scale if softmax_scale is not None else \
            1.0 / math.sqrt(k_channels or model_cfg.resolved_kv_channels())
        self.mask = LayerMask(model_cfg, layer_number)       # --window-size on this layer
        build_denominator_logits(self, model_cfg, comm_groups)   # softmax_offset or None
        self.score_mods = score_mods.active(model_cfg)   # config/score_mods.py, per block
        # --qk-clip: this step's largest logit per local head (context_parallel/max_logits.py)
        self.record_max_logits = getattr(model_cfg, "qk_clip", False)
        self.max_logits: Optional[torch.Tensor] = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``document_ids`` [b, S]: the whole sequence's documents (``--reset-attention-mask``)."""
        if self.record_max_logits and self.training:
            self._record_max_logits(q, k)
        if self.group.size == 1:
            pos = torch.arange(q.shape[2], device=q.device)
            mask = self.mask.keep(pos, pos, self.is_causal, document_ids, document_ids)
            out, lse = block_forward(q, k, v, self.scale, self.is_causal, mask, self.score_mods)
            return fold(out, lse, self.softmax_offset)[0]
        return RingAttentionFunction.apply(q, k, v, self.group, self.scale, self.is_causal,
                                           document_ids, self.mask, self.softmax_offset,
                                           self.score_mods)

    def _record_max_logits(self, q, k) -> None:
        """This rank's queries against every key of the ring, on their true positions."""
        cp = self.group.size
        if cp == 1:
            mx = max_logit_per_head(q, k, self.scale, self.is_causal)
        else:
            keys, k_pos = ring_keys(k, self.group)
            q_pos = token_indices(cp * q.shape[2], cp, self.group.rank, q.device)
            mx = max_logit_per_head(q, keys, self.scale, self.is_causal, q_pos, k_pos)
        self.max_logits = record_max(self.max_logits, mx)


def check_cp_attention_args(model_cfg, attn_mask_type, what: str) -> None:
    """The masks CP attention computes.  It draws no attention dropout: a run with
    --attention-dropout > 0 is refused by the feature table (``features.CP_DROPOUT``)."""
    if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
        raise ValueError(f"{what} supports causal and no_mask masks, not {attn_mask_type}")
