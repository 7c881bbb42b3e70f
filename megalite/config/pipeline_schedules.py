"""The pipeline-schedule registry: every schedule by its ``--pipeline-schedule`` name, with
the planner's bubble and in-flight formulas, and ``plan``, the program each rank walks.

Everything the rest of megalite asks about a schedule comes through here (the flag's
choices, the executor, validation, the feature table, the planner, ``megalite viz``); the
programs themselves are built by ``pipeline_orders`` (1F1B, interleaved, ZB-H1, ZB-V),
``pipeline_dualpipev`` and ``pipeline_pairs`` (combined 1F1B and the F&B pair transforms)
in the vocabulary of ``pipeline_program``, which also simulates them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from megalite.config.pipeline_dualpipev import dualpipev_program
from megalite.config.pipeline_orders import (interleaved_program, order_1f1b,
                                             order_interleaved, order_zbv, orders_zero_bubble)
from megalite.config.pipeline_pairs import delay_wgrad, order_combined_1f1b, pairs_adjacent
from megalite.config.pipeline_program import (UNIT_COSTS, Costs, Op, build_program,
                                              check_fifo, peak_in_flight, simulate,
                                              unpaired_forwards)


def compute_orders(schedule: str, p: int, m: int, v: int = 1,
                   forward_only: bool = False) -> List[List[Op]]:
    """Every rank's compute order of ``schedule`` (a name of ``SCHEDULES``)."""
    return get_schedule(schedule).orders(p, m, v, forward_only)


@functools.lru_cache(maxsize=64)
def plan(schedule: str, p: int, m: int, v: int = 1, forward_only: bool = False,
         overlap: bool = False, delay: bool = False):
    """The program every rank walks for one iteration (cached; unit-cost placement).
    ``overlap`` (``--overlap-moe-expert-parallel-comm``): the schedule's F&B-paired
    variant (1F1B: combined 1F1B; DualPipeV pairs anyway); ``delay``
    (``--delay-wgrad-compute``): paired backwards split into B + W (``delay_wgrad``)."""
    spec = get_schedule(schedule)
    if overlap and spec.combined is not None:
        program = pairs_adjacent(build_program(
            [spec.combined(p, m, r, forward_only) for r in range(p)], p, v))
        check_fifo(program, p)
        simulate(program)          # raises DeadlockError if some batch never completes
    elif spec.program is not None:
        program = spec.program(p, m, v, forward_only)
    else:
        program = build_program(spec.orders(p, m, v, forward_only), p, v, vshape=spec.vshape)
    return delay_wgrad(program) if overlap and delay else program


@functools.lru_cache(maxsize=256)
def paired_counts(schedule: str, p: int, m: int, v: int = 1) -> Tuple[Tuple[float, int], ...]:
    """Per rank, (micro-batches in flight at the peak, unpaired chunk forwards) of what
    ``--overlap-moe-expert-parallel-comm`` runs, read off the compute order ``plan(...,
    overlap=True)`` places (the schedule's ``combined``): combined 1F1B's one more warm-up
    forward holds one more micro-batch than 1F1B (tests/unit/test_planner_ep_overlap.py
    checks it against ``simulate``)."""
    spec = get_schedule(schedule)
    orders = [spec.combined(p, m, r) for r in range(p)]
    return tuple((peak_in_flight(ops, v), unpaired_forwards(ops)) for ops in orders)


def bubble(schedule: str, p: int, m: int, v: int = 1, costs: Costs = UNIT_COSTS,
           comm_cost: float = 0.0) -> float:
    """Bubble fraction of ``schedule`` simulated with ``costs``."""
    return simulate(plan(schedule, p, m, v), costs, comm_cost).bubble_fraction


# -- the schedule registry --------------------------------------------------------------------
# Everything the rest of megalite asks about a pipeline schedule: the flag's choices, the
# executor (which ops, B/W split), validation (virtual stages), the feature table and the
# planner (bubble and in-flight activations).  Adding a schedule = its compute order and one
# entry below, plus its line in docs/pipeline.md (docs/extending.md).

