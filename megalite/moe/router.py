"""The top-k router: which experts each token goes to, with what weight, and the
load-balancing terms (Megatron-Core's ``TopKRouter`` / ``topk_softmax_with_capacity``).

Scores: ``softmax`` over the top-k logits (= softmax over all experts renormalized over
the top-k: Mixtral, Qwen3-MoE), ``softmax`` over all experts before the top-k with
``--moe-router-pre-softmax`` (not renormalized: Qwen2-MoE), or ``sigmoid`` normalized over
the top-k (DeepSeek-V3); then times ``--moe-router-topk-scaling-factor``.  With the DeepSeek-V3 expert bias the top-k is
chosen on ``score + bias`` while the weights stay the unbiased scores; the bias is not
trained by gradients but nudged after each step toward the under-loaded experts
(``MoELayer.update_expert_bias``).

Load-balancing terms go through the extra-loss channel (``add_extra_loss``), so any pipeline
stage adds them.  Their statistics (expert counts, summed scores, logsumexp^2) are summed
over every rank holding other parts of the SAME tokens -- the TP group with sequence
parallelism, the CP group with context parallelism -- so each term is the whole
sequence's, as on one rank.  Over TP the all-reduce's backward is the identity: every TP
rank sees the same term (the channel's contract) and back-propagates it into its own
tokens.  CP ranks count in the channel's 1 / (micro-batches x DP x CP) scale like data
ranks (``transformer/loss_reduction.extra_term_scale``), so over CP the backward all-reduces too: each rank's tokens get the gradient of
the whole term.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megalite.param_spec import ParamSpec, make_param
from megalite.tensor_parallel.mappings import copy_to_tp_region, reduce_from_tp_region
from megalite.moe.loss_names import AUX_LOSS, Z_LOSS, extra_loss_names  # noqa: F401  (re-exported)
from megalite.transformer.extra_losses import add_extra_loss


def capacity(num_tokens: int, num_experts: int, topk: int, factor: float) -> int:
    """Megatron's expert capacity: ceil(tokens x topk / experts x factor)."""
    return int(math.ceil(num_tokens * topk / num_experts * factor))


