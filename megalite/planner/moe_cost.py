"""Routing imbalance: how much more than the mean the most loaded EP rank receives.

A dropless MoE layer waits for its slowest EP rank -- the one whose experts got the most
token copies -- in the grouped GEMMs and in the all-to-all that returns them.  Three
sources for that factor (``ModelOptions.moe_routing``):

- ``"balanced"``: 1.0, an exact even split (an upper bound: Megatron's
  ``--moe-router-force-load-balancing``, which NeMo's and ModelZoo's MoE benchmarks use,
  draws random router logits -- ``apply_random_logits`` in router.py -- so it is
  ``"uniform"``);
- ``"uniform"``: every copy picks an expert uniformly at random -- the expected maximum of
  the EP ranks' binomial loads (no router preference, only sampling noise), which is what
  a well-balanced trained router approaches;
- a path to a megalite metrics file (``--metrics-file``, JSON lines): the per-layer
  ``moe_layer_N_tokens_per_expert`` counts a real run logged, grouped into this layout's
  EP ranks (experts are contiguous on a rank), max over mean per layer, averaged over the
  layers and the records.
- a number: that factor.
"""
from __future__ import annotations

import json
import math
import os
from functools import lru_cache
from statistics import NormalDist
from typing import Union

from megalite.config import ConfigError, ModelConfig
from megalite.planner.layout import Layout

Routing = Union[str, float]


