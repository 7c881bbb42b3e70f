"""Which core-attention kernel runs (``--attention-backend``), and the unfused one.

Why: on CPU, SDPA's flash kernel is not always the fastest.  Its backward recomputes the
scores block by block, and in bf16 it is 2-8x slower than its own forward.  At short
sequences the explicit path is faster: two batched matmuls and a softmax that keep the
probabilities for backward.  It is Megatron's "unfused" attention.  Measured on the
2-core AMD EPYC with avx512_bf16, forward + backward of one layer in ms, flash / unfused
(``benchmarks/attention_kernels.py``; docs/performance.md):

    b x heads/groups x s x d    fp32            bf16
    12 x 4/4 x 64 x 32          1.07 / 0.71     2.99 / 0.60
    8 x 8/4 x 128 x 32          4.53 / 3.74     9.36 / 1.90
    8 x 8/4 x 256 x 32          13.8 / 15.0     16.5 / 6.13
    4 x 8/4 x 512 x 32          26.2 / 67.2     25.5 / 31.5

So ``auto`` picks unfused on CPU up to ``UNFUSED_MAX_SEQ`` of the dtype and SDPA otherwise.
The rule looks only at the device, dtype and length, never at a timing, so every rank and
every resumed run picks the same kernel and the losses stay reproducible.  The
probabilities cost ``b * heads * s * s`` elements per layer, which is why the limits are
short sequences only.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from megalite.config.score_mods import ScoreMod, apply_all
from megalite.config.attention_variants import denominator_logit
from megalite.transformer.attention_masks import additive
from megalite.transformer.softmax_denominator import softmax_with_denominator

# Longest sequence at which ``auto`` runs the unfused kernel on CPU, per dtype (above).
UNFUSED_MAX_SEQ = {torch.bfloat16: 256, torch.float32: 128}

_MASKS: Dict[Tuple[int, int, int, torch.dtype, str], torch.Tensor] = {}


def core_attention_kernel(backend: str, device_type: str, seq: int, dtype: torch.dtype,
                          dropout: float = 0.0, score_mods: bool = False) -> str:
    """"unfused", "flash" (SDPA's fused kernel) or "math" (SDPA's fallback when CPU dropout
    is on: it keeps the probabilities, like unfused).  The planner asks the same question.
    Modified scores (``score_mods``: config/score_mods.py) only the unfused kernel computes."""
    if backend in ("unfused", "local") or score_mods:
        return "unfused"
    if backend == "auto" and device_type == "cpu" and seq <= UNFUSED_MAX_SEQ.get(dtype, 0):
        return "unfused"
    return "math" if device_type == "cpu" and dropout > 0 else "flash"


def causal_bias(rows: int, s_q: int, s_k: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[rows * s_q, s_k]: -inf above the diagonal of each of ``rows`` stacked [s_q, s_k]
    blocks (SDPA's ``is_causal``), 0 elsewhere; cached."""
    key = (rows, s_q, s_k, dtype, str(device))
    bias = _MASKS.get(key)
    if bias is None:
        above = torch.ones(s_q, s_k, dtype=torch.bool, device=device).triu(1)
        bias = torch.zeros(s_q, s_k, dtype=dtype, device=device).masked_fill(above, float("-inf"))
        bias = _MASKS[key] = bias.repeat(rows, 1)
    return bias


def unfused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                      dropout_p: float = 0.0, scale: Optional[float] = None,
                      score_mods: Sequence[Tuple[ScoreMod, float]] = (),
                      keep_mask: Optional[torch.Tensor] = None,
                      denominator_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(q k^T * scale) v on ``bhsd`` q [b, np, s, d] and k, v [b, ng, s, d]
    (``scale`` default 1/sqrt(d); v may have another head dim, MLA's).  ``score_mods``:
    (entry, value) pairs of config/score_mods.py applied to the scaled scores before the
    mask (Gemma 2's soft-cap: scores -> cap * tanh(scores / cap)).
    ``keep_mask`` [b|1, s, s_k] (boolean, every head; ``transformer/attention_masks.py``)
    replaces the causal mask: a document mask, a sliding window.  ``denominator_logits``
    [np]: each head's logit joins the softmax denominator (``softmax_denominator.py``).

    The query heads of one group are stacked along the sequence, so each group is one
    batched matmul against its shared k / v (no copies of k, v).  Scale and causal mask go
    into that matmul (``baddbmm``, as Megatron's unfused path), so autograd keeps only the
    probabilities, and backward makes only their gradient and the scores' gradient (a
    score modification keeps what its own backward needs, e.g. the soft-cap's tanh: the mask
    must follow it, tanh(-inf) is -1)."""
    b, heads, s, d = q.shape
    groups, s_k = k.shape[1], k.shape[2]
    rows = heads // groups
    alpha = d ** -0.5 if scale is None else scale
    q3 = q.reshape(b * groups, rows * s, d)
    k3 = k.reshape(b * groups, s_k, d).transpose(1, 2)
    bias = None
    if keep_mask is not None:   # each group's stacked query heads share the sample's mask
        bias = additive(keep_mask, q.dtype)[:, None, None].expand(b, groups, rows, s, s_k)
        bias = bias.reshape(b * groups, rows * s, s_k)
    elif causal:
        bias = causal_bias(rows, s, s_k, q.dtype, q.device)
    if score_mods:
        scores = apply_all(torch.bmm(q3, k3).mul_(alpha), score_mods)
        if bias is not None:
            scores = scores + bias
    elif bias is not None:
        scores = torch.baddbmm(bias, q3, k3, alpha=alpha)      # [b*g, r*s, s_k]
    else:
        scores = torch.bmm(q3, k3).mul_(alpha)
    probs = torch.softmax(scores, dim=-1) if denominator_logits is None else \
        softmax_with_denominator(scores, denominator_logits, b, groups, rows, s)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    out = torch.bmm(probs, v.reshape(b * groups, s_k, v.shape[-1]))   # [b*g, r*s, dv]
    return out.view(b, heads, s, v.shape[-1])


def attention_kernel_of(cfg, device: str) -> str:
    """The core-attention kernel a run of ``cfg`` (a ``MegaliteConfig``) runs on ``device``
    ("flash", "math" or "unfused", as ``core_attention_kernel`` says): megalite's local core
    attention follows --attention-backend; CP's and TE's run SDPA or their own fused kernels.
    The planner's memory prediction asks it (planner/step_peak.py, commands/validate_run.py)."""
    local = cfg.model.transformer_impl != "transformer_engine"
    backend = cfg.model.attention_backend if local and cfg.parallel.cp == 1 else "flash"
    dtype = torch.bfloat16 if cfg.optimizer.bf16 else \
        torch.float16 if cfg.optimizer.fp16 else torch.float32
    # a softmax denominator term: the local and all-to-all attentions run the unfused
    # kernel (ring: its tiles)
    unfused = local and denominator_logit(cfg.model) is not None and (
        cfg.parallel.cp == 1 or cfg.parallel.cp_comm_type == "a2a")
    return core_attention_kernel(backend, device, cfg.model.seq_length, dtype,
                                 cfg.model.attention_dropout, score_mods=unfused)
