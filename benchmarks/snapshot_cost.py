#!/usr/bin/env python
"""What an in-memory peer snapshot costs per iteration, side by side with snapshots off.

Two ``megalite.elastic.launch`` agents on this machine stand for two nodes (one core each
where the machine has two or more, a snapshot folder each), one worker per agent: the
GPT-3 twin at DP2 with the distributed optimizer, ``--train-iters N``.  Run twice in one
invocation, ``--snapshot-interval 0`` and ``1``; printed per run: the mean time per
iteration (iterations 3..N: the first two warm up), and with snapshots on the training
thread's stall per snapshot (capture + clone) and the background thread's time (serialize,
write to the node's folder, send the replica to the buddy and store the one received), as
the ``> snapshot:`` log lines report them, and the bytes per rank.

    python benchmarks/snapshot_cost.py [--iters 20] [--hidden-size 64]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
TWIN = ["--config", "launch/recipes/twins/gpt3-175b.yaml", "--pipeline-model-parallel-size",
        "1", "--tensor-model-parallel-size", "1", "--use-distributed-optimizer"]
SNAP_LINE = re.compile(r"> snapshot: iteration (\d+): (\d+) snapshot\(s\) of ([\d.]+) MiB per "
                       r"rank: stall ([\d.]+) ms per snapshot on the training thread, ([\d.]+) "
                       r"ms in the background")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(work, name, iters, interval, extra):
    metrics = os.path.join(work, f"{name}.jsonl")
    port = _free_port()
    cmd = [PY, "-m", "megalite.elastic.launch", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", name,
           "pretrain_gpt.py", *TWIN, *extra, "--train-iters", str(iters), "--elastic",
           "--snapshot-interval", str(interval), "--metrics-file", metrics]
    cores = sorted(os.sched_getaffinity(0))
    procs, logs = [], []
    for i in range(2):
        log = os.path.join(work, f"{name}-{i}.log")
        logs.append(log)
        env = dict(os.environ, MEGALITE_SNAPSHOT_DIR=os.path.join(work, f"{name}-shm{i}"),
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        pin = ["taskset", "-c", str(cores[i % len(cores)])] if len(cores) >= 2 else []
        procs.append(subprocess.Popen(pin + cmd, cwd=ROOT, env=env, stdout=open(log, "w"),
                                      stderr=subprocess.STDOUT))
        if i == 0:                      # the first agent hosts the rendezvous store
            end = time.time() + 120
            while time.time() < end:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.1)
    codes = [p.wait() for p in procs]
    recs = [json.loads(line) for line in open(metrics) if '"lm_loss"' in line]
    steps = [r["elapsed_ms"] + r.get("snapshot_stall_ms", 0.0) for r in recs[2:]]
    text = open(logs[0]).read()
    snaps = [m.groups() for m in SNAP_LINE.finditer(text)][2:]
    return {"codes": codes, "iter_ms": sum(steps) / max(len(steps), 1),
            "stall_ms": sum(float(s[3]) for s in snaps) / len(snaps) if snaps else 0.0,
            "background_ms": sum(float(s[4]) for s in snaps) / len(snaps) if snaps else 0.0,
            "mib": float(snaps[-1][2]) if snaps else 0.0,
            "losses": [r["lm_loss"] for r in recs]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--hidden-size", type=int, default=None,
                    help="a larger twin (e.g. 256) for a state of a few MiB more")
    a = ap.parse_args()
    extra = []
    if a.hidden_size:
        extra = ["--hidden-size", str(a.hidden_size), "--ffn-hidden-size",
                 str(4 * a.hidden_size)]
    work = tempfile.mkdtemp(prefix="snapshot-cost-")
    off = run(work, "off", a.iters, 0, extra)
    on = run(work, "on", a.iters, 1, extra)
    print(f"two agents x 1 worker (DP2, distributed optimizer), {a.iters} iterations; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"  {'snapshots':<22}{'ms / iteration':>16}{'stall ms':>10}{'background ms':>15}"
          f"{'MiB per rank':>14}{'exit':>8}")
    print(f"  {'off':<22}{off['iter_ms']:>16.1f}{'-':>10}{'-':>15}{'-':>14}"
          f"{str(off['codes']):>8}")
    print(f"  {'every iteration':<22}{on['iter_ms']:>16.1f}{on['stall_ms']:>10.1f}"
          f"{on['background_ms']:>15.1f}{on['mib']:>14.1f}{str(on['codes']):>8}")
    same = on["losses"] == off["losses"]
    print(f"  per iteration: +{on['iter_ms'] - off['iter_ms']:.1f} ms "
          f"({100 * (on['iter_ms'] / off['iter_ms'] - 1):+.1f}%) with snapshots, of which "
          f"{on['stall_ms']:.1f} ms is the training thread's stall; losses identical: "
          f"{'yes' if same else 'NO'}")
    print(f"logs: {work}")


if __name__ == "__main__":
    main()
