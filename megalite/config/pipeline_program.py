"""A pipeline program as data: the op and message vocabulary, the p2p placement and a
deadlock-checking timing simulator.

Every schedule (``pipeline_orders``, ``pipeline_dualpipev``, ``pipeline_pairs``) is written
in these terms and the registry (``pipeline_schedules``) turns its compute orders into
programs here; the real executor (``pipeline_parallel/schedules.py``) walks exactly those
programs, so what the simulator predicts (order, bubbles, deadlock freedom, p2p pairing) is
what runs.  Kept apart from the schedules so each schedule reads only what it needs.

Vocabulary: ``p`` pipeline ranks, ``v`` model chunks per rank (virtual stages), ``m``
micro-batches.  Chunk ``c`` of rank ``r`` is global virtual stage ``s = c*p + r``, or in
the V shape (``vshape``, DualPipeV) ``r`` for chunk 0 and ``2p-1-r`` for chunk 1
(``stage_index``); a message between two chunks of one rank is handed over locally.
Compute ops are ``F`` (forward), ``BW`` (full backward), ``B`` (input-gradient only) and
``W`` (weight-gradient only; zero bubble).  A ``comm`` op is one blocking
``comm.batch_send_recv`` call: its sends and receives are posted together and it returns
when all of them completed.

Building a program: (1) the schedule gives each rank's compute order; (2) a dependency-
only simulation gives ideal times; (3) every receive goes right before the op that
consumes it, every send into the first slot of the sender at which (in the ideal
timeline) the receiver is already waiting -- so with consistent costs nobody stalls on a
blocking send; (4) per rank pair the sends are kept in the receiver's order (p2p matching
is FIFO).  ``simulate`` then replays the program with blocking semantics and raises
``DeadlockError`` if some batch can never complete.

Bubble fraction (Narayanan et al.): idle time / ideal compute time, summed over ranks.
With unit costs it is exactly (p-1)/m for 1F1B and (p-1)/(v*m) for interleaved 1F1B.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple, Union

UNIT_COSTS = {"F": 1, "B": 1, "W": 1}


class DeadlockError(RuntimeError):
    pass


@dataclass(frozen=True)
class Msg:
    kind: str   # "act" (forward activation) or "grad" (gradient w.r.t. it)
    mb: int
    stage: int  # global virtual stage that consumes the message

    def __str__(self):         # as the flight recorder and its diagnosis print it
        return f"{self.kind} mb {self.mb} stage {self.stage}"


@dataclass(frozen=True)
class Op:
    kind: str              # F, B, W, BW or comm
    mb: int = -1
    chunk: int = 0
    sends: Tuple[Tuple[Msg, int], ...] = ()   # (message, destination pp rank)
    recvs: Tuple[Tuple[Msg, int], ...] = ()   # (message, source pp rank)
    paired: bool = False   # one half of an F&B pair (DualPipeV): the forward of one
    #                        micro-batch and the backward of another, run side by side

    def __str__(self):
        if self.kind == "comm":
            s = ",".join(f"{m.kind}{m.mb}>{r}" for m, r in self.sends)
            r = ",".join(f"{m.kind}{m.mb}<{r}" for m, r in self.recvs)
            return f"comm[{s}|{r}]"
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def stage_index(pp_rank: int, chunk: int, pp: int, vshape: bool = False) -> int:
    """The block (global virtual stage) chunk ``chunk`` of rank ``pp_rank`` holds:
    Megatron's interleaving c*P + r, or in the V shape r going down and 2P-1-r back up."""
    if vshape:
        return pp_rank if chunk == 0 else 2 * pp - 1 - pp_rank
    return chunk * pp + pp_rank


def stage_place(stage: int, pp: int, vshape: bool = False) -> Tuple[int, int]:
    """(pp_rank, chunk) holding block ``stage``: the inverse of ``stage_index``."""
    if vshape:
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp


Costs = Union[Dict[str, float], Callable[[int, Op], float]]


