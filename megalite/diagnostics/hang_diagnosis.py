"""``megalite hangs LOGDIR``: from the ranks' flight-recorder dumps, which rank a hang waits on.

Each dump (``flight_recorder``) says what its rank was waiting in -- an op on one group with
its sequence number there, or a p2p batch with each message's number per peer -- and how many
ops it had issued on every group.  So for each waiting rank the members that have not reached
that op are known: they never entered it (their count is lower), or they left no dump.  That
gives a graph "waits on"; following it from every waiting rank ends at the cause:

* a rank that left no dump: stopped or dead (on this host its process state says which), or
  unable to run Python; what it did last is the newest op its peers completed with it;
* a rank that dumped while in no collective (busy elsewhere) or that failed with an error;
* a cycle of waiting ranks, where every member waits on another: the order of their ops
  differs.  Then the rank whose latest iteration departs from its previous one (an op
  skipped), or whose op at the same number differs from its group peers', is named.

Dumps of an older run in the folder are ignored (run id); a dump its rank wrote before it
went on to complete more ops with its peers is stale and ignored as well.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections import defaultdict
from typing import Dict, List, Optional

# the folder's readers; load_dumps and wait_for_dumps are also read from here
from megalite.diagnostics.hang_folder import (Fatal, load_dumps, load_fatal,  # noqa: F401
                                              wait_for_dumps)

MAX_LISTED = 8              # stuck groups and waiting ranks shown before "... and N more"
TRAIN_PHASES = ("loss tokens", "forward-backward", "loss", "grad sync", "optimizer",
                "after step")


# -- loading -------------------------------------------------------------------------------

# -- reading one dump ------------------------------------------------------------------------

def site_text(e: dict) -> str:
    parts = [f"iteration {e['it']}" if e.get("it") else "", e.get("phase", ""),
             e.get("step", ""), e.get("where", "")]
    return ", ".join(p for p in parts if p)


def op_text(e: dict) -> str:
    if e["op"] == "p2p":
        msgs = ", ".join(f"{kind} #{n} {'to' if kind == 'send' else 'from'} {peer}"
                         + (f" ({key})" if key else "")
                         for kind, peer, _shape, n, key in e["parts"])
        return f"p2p [{msgs}] on {e['group']}"
    shape = "x".join(map(str, e["shapes"][0])) if e.get("shapes") else ""
    return f"{e['op']} #{e['seq']} on {e['group']}" + (f" [{shape} {e['dtype']}]" if shape
                                                         else "")


def clock(t: Optional[float]) -> str:
    if t is None:
        return "?"
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


class Rank:
    """One rank as its dump (or its absence) shows it."""

    def __init__(self, rank: int, dump: Optional[dict]):
        self.rank, self.dump = rank, dump
        self.entries = dump["entries"] if dump else []
        for e in self.entries:
            e["_rank"] = rank
        self.groups = dump["groups"] if dump else {}
        self.stale = False
        self.current = None           # the op it waits in (or failed in)
        if dump:
            self._apply_gpu_completion()
            pending = [e for e in self.entries if e["t1"] is None and
                       (e.get("waiting") or e.get("error"))]
            self.current = pending[-1] if pending else None

    def _apply_gpu_completion(self):
        """NCCL: an op has returned to Python long before the GPU completes it; torch's own
        trace (when on) knows the last completed collective per process group."""
        trace = self.dump.get("torch_fr") or {}
        status = trace.get("pg_status") or {}
        if self.dump.get("backend") != "nccl" or not status:
            return
        done = {label: int((status.get(str(g.get("torch"))) or {}).get(
            "last_completed_collective", 10 ** 12)) for label, g in self.groups.items()}
        for e in self.entries:
            if e["op"] != "p2p" and e["t1"] is not None and e["seq"] > done.get(e["group"],
                                                                               10 ** 12):
                e["t1"], e["waiting"] = None, True     # issued, never completed on the GPU
                e["gpu"] = True

    def issued(self, label: str) -> int:
        return (self.groups.get(label) or {}).get("seq", 0)

    def messages(self, label: str, kind: str, peer: int) -> int:
        return (self.groups.get(label) or {}).get("p2p", {}).get(f"{kind}:{peer}", 0)

    def last_completed(self) -> Optional[dict]:
        done = [e for e in self.entries if e["t1"] is not None]
        return max(done, key=lambda e: e["t1"]) if done else None


# -- the diagnosis -----------------------------------------------------------------------------

class Diagnosis:
    def __init__(self, dumps: Dict[int, dict], fatal: Optional[Dict[int, Fatal]] = None):
        self.fatal = fatal or {}               # rank -> its death by a signal (no dump)
        any_dump = max(dumps.values(), key=lambda d: d["time"])
        self.world = any_dump.get("world_size", max(dumps) + 1)
        self.run_id = any_dump.get("run_id", "?")
        self.grid = any_dump.get("grid") or {}
        self.peers = {}
        for d in dumps.values():
            self.peers.update({int(r): p for r, p in d.get("peers", {}).items()})
        self.ranks = {r: Rank(r, dumps.get(r)) for r in range(self.world)}
        self.members = {}                      # group label -> ranks
        for d in dumps.values():
            for label, g in d["groups"].items():
                self.members[label] = g["ranks"]
        self._mark_stale()
        self.waits = defaultdict(list)         # rank -> [(other rank, why)]
        self.stuck = []                        # lines about stuck groups
        for r in self.ranks.values():
            if r.current is not None and not r.stale:
                self._waits_of(r)

    def alive(self, r: int) -> bool:
        return self.ranks[r].dump is not None and not self.ranks[r].stale

    def _mark_stale(self):
        """A dump is stale when a peer completed an op with that rank that the dump says the
        rank had not yet issued (it went on after dumping: an earlier watchdog dump)."""
        for r in self.ranks.values():
            if r.dump is None:
                continue
            for other in self.ranks.values():
                if other is r or other.dump is None:
                    continue
                if any(e["t1"] is not None and self._ahead_of(e, r) for e in other.entries):
                    r.stale = True
                    break

    def _ahead_of(self, e: dict, r: "Rank") -> bool:
        label = e["group"]
        if e["op"] != "p2p":
            return r.rank in self.members.get(label, ()) and e["seq"] > r.issued(label)
        # a completed receive proves the send (a send may complete into a buffer first)
        return any(kind == "recv" and peer == r.rank and n > r.messages(label, "send", e["_rank"])
                   for kind, peer, _shape, n, _key in e["parts"])

    def _involves(self, e: dict, rank: int) -> bool:
        if e["op"] == "p2p":
            return any(peer == rank for _k, peer, _s, _n, _key in e["parts"])
        return rank in self.members.get(e["group"], ())

    def _waits_of(self, r: Rank):
        e = r.current
        label = e["group"]
        if e["op"] != "p2p":
            missing = []
            for m in self.members.get(label, ()):
                if m == r.rank:
                    continue
                if not self.alive(m):
                    missing.append((m, "left no dump"))
                elif self.ranks[m].issued(label) < e["seq"]:
                    missing.append((m, f"its last op there is #{self.ranks[m].issued(label)}"
                                       + self._elsewhere(m, label)))
                else:
                    theirs = self._op_numbered(m, label, e["seq"])
                    # its op with this number is another one: each waits on the other (the
                    # call site may differ across pipeline stages, the loop's phase not)
                    if theirs is not None and (signature(theirs)[:4], theirs["it"]) != \
                            (signature(e)[:4], e["it"]):
                        self.waits[r.rank].append((m, f"{op_text(e)}: rank {m} issued "
                                                      f"{op_text(theirs)} at {site_text(theirs)} "
                                                      f"as its #{e['seq']} there"))
            for m, why in missing:
                self.waits[r.rank].append((m, f"{op_text(e)}: rank {m} never entered it "
                                              f"({why})"))
            if missing:
                self.stuck.append((label, e["seq"], r.rank, e, missing))
            return
        for kind, peer, _shape, n, key in e["parts"]:
            other = "recv" if kind == "send" else "send"
            if not self.alive(peer):
                why = "left no dump"
            elif self.ranks[peer].messages(label, other, r.rank) < n:
                why = (f"it has posted {self.ranks[peer].messages(label, other, r.rank)} "
                       f"{other}s {'to' if other == 'send' else 'from'} {r.rank}"
                       + self._elsewhere(peer, label))
            else:
                continue
            self.waits[r.rank].append((peer, f"{kind} #{n} {'to' if kind == 'send' else 'from'}"
                                             f" {peer} on {label}"
                                             + (f" ({key})" if key else "")
                                             + f": rank {peer} has no matching {other} "
                                               f"({why})"))
            self.stuck.append((label, n, r.rank, e, [(peer, why)]))

    def _op_numbered(self, m: int, label: str, seq: int) -> Optional[dict]:
        return next((e for e in self.ranks[m].entries if e["group"] == label and
                     e["op"] != "p2p" and e["seq"] == seq), None)

    def _elsewhere(self, m: int, label: str) -> str:
        cur = self.ranks[m].current
        if cur is None:
            return "; it is in no collective"
        return "" if cur["group"] == label and cur["op"] != "p2p" else \
            f"; it waits in {op_text(cur)}"

    # -- causes -------------------------------------------------------------------------------
    def causes(self) -> List[tuple]:
        """(rank, why): the ranks the waiting ends at, most waited-on first.  When the
        waiting ranks only wait on each other (a cycle), the ranks the evidence points at:
        a rank that left its own program, else one whose op differs from its group's."""
        terminal, reach = set(), defaultdict(set)
        for start in self.waits:
            seen, todo = set(), [start]
            while todo:
                r = todo.pop()
                if r in seen:
                    continue
                seen.add(r)
                if not self.alive(r) or self.ranks[r].current is None:
                    terminal.add(r)
                    reach[r].add(start)
                todo += [m for m, _ in self.waits.get(r, ())]
        if terminal:
            ranked = [(r, self.state_of(r)) for r in
                      sorted(terminal, key=lambda r: (-len(reach[r]), r))]
            return self._left_before_killed(ranked)
        cycle = "the waiting ranks wait on each other (their ops differ), and"
        found = [(r, f"{cycle} it left its own program (evidence below)")
                 for r, _ in self.deviations()]
        if not found:
            found = [(a, f"{cycle} its op differs from rank {b}'s at the same number "
                         f"(mismatch below)") for a, b, _ in self.mismatches()]
        return found

    def died_in_collective(self, rank: int) -> bool:
        """No dump, and its fatal-signal handler saw it die inside one of megalite.comm's
        collectives: the backend aborted it there (a mismatch gloo detects, NCCL's async
        error handling)."""
        f = self.fatal.get(rank)
        return not self.alive(rank) and f is not None and f.collective is not None

    def running_without_dump(self, rank: int) -> bool:
        """No dump, and its process still runs on this host: most likely blocked in a
        collective that nothing has ended yet (the diagnosis was printed early)."""
        host, pid = self.peers.get(rank, (None, None))
        return not self.alive(rank) and not self.ranks[rank].stale and \
            rank not in self.fatal and host == socket.gethostname() and \
            process_state(pid) == "running but wrote no dump"

    def _left_before_killed(self, ranked: List[tuple]) -> List[tuple]:
        """When every rank the waiting ends at was killed inside a collective (the backend
        aborted on the mismatch) or still runs without a dump, those are victims of a rank
        that left its own program, if one did: that rank comes first."""
        killed = [r for r, _ in ranked if self.died_in_collective(r)]
        waiting = [r for r, _ in ranked if self.running_without_dump(r)]
        if len(killed) + len(waiting) < len(ranked):
            return ranked
        left_dead = [r for r, _ in self.dead_departures()]
        left = [r for r, _ in self.deviations()] + left_dead
        if not left:
            return ranked
        killed = [r for r in killed if r not in left_dead]
        lead = "it left its own program (evidence below)"
        if killed:
            lead += (f"; rank{'s' if len(killed) > 1 else ''} {compact(killed)} then died "
                     f"inside a collective (the backend aborted on the mismatch)")
        if waiting:
            lead += (f"; rank{'s' if len(waiting) > 1 else ''} {compact(waiting)} had not "
                     f"dumped yet")
        victim = f" -- a victim of rank {compact(left)}'s departure"
        why = dict(ranked)
        return [(r, lead + (f"; {why[r]}" if r in why else "")) for r in left] + \
            [(r, w + victim) for r, w in ranked if r not in left]

    def dead_departures(self) -> List[tuple]:
        """(rank, text): ranks killed inside a collective whose op in flight (their fatal
        record's) differs from what every live rank of the same pipeline stage issued under
        that number on its group of the same kind -- such ranks run the same program with
        other peers, so the dead rank is the one that left it."""
        out = []
        for r in sorted(self.fatal):
            e = self.fatal[r].in_flight
            if not self.died_in_collective(r) or e is None or e["op"] == "p2p":
                continue
            kind = e["group"].split("[")[0]
            seen = []
            for a in self.ranks.values():
                if not self.alive(a.rank) or self.stage(a.rank) != self.stage(r):
                    continue
                theirs = next((x for x in a.entries if x["op"] != "p2p" and x["seq"] == e["seq"]
                               and x["group"].split("[")[0] == kind), None)
                if theirs is not None:
                    seen.append((a.rank, theirs))
            mine = signature(e, with_step=True)
            if seen and all(signature(t, with_step=True) != mine for _, t in seen):
                a, t = seen[0]
                out.append((r, f"rank {r} left its program at iteration {e['it']}: it died in "
                               f"{op_text(e)} at {site_text(e)}; rank {a}, on the same "
                               f"pipeline stage, issued {op_text(t)} at {site_text(t)} as its "
                               f"#{e['seq']} there"))
        return out

    def stage(self, rank: int) -> int:
        """The pipeline stage of ``rank`` (pipeline is the outermost dimension of the grid)."""
        pp = max(1, int(self.grid.get("pp", 1)))
        return rank // max(1, self.world // pp)

    def deviations(self) -> List[tuple]:
        """(rank, text): ranks that left their own program -- the first iteration in the dump
        that is not what the one before it was (a whole iteration: the same ops; the one in
        progress: a prefix of them).  This decides between members that disagree at an op
        number, in a group of any size: the member whose program changed is the cause.  An
        iteration where most ranks depart from the one before is a change of program (a
        first iteration, a ramp-up step), not a fault."""
        departures = {r: self._departures(r) for r in self.ranks if self.alive(r)}
        limit = max(2, len(departures) // 2)
        count = defaultdict(int)
        for by_it in departures.values():
            for it in by_it:
                count[it] += 1
        found = []
        for r, by_it in sorted(departures.items()):
            kept = [it for it in sorted(by_it) if count[it] <= limit]
            if kept:
                found.append((r, by_it[kept[0]]))
        return found

    def _departures(self, rank: int) -> Dict[int, str]:
        """iteration -> how ``rank``'s training ops there depart from the iteration before."""
        r = self.ranks[rank]
        if not r.entries:
            return {}
        by_it = defaultdict(list)
        for e in r.entries:
            if e["phase"] in TRAIN_PHASES:
                by_it[e["it"]].append(e)
        oldest, newest = min(e["it"] for e in r.entries), max(e["it"] for e in r.entries)
        whole_oldest = r.dump.get("previous_iteration_whole", True)
        out = {}
        for it in sorted(by_it):
            prev = by_it.get(it - 1)
            if it < 2 or not prev or (it - 1 == oldest and not whole_oldest):
                continue              # the buffer no longer holds the whole iteration before
            cur = by_it[it]
            head = f"rank {rank} left its program at iteration {it}: "
            for i, e in enumerate(cur):
                if i >= len(prev) or signature(e) != signature(prev[i]):
                    was = op_text(prev[i]) + " at " + site_text(prev[i]) if i < len(prev) \
                        else "nothing"
                    out[it] = head + (f"its op {i + 1} there is {op_text(e)} at "
                                      f"{site_text(e)}; in iteration {it - 1} it was {was}")
                    break
            else:
                if it < newest and len(cur) < len(prev):     # it went on to the next one
                    e = prev[len(cur)]
                    out[it] = head + (f"it went on to iteration {it + 1} after {len(cur)} "
                                      f"ops; in iteration {it - 1} op {len(cur) + 1} was "
                                      f"{op_text(e)} at {site_text(e)}")
        return out

    def mismatches(self) -> List[tuple]:
        """(rank a, rank b, text): ops with the same number on a group that differ."""
        out = []
        for label, members in self.members.items():
            views = [self.ranks[m] for m in members if self.alive(m)]
            if len(views) < 2:
                continue
            by_seq = [{e["seq"]: e for e in v.entries if e["group"] == label and
                       e["op"] != "p2p"} for v in views]
            common = set(by_seq[0]).intersection(*by_seq[1:])
            for seq in sorted(common):
                sigs = [signature(b[seq], with_step=True) for b in by_seq]
                if len(set(sigs)) > 1:
                    i = next(k for k in range(1, len(sigs)) if sigs[k] != sigs[0])
                    a, b = by_seq[0][seq], by_seq[i][seq]
                    out.append((views[0].rank, views[i].rank,
                                f"{label} op #{seq}: rank {views[0].rank} issued {op_text(a)} "
                                f"at {site_text(a)}; rank {views[i].rank} issued {op_text(b)} "
                                f"at {site_text(b)}"))
                    break
        return out

    # -- text ---------------------------------------------------------------------------------
    def last_seen(self, rank: int) -> Optional[tuple]:
        """(entry, rank that recorded it): the newest op a peer completed with ``rank``."""
        best = None
        for other in self.ranks.values():
            if other.rank == rank or not self.alive(other.rank):
                continue
            for e in other.entries:
                if e["t1"] is not None and self._involves(e, rank) and \
                        (best is None or e["t1"] > best[0]["t1"]):
                    best = (e, other.rank)
        return best

    def state_of(self, rank: int) -> str:
        r = self.ranks[rank]
        if r.dump is not None and not r.stale:
            reason = r.dump.get("reason", "")
            if reason.startswith("error"):
                return f"it failed ({reason})"
            return "it was in no collective when it dumped (busy elsewhere)"
        host, pid = self.peers.get(rank, (None, None))
        what = "stale dump" if r.stale else "no dump"
        if rank in self.fatal:
            return f"{what}: it died of a signal: {fatal_text(self.fatal[rank])}"
        if host is None:
            return f"{what}: dead, stopped or unable to run Python"
        if host != socket.gethostname():
            return f"{what}: dead, stopped or unable to run Python (pid {pid} on {host})"
        return f"{what}: {process_state(pid)} (pid {pid} on this host)"

    def report(self) -> str:
        alive = [r for r in self.ranks if self.alive(r)]
        absent = [r for r in self.ranks if not self.alive(r)]
        lines = [f"hang diagnosis: run {self.run_id}, {self.world} ranks, {len(alive)} current "
                 f"dumps" + (f" (none from rank{'s' if len(absent) > 1 else ''} "
                             f"{compact(absent)})" if absent else "")]
        waiting = sorted(self.waits)
        if not waiting:
            lines.append("no rank is waiting on another: nothing is stuck in a collective")
            return "\n".join(lines)
        causes = self.causes()
        for c, why in causes[:MAX_LISTED]:
            lines += self._cause_lines(c, why)
        if not causes:
            lines.append("cause: not found -- the waiting ranks wait on each other (a cycle): "
                         + "; ".join(f"rank {a} on {compact([m for m, _ in self.waits[a]])}"
                                     for a in waiting[:MAX_LISTED]))
        for rank, text in (self.deviations() + self.dead_departures())[:MAX_LISTED]:
            lines.append(f"  evidence: {text}")
        for _a, _b, text in self.mismatches()[:MAX_LISTED]:
            lines.append(f"  mismatch: {text}")
        lines += self._stuck_lines()
        return "\n".join(lines)

    def _stuck_lines(self) -> List[str]:
        """Per stuck collective: who waits in it, who never entered it; per p2p wait: the
        message and why it does not come.  Oldest first (the first to wait is nearest the
        cause)."""
        rows = {}
        for label, seq, r, e, missing in self.stuck:
            key = (label, seq) if e["op"] != "p2p" else (label, "p2p", r, seq)
            row = rows.setdefault(key, {"e": e, "waiting": set(), "missing": {}})
            row["waiting"].add(r)
            row["missing"].update(missing)
        out = [f"stuck ({len(rows)}):"]
        for key, row in sorted(rows.items(), key=lambda kv: kv[1]["e"]["t0"])[:MAX_LISTED]:
            e = row["e"]
            gpu = " (issued, not completed on the GPU)" if e.get("gpu") else ""
            absent = "; ".join(f"{m} ({why})" for m, why in sorted(row["missing"].items()))
            if e["op"] != "p2p":
                out.append(f"  {op_text(e)} at {site_text(e)}{gpu}: waiting "
                           f"{compact(row['waiting'])} (since {clock(e['t0'])}); never "
                           f"entered: {absent}")
            else:
                (r,) = row["waiting"]
                out.append(f"  rank {r} in {op_text(e)} at {site_text(e)} (since "
                           f"{clock(e['t0'])}): no counterpart from {absent}")
        if len(rows) > MAX_LISTED:
            out.append(f"  ... and {len(rows) - MAX_LISTED} more")
        return out

    def _cause_lines(self, c: int, why: str) -> List[str]:
        waiters = sorted(a for a, ms in self.waits.items() if any(m == c for m, _ in ms))
        lines = [f"cause: rank {c} -- {why}"]
        r = self.ranks[c]
        if self.alive(c):
            last = r.last_completed()
            if r.current is not None:
                lines.append(f"  it waits in {op_text(r.current)} at {site_text(r.current)}")
            if last is not None:
                lines.append(f"  its last completed op: {op_text(last)} at {site_text(last)} "
                             f"({clock(last['t1'])})")
        else:
            seen = self.last_seen(c)
            if seen is not None:
                e, by = seen
                lines.append(f"  last op it completed (as rank {by} recorded it): {op_text(e)} "
                             f"at {site_text(e)} ({clock(e['t1'])})")
        for a in waiters[:3]:
            e = self.ranks[a].current
            lines.append(f"  rank {a} waits for it in {op_text(e)} at {site_text(e)} "
                         f"(since {clock(e['t0'])})")
        if len(waiters) > 3:
            lines.append(f"  ... and {len(waiters) - 3} more ranks wait for it directly")
        return lines


def fatal_text(f: Fatal) -> str:
    """A rank's death by a signal, as a cause line says it."""
    where = f" inside comm.{f.collective}" if f.collective else ""
    if f.caller:
        where += f", called from {f.caller}"
    if f.collective and f.in_flight:
        where += f" ({op_text(f.in_flight)} at {site_text(f.in_flight)})"
    return f"{f.error} (a fatal signal){where}; its last words: {f.name}"


def signature(e: dict, with_step: bool = False) -> tuple:
    """What must repeat from one iteration to the next (and agree between group members):
    op, group kind, shapes (not an all-to-all's routed rows), dtype, phase, step, site."""
    kind = e["group"].split("[")[0]
    if e["op"] == "p2p":
        body = tuple((k, p, tuple(s), key) for k, p, s, _n, key in e["parts"])
    else:
        shapes = tuple(tuple(s[1:] if e["op"] == "all_to_all" else s) for s in e["shapes"])
        body = (shapes, e.get("dtype"))
    out = (e["op"], kind, body, e["phase"], e["step"], e["where"])
    return out + ((e["it"],) if with_step else ())


def compact(ranks) -> str:
    ranks = sorted(ranks)
    runs, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            runs.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(runs)


def process_state(pid) -> str:
    """stopped / dead / running, from /proc (this host only)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError, TypeError):
        return "dead (no such process)"
    return {"T": "stopped (SIGSTOP)", "t": "stopped by a debugger", "Z": "dead (zombie)",
            "D": "in uninterruptible I/O"}.get(state, "running but wrote no dump")


def diagnose(dumps: Dict[int, dict], fatal: Optional[Dict[int, Fatal]] = None) -> str:
    if not dumps:
        return "no flight-recorder dumps found"
    return Diagnosis(dumps, fatal).report()


def diagnose_folder(folders: List[str], run_id: Optional[str] = None) -> str:
    dumps = load_dumps(folders, run_id)
    if not dumps:
        return f"no flight-recorder dumps (rank*.json) in {', '.join(folders)}"
    run_id = next(iter(dumps.values())).get("run_id")
    return diagnose(dumps, load_fatal(folders, run_id))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="megalite hangs", description="Say which rank a hung run waits on, from the "
        "per-rank flight-recorder dumps (docs/troubleshooting.md, 'Reading a hang diagnosis').")
    ap.add_argument("logdir", nargs="+", help="the dump folder (--hang-dump-dir; or the --save "
                    "folder or the metrics file's folder, which hold hang_dumps/); several "
                    "folders (one per node) are read together")
    ap.add_argument("--run-id", help="diagnose this run (default: the newest in the folder)")
    a = ap.parse_args(argv)
    missing = [d for d in a.logdir if not os.path.isdir(d)]
    if missing:
        print(f"megalite hangs: error: no such folder: {missing[0]}", file=sys.stderr)
        return 2
    text = diagnose_folder(a.logdir, a.run_id)
    print(text)
    return 0 if not text.startswith("no flight-recorder dumps") else 1
