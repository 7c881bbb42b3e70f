#!/usr/bin/env python
"""The test hook's matrix (issue 38): for each layout and op, one rank drops one op in
iteration 3 of a 4-process gloo run (``MEGALITE_FAULT_INJECT``), and the table says which
rank the diagnosis names as the cause -- at run time (the diagnosis printed while the job
ends, and ``megalite hangs DIR`` afterwards) and before launch (``--dry-run
--check-collectives``) -- next to the rank that dropped it.

    python benchmarks/hang_matrix.py [CASE ...]

The cases and how each is run live here; tests/e2e/test_hang_matrix_e2e.py asserts them.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--mock-data", "--vocab-size", "100", "--lr", "1e-3",
        "--global-batch-size", "4", "--micro-batch-size", "1", "--eval-iters", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "6"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2"]
DISTOPT_TP2 = ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]

# id: (script, layout flags, the hook, the rank that drops the op: the cause to be named)
CASES = {
    "dp-all-gather-distopt-tp2": ("pretrain_gpt.py", DISTOPT_TP2,
                                  "skip:rank=2,iteration=3,group=dp-cp,op=all_gather", 2),
    "loss-all-reduce-dp4": ("pretrain_gpt.py", [],
                            "skip:rank=1,iteration=3,group=dp-cp,op=all_reduce,phase=loss", 1),
    "ep-all-to-all": ("pretrain_moe.py", MOE,
                      "skip:rank=1,iteration=3,group=ep,op=all_to_all", 1),
    "dp-reduce-scatter-distopt-tp2": ("pretrain_gpt.py", DISTOPT_TP2,
                                      "skip:rank=2,iteration=3,group=dp-cp,op=reduce_scatter",
                                      2),
    "cp-ring-send": ("pretrain_gpt.py", ["--context-parallel-size", "2"],
                     "skip:rank=1,iteration=3,group=cp,op=send", 1),
    "moe-token-counts": ("pretrain_moe.py", MOE,
                         "skip:rank=3,iteration=3,group=ep,op=all_gather", 3),
    "fsdp2-all-gather": ("pretrain_gpt.py", ["--use-torch-fsdp2"],
                         "skip:rank=1,iteration=3,group=dp-cp(fsdp2),op=all_gather", 1),
}
PREFIX = "[hang diagnosis] "


def first_cause(text: str) -> str:
    return next((l.strip() for l in text.splitlines() if l.strip().startswith("cause:")), "")


def cause_rank(line: str):
    """The rank a ``cause: rank R -- ...`` line names (None for none)."""
    words = line.split()
    return int(words[2]) if len(words) > 2 and words[:2] == ["cause:", "rank"] else None


def run_time(case: str, folder: str) -> dict:
    """Launch the case under ``megalite.elastic.launch``: the diagnosis printed at run
    time (the last one printed), ``megalite hangs`` on the dump folder afterwards."""
    script, layout, fault, _rank = CASES[case]
    dumps = os.path.join(folder, "dumps")
    t0 = time.monotonic()
    with open(os.path.join(folder, "stderr.txt"), "w+") as log:   # a pipe would fill up
        p = subprocess.run([PY, "-m", "megalite.elastic.launch", "--standalone",
                            "--nproc-per-node", "4", script, *TINY, *layout,
                            "--log-interval", "1000", "--distributed-timeout-minutes", "0.1",
                            "--hang-dump-dir", dumps],
                           cwd=ROOT, env={**ENV, "MEGALITE_FAULT_INJECT": fault},
                           stdout=subprocess.DEVNULL, stderr=log, timeout=300)
        log.seek(0)
        err = log.read()
    seconds = time.monotonic() - t0
    printed = [l[len(PREFIX):] for l in err.splitlines() if l.startswith(PREFIX)]
    heads = [i for i, l in enumerate(printed) if l.startswith("hang diagnosis:")]
    after = subprocess.run([PY, "-m", "megalite.cli", "hangs", dumps], capture_output=True,
                           text=True, env=ENV, cwd=ROOT, timeout=120)
    return {"status": p.returncode, "stderr": err, "seconds": seconds,
            "printed": "\n".join(printed[heads[-1]:]) if heads else "",
            "hangs": after.stdout, "hangs_status": after.returncode, "dumps": dumps}


def before_launch(case: str) -> subprocess.CompletedProcess:
    script, layout, fault, _rank = CASES[case]
    return subprocess.run([PY, script, *TINY, *layout, "--dry-run", "--check-collectives",
                           "--world-size", "4"], capture_output=True, text=True, cwd=ROOT,
                          env={**ENV, "MEGALITE_FAULT_INJECT": fault}, timeout=300)


def main(argv=None) -> int:
    cases = (argv if argv is not None else sys.argv[1:]) or list(CASES)
    rows = []
    for case in cases:
        with tempfile.TemporaryDirectory() as folder:
            run = run_time(case, folder)
        t0 = time.monotonic()
        pre = before_launch(case)
        pre_s = time.monotonic() - t0
        pre_cause = cause_rank(first_cause(pre.stdout))
        refused = pre.returncode == 2 and pre_cause is None and "does not cover" in pre.stderr
        rows.append((case, CASES[case][3], cause_rank(first_cause(run["printed"])),
                     cause_rank(first_cause(run["hangs"])), run["seconds"],
                     "refused" if refused else pre_cause, pre_s,
                     first_cause(run["hangs"]).split(" -- ", 1)[-1][:70]))
        print(f"{case}: done", file=sys.stderr, flush=True)
    print("| case | drops the op | run time: printed | megalite hangs | s | before launch | s "
          "| why (megalite hangs) |")
    print("|---|---|---|---|---|---|---|---|")
    for case, rank, printed, hangs, s, pre, pre_s, why in rows:
        print(f"| {case} | rank {rank} | rank {printed} | rank {hangs} | {s:.0f} | "
              + (f"rank {pre}" if isinstance(pre, int) else str(pre))
              + f" | {pre_s:.0f} | {why} |")
    ok = all(printed == rank == hangs and (pre == rank or pre == "refused")
             for _c, rank, printed, hangs, _s, pre, _p, _w in rows)
    print("all correct" if ok else "NOT all correct")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
