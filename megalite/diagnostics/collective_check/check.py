"""The pre-launch proof: every group's members issue the same collectives, every pipeline
send has its receive, and the programs run to the end.

Ranks are grouped in classes whose programs are the same up to where their peers sit:

* exhaustively (``mode="every-rank"``, the default up to 64 ranks) each rank is its own
  class and every rank is traced;
* with representatives (``mode="representatives"``) a class is a pipeline rank: its lowest
  and highest rank are traced, must agree, and stand for every rank of the class; a rank
  the test hook touches is a class of its own.  Why a pipeline rank: a rank's program is
  ``pipeline_schedules.plan(...)[pp rank]`` walked over the layers ``layers_of_stage(pp rank, v)``,
  with the embedding / loss / tied-embedding ops of the first and last stage; its other
  coordinates (TP, CP, DP, EP, expert-TP, expert-DP) choose which shard it holds and which
  peers it talks to, never how many ops or their shapes (validation refuses uneven splits;
  the trace routes MoE tokens evenly).  So rank r's program is its representative's with
  every peer position moved by r's offset from the representative in that group.  At 64
  ranks the exhaustive check traces every rank and shows every class agrees with it.

Then, per group (once per combination of member classes): the members' collectives on it
match in number, op, shapes and dtype; per ordered pair of a p2p group the i-th send meets
the i-th receive with the same shape, dtype and message name; and a simulation of every
class's program (an op completes when all its members are at it, a p2p batch when every
counterpart is posted) reaches the end -- no cross-group deadlock.  Monotone progress makes
the end state unique, so the class-level simulation is exact.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from megalite.diagnostics.collective_check.trace import Op
from megalite.comm.flight_recorder import ranks_text

MAX_PROBLEMS = 10


@dataclass
class Classes:
    """rank -> class, class -> traced representatives (the first is the one used)."""
    of: Dict[int, object]
    reps: Dict[object, List[int]]
    mode: str


def every_rank(world: int) -> Classes:
    return Classes({r: r for r in range(world)}, {r: [r] for r in range(world)}, "every-rank")


def by_pipeline_rank(grid, singled_out=()) -> Classes:
    """Class = pipeline rank (two representatives each: its lowest and highest rank);
    ``singled_out`` ranks (the test hook's) are classes of their own."""
    of, reps = {}, defaultdict(list)
    for pp_rank, members in enumerate(_pipeline_members(grid)):
        rest = [r for r in members if r not in singled_out]
        for r in rest:
            of[r] = pp_rank
        if rest:
            reps[pp_rank] = sorted({rest[0], rest[-1]})
    for r in singled_out:
        of[r] = ("rank", r)
        reps[("rank", r)] = [r]
    return Classes(of, dict(reps), "representatives")


def _pipeline_members(grid) -> List[List[int]]:
    pp = grid.dims["dense"]["pp"]
    members = [[] for _ in range(pp)]
    for group in grid.groups("pp"):
        for i, r in enumerate(group):
            members[i].append(r)
    return [sorted(m) for m in members]


@dataclass
class Verdict:
    mode: str
    ranks_traced: int
    ops_per_rank: Dict[object, int]
    problems: List[str] = field(default_factory=list)
    groups_checked: int = 0
    classes_hold: Optional[bool] = None   # every rank traced: each equals its class's first
    notes: List[str] = field(default_factory=list)
    involved: List[int] = field(default_factory=list)   # ranks the problems name, in order
    causes: List[tuple] = field(default_factory=list)   # (rank, why): set by the caller

    @property
    def ok(self) -> bool:
        return not self.problems


class Checker:
    def __init__(self, grid, classes: Classes, programs: Dict[int, List[Op]], exempt=()):
        self.grid, self.classes, self.programs = grid, classes, programs
        self.exempt = set(exempt)     # ranks the test hook changes on purpose
        self.world = grid.world_size
        self.problems: List[str] = []
        self.involved: List[int] = []
        self.notes: List[str] = []
        self._members = {}          # kind -> rank -> its group's ranks
        self._index = {}            # class -> {(kind, seq) | (kind, dir, pos, n): op index}
        for c, reps in classes.reps.items():
            self._index[c] = _op_index(programs[reps[0]])

    # -- groups ---------------------------------------------------------------------------
    def instances(self, kind: str) -> List[tuple]:
        if kind == "world":
            return [tuple(range(self.world))]
        return [tuple(g) for g in self.grid.groups(kind)]

    def group_of(self, kind: str, rank: int) -> tuple:
        if kind not in self._members:
            self._members[kind] = {r: g for g in self.instances(kind) for r in g}
        return self._members[kind][rank]

    def program(self, rank: int) -> List[Op]:
        return self.programs[self.classes.reps[self.classes.of[rank]][0]]

    def offset(self, kind: str, rank: int) -> int:
        """How far ``rank`` sits from its class representative in its group of ``kind``."""
        rep = self.classes.reps[self.classes.of[rank]][0]
        return self.group_of(kind, rank).index(rank) - self.group_of(kind, rep).index(rep)

    def problem(self, text: str, *ranks: int) -> None:
        """A problem, and the ranks it names (the candidates for its cause)."""
        self.problems.append(text)
        self.involved += [r for r in ranks if r not in self.involved]

    # -- 1. the classes hold ---------------------------------------------------------------
    def check_classes(self) -> None:
        for c, reps in self.classes.reps.items():
            if len(reps) < 2:
                continue
            a, b = reps
            ra, rb = relative(self.programs[a], a, self), relative(self.programs[b], b, self)
            if ra != rb:
                i = next((k for k, (x, y) in enumerate(zip(ra, rb)) if x != y), min(len(ra),
                                                                                   len(rb)))
                self.problem(f"ranks {a} and {b} (pipeline rank {c}) issue different programs, "
                             f"so they cannot stand for each other: op {i + 1} is "
                             f"{_describe(self.programs[a], i)} on rank {a} and "
                             f"{_describe(self.programs[b], i)} on rank {b}", a, b)

    # -- 2. collectives agree within each group ------------------------------------------------
    def check_collectives(self) -> int:
        kinds = {op.kind for p in self.programs.values() for op in p if op.op != "p2p"}
        checked = 0
        for kind in sorted(kinds):
            seen = set()
            for members in self.instances(kind):
                key = frozenset(self.classes.of[m] for m in members)
                if key in seen:
                    continue
                seen.add(key)
                checked += 1
                if len(key) > 1:
                    self._compare_collectives(kind, members)
        return checked

    def _compare_collectives(self, kind: str, members: tuple) -> None:
        first = {}
        for m in members:
            first.setdefault(self.classes.of[m], m)
        views = [(m, [op for op in self.program(m) if op.kind == kind and op.op != "p2p"])
                 for m in first.values()]
        (a, ops_a), rest = views[0], views[1:]
        label = f"{kind}[{_ranks(members)}]"
        # members on one pipeline stage run the same code: their call sites must agree too
        # (equal shapes from different sites pair up and compute nonsense); across stages
        # only the loop's phase can
        one_stage = len({self.group_of("pp", m).index(m) for m in members}) == 1

        def where(op):
            return op.site if one_stage else op.phase
        for b, ops_b in rest:
            for i in range(max(len(ops_a), len(ops_b))):
                x = ops_a[i] if i < len(ops_a) else None
                y = ops_b[i] if i < len(ops_b) else None
                if x is None or y is None or x.signature() != y.signature() or \
                        where(x) != where(y):
                    self.problem(f"{label} op #{i + 1}: rank {a} issues {_op(x)}; rank {b} "
                                 f"issues {_op(y)}", a, b)
                    return

    # -- 3. every send has its receive -------------------------------------------------------
    def check_p2p(self) -> int:
        kinds = {op.kind for p in self.programs.values() for op in p if op.op == "p2p"}
        checked = 0
        for kind in sorted(kinds):
            seen = set()
            for members in self.instances(kind):
                key = tuple((self.classes.of[m], self.offset(kind, m)) for m in members)
                if key in seen:
                    continue
                seen.add(key)
                checked += 1
                self._match_messages(kind, members)
        return checked

    def _match_messages(self, kind: str, members: tuple) -> None:
        size = len(members)
        parts = defaultdict(list)    # (direction, from position, to position) -> messages
        for i, m in enumerate(members):
            d = self.offset(kind, m)
            for op in self.program(m):
                if op.kind != kind or op.op != "p2p":
                    continue
                for direction, pos, shape, n, key in op.parts:
                    other = (pos + d) % size
                    pair = (i, other) if direction == "send" else (other, i)
                    parts[(direction,) + pair].append((n, shape, op.dtype, key, op.site))
        label = f"{kind}[{_ranks(members)}]"
        for (direction, src, dst), sent in sorted(parts.items()):
            if direction != "send":
                continue
            got = parts.get(("recv", src, dst), [])
            self._pair(label, members[src], members[dst], sent, got)
        for (direction, src, dst), got in sorted(parts.items()):
            if direction == "recv" and ("send", src, dst) not in parts:
                n, shape, dtype, key, site = got[0]
                self.problem(f"{label}: rank {members[dst]}'s receive #{n} from rank "
                             f"{members[src]} ({key or 'message'} at {site}) has no send",
                             members[dst], members[src])

    def _pair(self, label, src, dst, sent, got) -> None:
        for k in range(max(len(sent), len(got))):
            s = sent[k] if k < len(sent) else None
            r = got[k] if k < len(got) else None
            if s is None:
                self.problem(f"{label}: rank {dst}'s receive #{r[0]} from rank {src} "
                             f"({r[3] or 'message'}, at {r[4]}) has no send; rank {src}'s last "
                             f"send to it is #{sent[-1][0] if sent else 0}"
                             + (f" ({sent[-1][3]}, at {sent[-1][4]})" if sent else ""),
                             dst, src)
                return
            if r is None:
                self.problem(f"{label}: rank {src}'s send #{s[0]} to rank {dst} "
                             f"({s[3] or 'message'}, at {s[4]}) has no receive", src, dst)
                return
            if s[1:4] != r[1:4]:
                self.problem(f"{label}: rank {src}'s send #{s[0]} to rank {dst} ({s[3]}, "
                             f"{list(s[1])} {s[2]}, at {s[4]}) is received by rank {dst} as "
                             f"#{r[0]} ({r[3]}, {list(r[1])} {r[2]}, at {r[4]})", src, dst)
                return

    # -- 4. the programs run to the end -------------------------------------------------------
    def sim_classes(self) -> Dict[int, object]:
        """Classes fine enough for the class-level simulation to be exact: refined until
        every member of a class sees the same classes in each of its groups (a rank the
        test hook singles out makes its neighbours differ from their class-mates)."""
        of = dict(self.classes.of)
        if len(set(of.values())) == self.world:
            return of
        kinds = sorted({op.kind for p in self.programs.values() for op in p})
        while True:
            seen = {}
            for kind in kinds:
                for members in self.instances(kind):
                    sig = tuple(sorted(map(repr, (of[m] for m in members))))
                    for m in members:
                        seen.setdefault(m, []).append((kind, sig))
            new = {r: (of[r], tuple(seen.get(r, ()))) for r in range(self.world)}
            ids = {}
            new = {r: ids.setdefault(v, (self.classes.of[r], len(ids))) for r, v in new.items()}
            if len(ids) == len(set(of.values())):
                return of
            of = new

    def simulate(self) -> None:
        """Every class's program from its start: a collective completes when each member
        is at it, a p2p batch when each counterpart message is posted."""
        sim_of = self.sim_classes()
        member = {}                                  # sim class -> one of its ranks
        for r in range(self.world):
            member.setdefault(sim_of[r], r)
        classes = list(member)
        prog = {c: self.program(member[c]) for c in classes}
        index = {c: self._index[self.classes.of[member[c]]] for c in classes}
        ptr = dict.fromkeys(classes, 0)
        in_group = {}

        def classes_in(kind: str, c) -> set:
            if (kind, c) not in in_group:
                in_group[(kind, c)] = {sim_of[m] for m in self.group_of(kind, member[c])}
            return in_group[(kind, c)]

        def counterpart_posted(c, op: Op, part) -> bool:
            direction, pos, _shape, n, _key = part
            me_rank = member[c]
            group = self.group_of(op.kind, me_rank)
            size = len(group)
            peer = group[(pos + self.offset(op.kind, me_rank)) % size]
            c2 = sim_of[peer]
            other = "recv" if direction == "send" else "send"
            at = index[c2].get((op.kind, other,
                                (group.index(me_rank) - self.offset(op.kind, peer)) % size, n))
            return at is not None and ptr[c2] >= at

        progress = True
        while progress:
            progress = False
            for c in classes:
                while ptr[c] < len(prog[c]):
                    op = prog[c][ptr[c]]
                    if op.op == "p2p":
                        if not all(counterpart_posted(c, op, p) for p in op.parts):
                            break
                        ptr[c] += 1
                    else:
                        others = classes_in(op.kind, c)
                        at = {c2: index[c2].get((op.kind, op.seq)) for c2 in others}
                        if any(i is None or ptr[c2] != i for c2, i in at.items()):
                            break
                        for c2 in others:
                            ptr[c2] += 1
                    progress = True
        stuck = [c for c in classes if ptr[c] < len(prog[c])]
        if stuck:
            lines = [f"rank {member[c]} waits in {_op(prog[c][ptr[c]])}" for c in stuck[:4]]
            self.problem("the programs deadlock: " + "; ".join(lines)
                         + (f"; ... {len(stuck) - 4} more" if len(stuck) > 4 else ""),
                         *(member[c] for c in stuck))

    def classes_hold(self) -> Optional[bool]:
        """Every rank traced: does each rank's program equal (peers as offsets) that of the
        lowest rank of its pipeline rank?  The fact that representatives rely on; None when
        not every rank was traced."""
        if self.classes.mode != "every-rank" or self.world == 1:
            return None
        held = True
        for members in _pipeline_members(self.grid):
            members = [r for r in members if r not in self.exempt]
            if not members:
                continue
            base = relative(self.programs[members[0]], members[0], self)
            for r in members[1:]:
                if relative(self.programs[r], r, self) != base:
                    held = False
                    self.notes.append(f"rank {r}'s program differs from rank {members[0]}'s "
                                      f"(same pipeline rank): representatives would not do")
                    break
        return held

    def run(self) -> Verdict:
        self.check_classes()
        groups = self.check_collectives() + self.check_p2p()
        if not self.problems:
            self.simulate()
        held = self.classes_hold()
        return Verdict(self.classes.mode, len(self.programs),
                       {c: len(self.programs[r[0]]) for c, r in self.classes.reps.items()},
                       self.problems[:MAX_PROBLEMS], groups, held, self.notes, self.involved)


def departure(ops: List[Op], reference: List[Op], iteration: int, ref_iteration: int
              ) -> Optional[str]:
    """How a rank's program in ``iteration`` departs from its own in ``ref_iteration``
    (every iteration issues the same program); None when they are the same."""
    def key(op):
        return (op.kind, op.op, op.seq, op.signature(), _without_iteration(op.site),
                op.parts)
    for i in range(max(len(ops), len(reference))):
        x = ops[i] if i < len(ops) else None
        y = reference[i] if i < len(reference) else None
        if x is None or y is None or key(x) != key(y):
            return (f"its op {i + 1} in iteration {iteration} is {_op(x)}; in iteration "
                    f"{ref_iteration} it is {_op(y)}")
    return None


def _without_iteration(site: str) -> str:
    head, _, rest = site.partition(", ")
    return rest if head.startswith("iteration ") else site


def _op_index(ops: List[Op]) -> dict:
    index = {}
    for i, op in enumerate(ops):
        if op.op == "p2p":
            for direction, pos, _shape, n, _key in op.parts:
                index[(op.kind, direction, pos, n)] = i
        else:
            index[(op.kind, op.seq)] = i
    return index


def relative(ops: List[Op], rank: int, checker: Checker) -> list:
    """A program with peers as offsets from ``rank`` (what must agree within a class)."""
    out = []
    for op in ops:
        me = op.group.index(rank)
        parts = tuple((d, (pos - me) % len(op.group), shape, n, key)
                      for d, pos, shape, n, key in op.parts)
        out.append((op.kind, op.op, op.seq, op.signature(), op.site, parts))
    return out


def _op(op: Optional[Op]) -> str:
    if op is None:
        return "nothing (its program has ended)"
    if op.op == "p2p":
        return "p2p [" + ", ".join(f"{d} #{n}" + (f" {key}" if key else "")
                                   for d, _p, _s, n, key in op.parts) + f"] at {op.site}"
    shape = " ".join("x".join(map(str, s)) for s in op.shapes)
    return f"{op.op} [{shape} {op.dtype}] at {op.site}"


def _describe(ops: List[Op], i: int) -> str:
    return _op(ops[i]) if i < len(ops) else "nothing (its program has ended)"


def _ranks(members) -> str:
    return ranks_text(members) if len(members) <= 16 else f"{members[0]},...,{members[-1]}"