def _cost(costs: Costs, rank: int, op: Op) -> float:
    if callable(costs):
        return costs(rank, op)
    if op.kind == "BW":
        return costs["B"] + costs["W"]
    return costs[op.kind]


# -- messages -------------------------------------------------------------------------------

def needs(op: Op, rank: int, p: int, v: int,
          vshape: bool = False) -> Optional[Tuple[Msg, int]]:
    """The message ``op`` consumes and the rank it comes from (None if none: the first
    stage's forward, the last stage's backward)."""
    s, last = stage_index(rank, op.chunk, p, vshape), p * v - 1
    if op.kind == "F" and s > 0:
        return Msg("act", op.mb, s), stage_place(s - 1, p, vshape)[0]
    if op.kind in ("B", "BW") and s < last:
        return Msg("grad", op.mb, s), stage_place(s + 1, p, vshape)[0]
    return None


def produces(op: Op, rank: int, p: int, v: int,
             vshape: bool = False) -> Optional[Tuple[Msg, int]]:
    """The message ``op`` sends and its destination rank (None if nothing)."""
    s, last = stage_index(rank, op.chunk, p, vshape), p * v - 1
    if op.kind == "F" and s < last:
        return Msg("act", op.mb, s + 1), stage_place(s + 1, p, vshape)[0]
    if op.kind in ("B", "BW") and s > 0:
        return Msg("grad", op.mb, s - 1), stage_place(s - 1, p, vshape)[0]
    return None