def group_limited_topk(scores: torch.Tensor, k: int, num_groups: Optional[int],
                       group_topk: Optional[int]) -> torch.Tensor:
    """Indices [T, k] of the top-k ``scores`` (Megatron's ``group_limited_topk`` when
    ``num_groups`` is set): the experts form ``num_groups`` equal groups, each token keeps
    the ``group_topk`` groups whose top ``k // group_topk`` scores sum highest, and takes
    its top-k among their experts -- so a token reaches at most ``group_topk`` EP ranks or
    nodes (DeepSeek-V2/V3's device- and node-limited routing)."""
    if not num_groups:
        return torch.topk(scores, k, dim=-1).indices
    T, E = scores.shape
    grouped = scores.view(T, num_groups, E // num_groups)
    group_scores = grouped.topk(k // group_topk, dim=-1).values.sum(-1)       # [T, groups]
    chosen = torch.topk(group_scores, group_topk, dim=-1, sorted=False).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    masked = grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(T, E)
    return torch.topk(masked, k, dim=-1).indices


class TopKRouter(nn.Module):
    """``forward(tokens [T, h], batch) -> (probs [T, k], indices [T, k], keep [T, k])``.

    ``batch``: the micro-batch size b (tokens are laid out [s, b] flattened, as the layer's
    hidden states), needed by the per-sequence aux loss.  ``keep`` is False for pairs
    dropped by the capacity factor (None without one: every pair kept).  ``last_stats``
    holds this forward's detached statistics for the layer's metrics (counts before
    dropping, the terms' values as tensors: no host round trip per layer).
    """

    def __init__(self, model_cfg, comm_groups, *, sequence_parallel: bool, layer_number: int,
                 device=None, dtype=None):
        super().__init__()
        m = model_cfg
        self.cfg = m
        self.num_experts, self.topk = m.num_experts, m.moe_router_topk
        self.layer_number = layer_number
        self.tp_group, self.cp_group = comm_groups.tp, comm_groups.cp
        self.sequence_parallel = sequence_parallel and comm_groups.tp.size > 1
        sp = self.tp_group.name if self.sequence_parallel else None
        make_param(self, "weight", ParamSpec((m.num_experts, m.hidden_size),
                                             init=("normal", m.init_method_std),
                                             sequence_parallel=sp), {}, device=device,
                   dtype=dtype)
        if getattr(m, "moe_expert_bias", False):     # gpt-oss: a trained logit bias
            make_param(self, "bias", ParamSpec((m.num_experts,), init=("zeros",),
                                               sequence_parallel=sp), {}, device=device,
                       dtype=dtype)
        else:
            self.bias = None
        bias = torch.zeros(m.num_experts, device=device, dtype=torch.float32) \
            if m.moe_router_enable_expert_bias else None
        self.register_buffer("expert_bias", bias)   # not trained: nudged after each step
        self.last_stats: Optional[dict] = None

    # -- statistics over the ranks holding parts of the same tokens -----------------------
    def _token_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks holding parts of the same tokens (module docstring): TP with
        SP (backward identity), CP (backward all-reduce)."""
        if self.sequence_parallel:
            t = reduce_from_tp_region(t, self.tp_group)
        if self.cp_group.size > 1:
            t = reduce_from_tp_region(copy_to_tp_region(t, self.cp_group), self.cp_group)
        return t

    def _tp_tokens(self, n: int) -> int:
        """Tokens of the whole sequence(s) ``n`` local tokens are part of."""
        return n * (self.tp_group.size if self.sequence_parallel else 1) * self.cp_group.size

    # -- routing --------------------------------------------------------------------------
    def _select(self, logits: torch.Tensor, need_aux: bool):
        """(probs [T, k], indices [T, k], scores for the aux loss [T, E] or None), the
        probs scaled by ``--moe-router-topk-scaling-factor`` (Megatron: after the score
        function and the normalization; the aux-loss scores are not scaled)."""
        probs, idx, aux_scores = self._scores(logits, need_aux)
        factor = self.cfg.moe_router_topk_scaling_factor
        return (probs * factor if factor else probs), idx, aux_scores

    def _scores(self, logits: torch.Tensor, need_aux: bool):
        m, k = self.cfg, self.topk
        bias = self.expert_bias

        def topk(routed):
            return group_limited_topk(routed, k, m.moe_router_num_groups,
                                      m.moe_router_group_topk)

        if m.moe_router_score_function == "sigmoid":
            scores = torch.sigmoid(logits)
            routed = scores if bias is None else scores + bias
            idx = topk(routed)
            probs = scores.gather(1, idx)
            if k > 1:
                probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
            aux_scores = scores / (scores.sum(-1, keepdim=True) + 1e-20) if need_aux else None
            return probs, idx, aux_scores
        if m.moe_router_pre_softmax:
            scores = torch.softmax(logits, dim=-1)
            routed = scores if bias is None else scores + bias
            idx = topk(routed)
            probs = scores.gather(1, idx)
        else:
            routed = logits if bias is None else logits + bias
            idx = topk(routed)
            probs = torch.softmax(logits.gather(1, idx), dim=-1)
        return probs, idx, torch.softmax(logits, dim=-1) if need_aux else None

    def _drop(self, probs, idx) -> torch.Tensor:
        """Capacity-factor dropping: each expert keeps at most ``capacity`` of this rank's
        pairs, by probability or by position (Megatron's ``--moe-token-drop-policy``).
        None without a capacity factor: every pair is kept."""
        m = self.cfg
        T, k, E = probs.shape[0], self.topk, self.num_experts
        if not m.moe_expert_capacity_factor:
            return None
        cap = capacity(T, E, k, m.moe_expert_capacity_factor)
        dense = torch.zeros(T, E, dtype=probs.dtype, device=probs.device)
        dense.scatter_(1, idx, probs.detach() + 1.0)        # > 0 where routed
        if m.moe_token_drop_policy == "position":
            rank = torch.arange(T, 0, -1, device=probs.device, dtype=probs.dtype)[:, None]
            dense = torch.where(dense > 0, rank.expand(T, E), dense)
        top = torch.topk(dense, min(cap, T), dim=0).indices           # [cap, E]
        kept = torch.zeros(T, E, dtype=torch.bool, device=probs.device)
        kept.scatter_(0, top, True)
        kept &= dense > 0
        return kept.gather(1, idx)

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, E]; --moe-router-dtype: the matmul itself in that dtype."""
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.cfg.moe_router_dtype)
        if dtype is None:
            return F.linear(tokens, self.weight, self.bias).float()
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(tokens.to(dtype), self.weight.to(dtype), bias).float()

    def forward(self, tokens: torch.Tensor, batch: int):
        m = self.cfg
        logits = self._logits(tokens)                                        # [T, E]
        lb = m.moe_router_load_balancing_type
        need_aux = lb != "none" and bool(m.moe_aux_loss_coeff)
        probs, idx, aux_scores = self._select(logits, need_aux)
        keep = self._drop(probs, idx)
        T, E, k = logits.shape[0], self.num_experts, self.topk
        counts = self._token_sum(torch.bincount(idx.reshape(-1), minlength=E).float())  # [E]
        stats = {"counts": counts.detach(), "aux_loss": 0.0, "z_loss": 0.0}
        if need_aux:
            if lb == "aux_loss":
                n = self._tp_tokens(T)
                score_sum = self._token_sum(aux_scores.sum(0))
                aux = (score_sum * counts).sum() * (E * m.moe_aux_loss_coeff / (k * n * n))
            else:   # per sequence: tokens are [s, b] flattened
                s = self._tp_tokens(T // batch)
                routing_map = torch.zeros(T, E, dtype=torch.float32, device=logits.device)
                routing_map.scatter_(1, idx, 1.0)
                per_seq_counts = self._token_sum(routing_map.view(-1, batch, E).sum(0))
                per_seq_scores = self._token_sum(aux_scores.view(-1, batch, E).sum(0))
                aux = (per_seq_scores * per_seq_counts).sum() * (
                    E * m.moe_aux_loss_coeff / (k * s * s * batch))
            add_extra_loss(AUX_LOSS, aux)
            stats["aux_loss"] = aux.detach()
        if m.moe_z_loss_coeff:
            lse = torch.logsumexp(logits, dim=-1)
            z = self._token_sum(lse.square().sum()) * (m.moe_z_loss_coeff / self._tp_tokens(T))
            add_extra_loss(Z_LOSS, z)
            stats["z_loss"] = z.detach()
        self.last_stats = stats
        return probs.to(tokens.dtype), idx, keep
