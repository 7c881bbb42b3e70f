"""Gated DeltaNet under context parallelism: the recurrent state walks the CP ranks in
sequence order, point to point; the sequence itself never moves.

Causal load balancing (``load_balance.py``) gives rank r chunks r and 2 CP - 1 - r of the
2 CP chunks.  The delta rule is a recurrence, so chunk c needs the state that chunk c - 1
left, and the state visits the chunks in order:

    CP = 2:   rank 0: c0 --S1--> rank 1: c1 --(local)--> c2 --S3--> rank 0: c3
    CP = 4:   r0:c0 -> r1:c1 -> r2:c2 -> r3:c3 -> r3:c4 -> r2:c5 -> r1:c6 -> r0:c7

up the ranks through their first chunks, across on the last rank, back down through their
second chunks.  Each hop sends one state per sequence and local value head (heads x dk x dv
fp32: 16 x 128 x 128 x 4 B = 1 MiB at Qwen3-Next-80B's TP1), 2 CP - 1 hops per layer
forward, as many backward (the gradient walks the chunks in reverse).  The cost is the
wait: the recurrence is serial, so rank r starts its first chunk after r chunk-times and its
second after 2 CP - 1 - r, and a DeltaNet layer's core takes as long at CP N as at CP 1
(its projections, the convolution and the layer's MLP still split N ways, and the
full-attention layers run ring attention as usual).  ``benchmarks/gated_delta_net_cp.py``
measures CP2 against CP1.

The convolution needs the K - 1 inputs before each chunk: the first chunk's from rank
r - 1's first chunk, the second chunk's from rank r + 1's second (on the last rank: its own
first chunk); one exchange with both neighbours per layer, gradients sent back the same
way.  With ``--reset-attention-mask`` the documents of the whole sequence are at hand
(``document_ids`` [b, S]), so each chunk's resets and the convolution's document cut know
the token before the chunk, wherever it lives.

Sends and receives are autograd functions whose backward sends the gradient back to where
the tensor came from.  The send of the first chunk's state returns a token that the
receive of the second chunk's state takes as input, so the backward on every rank runs
"send the gradient of the state I received" before "wait for the gradient of the state I
sent" -- the order that walks the gradient down the chain without a cycle.
"""
from __future__ import annotations

import torch

from megalite import comm
from megalite.context_parallel.load_balance import chunk_ids
from megalite.transformer.delta_rule import (causal_conv1d, chunk_gated_delta_rule,
                                             document_resets)
from megalite.transformer.gated_delta_net import CHUNK_SIZE, GatedDeltaNet


class _Send(torch.autograd.Function):
    """Send ``x`` to global rank ``dst``; returns a zero token (keep it in the graph);
    backward receives the gradient of ``x`` from ``dst``."""

    @staticmethod
    def forward(ctx, x, dst, group):
        comm.batch_send_recv([(x.detach(), dst)], [], group)
        ctx.dst, ctx.group, ctx.like = dst, group, x
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        like = ctx.like
        grad = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        comm.batch_send_recv([], [(grad, ctx.dst)], ctx.group)
        return grad, None, None


class _Recv(torch.autograd.Function):
    """Receive a tensor shaped ``like`` from global rank ``src`` after ``after`` (a token);
    backward sends its gradient back to ``src``."""

    @staticmethod
    def forward(ctx, after, like, src, group):
        out = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        comm.batch_send_recv([], [(out, src)], group)
        ctx.src, ctx.group = src, group
        return out

    @staticmethod
    def backward(ctx, grad):
        comm.batch_send_recv([(grad.contiguous(), ctx.src)], [], ctx.group)
        return torch.zeros(()), None, None, None


class _Exchange(torch.autograd.Function):
    """Send ``to_prev`` to rank ``prev`` and ``to_next`` to ``nxt`` (None: no neighbour, and
    what comes back from it is zeros) and receive what each sent here; backward the same
    exchange with the gradients (what came from prev goes back to prev)."""

    @staticmethod
    def forward(ctx, to_prev, to_next, prev, nxt, group):
        ctx.prev, ctx.nxt, ctx.group = prev, nxt, group
        got_prev, got_next = (torch.zeros(t.shape, dtype=t.dtype, device=t.device)
                              for t in (to_prev, to_next))
        _swap(to_prev, to_next, got_prev, got_next, prev, nxt, group)
        return got_prev, got_next

    @staticmethod
    def backward(ctx, d_prev, d_next):
        g_prev, g_next = (torch.zeros(t.shape, dtype=t.dtype, device=t.device)
                          for t in (d_prev, d_next))
        _swap(d_prev.contiguous(), d_next.contiguous(), g_prev, g_next, ctx.prev, ctx.nxt,
              ctx.group)
        return g_prev, g_next, None, None, None


