"""Reading a hang dump folder: the ranks' dumps (``rankNNNNN.json``, of the newest run) and
their fatal-signal records (``rankNNNNN.fatal.txt``); waiting for the dumps to arrive.

A process the backend aborts from C++ (gloo's enforce failures, NCCL's async error handling)
runs no Python and writes no dump.  ``hang_dumps.FatalRecord`` prepares the file while the
rank runs: a header line, the op the rank began last (a memory-mapped line that
``flight_recorder.InFlight`` rewrites at each op) and, when the process dies of a signal,
every thread's Python stack from ``faulthandler``.  A file with no stack is a rank that did
not die of a signal.  Kept free of torch, like the diagnosis that reads it.
"""
from __future__ import annotations

import glob
import json
import os
import time
from typing import Dict, List, Optional


COMM_FILE = "megalite/comm/__init__.py"     # the collectives, as a stack names their file

def dump_folder(folder: str) -> str:
    """The folder the dumps are in: ``folder``, or its ``hang_dumps/`` (given the --save
    folder or the metrics file's)."""
    if os.path.isdir(os.path.join(folder, "hang_dumps")) and \
            not glob.glob(os.path.join(folder, "rank*.json")):
        return os.path.join(folder, "hang_dumps")
    return folder


def dump_files(folders: List[str]) -> List[str]:
    files = []
    for folder in folders:
        files += sorted(glob.glob(os.path.join(dump_folder(folder), "rank*.json")))
    return files


def load_dumps(folders: List[str], run_id: Optional[str] = None) -> Dict[int, dict]:
    """rank -> dump, of the newest run (or ``run_id``) found in ``folders``."""
    dumps = []
    for path in dump_files(folders):
        try:
            with open(path) as f:
                dumps.append(json.load(f))
        except (OSError, ValueError):
            continue                      # being written, or torn: skip it
    if not dumps:
        return {}
    if run_id is None:
        run_id = max(dumps, key=lambda d: d["time"]).get("run_id")
    return {d["rank"]: d for d in dumps if d.get("run_id") == run_id}


def wait_for_dumps(folder: str, run_id: str, world_size: int, quiet: float,
                   limit: float, hurry=None) -> int:
    """Until every rank of the run has dumped, or none has for ``quiet`` seconds (at most
    ``limit``, or until the event ``hurry`` is set); returns how many dumps there are."""
    t0, last_change, seen = time.time(), time.time(), None
    while True:
        stamps = {}
        for path in glob.glob(os.path.join(folder, "rank*.json")):
            try:
                stamps[path] = os.stat(path).st_mtime
            except OSError:
                pass
        if stamps != seen:
            seen, last_change = stamps, time.time()
        now = time.time()
        if hurry is not None and hurry.is_set():
            quiet = min(quiet, 0.5)        # the job is being ended: only the dumps under way
        if len(seen) >= world_size or now - last_change >= quiet or now - t0 >= limit:
            return len(load_dumps([folder], run_id))
        time.sleep(0.2)


FATAL_HEADER = "megalite fatal-signal record: run {run_id} rank {rank} pid {pid} host {host}"
BOX_HEAD = "in flight: "       # the fatal record's second line (flight_recorder.InFlight)


def parse_in_flight(line: str) -> Optional[dict]:
    """The op a ``flight_recorder.InFlight`` line names, as a dump entry (never
    completed); None before the rank's first op."""
    fields = line[len(BOX_HEAD):].rstrip(" \n").split("\t")
    if not line.startswith(BOX_HEAD) or len(fields) < 10:
        return None
    seq, op, group, it, phase, step, where, shapes, dtype, parts = fields[:10]
    e = {"seq": int(seq), "op": op, "group": group, "it": int(it), "phase": phase,
         "step": step, "where": where, "t0": None, "t1": None, "waiting": True,
         "shapes": [[int(x) for x in s.split("x") if x] for s in shapes.split("/")]
         if shapes else [], "dtype": dtype.replace("torch.", "") if dtype != "None" else None}
    if op == "p2p":
        e["parts"] = [[k, int(peer), [int(x) for x in shape.split("x") if x], int(n), key or None]
                      for k, peer, shape, n, key in (p.split(",", 4) for p in parts.split(";"))]
    return e


def load_fatal(folders: List[str], run_id: Optional[str]) -> Dict[int, "Fatal"]:
    """rank -> the last words its fatal-signal handler wrote (``rankNNNNN.fatal.txt``), of
    run ``run_id``; a file with only its header (the rank did not die of a signal) is none."""
    out = {}
    for folder in folders:
        for path in sorted(glob.glob(os.path.join(dump_folder(folder), "rank*.fatal.txt"))):
            try:
                with open(path, errors="replace") as f:
                    text = f.read(200_000)
            except OSError:
                continue
            fatal = Fatal.parse(text, os.path.basename(path))
            if fatal is not None and (run_id is None or fatal.run_id == run_id):
                out[fatal.rank] = fatal
    return out


class Fatal:
    """A rank's death by a signal, as ``faulthandler`` recorded it: the error line
    ("Fatal Python error: Aborted") and where its main thread was -- inside which of
    megalite.comm's collectives, called from where."""

    def __init__(self, rank: int, run_id: str, error: str, collective: Optional[str],
                 caller: Optional[str], name: str, in_flight: Optional[dict] = None):
        self.rank, self.run_id, self.error, self.name = rank, run_id, error, name
        self.collective, self.caller = collective, caller
        self.in_flight = in_flight     # the op it began last (its flight recorder's)

    @classmethod
    def parse(cls, text: str, name: str) -> Optional["Fatal"]:
        head, _, body = text.partition("\n")
        words = head.split()
        if not head.startswith("megalite fatal-signal record:") or not body.strip() or \
                "run" not in words or "rank" not in words:
            return None
        run_id = words[words.index("run") + 1]
        rank = int(words[words.index("rank") + 1])
        box, _, rest = body.partition("\n")
        in_flight = parse_in_flight(box) if box.startswith(BOX_HEAD) else None
        if box.startswith(BOX_HEAD):
            body = rest
            if not body.strip():
                return None             # only the header: it did not die of a signal
        error = next((l.split(":", 1)[1].strip() for l in body.splitlines()
                      if l.startswith("Fatal Python error:")), "killed by a signal")
        collective = caller = None
        stacks = [cls._megalite_frames(block) for block in body.split("\n\n")]
        stacks = [f for f in stacks if any(fn == "<module>" for _p, fn, _l in f)] + stacks
        for frames in stacks:         # the main thread first (it runs the training loop)
            in_comm = [k for k, (path, fn, _l) in enumerate(frames)
                       if path == COMM_FILE and not fn.startswith("_")]
            if in_comm:
                collective = frames[in_comm[0]][1]
                up = next((f for f in frames[in_comm[-1] + 1:] if f[0] != COMM_FILE),
                          None)
                caller = f"{up[0]}:{up[2]} {up[1]}" if up else None
                break
        return cls(rank, run_id, error, collective, caller, name, in_flight)

    @staticmethod
    def _megalite_frames(block: str) -> List[tuple]:
        """(path from megalite/, function, line) of one thread's frames, innermost first."""
        out = []
        for line in block.splitlines():
            line = line.strip()
            if not line.startswith("File \"") or " in " not in line:
                continue
            path = line.split('"')[1].replace(os.sep, "/")
            number = line.split(", line ")[-1].split()[0]
            fn = line.rsplit(" in ", 1)[1]
            if "megalite/" in path:
                out.append((path[path.rfind("megalite/"):], fn, number))
            elif fn == "<module>":
                out.append((os.path.basename(path), fn, number))
        return out
