"""``--check-collectives``: prove before launch that the layout's ranks issue matching
collectives (``trace.py`` derives each rank's program from the real training step on meta
tensors; ``check.py`` compares and simulates the programs).  docs/troubleshooting.md,
"Checking collectives before launch", says what it covers and what it does not."""
from __future__ import annotations

import os
import resource
import time
import dataclasses
import threading
import multiprocessing
from dataclasses import dataclass
from typing import Optional

import torch

from megalite.comm.flight_recorder import FAULT_ENV, parse_faults
from megalite.diagnostics.collective_check.check import (Checker, by_pipeline_rank, departure,
                                                        every_rank)
from megalite.diagnostics.collective_check.trace import trace_rank
from megalite.parallel_state import RankGrid, usable_cores

EXHAUSTIVE_MAX_WORLD = 64      # up to here every rank is traced


@dataclass
class CheckRun:
    verdict: object
    seconds: float
    peak_rss_bytes: int
    iteration: int            # the training iteration traced


def iteration_to_trace() -> int:
    """Iteration 1, or the test hook's latest iteration."""
    faults = parse_faults(os.environ.get(FAULT_ENV)) or []
    return max([1] + [f.iteration for f in faults])


def hooked_ranks() -> set:
    return {f.rank for f in parse_faults(os.environ.get(FAULT_ENV)) or []}


def check_collectives(cfg, trainer_class, mode: Optional[str] = None, family=None,
                      progress=None) -> CheckRun:
    """Trace and check ``cfg``'s layout, running ``trainer_class``'s step (the loop's
    ``Trainer``).  ``mode``: "every-rank" or "representatives" (default: every rank up to
    ``EXHAUSTIVE_MAX_WORLD`` ranks)."""
    assert not cfg.parallel.use_torch_fsdp2, (      # validation refused it
        "rule '--check-collectives excludes --use-torch-fsdp2' (megalite/cli/features.py)")
    if cfg.training.compile:     # same collectives; compiling meta graphs only costs time
        cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training,
                                                                    compile=False))
    t0 = time.perf_counter()
    grid = RankGrid.from_config(cfg)
    mode = mode or ("every-rank" if grid.world_size <= EXHAUSTIVE_MAX_WORLD
                    else "representatives")
    classes = every_rank(grid.world_size) if mode == "every-rank" else \
        by_pipeline_rank(grid, hooked_ranks() & set(range(grid.world_size)))
    iteration = iteration_to_trace()
    to_trace = sorted({r for reps in classes.reps.values() for r in reps})
    programs = dict(_trace_all(cfg, trainer_class, to_trace, iteration, family, progress))
    verdict = Checker(grid, classes, programs, exempt=hooked_ranks()).run()
    if not verdict.ok:
        verdict.causes = _causes(cfg, trainer_class, classes, programs, verdict.involved,
                                 iteration, family)
    peak = max(resource.getrusage(who).ru_maxrss for who in
               (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) * 1024
    return CheckRun(verdict, time.perf_counter() - t0, peak, iteration)


MAX_CAUSE_CANDIDATES = 8      # ranks named by the problems that are traced once more


def _causes(cfg, trainer_class, classes, programs, involved, iteration, family) -> list:
    """(rank, why): of the ranks the problems name, those whose program departs from
    their own in another iteration -- the ones that left their program, as the hang
    diagnosis decides at run time.  The neighbouring iteration is traced for them (once per
    class); none under a batch-size ramp, whose programs change from step to step."""
    if cfg.training.rampup_batch_size:
        return []
    ref = iteration - 1 if iteration > 1 else iteration + 1
    out, seen = [], {}
    for r in involved[:MAX_CAUSE_CANDIDATES]:
        rep = classes.reps[classes.of[r]][0]
        if rep not in seen:
            seen[rep] = departure(programs[rep], trace_rank(cfg, trainer_class, rep, ref, family),
                                  iteration, ref)
        if seen[rep] is not None:
            out.append((r, f"it left its own program: {seen[rep]}"))
    return out


def _trace_one(job):
    cfg, trainer_class, rank, iteration, family = job
    return rank, trace_rank(cfg, trainer_class, rank, iteration, family)


def _one_thread():
    """Tracing is Python; its few real ops are tiny.  torch's intra-op threads only spin:
    with two forked workers on two busy cores their OpenMP barriers stalled every op (a
    DeepSeek-V3 check ran 10x slower than tracing its ranks one after another)."""
    torch.set_num_threads(1)


def _trace_all(cfg, trainer_class, ranks, iteration, family, progress):
    """(rank, program) for each rank; on several cores, traced by forked workers (tracing
    is single-threaded Python).  Only a single-threaded process forks: a child forked while
    another thread holds a lock (a logging handler, a store client) waits on it forever."""
    jobs = [(cfg, trainer_class, r, iteration, family) for r in ranks]
    workers = min(usable_cores(), len(jobs))
    threads = torch.get_num_threads()
    if workers < 2 or len(jobs) < 4 or threading.active_count() > 1:
        _one_thread()
        results = map(_trace_one, jobs)
        pool = None
    else:
        pool = multiprocessing.get_context("fork").Pool(workers, initializer=_one_thread)
        # one job at a time: a late long job on one worker would leave the others idle
        results = pool.imap_unordered(_trace_one, jobs, chunksize=1)
    try:
        for i, item in enumerate(results):
            if progress is not None:
                progress(i + 1, len(jobs))
            yield item
    finally:
        torch.set_num_threads(threads)
        if pool is not None:
            pool.close()
            pool.join()


def report_text(run: CheckRun, world: int) -> str:
    v = run.verdict
    ops = sorted(set(v.ops_per_rank.values()))
    how = "every rank traced" if v.mode == "every-rank" else \
        f"{v.ranks_traced} representatives traced for {len(v.ops_per_rank)} classes of ranks"
    head = (f"collective check ({how}; iteration {run.iteration}; {ops[0]}"
            + (f"-{ops[-1]}" if len(ops) > 1 else "") + " ops per rank; "
            f"{v.groups_checked} group patterns): ")
    tail = f"  ({run.seconds:.1f} s, peak memory {run.peak_rss_bytes / 2**20:.0f} MiB)"
    if v.classes_hold is not None:
        hooked = sorted(hooked_ranks())
        tail = ("  every rank's program equals its pipeline-rank class's (peers as offsets): "
                "the argument behind representatives holds for this layout"
                + (f" (rank{'s' if len(hooked) > 1 else ''} {', '.join(map(str, hooked))} "
                   f"left out: the test hook changes them)" if hooked else "") + "\n"
                if v.classes_hold else "".join(f"  note: {n}\n" for n in v.notes)) + tail
    if v.ok:
        return head + f"OK for all {world} ranks -- every group's members issue the same " \
            "collectives in the same order with the same shapes and dtypes, every send has " \
            "its receive, and the programs run to the end" + "\n" + tail
    return head + f"{len(v.problems)} problem{'s' if len(v.problems) > 1 else ''}\n" + \
        "\n".join(f"  {p}" for p in v.problems) + "\n" + \
        "".join(f"  cause: rank {r} -- {why}\n" for r, why in v.causes) + tail
