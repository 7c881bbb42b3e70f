"""Enumerate legal layouts, drop those that do not fit, rank the rest by step time.

Legality is megalite's own: every candidate becomes a ``MegaliteConfig`` and goes through
``megalite.cli.validation.validate_layout``.  Pruning keeps 16k-GPU searches to about a second:
TP is a power of two within a node, PP divides the rank count left by TP x CP, a layout's
micro-batch / recomputation variants are skipped once its model states alone do not fit,
and a recomputation level is tried only when the cheaper one does not fit.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Iterator, List, Optional, Sequence

from megalite.config import ConfigError, ModelConfig, ParallelDims
from megalite.config.pipeline_layout import parse_layout, virtual_stages_of
from megalite.planner.estimate import (Estimate, ModelOptions, estimate, memory_of,
                                       with_run_settings)
from megalite.planner.hardware import Cluster
from megalite.planner.layout import Layout
from megalite.config.pipeline_schedules import AUTO, SCHEDULES, resolve_schedule
from megalite.cli import features
from megalite.cli.validation import validate_layout

SEARCHED_SCHEDULES = tuple(n for n, s in SCHEDULES.items() if s.searched)
MOE_SEARCHED_SCHEDULES = tuple(n for n, s in SCHEDULES.items() if s.searched_for_moe)

RECOMPUTE_ORDER = ("none", "selective", "full")


@dataclass(frozen=True)
class SearchSpace:
    """What the search may turn; ``None`` = every value the rules allow."""
    tp: Optional[Sequence[int]] = None
    pp: Optional[Sequence[int]] = None
    cp: Optional[Sequence[int]] = None
    ep: Optional[Sequence[int]] = None
    etp: Optional[Sequence[int]] = None           # expert-TP; None: 1 or TP
    vpp: Optional[Sequence[int]] = None
    micro_batch: Optional[Sequence[int]] = None
    recompute: Sequence[str] = RECOMPUTE_ORDER
    zero: Sequence[int] = (0, 1)                  # stages megalite has flags for
    schedules: Sequence[str] = SEARCHED_SCHEDULES
    moe_schedules: Sequence[str] = MOE_SEARCHED_SCHEDULES   # tried too for MoE models
    cp_min_seq: int = 16384                       # CP only for long sequences
    max_micro_batch: int = 8
    max_vpp: int = 8
    uneven: bool = True                           # Llama-3-style lighter first/last stages
    sequence_parallel: Optional[bool] = None      # None: try both when TP > 1
    # --num-distributed-optimizer-instances for stages >= 1 (HSDP); "node": the count that
    # keeps one instance (TP x DP x CP / R ranks) inside a node
    instances: Sequence = (1,)
    # --pipeline-model-parallel-layout: only this split (its stage count fixes PP x VPP)
    pipeline_layout: Optional[str] = None


@dataclass
class SearchResult:
    ranked: List[Estimate]
    rejected: Counter = field(default_factory=Counter)
    considered: int = 0
    seconds: float = 0.0
    best_oom: Optional[Estimate] = None


def _pow2_upto(n: int) -> List[int]:
    return [1 << i for i in range(int(math.log2(n)) + 1)] if n >= 1 else []


def divisors(n: int) -> List[int]:
    """Every positive divisor of ``n``, ascending (the sizes a dimension of ``n`` can take)."""
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _pick(values: List[int], allowed: Optional[Sequence[int]]) -> List[int]:
    return values if allowed is None else [v for v in values if v in set(allowed)]


def searched_schedules(m: ModelConfig, space: SearchSpace) -> List[str]:
    """The schedules tried: ``space.schedules``, and for an MoE model its ``moe_schedules``
    (DualPipeV, whose paired steps hide the expert all-to-all)."""
    return list(space.schedules) + [s for s in space.moe_schedules
                                    if m.num_experts and s not in space.schedules]


ACCOUNT_CHOICES = ((True, True), (False, True), (True, False))   # (embedding, loss)


def pipeline_splits(m: ModelConfig, pp: int, space: SearchSpace):
    """(first, last, vpp, accounts, layout) choices for PP: even (with interleaving); lighter
    first and last stages, either by --decoder-first/last-pipeline-num-layers (no
    interleaving) or -- with interleaving -- by counting the embedding and/or the loss as
    pipeline layers (Megatron's --account-for-*-in-pipeline-split, Llama 3's 126 + 2 = 16 x 8
    split); or only the given layout string, at the PP it fits."""
    L, none = m.num_layers, (False, False)
    if space.pipeline_layout:
        try:
            parse_layout(space.pipeline_layout, pp, L, m.mtp_num_layers or 0)
        except ConfigError:
            return                                   # its stage count does not fit this PP
        yield None, None, virtual_stages_of(space.pipeline_layout, pp), none, \
            space.pipeline_layout
        return
    if pp == 1:
        yield None, None, 1, none, None
        return
    if pp > L:
        return
    interleave = any(SCHEDULES[s].virtual_stages for s in searched_schedules(m, space))
    if L % pp == 0:
        per = L // pp
        vpps = [v for v in divisors(per) if v <= space.max_vpp] if interleave else [1]
        for v in _pick(vpps, space.vpp):
            yield None, None, v, none, None
        return
    if not space.uneven:
        return
    k = -(-L // pp)                                  # middle stages get ceil(L / pp)
    rest = L - (pp - 2) * k
    first = rest // 2
    if first >= 1 and rest - first >= 1:
        yield first, rest - first, 1, none, None
    if not interleave:
        return
    for accounts in ACCOUNT_CHOICES:
        slots = L + sum(accounts)
        if slots % pp:
            continue
        vpps = [v for v in divisors(slots // pp) if 1 < v <= space.max_vpp]
        for v in _pick(vpps, space.vpp):
            yield None, None, v, accounts, None


def enumerate_layouts(m: ModelConfig, seq: int, global_batch: int, cluster: Cluster,
                      space: SearchSpace) -> Iterator[List[Layout]]:
    """Yield groups of layouts that share model-parallel sizes (micro-batch / recompute /
    ZeRO variants), so a group can be skipped once its states alone cannot fit."""
    world, gpn = cluster.num_gpus, cluster.gpus_per_node
    heads, groups = m.num_attention_heads, m.resolved_query_groups()
    # TP up to the node, or 8 where the NVLink domain spans nodes (NVL72's trays of 4)
    tp_max = max(gpn, min(cluster.nvlink_domain, 8))
    tps = [t for t in _pow2_upto(min(tp_max, heads)) if features.heads_split(heads, groups, t)]
    cps = [1] if seq < space.cp_min_seq else [c for c in _pow2_upto(64)
                                              if features.cp_sequence_split(seq, c)]
    schedules = searched_schedules(m, space)
    for tp in _pick(tps, space.tp):
        for cp in _pick(cps, space.cp):
            if world % (tp * cp):
                continue
            for pp in _pick(divisors(world // (tp * cp)), space.pp):
                dp = ParallelDims(world, tp=tp, pp=pp, cp=cp).dp
                if global_batch % dp:
                    continue
                for first, last, vpp, accounts, layout in pipeline_splits(m, pp, space):
                    scheds = [s for s in schedules
                              if features.schedule_fits(SCHEDULES[s], vpp)] or \
                        [resolve_schedule(AUTO, vpp).name]
                    if pp == 1:
                        scheds = [resolve_schedule(AUTO, 1).name]
                    for sched in scheds:
                        for ep, etp in _expert_options(m, tp, pp, world, space):
                            fewest = SCHEDULES[sched].min_micro_batches(pp)
                            mbs = [b for b in _pow2_upto(space.max_micro_batch)
                                   if (global_batch // dp) % b == 0 and
                                   (global_batch // dp) // b >= fewest]   # DualPipeV: 2p
                            for sp in ([False, True] if tp > 1 else [False]):
                                if space.sequence_parallel is not None and tp > 1 and \
                                        sp != space.sequence_parallel:
                                    continue
                                dims = ParallelDims(world, tp, pp, cp, ep, etp, vpp)
                                yield [Layout(replace(dims, dp_instances=r), micro_batch=mb,
                                              global_batch=global_batch, recompute=rc, zero=z,
                                              sp=sp, schedule=sched, first_layers=first,
                                              last_layers=last, account_embedding=accounts[0],
                                              account_loss=accounts[1],
                                              pipeline_layout=layout)
                                       for z in space.zero
                                       for r in instance_options(space, z, dims, gpn)
                                       for mb in _pick(mbs, space.micro_batch)
                                       for rc in space.recompute]


def instance_options(space: SearchSpace, zero: int, dims: ParallelDims,
                     gpus_per_node: int) -> List[int]:
    """The instance counts R to try: those asked for that split both data-parallel groups
    (DP x CP and expert-DP) evenly; only R = 1 without sharding (DDP)."""
    if zero == 0:
        return [1]
    out = []
    for r in space.instances:
        if r == "node":          # one instance = tp x (dp x cp / R) ranks = a node
            r = max(1, dims.tp * dims.dp * dims.cp // gpus_per_node)
        if features.hsdp_splits(r, ((dims.dp * dims.cp, "dp x cp"), (dims.edp, "expert dp"))) \
                and r not in out:
            out.append(r)
    return out


def _expert_options(m: ModelConfig, tp: int, pp: int, world: int, space: SearchSpace):
    if not m.num_experts:
        yield 1, tp
        return
    etps = sorted({1, tp}) if space.etp is None else sorted(set(space.etp))
    for ep in _pick(divisors(m.num_experts), space.ep):
        for etp in etps:
            if world % (etp * ep * pp) == 0:
                yield ep, etp


def _legal(L: Layout, m: ModelConfig, seq: int,
           opts: ModelOptions = ModelOptions()) -> Optional[str]:
    try:
        validate_layout(with_run_settings(L.to_config(m, seq), opts))
    except ConfigError as exc:
        return str(exc)
    return None


def search(m: ModelConfig, seq: int, global_batch: int, cluster: Cluster,
           space: SearchSpace = SearchSpace(), opts: ModelOptions = ModelOptions()
           ) -> SearchResult:
    start = time.perf_counter()
    if m.seq_length != seq:                 # learned positions default to the sequence length
        m = replace(m, seq_length=seq)
    res = SearchResult([])
    for group in enumerate_layouts(m, seq, global_batch, cluster, space):
        # Cheapest-memory member first: if even that does not fit, skip the group.
        probe = min(group, key=lambda L: (-RECOMPUTE_ORDER.index(L.recompute), L.micro_batch,
                                          -L.zero))
        floor = memory_of(m, probe, seq, cluster, opts)
        if not floor.fits:
            res.rejected["out of memory"] += len(group)
            res.considered += len(group)
            _keep_oom(res, floor)
            continue
        reason = _legal(probe, m, seq, opts)   # the probe's batch and recompute are the group's
        if reason and not any(w in reason for w in ("micro-batch", "global-batch",   # extremes
                                                    "--recompute")):
            res.rejected[_short(reason)] += len(group)
            res.considered += len(group)
            continue
        fitted = set()
        for L in sorted(group, key=lambda L: RECOMPUTE_ORDER.index(L.recompute)):
            res.considered += 1
            key = (L.micro_batch, L.zero, L.instances)
            if key in fitted:                  # a cheaper recompute level already fits
                res.rejected["dominated (less recomputation fits)"] += 1
                continue
            est = memory_of(m, L, seq, cluster, opts)
            if not est.fits:
                res.rejected["out of memory"] += 1
                _keep_oom(res, est)
                continue
            reason = _legal(L, m, seq, opts)
            if reason:
                res.rejected[_short(reason)] += 1
                continue
            fitted.add(key)
            res.ranked.append(estimate(m, L, seq, cluster, opts, est))
    res.ranked.sort(key=lambda e: rank_key(e, cluster))
    res.seconds = time.perf_counter() - start
    return res


def _keep_oom(res: SearchResult, est: Estimate):
    if res.best_oom is None or est.memory["total"] < res.best_oom.memory["total"]:
        res.best_oom = est


def _short(msg: str) -> str:
    return " ".join(msg.split()[:8])


def rank_key(e: Estimate, cluster: Cluster, tolerance: float = 0.005):
    """Step time in 0.5% bins, then the tie-breakers: TP and EP inside a node's NVLink
    domain, PP across nodes, as much DP as possible, EP before TP for experts, CP only when needed."""
    L, gpn = e.layout, cluster.nvlink_domain
    bin_ = math.floor(math.log(e.step) / math.log1p(tolerance))
    return (bin_, L.tp * L.cp > gpn, L.etp * L.ep > gpn, L.cp, -L.dp, L.etp, L.vpp,
            L.zero, L.instances, RECOMPUTE_ORDER.index(L.recompute), -L.micro_batch, e.step)


def evaluate(m: ModelConfig, seq: int, L: Layout, cluster: Cluster,
             opts: ModelOptions = ModelOptions()) -> Estimate:
    """Estimate one given layout (no search), e.g. a published one to compare against."""
    reason = _legal(L, m, seq, opts)
    if reason:
        raise ConfigError(reason)
    return estimate(m, L, seq, cluster, opts)