def expected_max_normal(n: int) -> float:
    """E[max of n standard normals], Blom's approximation (exact enough for n <= 1024)."""
    if n <= 1:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def uniform_imbalance(m: ModelConfig, L: Layout, seq: int) -> float:
    """Max / mean EP-rank load when each token copy lands on a uniformly random expert."""
    if not m.num_experts or L.ep <= 1:
        return 1.0
    sp = L.tp if L.sp else 1
    copies = L.ep * (seq // L.cp) * L.micro_batch // sp * m.moe_router_topk   # per EP group
    p = 1.0 / L.ep
    mean = copies * p
    sd = math.sqrt(copies * p * (1 - p))
    return 1.0 + expected_max_normal(L.ep) * sd / mean


@lru_cache(maxsize=8)
def _logged_counts(path: str, mtime: float) -> tuple:
    """Every ``moe_layer_N_tokens_per_expert`` list of a metrics file (read once)."""
    out = []
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                raise ConfigError(f"--moe-routing: '{path}' is not a JSON-lines metrics "
                                  "file (pretrain_gpt.py --metrics-file)") from None
            out += [tuple(v) for k, v in rec.items()
                    if k.startswith("moe_layer_") and k.endswith("_tokens_per_expert")]
    return tuple(out)


def measured_imbalance(path: str, m: ModelConfig, L: Layout) -> float:
    """Mean over logged layers and records of max / mean tokens per EP rank."""
    if not os.path.isfile(path):
        raise ConfigError(f"--moe-routing: metrics file '{path}' does not exist")
    per_rank = max(1, m.num_experts // max(1, L.ep))
    ratios = []
    for counts in _logged_counts(path, os.path.getmtime(path)):
        if len(counts) != m.num_experts:
            raise ConfigError(f"--moe-routing: '{path}' logs {len(counts)} experts, "
                              f"the model has {m.num_experts}")
        loads = [sum(counts[i:i + per_rank]) for i in range(0, len(counts), per_rank)]
        mean = sum(loads) / len(loads)
        if mean > 0:
            ratios.append(max(loads) / mean)
    if not ratios:
        raise ConfigError(f"--moe-routing: '{path}' has no moe_layer_*_tokens_per_expert "
                          "records (train an MoE model with --metrics-file)")
    return sum(ratios) / len(ratios)


def routing_imbalance(routing: Routing, m: ModelConfig, L: Layout, seq: int) -> float:
    if not m.num_experts:
        return 1.0
    if isinstance(routing, (int, float)):
        if routing < 1:
            raise ConfigError(f"--moe-routing: an imbalance factor is >= 1, got {routing}")
        return float(routing)
    if routing == "balanced":
        return 1.0
    if routing == "uniform":
        return uniform_imbalance(m, L, seq)
    return measured_imbalance(routing, m, L) if L.ep > 1 else 1.0


# ---- token dispatch over the EP group ---------------------------------------------------

# Megatron-Core's dispatchers as the cost model sees them (--moe-token-dispatcher-type
# alltoall, or flex with --moe-flex-dispatcher-backend deepep | hybridep):
# - "alltoall": NCCL all-to-all of every (token, expert) pair: top-k copies per token, the
#   share bound for other nodes over the rank's NIC, the rest over NVLink;
# - "deepep": DeepEP's normal kernels (github.com/deepseek-ai/DeepEP, "internode" kernels):
#   a token crosses the network once per destination *node* (to the GPU of the same local
#   rank there), which forwards it over NVLink to each of that node's GPUs holding one of
#   its experts (once per GPU, not per expert); a node is the host's NVLink island -- on an
#   NVL72 rack the compute tray (DeepEP does not span multi-node NVLink);
# - "hybridep": the same once-per-node / once-per-GPU fan-out, with the NVLink domain as the
#   node (Megatron's transformer_config.py: "only hybridep backend supports the MNNVL case").
DISPATCHERS = ("alltoall", "deepep", "hybridep")


def _miss(pool: int, picked: int, avoid: int) -> float:
    """P(none of ``picked`` distinct draws from ``pool`` lands in a set of ``avoid``)."""
    p = 1.0
    for i in range(picked):
        p *= max(0.0, (pool - avoid - i) / (pool - i))
    return p


def dispatch_fanout(m: ModelConfig, L: Layout, dispatcher: str, node: int) -> tuple:
    """(copies over the network, copies over NVLink) one token costs per dispatch, with the
    top-k experts drawn uniformly without replacement; ``node``: the ranks of one NVLink
    island (the EP group's members on it: ``node // etp``).  Group-limited routing
    (--moe-router-num-groups / --moe-router-group-topk, groups = nodes) caps the nodes a
    token reaches at group-topk."""
    E, k, ep = m.num_experts, m.moe_router_topk, L.ep
    local = max(1, min(ep, node // max(1, L.etp)))       # EP ranks per island
    islands = -(-ep // local)
    if dispatcher not in DISPATCHERS:
        raise ConfigError(f"--moe-flex-dispatcher-backend: unknown dispatcher '{dispatcher}'; "
                          f"choose from {', '.join(DISPATCHERS)}")
    if dispatcher == "alltoall":
        return k * (ep - local) / ep, k * (local - 1) / ep
    per_rank, per_island = E // ep, E // islands
    gpus = ep * (1 - _miss(E, k, per_rank))               # distinct destination GPUs
    nodes = islands * (1 - _miss(E, k, per_island))       # distinct destination islands
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    if groups and group_topk and groups >= islands:
        nodes = min(nodes, group_topk * islands / groups)
    remote = nodes * (islands - 1) / islands              # islands other than this one
    # NVLink: every destination GPU once, less this rank when it holds one of the experts
    # and the arrival GPU on each remote island when it does (1 in ``local``)
    own = gpus / ep                                        # P(this rank holds one)
    return remote, max(0.0, gpus - own - remote / local)


def capacity_load(m: ModelConfig, imbalance: float, pad: bool) -> float:
    """The most loaded rank's expert rows over the mean with token dropping: an expert
    keeps at most capacity-factor x its mean share (--moe-expert-capacity-factor), and with
    --moe-pad-expert-input-to-capacity every expert runs exactly that many rows."""
    cf = m.moe_expert_capacity_factor
    if not m.num_experts or cf is None:
        return imbalance
    return float(cf) if pad else min(imbalance, float(cf))
