"""The records of a ``--pipeline-timeline`` trace: executor events, bucket reductions and
simulations as plain dicts, written as and read back from a Chrome trace.

torch-free, so ``megalite viz timeline`` reads and draws a trace without importing torch;
``timeline.py`` gathers the records of a run over the pp group.
"""
from __future__ import annotations

import json
import os
from typing import List

from megalite.errors import DataError


def _comm_name(op) -> str:
    if op.sends and op.recvs:
        return "send+recv"
    return "send" if op.sends else "recv"


def _msgs(pairs) -> List[str]:
    return [f"{m.kind} mb{m.mb} stage{m.stage} peer {peer}" for m, peer in pairs]


def records_from_events(events, pp_rank: int, global_rank: int) -> List[dict]:
    """Executor events -> plain dicts (seconds, wall clock)."""
    out = []
    for op, start, end in events:
        rec = dict(rank=pp_rank, global_rank=global_rank, start=start, end=end,
                   mb=op.mb, chunk=op.chunk)
        if op.kind == "comm":
            rec.update(kind=_comm_name(op), sends=_msgs(op.sends), recvs=_msgs(op.recvs))
        else:
            rec["kind"] = op.kind
        out.append(rec)
    return out


def records_from_buckets(trace: List[dict], pp_rank: int, global_rank: int) -> List[dict]:
    """``--overlap-grad-reduce`` bucket reductions (``grad_buckets.OverlapScheduler.trace``:
    wall-clock launch and completion) as comm-thread records named "reduce k"."""
    return [dict(rank=pp_rank, global_rank=global_rank, start=b["launch"], end=b["done"],
                 mb=-1, chunk=0, kind="reduce", label=f"reduce {b['bucket']}",
                 elements=b["elements"], deferred=b["deferred"])
            for b in trace if b["launch"] is not None and b["done"] is not None]


def records_from_sim(result) -> List[dict]:
    """A ``pipeline_program.SimResult`` in the same form (unit time = 1 second)."""
    return [dict(rank=e.rank, global_rank=e.rank, start=e.start, end=e.end, mb=e.mb,
                 chunk=e.chunk, kind="send+recv" if e.kind == "comm" else e.kind,
                 detail=e.detail) for e in result.events]


def chrome_trace(records: List[dict], metadata: dict) -> dict:
    t0 = min((r["start"] for r in records), default=0.0)
    trace = []
    for pp_rank in sorted({r["rank"] for r in records}):
        g = next(r["global_rank"] for r in records if r["rank"] == pp_rank)
        trace.append({"name": "process_name", "ph": "M", "pid": pp_rank,
                      "args": {"name": f"stage {pp_rank} (rank {g})"}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": pp_rank,
                      "args": {"sort_index": pp_rank}})
    for r in records:
        compute = r["kind"] in ("F", "B", "W", "BW")
        name = f"{r['kind']}{r['mb']}" if compute else r.get("label", r["kind"])
        args = {k: v for k, v in r.items() if k not in ("start", "end", "rank")}
        trace.append({"name": name, "cat": r["kind"] if compute else "comm", "ph": "X",
                      "ts": (r["start"] - t0) * 1e6, "dur": (r["end"] - r["start"]) * 1e6,
                      "pid": r["rank"], "tid": 0 if compute else 1, "args": args})
    return {"traceEvents": trace, "displayTimeUnit": "ms", "metadata": metadata}


def write_chrome_trace(path: str, records: List[dict], metadata: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(chrome_trace(records, metadata), f)


def load_records(path: str, iteration: int = None) -> tuple:
    """(records, metadata) of a trace file; ``iteration`` None = the last one recorded.
    A missing or foreign file is a ``DataError`` (one line at the boundary)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise DataError(f"timeline '{path}': {exc.strerror or exc}; give the file written by "
                        "--pipeline-timeline") from None
    except ValueError as exc:
        raise DataError(f"timeline '{path}' is not JSON ({exc}); give the file written by "
                        "--pipeline-timeline") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise DataError(f"timeline '{path}' has no traceEvents: it is not a --pipeline-timeline "
                        "Chrome trace")
    recs = []
    for e in data["traceEvents"]:
        if e.get("ph") != "X":
            continue
        a = e.get("args", {})
        kind = e["cat"] if e["cat"] != "comm" else e["name"]
        recs.append(dict(rank=e["pid"], kind=kind, mb=a.get("mb", -1), chunk=a.get("chunk", 0),
                         start=e["ts"] / 1e6, end=(e["ts"] + e["dur"]) / 1e6,
                         iteration=a.get("iteration", 1)))
    if recs:
        wanted = iteration or max(r["iteration"] for r in recs)
        recs = [r for r in recs if r["iteration"] == wanted]
    return recs, data.get("metadata", {})
