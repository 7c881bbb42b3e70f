"""Token dispatchers: get each (token, expert) pair to the rank holding that expert, run
the local experts, bring the outputs back and sum them weighted by the router's probs.

``alltoall`` (Megatron's ``MoEAlltoAllTokenDispatcher``), per MoE layer and micro-batch:
1. permute: this rank's pairs sorted by expert (so the rows for EP rank j are contiguous);
2. the per-expert counts are all-gathered over EP (every rank then knows every split);
3. all-to-all over EP with uneven splits: the rows arrive ordered [source rank][expert];
4. expert-TP > 1: the EP-received rows are all-gathered over expert-TP (its peers hold the
   same experts, other column shards, and received other tokens);
5. rows sorted to [local expert][source], the local experts run as a grouped GEMM;
6. the reverse: unsort, reduce-scatter over expert-TP (sums the partial outputs of the
   shards), all-to-all back, then unpermute: ``out[token] += prob * y``.
So each token's hidden state crosses EP to its top-k experts and back: two all-to-alls
forward and their two transposes backward, each of ``pairs x h`` elements in total.

``allgather`` (Megatron's ``MoEAllGatherTokenDispatcher``): all-gather the tokens, probs
and choices over the expert-TP x EP group, run the local experts on the pairs routed to
them, scatter the weighted outputs into the gathered layout, and reduce-scatter back
(the reduce sums the other experts' and the other shards' contributions).  Simple and
balanced in volume, but every rank sees every token of the group.

A rank that receives no token for an expert (or at all) runs empty GEMMs: nothing breaks.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from megalite.comm.flight_recorder import module_site
from megalite.moe.comm_ops import (all_gather_counts, all_to_all, gather_equal, gather_uneven,
                                   reduce_scatter_equal, reduce_scatter_uneven)


def sort_chunks(sizes: torch.Tensor) -> torch.Tensor:
    """Permutation of rows laid out as chunks ``sizes`` [A, B] in row-major order that
    orders them B-major (chunk (a, b) moves to position b * A + a)."""
    a, b = sizes.shape
    chunk = torch.repeat_interleave(torch.arange(a * b, device=sizes.device), sizes.reshape(-1))
    key = (chunk % b) * a + chunk // b
    return torch.argsort(key, stable=True)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


class GatherRows(torch.autograd.Function):
    """``x.index_select(0, index)`` where ``index`` visits every row of ``x`` exactly
    ``repeat`` times (a permutation of the rows repeated ``repeat`` times, row r at slots
    r*repeat .. r*repeat+repeat-1 of ``inverse``).  The backward is then a gather too --
    ``grad.index_select(0, inverse)`` summed over the repeats -- instead of the scatter-add
    that autograd's ``index_select`` backward would do."""

    @staticmethod
    def forward(ctx, x, index, inverse, repeat: int):
        ctx.save_for_backward(inverse)
        ctx.repeat = repeat
        return x.index_select(0, index)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        g = grad.index_select(0, inverse)
        if ctx.repeat > 1:
            g = g.view(-1, ctx.repeat, *g.shape[1:]).sum(1)
        return g, None, None, None