def _swap(to_prev, to_next, got_prev, got_next, prev, nxt, group):
    sends = [(t, p) for t, p in ((to_prev, prev), (to_next, nxt)) if p is not None]
    recvs = [(t, p) for t, p in ((got_prev, prev), (got_next, nxt)) if p is not None]
    comm.batch_send_recv(sends, recvs, group)


class ContextParallelGatedDeltaNet(GatedDeltaNet):
    """``GatedDeltaNet`` on this CP rank's two chunks (``context_parallel_spec`` puts it in
    the linear-attention slot when CP > 1): the state and the convolution's inputs before
    each chunk come from the ranks that hold the chunk before it."""

    def __init__(self, model_cfg, comm_groups, **kwargs):
        super().__init__(model_cfg, comm_groups, **kwargs)
        self.group = comm_groups.cp

    def _chunks(self, local: int):
        """This rank's two chunks as (start, end) positions of the whole sequence, from the
        length ``local`` of this rank's part."""
        n, r = self.group.size, self.group.rank
        c = local // 2
        return [(i * c, (i + 1) * c) for i in chunk_ids(n, r)]

    def _neighbours(self):
        n, r, ranks = self.group.size, self.group.rank, self.group.ranks
        return (ranks[r - 1] if r > 0 else None), (ranks[r + 1] if r < n - 1 else None)

    def _conv(self, mixed: torch.Tensor, document_ids) -> torch.Tensor:
        K1 = self.kernel - 1
        c = mixed.shape[-1] // 2
        assert c >= K1, f"CP chunks of {c} tokens are shorter than the convolution's {K1} tail"
        first, second = mixed[..., :c], mixed[..., c:]
        prev, nxt = self._neighbours()
        # rank r - 1 sent its first chunk's tail (before our first chunk); rank r + 1 its
        # second chunk's (before our second); the last rank's second follows its first
        got_prev, got_next = _Exchange.apply(second[..., -K1:], first[..., -K1:], prev, nxt,
                                             self.group)
        tail_first = got_prev if prev is not None else None
        tail_second = got_next if nxt is not None else first[..., -K1:]
        (a0, a1), (b0, b1) = self._chunks(mixed.shape[-1])
        docs = {}
        if document_ids is not None:
            docs = [dict(documents=document_ids[:, s:e],
                         tail_documents=document_ids[:, s - K1:s] if s >= K1 else None)
                    for s, e in ((a0, a1), (b0, b1))]
        out_first = causal_conv1d(first, self.conv_weight, tail=tail_first,
                                  **(docs[0] if docs else {}))
        out_second = causal_conv1d(second, self.conv_weight, tail=tail_second,
                                   **(docs[1] if docs else {}))
        return torch.cat([out_first, out_second], dim=-1)

    def _recurrence(self, q, k, v, decay, beta, document_ids) -> torch.Tensor:
        c = q.shape[1] // 2
        halves = [[t[:, :c], t[:, c:]] for t in (q, k, v, decay, beta)]
        resets = [None, None]
        if document_ids is not None:
            for i, (s, e) in enumerate(self._chunks(q.shape[1])):
                before = document_ids[:, s - 1] if s > 0 else None
                resets[i] = document_resets(document_ids[:, s:e], before)
        b, _, h, dk = q.shape
        like = q.new_empty(b, h, dk, v.shape[-1], dtype=torch.float32)
        prev, nxt = self._neighbours()
        after = torch.zeros((), requires_grad=torch.is_grad_enabled())
        state = None if prev is None else _Recv.apply(after, like, prev, self.group)
        first, state = chunk_gated_delta_rule(*(t[0] for t in halves), chunk_size=CHUNK_SIZE,
                                              initial_state=state, resets=resets[0])
        if nxt is not None:     # up to the next rank, and back down from it
            token = _Send.apply(state, nxt, self.group)
            state = _Recv.apply(token, like, nxt, self.group)
        second, state = chunk_gated_delta_rule(*(t[1] for t in halves), chunk_size=CHUNK_SIZE,
                                               initial_state=state, resets=resets[1])
        if prev is not None:    # down to the rank that holds the next chunk
            second = second + _Send.apply(state, prev, self.group)
        return torch.cat([first, second], dim=1)