def ideal_times(orders: List[List[Op]], p: int, v: int, costs: Costs = UNIT_COSTS,
                vshape: bool = False):
    """Dependency-only timing (sends never block): [(start, end)] per rank and op."""
    times = [[None] * len(o) for o in orders]
    ready: Dict[Msg, float] = {}
    pos, clock = [0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                op = orders[r][pos[r]]
                need = needs(op, r, p, v, vshape)
                if need and need[0] not in ready:
                    break
                start = max(clock[r], ready[need[0]] if need else 0)
                end = start + _cost(costs, r, op)
                times[r][pos[r]] = (start, end)
                out = produces(op, r, p, v, vshape)
                if out:
                    ready[out[0]] = end
                clock[r], pos[r], progress = end, pos[r] + 1, True
    if any(pos[r] < len(orders[r]) for r in range(p)):
        raise DeadlockError("compute orders are inconsistent (a dependency never arrives)")
    return times


# -- programs: compute ops with blocking p2p batches ----------------------------------------

def build_program(orders: List[List[Op]], p: int, v: int, costs: Costs = UNIT_COSTS,
                  vshape: bool = False) -> List[List[Op]]:
    times = ideal_times(orders, p, v, costs, vshape)
    recv_slot: Dict[Msg, int] = {}
    slot_recvs = [dict() for _ in range(p)]         # rank -> slot -> [(msg, src)]
    for r, order in enumerate(orders):
        for j, op in enumerate(order):
            need = needs(op, r, p, v, vshape)
            if need and need[1] != r:                # local hand-overs need no batch
                recv_slot[need[0]] = j
                slot_recvs[r].setdefault(j, []).append(need)
    # Sends, per (src, dst) pair in the receiver's order so FIFO matching holds.
    per_pair: Dict[Tuple[int, int], list] = {}
    for r, order in enumerate(orders):
        for a, op in enumerate(order):
            out = produces(op, r, p, v, vshape)
            if out and out[1] != r:
                per_pair.setdefault((r, out[1]), []).append((out[0], a))
    slot_sends = [dict() for _ in range(p)]
    for (src, dst), msgs in per_pair.items():
        msgs.sort(key=lambda ma: recv_slot[ma[0]])
        floor = 0
        for msg, a in msgs:
            b = recv_slot[msg]
            posted = times[dst][b - 1][1] if b > 0 else 0   # receiver reaches slot b
            n = len(orders[src])
            j = a + 1
            while j < n and times[src][j][0] < posted:
                j += 1
            j = max(j, floor)
            floor = j
            slot_sends[src].setdefault(j, []).append((msg, dst))
    program = []
    for r, order in enumerate(orders):
        prog = []
        for j in range(len(order) + 1):
            sends, recvs = slot_sends[r].get(j, []), slot_recvs[r].get(j, [])
            if sends or recvs:
                prog.append(Op("comm", sends=tuple(sends), recvs=tuple(recvs)))
            if j < len(order):
                prog.append(order[j])
        program.append(prog)
    check_fifo(program, p)
    return program


def check_fifo(program: List[List[Op]], p: int) -> None:
    """Per ordered rank pair, the k-th send must be the message the k-th receive expects."""
    sent: Dict[Tuple[int, int], list] = {}
    got: Dict[Tuple[int, int], list] = {}
    for r, prog in enumerate(program):
        for op in prog:
            for msg, dst in op.sends:
                sent.setdefault((r, dst), []).append(msg)
            for msg, src in op.recvs:
                got.setdefault((src, r), []).append(msg)
    if sent != got:
        raise DeadlockError("p2p sends and receives are not in the same order per rank pair")


@dataclass
class Event:
    rank: int
    kind: str
    mb: int
    chunk: int
    start: float
    end: float
    detail: str = ""


@dataclass
class SimResult:
    events: List[Event] = field(default_factory=list)
    makespan: float = 0.0
    busy: List[float] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        """Total idle time over total compute time (= t_pb / t_id per rank when even)."""
        total = sum(self.busy)
        return (self.makespan * len(self.busy) - total) / total


def peak_in_flight(ops: List[Op], v: int = 1) -> float:
    """Most micro-batches whose activations a rank walking ``ops`` holds at once: a
    forward keeps its chunk's, the op that ends its backward (BW, or the W of a split
    backward) frees them; in micro-batches (chunks / ``v``).  What the planner's memory
    model reads for a program no closed formula covers (combined 1F1B)."""
    held = peak = 0
    for op in ops:
        if op.kind == "F":
            held += 1
            peak = max(peak, held)
        elif op.kind in ("BW", "W"):
            held -= 1
    return peak / v


def unpaired_forwards(ops: List[Op]) -> int:
    """Forwards of ``ops`` with no backward beside them (warm-up)."""
    return sum(op.kind == "F" and not op.paired for op in ops)


def simulate(program: List[List[Op]], costs: Costs = UNIT_COSTS,
             comm_cost: float = 0.0) -> SimResult:
    """Replay a program with blocking batches: a batch ends when all its messages were
    posted by both sides (+ ``comm_cost``); compute ops take their cost."""
    p = len(program)
    posted: Dict[Msg, list] = {}
    pos, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    post_time: Dict[Tuple[int, int], float] = {}
    res = SimResult()
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(program[r]):
                op = program[r][pos[r]]
                if op.kind != "comm":
                    c = _cost(costs, r, op)
                    res.events.append(Event(r, op.kind, op.mb, op.chunk, clock[r], clock[r] + c))
                    clock[r] += c
                    busy[r] += c
                else:
                    key = (r, pos[r])
                    if key not in post_time:
                        post_time[key] = clock[r]
                        for msg, _ in op.sends:
                            posted.setdefault(msg, [None, None])[0] = clock[r]
                        for msg, _ in op.recvs:
                            posted.setdefault(msg, [None, None])[1] = clock[r]
                    msgs = [m for m, _ in op.sends + op.recvs]
                    if any(None in posted[m] for m in msgs):
                        break
                    end = max([clock[r]] + [max(posted[m]) + comm_cost for m in msgs])
                    res.events.append(Event(r, "comm", -1, 0, clock[r], end, str(op)))
                    clock[r] = end
                pos[r] += 1
                progress = True
    if any(pos[r] < len(program[r]) for r in range(p)):
        stuck = {r: str(program[r][pos[r]]) for r in range(p) if pos[r] < len(program[r])}
        raise DeadlockError(f"pipeline program deadlocks at {stuck}")
    res.makespan, res.busy = max(clock), busy
    return res
