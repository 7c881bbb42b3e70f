"""DualPipeV's per-rank programs, emitted phase by phase as DeepSeek's ``dualpipev.py`` runs.

DualPipeV places its own p2p (a batch before each compute op, receives posted early) rather
than going through the generic placement, and its eight phases are long enough to deserve a
module; the registry (``pipeline_schedules``) holds its bubble and memory formulas.
"""
from __future__ import annotations

import collections
from typing import List

from megalite.config.pipeline_program import DeadlockError, Op, check_fifo, needs, produces


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
