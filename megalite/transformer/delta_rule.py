"""The gated delta rule and the short causal convolution of Gated DeltaNet, in pure PyTorch.

The recurrence, per value head, with state S [dk, dv] (Yang et al., "Gated Delta Networks"):

    S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T,    o_t = S_t^T q_t

``chunk_gated_delta_rule`` computes it chunk by chunk (the WY / UT form): inside a chunk of C
tokens a unit lower-triangular solve condenses the C rank-one updates into matmuls, and
only the state S walks from chunk to chunk.  So the sequence costs s/C sequential steps of
[C, dk] x [dk, dv] products; the state entering the first chunk (``initial_state``) and the
one leaving the last (returned) let a caller continue a sequence elsewhere (context
parallelism hands them from rank to rank).

Document masking (packed sequences, ``--reset-attention-mask``): ``resets`` [b, s] marks the
tokens that start a document.  Such a token sees a zero state, i.e. ``exp(g_t) = 0``; rather
than put -inf into the cumulative decays (their differences would be NaN), each chunk is cut
into segments at its resets: decays between two tokens of different segments are zero, only
the chunk's first segment reads the incoming state, and only its last segment writes the
outgoing one.  Each document also starts a chunk of its own (``_align_documents``: the
tokens move to chunk-aligned places, zero-padded), as flash-linear-attention's varlen kernel
and transformers on each document alone chunk it: the same algorithm either way (float64
agrees to 1e-14), but a document cut into chunks at other places rounds differently in
fp32 (2e-5 on a three-document batch's logits against transformers, 2e-6 aligned:
tests/unit/test_gated_delta_net.py).  The cost is up to C - 1 padded tokens a document.

``causal_conv1d``: the depthwise convolution over the last ``K`` tokens of each channel,
seeing zeros before the sequence (or ``tail``, the previous ``K - 1`` tokens held by an
earlier CP rank) and, with ``documents``, nothing of an earlier document.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA kernels' and Qwen3-Next's form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def document_resets(document_ids: torch.Tensor,
                    previous: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[b, s] bool: token t starts a document (its id differs from token t-1's).  Token 0
    starts one only when ``previous`` (the id of the token before the sequence, [b], on an
    earlier CP rank) differs."""
    resets = torch.zeros_like(document_ids, dtype=torch.bool)
    resets[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    if previous is not None:
        resets[:, 0] = document_ids[:, 0] != previous
    return resets


def _align_documents(resets: torch.Tensor, chunk: int):
    """(index [b, s] of each token's place in the aligned layout, its length): every
    document after the first segment (which continues the incoming state) starts at a
    multiple of ``chunk``; a segment's tail is zero-padded up to the next one."""
    b, s = resets.shape
    seg = resets.to(torch.int64).cumsum(-1)                          # [b, s], 0 = continues
    n_seg = int(seg.max()) + 1
    lengths = torch.zeros(b, n_seg, dtype=torch.int64, device=resets.device)
    lengths.scatter_add_(1, seg, torch.ones_like(seg))
    padded = -(-lengths // chunk) * chunk
    starts = padded.cumsum(-1) - padded                              # aligned segment starts
    first = lengths.cumsum(-1) - lengths                             # original segment starts
    t = torch.arange(s, device=resets.device).expand(b, s)
    place = starts.gather(1, seg) + t - first.gather(1, seg)
    return place, int(padded.sum(-1).max())


def _scatter(x: torch.Tensor, place: torch.Tensor, length: int) -> torch.Tensor:
    """x [b, s, ...] moved to ``place`` in a zero tensor [b, length, ...]."""
    out = x.new_zeros(x.shape[0], length, *x.shape[2:])
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    out[rows, place] = x
    return out


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           g: torch.Tensor, beta: torch.Tensor, *, chunk_size: int = 64,
                           initial_state: Optional[torch.Tensor] = None,
                           resets: Optional[torch.Tensor] = None
                           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Outputs [b, s, h, dv] and the final state [b, h, dk, dv] of the gated delta rule.

    q, k [b, s, h, dk] (already L2-normalized; q is scaled by dk^-0.5 here), v [b, s, h, dv],
    g (log decay, <= 0) and beta [b, s, h]; every value head has its own q/k (repeat grouped
    heads before the call).  Computed in fp32, returned in v's dtype."""
    inside = None if resets is None else \
        torch.arange(resets.shape[1], device=resets.device) % chunk_size != 0
    if inside is not None and bool(resets[:, inside].any()):  # documents start chunks
        place, length = _align_documents(resets, chunk_size)
        moved = [_scatter(x, place, length) for x in (q, k, v, g, beta)]
        out, state = chunk_gated_delta_rule(
            *moved, chunk_size=chunk_size, initial_state=initial_state,
            resets=_scatter(resets, place, length))
        rows = torch.arange(out.shape[0], device=out.device)[:, None]
        return out[rows, place], state
    dtype = v.dtype
    b, s, h, dk = k.shape
    dv = v.shape[-1]
    C = chunk_size
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))  # [b, h, s, .]
    q = q * dk ** -0.5
    pad = (C - s % C) % C
    if pad:     # padded tokens: beta 0 (no update), g 0 (no decay): they change nothing
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (s + pad) // C
    q, k, v = (x.reshape(b, h, n, C, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, C), beta.reshape(b, h, n, C)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)                                                  # [b, h, n, C]

    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # j <= i
    if resets is None:
        same = lower
        first = last = None
    else:
        r = F.pad(resets, (0, pad)).reshape(b, 1, n, C).to(torch.int32)
        seg = r.cumsum(-1)                                              # segment in chunk
        same = lower & (seg[..., :, None] == seg[..., None, :])        # [b, 1, n, C, C]
        first = (seg == 0).to(q.dtype)                                  # reads the old state
        last = (seg == seg[..., -1:]).to(q.dtype)                       # writes the new one
    diff = (cum[..., :, None] - cum[..., None, :]).masked_fill(~same, float("-inf"))
    decay = diff.exp()                                                  # [b, h, n, C, C]

    # (I + L) u = v_beta and (I + L) w = k_beta exp(cum), L the strictly lower part of
    # (k_beta k^T) * decay: the chunk's updates condensed (the diagonal is the unit one)
    system = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    reads = k_beta * cum.exp()[..., None]
    q_read = q * cum.exp()[..., None]
    if first is not None:
        reads, q_read = reads * first[..., None], q_read * first[..., None]
    u = torch.linalg.solve_triangular(system + eye, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system + eye, reads, upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    k_write = k * (cum[..., -1:] - cum).exp()[..., None]
    carry = cum[..., -1].exp()                                          # [b, h, n]
    if last is not None:
        k_write = k_write * last[..., None]
        carry = carry * first[..., -1]

    state = (q.new_zeros(b, h, dk, dv) if initial_state is None
             else initial_state.to(q.dtype))
    outs = []
    for i in range(n):       # the only sequential part: the state from chunk to chunk
        v_new = u[:, :, i] - w[:, :, i] @ state
        outs.append(q_read[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * carry[:, :, i, None, None] + k_write[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=2).reshape(b, h, n * C, dv)[:, :, :s]
    return out.transpose(1, 2).to(dtype), state


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, *,
                  tail: Optional[torch.Tensor] = None,
                  documents: Optional[torch.Tensor] = None,
                  tail_documents: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Depthwise causal convolution: out[:, c, t] = sum_j weight[c, j] x[:, c, t - K + 1 + j].

    x [b, ch, s]; weight [ch, K].  ``tail`` [b, ch, K-1]: the tokens before the sequence
    (zeros when None).  ``documents`` [b, s] (and ``tail_documents`` [b, K-1]): a token sees
    only inputs of its own document."""
    K = weight.shape[1]
    s = x.shape[-1]
    prev = x.new_zeros(*x.shape[:-1], K - 1) if tail is None else tail.to(x.dtype)
    full = torch.cat([prev, x], dim=-1)                                 # [b, ch, K-1+s]
    if documents is None:
        return F.conv1d(full, weight[:, None, :].to(x.dtype), groups=x.shape[1])
    if tail_documents is None:      # nothing before the sequence: its own id never matches
        tail_documents = documents.new_full((documents.shape[0], K - 1), -1)
    docs = torch.cat([tail_documents, documents], dim=-1)              # [b, K-1+s]
    out = None
    for j in range(K):
        keep = (docs[:, j:j + s] == documents).to(x.dtype)[:, None]    # [b, 1, s]
        term = full[..., j:j + s] * weight[:, j, None].to(x.dtype) * keep
        out = term if out is None else out + term
    return out
