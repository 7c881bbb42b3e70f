"""Pipeline schedules as data: per-rank op lists, a deadlock-checking timing simulator.

The real executor (``schedules.py``) walks exactly the programs built here, so what the
simulator predicts (order, bubbles, deadlock freedom, p2p pairing) is what runs.

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

import collections
import functools
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


# -- compute orders -------------------------------------------------------------------------

def order_1f1b(p: int, m: int, rank: int, forward_only: bool = False) -> List[Op]:
    """Non-interleaved 1F1B: p-rank-1 warm-up forwards, steady 1F1B, cool-down backwards."""
    if forward_only:
        return [Op("F", i) for i in range(m)]
    warmup = min(p - rank - 1, m)
    ops = [Op("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [Op("F", warmup + i), Op("BW", i)]
    return ops + [Op("BW", i) for i in range(m - warmup, m)]


def order_combined_1f1b(p: int, m: int, rank: int, forward_only: bool = False) -> List[Op]:
    """Combined 1F1B (Megatron's ``--overlap-moe-expert-parallel-comm``): 1F1B whose every
    steady-state forward is paired with the backward of another micro-batch, run side by
    side by the overlapped executor.  One more warm-up forward than 1F1B (p - rank), so
    the last stage's pair is F(i+1) beside BW(i), not a backward of the forward beside it;
    the price is one more micro-batch in flight per rank."""
    if forward_only:
        return [Op("F", i) for i in range(m)]
    warmup = min(p - rank, m)
    ops = [Op("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [Op("F", warmup + i, paired=True), Op("BW", i, paired=True)]
    return ops + [Op("BW", i) for i in range(m - warmup, m)]


def _interleaved_id(k: int, p: int, v: int, backward: bool) -> Tuple[int, int]:
    """(micro-batch, chunk) of the k-th forward/backward of a rank (Megatron's order:
    groups of p micro-batches per chunk)."""
    chunk = (k // p) % v
    if backward:
        chunk = v - 1 - chunk
    return (k // (p * v)) * p + k % p, chunk


def order_interleaved(p: int, m: int, v: int, rank: int, forward_only: bool = False) -> List[Op]:
    """Interleaved 1F1B (Narayanan et al. 2021); needs m to be a multiple of p."""
    if m % p:
        raise ValueError(f"interleaved schedule: micro-batches ({m}) must be a multiple of "
                         f"pipeline size ({p})")
    total = m * v
    fwd = [Op("F", *_interleaved_id(k, p, v, False)) for k in range(total)]
    if forward_only:
        return fwd
    bwd = [Op("BW", *_interleaved_id(k, p, v, True)) for k in range(total)]
    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    ops = fwd[:warmup]
    for i in range(total - warmup):
        ops += [fwd[warmup + i], bwd[i]]
    return ops + bwd[total - warmup:]


def orders_zero_bubble(p: int, m: int) -> List[List[Op]]:
    """ZB-H1 (Qi et al. 2023): 1F1B's F/B order with B split from W; W fills bubbles.

    Placed by a unit-cost list schedule: a rank runs its next F/B when the input is there;
    otherwise it runs its oldest pending W.  A micro-batch counts as in flight from its F
    to its W; before an F that would exceed p in flight (1F1B's peak, on its first stage)
    a pending W goes first.  With F = B = W this gives the paper's (p-1)(F+B-W) bubble.
    """
    seqs = [[Op("B", o.mb) if o.kind == "BW" else o for o in order_1f1b(p, m, r)]
            for r in range(p)]
    pos, pending, out = [0] * p, [[] for _ in range(p)], [[] for _ in range(p)]
    in_flight, done_at = [0] * p, {}
    t = 0
    while any(pos[r] < len(seqs[r]) or pending[r] for r in range(p)):
        started = []
        for r in range(p):
            nxt = seqs[r][pos[r]] if pos[r] < len(seqs[r]) else None
            ready = nxt is not None and _zb_ready(nxt, r, p, done_at, t)
            if nxt is not None and nxt.kind == "F" and in_flight[r] >= p and pending[r]:
                ready = False  # memory cap: finish a W first
            if ready:
                op = nxt
                pos[r] += 1
                in_flight[r] += op.kind == "F"
                if op.kind == "B":
                    pending[r].append(op.mb)
            elif pending[r]:
                op = Op("W", pending[r].pop(0))
                in_flight[r] -= 1
            else:
                continue
            out[r].append(op)
            started.append((r, op))
        for r, op in started:
            done_at[(r, op.kind, op.mb)] = t + 1
        t += 1
        if t > 10 * (m + p) * 3:
            raise DeadlockError("zero-bubble order did not converge")
    return out


def _zb_ready(op: Op, r: int, p: int, done_at, t) -> bool:
    if op.kind == "F":
        return r == 0 or done_at.get((r - 1, "F", op.mb), t + 1) <= t
    need = (r, "F", op.mb) if r == p - 1 else (r + 1, "B", op.mb)
    return done_at.get(need, t + 1) <= t


class _DualPipeVRank:
    """One rank's DualPipeV program, emitted as DeepSeek's ``dualpipev.py`` runs it: each
    compute op first commits the pending sends and receives as one blocking batch (its
    ``_commit_and_wait_comm``), receives are posted before the op that needs them (some a
    step early) and a result is sent after the op that made it.  Hand-overs between the
    two chunks of the last rank are local and need no message."""

    def __init__(self, p: int, m: int, rank: int, forward_only: bool):
        self.p, self.m, self.rank, self.forward_only = p, m, rank, forward_only
        self.count = {}                       # (what, chunk) -> how many so far
        self.deferred = collections.deque()   # (mb, chunk) whose W is still to run
        self.sends, self.recvs, self.program = [], [], []

    def _next(self, what: str, chunk: int) -> int:
        n = self.count.get((what, chunk), 0)
        self.count[(what, chunk)] = n + 1
        return n

    def _message(self, kind: str, chunk: int, inbound: bool):
        if kind == "BW" and self.forward_only:
            return
        what = ("recv " if inbound else "send ") + kind
        op = Op(kind, self._next(what, chunk), chunk)
        found = (needs if inbound else produces)(op, self.rank, self.p, 2, vshape=True)
        if found and found[1] != self.rank:
            (self.recvs if inbound else self.sends).append(found)

    def commit(self):
        if self.sends or self.recvs:
            self.program.append(Op("comm", sends=tuple(self.sends), recvs=tuple(self.recvs)))
        self.sends, self.recvs = [], []

    def recv_f(self, c):
        self._message("F", c, True)

    def send_f(self, c):
        self._message("F", c, False)

    def recv_b(self, c):
        self._message("BW", c, True)

    def send_b(self, c):
        self._message("BW", c, False)

    def _compute_f(self, c, paired=False):
        self.program.append(Op("F", self._next("F", c), c, paired=paired))

    def _compute_b(self, c, split=False, paired=False):
        if self.forward_only:
            return
        mb = self._next("B", c)
        self.program.append(Op("B" if split else "BW", mb, c, paired=paired))
        if split:
            self.deferred.append((mb, c))

    def forward(self, c, recv=True, send=True):
        if recv:
            self.recv_f(c)
        self.commit()
        self._compute_f(c)
        if send:
            self.send_f(c)

    def backward(self, c, split=False, recv=True, send=True):
        if recv:
            self.recv_b(c)
        self.commit()
        self._compute_b(c, split)
        if send:
            self.send_b(c)

    def forward_backward(self, c0, c1, recv0=True):
        """An F&B pair: the forward of one micro-batch beside the backward of another."""
        if recv0:
            self.recv_f(c0)
        self.recv_b(c1)
        self.commit()
        self._compute_f(c0, paired=not self.forward_only)
        self._compute_b(c1, paired=True)
        self.send_f(c0)
        self.send_b(c1)

    def weight(self):
        if self.forward_only:
            return
        self.commit()
        mb, c = self.deferred.popleft()
        self.program.append(Op("W", mb, c))


def dualpipev_rank_program(p: int, m: int, rank: int, forward_only: bool = False) -> List[Op]:
    """DualPipeV (DeepSeek's DualPipe cut in half, Sea AI Lab): the V shape's two chunks per
    rank, chunk 0 going down the ranks and chunk 1 coming back up; needs m >= 2p.

    The eight phases of DeepSeek's ``dualpipev.py``: chunk-0 warm-up forwards, F0 F1,
    B1 W1 F1 (zero bubble), the steady state of F0&B1 and F1&B0 pairs (a forward of one
    micro-batch beside the backward of another: the pairs the overlapped execution
    overlaps), B1 + F1&B0, the B1 B0 drain whose second half defers W, then the deferred
    W's (oldest first) between the last B0's.  A backward that defers its W is a ``B``
    followed later by its ``W``; the others are full ``BW``.
    """
    if m < 2 * p:
        raise ValueError(f"dualpipev: micro-batches ({m}) must be at least 2 x pipeline size "
                         f"({2 * p})")
    e, last = _DualPipeVRank(p, m, rank, forward_only), rank == p - 1
    down = p - rank - 1                             # ranks below this one
    for _ in range(2 * down):                       # 1: chunk-0 warm-up
        e.forward(0)
    e.recv_f(0)                                     # 2: F0 F1
    for i in range(rank + 1):
        e.forward(0, recv=False, send=False)
        e.recv_f(0)
        e.forward(1, send=not last or i < rank)
        e.send_f(0)
    for _ in range(down):                           # 3: B1 W1 F1
        e.backward(1, split=True)
        e.recv_f(1)
        e.weight()
        e.forward(1, recv=False)
    for i in range(m - 2 * p + rank + 1):           # 4: steady state, F0&B1 then F1&B0
        if i == 0 and last:     # DeepSeek: not paired, to shorten the bubble
            e.forward(0, recv=False, send=False)
            e.send_f(1)
            e.backward(1, send=False)
            e.send_f(0)
            e.send_b(1)
        else:
            e.forward_backward(0, 1, recv0=i > 0)
        e.forward_backward(1, 0)
    for _ in range(down):                           # 5: B1, F1&B0
        e.backward(1)
        e.forward_backward(1, 0)
    split = False
    for i in range(rank + 1):                       # 6: B1 B0, the second half deferring W
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        e.backward(1, split)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        e.backward(0, split)
    for _ in range(down):                           # 7: W, B0
        e.weight()
        e.backward(0, split=True)
    for _ in range(rank + 1):                       # 8: the last W's
        e.weight()
    e.commit()
    if e.deferred:
        raise AssertionError("dualpipev program left weight gradients undone")
    return e.program


def dualpipev_program(p: int, m: int, v: int = 2, forward_only: bool = False):
    """Every rank's DualPipeV program; checked: FIFO per rank pair, every message received
    before the op that consumes it."""
    program = [dualpipev_rank_program(p, m, r, forward_only) for r in range(p)]
    check_fifo(program, p)
    for r, prog in enumerate(program):
        have = set()
        for op in prog:
            have.update(msg for msg, _ in op.recvs)
            need = needs(op, r, p, 2, vshape=True) if op.kind != "comm" else None
            if need and need[1] != r and need[0] not in have:
                raise DeadlockError(f"rank {r} runs {op} before receiving {need[0]}")
    return program


def compute_orders(schedule: str, p: int, m: int, v: int = 1,
                   forward_only: bool = False) -> List[List[Op]]:
    """Every rank's compute order of ``schedule`` (a name of ``SCHEDULES``)."""
    return get_schedule(schedule).orders(p, m, v, forward_only)


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


def interleaved_program(p: int, m: int, v: int, forward_only: bool = False) -> List[List[Op]]:
    """Megatron's lock-step exchanges for interleaved 1F1B.

    Every step (a warm-up F, a steady F+BW pair, a cool-down BW) ends in one batch that
    sends what the step produced and receives from each neighbour whatever it sends in
    its matching step -- possibly a message needed only later, which is buffered.  This
    keeps all ranks in phase, which blocking p2p needs to reach the ideal bubble.
    Receives are anonymous here and named by FIFO matching against the senders.
    """
    orders = [order_interleaved(p, m, v, r, forward_only) for r in range(p)]
    total = m * v
    chunk = lambda k: _interleaved_id(k, p, v, False)[1]          # noqa: E731
    bchunk = lambda k: _interleaved_id(k, p, v, True)[1]          # noqa: E731
    program = []
    for r in range(p):
        order = orders[r]
        fwd = [o for o in order if o.kind == "F"]
        bwd = [o for o in order if o.kind == "BW"]
        all_warmup = forward_only or m == p
        warmup = total if all_warmup else min((p - r - 1) * 2 + (v - 1) * p, total)
        prev, nxt = (r - 1) % p, (r + 1) % p
        prog: List[Op] = []

        def exchange(ops, recv_prev, recv_next):
            sends = tuple(out for o in ops if (out := produces(o, r, p, v)))
            recvs = ((None, prev),) * recv_prev + ((None, nxt),) * recv_next
            if sends or recvs:
                prog.append(Op("comm", sends=sends, recvs=recvs))

        exchange([], r > 0, False)                      # input of the first forward
        for k in range(warmup):
            prog.append(fwd[k])
            recv_prev = not (r == 0 and chunk(k + 1) == 0) and k != total - 1
            recv_next = k == warmup - 1 and not all_warmup and r != p - 1
            exchange([fwd[k]], recv_prev, recv_next)
        for i in range(total - warmup):
            f, b = fwd[warmup + i], bwd[i]
            prog += [f, b]
            recv_prev = (r != 0 or chunk(warmup + i - (p - 1)) != v - 1) and \
                i != total - warmup - 1
            recv_next = r != p - 1 or bchunk(i - (p - 1)) != 0
            exchange([f, b], recv_prev, recv_next)
        if not forward_only:
            if all_warmup:
                exchange([], False, r != p - 1)
            for k in range(total - warmup, total):
                prog.append(bwd[k])
                recv_next = not (r == p - 1 and bchunk(k + 1) == v - 1) and k != total - 1
                exchange([bwd[k]], False, recv_next)
        program.append(prog)
    return _name_receives(program, p, v)


def _name_receives(program: List[List[Op]], p: int, v: int) -> List[List[Op]]:
    """Give anonymous receives the identity of the matching (FIFO) send, then check that
    every message arrives before the op that consumes it."""
    streams: Dict[Tuple[int, int], list] = {}
    for r, prog in enumerate(program):
        for op in prog:
            for msg, dst in op.sends:
                streams.setdefault((r, dst), []).append(msg)
    taken: Dict[Tuple[int, int], int] = {}
    named = []
    for r, prog in enumerate(program):
        have, out = set(), []
        for op in prog:
            if op.kind == "comm":
                recvs = []
                for _, src in op.recvs:
                    i = taken.get((src, r), 0)
                    stream = streams.get((src, r), [])
                    if i >= len(stream):
                        raise DeadlockError(f"rank {r} receives more from {src} than it sends")
                    recvs.append((stream[i], src))
                    have.add(stream[i])
                    taken[(src, r)] = i + 1
                op = Op("comm", sends=op.sends, recvs=tuple(recvs))
            else:
                need = needs(op, r, p, v)
                if need and need[0] not in have:
                    raise DeadlockError(f"rank {r} runs {op} before receiving {need[0]}")
            out.append(op)
        named.append(out)
    for pair, stream in streams.items():
        if taken.get(pair, 0) != len(stream):
            raise DeadlockError(f"messages {pair[0]}->{pair[1]} sent but never received")
    return named


def pairs_adjacent(program: List[List[Op]]) -> List[List[Op]]:
    """Each paired F directly followed by its backward: the batches the generic placement
    put between them are split, receives moved before the F and sends after the backward
    (per rank pair the order is kept, so FIFO matching still holds)."""
    out = []
    for prog in program:
        prog, j = list(prog), 0
        while j < len(prog):
            op = prog[j]
            if op.kind == "F" and op.paired:
                k = j + 1
                while prog[k].kind == "comm":
                    k += 1
                between = prog[j + 1:k]
                recvs = tuple(r for c in between for r in c.recvs)
                sends = tuple(x for c in between for x in c.sends)
                head, tail = [], []
                if recvs:
                    if j > 0 and prog[j - 1].kind == "comm":
                        prev = prog[j - 1]
                        prog[j - 1] = Op("comm", sends=prev.sends, recvs=prev.recvs + recvs)
                    else:
                        head = [Op("comm", recvs=recvs)]
                if sends:
                    nxt = prog[k + 1] if k + 1 < len(prog) else None
                    if nxt is not None and nxt.kind == "comm":
                        prog[k + 1] = Op("comm", sends=sends + nxt.sends, recvs=nxt.recvs)
                    else:
                        tail = [Op("comm", sends=sends)]
                prog[j:k + 1] = head + [op, prog[k]] + tail
                j += len(head) + 2 + len(tail)
            else:
                j += 1
        out.append(prog)
    return out


def delay_wgrad(program: List[List[Op]]) -> List[List[Op]]:
    """``--delay-wgrad-compute``: each paired backward split into B and its W, the W right
    behind (in the pair's backward half: its weight-gradient GEMMs are compute the forward
    half's last all-to-all can hide behind)."""
    out = []
    for prog in program:
        new = []
        for op in prog:
            if op.paired and op.kind == "BW":
                new += [Op("B", op.mb, op.chunk, paired=True),
                        Op("W", op.mb, op.chunk, paired=True)]
            else:
                new.append(op)
        out.append(new)
    return out


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
