"""What ``--optimizer muon`` changes in the plan: optimizer state and optimizer time.

State: Muon keeps one fp32 momentum per weight-matrix element (4 bytes) where AdamW keeps
two moments (8); the embeddings, the output layer and the norms stay with AdamW
(optimizer/muon.py).  Biases and q/k-norm weights are counted as matrix elements here
(a few per thousand of a layer).

Time: Newton-Schulz on each whole matrix (a x b, m = min, n = max) costs, per iteration,
X X^T (2 m^2 n) + S S (2 m^3) + (bS + cS^2) X (2 m^2 n) FLOPs.  Every TP rank of a matrix
computes it whole (``--muon-tp-mode duplicated``); the distributed optimizer and FSDP2 give
each matrix to one rank of the shard group (optimizer/muon_layout.py), so a rank computes
1/d of its stage's matrices; DDP replicas each compute all of them.
"""
from __future__ import annotations

from typing import List, Tuple

from megalite.config.model import ModelConfig
from megalite.planner import model_spec as ms
from megalite.planner.layout import Layout

MOMENTUM_BYTES = 4


def matrix_params(m: ModelConfig, L: Layout, pp_rank: int) -> ms.ParamCount:
    """The stage's parameters Muon steps on one rank (TP-local): all but the embeddings,
    the output layer and the norms."""
    p = L.stage_params(m, pp_rank)
    dense = p.dense
    if pp_rank == 0:
        dense -= ms.embedding_params(m, L.tp)
    if pp_rank == L.output_rank:
        dense -= L.head_params(m)
    dense_layers, moe_layers = ms.stage_layer_kinds(m, L.pp, pp_rank, L.vpp, *L.stage_split)
    dense -= (dense_layers + moe_layers) * 2 * ms.norm_params(m, m.hidden_size)
    return ms.ParamCount(max(dense, 0), p.expert)


def layer_matrices(m: ModelConfig, moe: bool, ep: int = 1) -> List[Tuple[int, int]]:
    """Whole logical matrices of one layer (Q, K, V apart; a local expert's fc1, fc2)."""
    h, d = m.hidden_size, m.resolved_kv_channels()
    heads, groups = m.num_attention_heads, m.resolved_query_groups()
    blocks = 2 if m.swiglu else 1
    out = [(heads * d, h), (groups * d, h), (groups * d, h), (h, heads * d)]
    if moe:
        ffn = ms.moe_ffn(m)
        out += [(m.num_experts, h)] + [(blocks * ffn, h), (h, ffn)] * (m.num_experts // ep)
    else:
        out += [(blocks * m.resolved_ffn_hidden_size(), h), (h, m.resolved_ffn_hidden_size())]
    return out


def newton_schulz_flops(a: int, b: int, steps: int) -> int:
    lo, hi = min(a, b), max(a, b)
    return steps * (4 * lo * lo * hi + 2 * lo ** 3)


def stage_newton_schulz_flops(m: ModelConfig, L: Layout, pp_rank: int, steps: int) -> float:
    """FLOPs of one rank's Newton-Schulz per step: its stage's matrices, 1/d of them when
    the optimizer is sharded (ZeRO >= 1), all of them otherwise."""
    dense_layers, moe_layers = ms.stage_layer_kinds(m, L.pp, pp_rank, L.vpp, *L.stage_split)
    total = 0
    for n, moe in ((dense_layers, False), (moe_layers, True)):
        if n:
            total += n * sum(newton_schulz_flops(a, b, steps)
                             for a, b in layer_matrices(m, moe, L.ep))
    return total / (L.dense_shards if L.zero >= 1 else 1)


def optimizer_state_saving(m: ModelConfig, L: Layout, pp_rank: int, adam_bytes: int) -> int:
    """Bytes of optimizer state one rank keeps less under Muon than under AdamW."""
    p = matrix_params(m, L, pp_rank)
    per = adam_bytes - MOMENTUM_BYTES

    def held(n, shards):
        return -(-n // shards) if L.zero >= 1 else n
    return per * (held(p.dense, L.dense_shards) + held(p.expert, L.expert_shards))