@dataclass(frozen=True)
class Schedule:
    name: str                  # the --pipeline-schedule value
    summary: str               # one line: --help, the feature table, docs
    virtual_stages: bool       # True: runs v > 1 model chunks per rank; False: exactly one
    split_backward: bool       # backward split into B (input grads) and W (weight grads)
    orders: Callable           # (p, m, v, forward_only) -> every rank's compute order
    # (p, v, work, hop, forward_part) -> the planner's pipeline bubble (time): ``work`` is
    # a micro-batch's slot without its p2p, ``hop`` one forward and one backward message
    # between neighbours (interleaving divides the work by v, not the hops),
    # ``forward_part`` the slowest stage's forward (+ recompute) share
    bubble_time: Callable
    # (p, m, v, pp_rank) -> micro-batches whose activations ``pp_rank`` holds at its peak
    in_flight: Callable
    # (p, m, v, pp_rank) -> chunk forwards with no backward beside them (warm-up; the
    # cool-down mirrors it): what an overlap of one micro-batch's all-to-all with another's
    # compute cannot hide (the planner's EP overlap)
    unpaired_forwards: Callable
    program: Optional[Callable] = None   # (p, m, v, forward_only) -> programs, when the
    #                                      generic placement (``build_program``) is not used
    searched: bool = True      # the planner's --schedules default includes it
    searched_for_moe: bool = False   # ... for MoE models (it hides the expert all-to-all)
    chunks_per_rank: Optional[int] = None   # model chunks the schedule fixes (None: --vpp)
    vshape: bool = False       # chunk 1 runs back up the ranks (``stage_index``)
    min_micro_batches: Callable = lambda p: 1   # p -> fewest micro-batches it can run
    # the executor posts each batch's messages and waits only where one is read (so an F&B
    # pair's second op receives while the first computes); ``simulate`` stays blocking
    async_p2p: bool = False
    # (p, m, rank, forward_only) -> the rank's order with steady-state F&B pairs, what
    # --overlap-moe-expert-parallel-comm runs (combined 1F1B); None: the schedule's own
    # program pairs them (DualPipeV) or it has no pairs (``pairs_f_and_b``)
    combined: Optional[Callable] = None
    pairs_f_and_b: bool = False   # the overlapped F&B execution has pairs to overlap


def _orders_1f1b(p, m, v, forward_only):
    return [order_1f1b(p, m, r, forward_only) for r in range(p)]


def _orders_interleaved(p, m, v, forward_only):
    return [order_interleaved(p, m, v, r, forward_only) for r in range(p)]


def _orders_zero_bubble(p, m, v, forward_only):
    return _orders_1f1b(p, m, v, True) if forward_only else orders_zero_bubble(p, m)


def _orders_dualpipev(p, m, v, forward_only):
    return [[op for op in prog if op.kind != "comm"]
            for prog in dualpipev_program(p, m, v, forward_only)]


def _dualpipev_bubble(p, v, work, hop, fwd):
    """DeepSeek's (S/2 - 1)(F&B + B - 3W) over S = 2p stages, per chunk: F&B = F + B (not
    overlapped), a chunk is half of the rank's ``work``, B (full) is its non-forward part
    and W half of that; plus one hop per warm-up step."""
    full_b = (work - fwd) / 2
    return (p - 1) * (work / 2 + full_b - 3 * full_b / 2 + hop)


def _dualpipev_in_flight(p, m, v, rank):
    """Chunk-micro-batches held at the peak (forwarded, weight gradient not yet done), in
    micro-batches of the rank's two chunks: every rank holds 2p + 1 = DeepSeek's PP + 1
    (PP there counts the 2p stages)."""
    return (2 * p + 1) / 2


def _dualpipev_unpaired(p, m, v, rank):
    """Phases 1-3 run 2(p-r-1) + 2(r+1) + (p-r-1) chunk forwards alone; DeepSeek leaves the
    last rank's first steady F0 unpaired too."""
    return min(3 * (p - rank - 1) + 2 * (rank + 1) + (rank == p - 1), 2 * m)


def _orders_zbv(p, m, v, forward_only):
    return [order_zbv(p, m, r, forward_only) for r in range(p)]


def _zbv_bubble(p, v, work, hop, fwd):
    """Idle per rank: (p - 1) chunk ops of the dearer of F and B (a chunk's F is half the
    forward part, B and W each a quarter of the rest), plus one hop per warm-up step.  Exact
    at unit costs on the blocking program and, for B = W >= F, on the dependency-only
    timing the asynchronous p2p approaches; with F > B it idles more ((p - 2)(F - B) and
    up), so it is a lower bound there."""
    return (p - 1) * (max(fwd / 2, (work - fwd) / 4) + hop)


