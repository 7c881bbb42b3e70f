"""``--pipeline-timeline PATH``: a Chrome trace (chrome://tracing, Perfetto) of the schedule.

Every pipeline rank's F / B / W / BW ops and p2p batches, with wall-clock times, are
gathered over the pp group after each training iteration; the writer (last stage, TP, CP
and DP rank 0 -- the rank that logs the loss) writes one file holding the first
``MAX_ITERATIONS`` iterations of its pipeline.  One process per stage (``pid`` = pp
rank), compute on thread 0 and communication on thread 1.  ``megalite viz timeline``
draws it; the records and the trace format are ``timeline_records.py``'s.
"""
from __future__ import annotations

from typing import Dict

from megalite import comm
from megalite.pipeline_parallel.timeline_records import (  # noqa: F401  (re-exported)
    chrome_trace, load_records, records_from_buckets, records_from_events, records_from_sim,
    write_chrome_trace)

MAX_ITERATIONS = 4
_HISTORY: Dict[str, dict] = {}   # path -> {"iterations": n, "events": [...]} (writer only)


def is_timeline_writer(state) -> bool:
    return state.is_last_stage(ignore_virtual=True) and state.tp.rank == 0 and \
        state.cp.rank == 0 and state.dp.rank == 0


def record_iteration(cfg, state, events, schedule: str, buckets=()) -> None:
    """Gather this iteration's events over the pp group; the writer appends and rewrites.

    Collective over the pp group: every stage calls it (the training loop, after the
    gradient sync, with the events the schedule handed back and, with
    --overlap-grad-reduce, the strategy's bucket trace)."""
    path = cfg.logging.pipeline_timeline
    hist = _HISTORY.setdefault(path, {"iterations": 0, "events": []})
    if hist["iterations"] >= MAX_ITERATIONS:
        return
    hist["iterations"] += 1
    it = hist["iterations"]
    mine = records_from_events(events, state.pp.rank, state.rank) + \
        records_from_buckets(list(buckets), state.pp.rank, state.rank)
    for r in mine:
        r["iteration"] = it
    gathered = comm.all_gather_object(mine, state.pp)
    if not is_timeline_writer(state):
        return
    hist["events"] += [r for rank_records in gathered for r in rank_records]
    meta = {"schedule": schedule, "pp": state.pp.size, "vpp": state.vpp_size,
            "micro_batches": cfg.num_micro_batches, "iterations": it,
            "tp": state.tp.size, "world_size": cfg.world_size}
    write_chrome_trace(path, hist["events"], meta)
