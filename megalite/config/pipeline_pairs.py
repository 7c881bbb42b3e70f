"""Forward & backward pairs for ``--overlap-moe-expert-parallel-comm`` and
``--delay-wgrad-compute``: the combined 1F1B order and the two program transforms.

The overlapped executor runs a paired forward beside the backward of another micro-batch;
these are the pieces that make a program's pairs (combined 1F1B), put each pair's two ops
side by side (``pairs_adjacent``) and split the paired backwards (``delay_wgrad``).  The
registry's ``plan`` applies them; kept together since they change together.
"""
from __future__ import annotations

from typing import List

from megalite.config.pipeline_program import Op


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