class Pairs:
    """This rank's (token, expert) pairs sorted by expert, and how many pairs each of the
    ``num_experts`` experts got.

    With every pair kept (no capacity dropping, all experts wanted: ``keep is None``) the
    sort is one permutation ``order`` of the T x k pair slots: ``permute`` gathers token
    ``order // k`` into each sorted row and ``unpermute`` gathers each slot's row back and
    sums the k slots of a token weighted by its probs -- gathers both ways, forward and
    backward.  Otherwise (dropped pairs, or only experts [first, last)) the kept pairs are
    listed explicitly and ``unpermute`` scatter-adds."""

    def __init__(self, probs, indices, keep, num_experts: int, first_expert: int = 0,
                 last_expert: Optional[int] = None):
        T, k = indices.shape
        self.num_tokens, self.topk, self.probs = T, k, probs
        expert = indices.reshape(-1)
        mask = None if keep is None else keep.reshape(-1)
        if last_expert is not None:     # only the experts in [first, last)
            inside = (expert >= first_expert) & (expert < last_expert)
            mask = inside if mask is None else mask & inside
        if mask is None:
            self.order = torch.argsort(expert, stable=True)
            self.inverse = inverse_permutation(self.order)
            self.token = self.weight = None
        else:
            slot = mask.nonzero().squeeze(1)
            slot = slot[torch.argsort(expert[slot], stable=True)]
            self.token, self.weight = slot // k, probs.reshape(-1)[slot]
            expert = expert[slot]
            self.order = None
        self.counts = torch.bincount(expert - first_expert,
                                     minlength=num_experts)[:num_experts]

    def permute(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.order is not None:
            return GatherRows.apply(tokens, self.order // self.topk, self.inverse, self.topk)
        return tokens.index_select(0, self.token)

    def unpermute(self, y: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """``out[token] = sum over its pairs of prob * y``."""
        if self.order is not None:
            assert num_tokens == self.num_tokens
            back = GatherRows.apply(y, self.inverse, self.order, 1)
            back = back.view(num_tokens, self.topk, y.shape[-1])
            return (back * self.probs.unsqueeze(-1).to(y.dtype)).sum(1)
        # index_put keeps only the index for backward, where index_add would also keep its
        # weighted source
        out = y.new_zeros((num_tokens, y.shape[-1]))
        return out.index_put((self.token,), y * self.weight.unsqueeze(-1).to(y.dtype),
                             accumulate=True)


class Dispatcher:
    """What both dispatchers share: the EP group, the local expert count, and the tokens
    each local expert received in the last call (for the load logging)."""

    def __init__(self, num_experts: int, ep_group):
        self.num_experts, self.ep = num_experts, ep_group
        self.num_local = num_experts // ep_group.size
        self.last_counts: Optional[torch.Tensor] = None

    @property
    def last_tokens_per_local_expert(self) -> Optional[List[int]]:
        return None if self.last_counts is None else [int(c) for c in self.last_counts.tolist()]


class AllToAllDispatcher(Dispatcher):
    def __init__(self, num_experts: int, ep_group, expert_tp_group):
        super().__init__(num_experts, ep_group)
        self.etp = expert_tp_group

    def __call__(self, tokens, probs, indices, keep, experts) -> torch.Tensor:
        ep, etp, n_local = self.ep, self.etp, self.num_local
        pairs = Pairs(probs, indices, keep, self.num_experts)
        x = pairs.permute(tokens)                                        # [pairs, h]
        if ep.size == 1 and etp.size == 1:      # nothing to exchange, no host round trip
            self.last_counts = pairs.counts
            return pairs.unpermute(experts(x, pairs.counts), tokens.shape[0])
        counts = all_gather_counts(pairs.counts, ep)                     # [ep, E]
        mine = counts[:, ep.rank * n_local:(ep.rank + 1) * n_local]      # [ep src, local]
        input_splits = pairs.counts.view(ep.size, n_local).sum(1).tolist()
        output_splits = mine.sum(1).tolist()
        with module_site("dispatch"):     # the flight recorder tells the two apart
            x = all_to_all(x, ep, output_splits, input_splits)           # [src][expert]
        chunks = mine.unsqueeze(0)                                       # [etp, ep, local]
        if etp.size > 1:
            chunks = all_gather_counts(mine.contiguous(), etp)
            x = gather_uneven(x, etp, chunks.sum((1, 2)).tolist())
        sizes = chunks.reshape(-1, n_local)                              # [etp*ep, local]
        per_expert = sizes.sum(0)
        self.last_counts = per_expert
        if sizes.shape[0] > 1:
            perm = sort_chunks(sizes)
            inv = inverse_permutation(perm)
            y = experts(GatherRows.apply(x, perm, inv, 1), per_expert.tolist())
            y = GatherRows.apply(y, inv, perm, 1)
        else:
            y = experts(x, per_expert.tolist())
        if etp.size > 1:
            y = reduce_scatter_uneven(y, etp, chunks.sum((1, 2)).tolist())
        with module_site("combine"):
            y = all_to_all(y, ep, input_splits, output_splits)
        return pairs.unpermute(y, tokens.shape[0])


class AllGatherDispatcher(Dispatcher):
    def __init__(self, num_experts: int, ep_group, tp_ep_group):
        super().__init__(num_experts, ep_group)
        self.group = tp_ep_group

    def __call__(self, tokens, probs, indices, keep, experts) -> torch.Tensor:
        g = self.group
        all_tokens = gather_equal(tokens, g)
        all_probs = gather_equal(probs, g)
        if g.size > 1:
            indices = all_gather_counts(indices.contiguous(), g).reshape(-1, indices.shape[1])
            if keep is not None:
                keep = all_gather_counts(keep.to(torch.uint8).contiguous(), g).reshape(
                    -1, keep.shape[1]).bool()
        first = self.ep.rank * self.num_local
        last = first + self.num_local if self.num_local < self.num_experts else None
        pairs = Pairs(all_probs, indices, keep, self.num_local, first, last)
        self.last_counts = pairs.counts
        y = experts(pairs.permute(all_tokens), pairs.counts)
        return reduce_scatter_equal(pairs.unpermute(y, all_tokens.shape[0]), g)


def build_dispatcher(model_cfg, comm_groups):
    kind = model_cfg.moe_token_dispatcher_type
    if kind == "alltoall":
        return AllToAllDispatcher(model_cfg.num_experts, comm_groups.ep, comm_groups.expert_tp)
    if kind == "allgather":
        return AllGatherDispatcher(model_cfg.num_experts, comm_groups.ep, comm_groups.tp_ep)
    raise ValueError(f"unknown --moe-token-dispatcher-type {kind!r}")
