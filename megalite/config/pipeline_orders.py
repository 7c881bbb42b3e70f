"""Compute orders of the 1F1B family: 1F1B, interleaved 1F1B (and its lock-step program),
ZB-H1 zero bubble and ZB-V (its V-shaped variant).

One module for the schedules Megatron and the zero-bubble paper derive from 1F1B's warm-up /
steady / cool-down shape; the registry (``pipeline_schedules``) names them, and the generic
placement (``pipeline_program.build_program``) turns the orders into programs, except
interleaved 1F1B, whose lock-step exchanges (``interleaved_program``) are built here.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from megalite.config.pipeline_program import DeadlockError, Op, needs, produces


def order_1f1b(p: int, m: int, rank: int, forward_only: bool = False) -> List[Op]:
    """Non-interleaved 1F1B: p-rank-1 warm-up forwards, steady 1F1B, cool-down backwards."""
    if forward_only:
        return [Op("F", i) for i in range(m)]
    warmup = min(p - rank - 1, m)
    ops = [Op("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [Op("F", warmup + i), Op("BW", i)]
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


def order_zbv(p: int, m: int, rank: int, forward_only: bool = False) -> List[Op]:
    """ZB-V (Qi et al. 2023, section 6; torch's ``ScheduleZBVZeroBubble``): DualPipeV's V
    placement (chunk 0 down the ranks, chunk 1 back up) with 1F1B-like chunk order and B
    split from W, W run right after its B in the steady state and deferred in the
    cool-down.  Needs m >= 2p - 1 (the warm-up is 2(p - r) - 1 chunk-0 forwards).

    Warm-up: 2(p - r) - 1 F0, then r pairs F1 F0, then p - r steps F1 B1 W1; steady: F0 B0
    W0 F1 B1 W1 until every forward ran; cool-down: r pairs B0 B1, p - r steps B0 W0, then
    the deferred W1's and W0's.  Simulated with F = B = W = 1 every rank idles p - 1 (not
    the paper's ideal 0; with B or W dearer than F the blocking placement idles much more)
    and holds at most 2p chunk-micro-batches (forwarded, W not yet run).
    """
    if m < 2 * p - 1:
        raise ValueError(f"zbv: micro-batches ({m}) must be at least 2 x pipeline size - 1 "
                         f"({2 * p - 1})")
    if forward_only:
        return [Op("F", mb, c) for mb in range(m) for c in (0, 1)]
    n = {k: 0 for k in ("F0", "F1", "B0", "B1")}
    ops: List[Op] = []

    def emit(kind: str, chunk: int) -> int:
        key = f"{kind}{chunk}"
        mb, n[key] = n[key], n[key] + 1
        ops.append(Op(kind, mb, chunk))
        return mb

    for _ in range(2 * (p - rank) - 1):
        emit("F", 0)
    for _ in range(rank):
        emit("F", 1)
        emit("F", 0)
    for _ in range(p - rank):
        emit("F", 1)
        ops.append(Op("W", emit("B", 1), 1))
    while n["F1"] < n["F0"] or n["F0"] < m:
        if n["F0"] < m:
            emit("F", 0)
        ops.append(Op("W", emit("B", 0), 0))
        emit("F", 1)
        ops.append(Op("W", emit("B", 1), 1))
    w0, w1 = n["B0"], n["B1"]
    for _ in range(rank):
        emit("B", 0)
        emit("B", 1)
    for _ in range(p - rank):
        emit("B", 0)
        ops.append(Op("W", w0, 0))
        w0 += 1
    ops += [Op("W", mb, 1) for mb in range(w1, n["B1"])]
    ops += [Op("W", mb, 0) for mb in range(w0, n["B0"])]
    return ops