def _zbv_unpaired(p, m, v, rank):
    """The 2(p - r) - 1 chunk-0 warm-up forwards and the r pairs F1 F0 have no backward
    after them: 2p - 1 on every rank; every later forward is followed by its chunk's B."""
    return min(2 * p - 1, 2 * m)


def _1f1b_unpaired(p, m, v, rank):
    """Megatron's p - r - 1 warm-up forwards."""
    return min(p - rank - 1, m)


def _interleaved_unpaired(p, m, v, rank):
    """Megatron's 2(p - r - 1) + (v - 1)p warm-up chunk forwards."""
    return min(2 * (p - rank - 1) + (v - 1) * p, m * v)


def _interleaved_in_flight(p, m, v, rank):
    """Megatron's warm-up of 2(p - i - 1) + (v - 1)p + 1 chunks, in micro-batches."""
    return min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v) / v


SCHEDULES: Dict[str, Schedule] = {s.name: s for s in (
    Schedule("1f1b", "1F1B: p-rank-1 warm-up forwards, one forward one backward, cool-down",
             virtual_stages=False, split_backward=False, orders=_orders_1f1b,
             bubble_time=lambda p, v, work, hop, fwd: (p - 1) * (work + hop),
             in_flight=lambda p, m, v, rank: float(min(p - rank, m)),
             unpaired_forwards=_1f1b_unpaired, combined=order_combined_1f1b,
             pairs_f_and_b=True),
    Schedule("interleaved", "interleaved 1F1B over v model chunks per rank (VPP): bubble "
             "(p-1)/(v m)", virtual_stages=True, split_backward=False,
             orders=_orders_interleaved, program=interleaved_program,
             bubble_time=lambda p, v, work, hop, fwd: (p - 1) * (work / v + hop),
             in_flight=_interleaved_in_flight, unpaired_forwards=_interleaved_unpaired),
    Schedule("zero-bubble", "ZB-H1: backward split into B and W, W placed in the bubbles",
             virtual_stages=False, split_backward=True, orders=_orders_zero_bubble,
             bubble_time=lambda p, v, work, hop, fwd: (p - 1) * fwd,
             in_flight=lambda p, m, v, rank: float(min(p, m)),
             unpaired_forwards=_1f1b_unpaired, searched=False),
    Schedule("dualpipev", "DualPipeV: V-shaped 2 chunks per rank (first and last layers on "
             "rank 0), forward and backward of different micro-batches paired, W deferred "
             "into the bubbles", virtual_stages=True, split_backward=True,
             orders=_orders_dualpipev, program=dualpipev_program,
             bubble_time=_dualpipev_bubble,
             in_flight=_dualpipev_in_flight, unpaired_forwards=_dualpipev_unpaired,
             searched=False, searched_for_moe=True, chunks_per_rank=2, vshape=True,
             min_micro_batches=lambda p: 2 * p, async_p2p=True, pairs_f_and_b=True),
    Schedule("zbv", "ZB-V: DualPipeV's V (2 chunks per rank) in a 1F1B-like order, backward "
             "split into B and W, W deferred into the cool-down; at most p micro-batches "
             "held, as 1F1B's first stage",
             virtual_stages=True, split_backward=True, orders=_orders_zbv,
             bubble_time=_zbv_bubble, in_flight=lambda p, m, v, rank: float(p),
             unpaired_forwards=_zbv_unpaired, searched=False, chunks_per_rank=2,
             vshape=True, min_micro_batches=lambda p: 2 * p - 1, async_p2p=True),
)}
SCHEDULE_NAMES = tuple(SCHEDULES)
AUTO = "auto"     # --pipeline-schedule auto: interleaved with virtual stages, else 1F1B


def get_schedule(name: str) -> Schedule:
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule '{name}'; choose from {SCHEDULE_NAMES}")
    return SCHEDULES[name]


def resolve_schedule(flag: str, vpp: int) -> Schedule:
    """What ``--pipeline-schedule flag`` runs with ``vpp`` virtual stages per rank: ``auto``
    takes the first schedule whose virtual-stage need matches."""
    if flag != AUTO:
        return get_schedule(flag)
    return next(s for s in SCHEDULES.values() if s.virtual_stages == (vpp > 1))
