"""Routing imbalance: how much more than the mean the most loaded EP rank receives.

A dropless MoE layer waits for its slowest EP rank -- the one whose experts got the most
token copies -- in the grouped GEMMs and in the all-to-all that returns them.  Three
sources for that factor (``ModelOptions.moe_routing``):

- ``"balanced"``: 1.0, routing forced to an even split (Megatron's
  ``--moe-router-force-load-balancing``, used by NeMo's MoE benchmarks);
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
