#!/usr/bin/env python
"""A lost node, side by side: torchrun's default rendezvous settings vs megalite's launcher,
a restart from the disk checkpoint vs from the survivors' in-memory snapshots, and restarted
workers that start cold vs in warm spare processes (``--warm-spares 2``: torch and megalite
imported before they are needed, megalite/elastic/warm.py).

Two agents on this machine stand for two nodes (``--nnodes 1:2``, c10d rendezvous on
localhost, 2 workers each: the GPT-3 twin at TP2 DP2, --save-interval larger than the run).
After iteration KILL_AT, agent B and its workers are SIGKILLed for good.  Agent A's
workers fail at once (their peers' sockets close); A re-forms alone (DP1) and finishes.
Each agent has a snapshot folder of its own (``MEGALITE_SNAPSHOT_DIR``), and B's is removed
with it: its shards come back from the replicas A holds.  The disk-only cases pass
``--snapshot-interval 0``.

Printed per launcher: the time from the kill to the re-formed group (A's agent log: the
rendezvous of restart 1 completes) and to the next new iteration (metrics file), the restart
time between the two (the workers' start-up, the restore and the first iteration: what warm
spares shorten), the
iterations trained twice, and whether every loss equals the uninterrupted run's (DP2 with
no failure, run first).  Both use TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it a
restart across nodes fails outright (docs/launching.md, "Restarts").

    python benchmarks/elastic_recovery.py [--kill-at 4] [--iters 12] [--cases launch-snap,launch-warm]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from megalite.testing import process_tree  # noqa: E402
PY = sys.executable
TWIN = ["--config", "launch/recipes/twins/gpt3-175b.yaml", "--pipeline-model-parallel-size",
        "1"]


def _losses(path):
    out = {}
    if os.path.exists(path):
        for line in open(path):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if "lm_loss" in rec and "split" not in rec:
                out[rec["iteration"]] = rec["lm_loss"]
    return out


def _warm_ready(pid, count):
    """Whether ``count`` warm spares of the agent ``pid`` wait in its pool (a real failure
    comes long after the start; on this machine the spares' imports take some seconds)."""
    pools = set()
    for p in process_tree(pid, include_self=False):
        try:
            cmd = open(f"/proc/{p}/cmdline").read().split("\0")
        except OSError:
            continue
        if "megalite.elastic.warm" in cmd and "serve" in cmd:
            pools.add(cmd[cmd.index("serve") + 1])
    return sum(len([f for f in os.listdir(p) if f.endswith(".sock")]) for p in pools
               if os.path.isdir(p)) >= count


def run_case(name, launcher, work, iters, kill_at, port, flags):
    metrics = os.path.join(work, f"{name}.jsonl")
    cmd = [*launcher, "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", name, "--max-restarts", "3",
           "pretrain_gpt.py", *TWIN, "--train-iters", str(iters), "--elastic",
           "--metrics-file", metrics, *flags]
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", LOGLEVEL="INFO",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    logs = {n: open(os.path.join(work, f"{name}-{n}.log"), "w") for n in "ab"}
    agents = {}
    for n in "ab":     # each agent's own snapshot folder: a "node" of its own
        # A hosts the rendezvous store (is_host): the store dies with the agent that hosts
        # it, and on one machine either could otherwise win the port
        own = cmd[:len(launcher)] + ["--rdzv-conf", f"is_host={int(n == 'a')}"] + \
            cmd[len(launcher):]
        agents[n] = subprocess.Popen(own, cwd=ROOT, stdout=logs[n], stderr=subprocess.STDOUT,
                                     env=dict(env, MEGALITE_SNAPSHOT_DIR=os.path.join(
                                         work, f"{name}-shm-{n}")))
        time.sleep(0.5)
    first_seen, kill_time, killed_after = {}, None, None
    try:
        while agents["a"].poll() is None:
            now = time.time()
            for it in _losses(metrics):
                first_seen.setdefault(it, now)
            warm_ok = "--warm-spares" not in launcher or _warm_ready(agents["a"].pid, 2)
            if kill_time is None and max(first_seen, default=0) >= kill_at and warm_ok:
                kill_time = time.time()
                for pid in process_tree(agents["b"].pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                shutil.rmtree(os.path.join(work, f"{name}-shm-b"), ignore_errors=True)
                killed_after = max(_losses(metrics))
            time.sleep(0.05)
    finally:
        for p in agents.values():
            if p.poll() is None:
                p.kill()
        for f in logs.values():
            f.close()
    log = open(os.path.join(work, f"{name}-a.log")).read()
    warm_workers = log.count("> warm spare: this worker runs in a process")
    # the agent's "Rendezvous complete" line of restart 1 (torch's INFO log)
    stamp = re.search(r"I\d{4} (\d\d):(\d\d):(\d\d\.\d+) \d+ \S+\] \[default\] Rendezvous "
                      r"complete for workers\. Result:\n(?:.*\n){0,2}?.*restart_count=1", log)
    reform = None
    if stamp and kill_time:
        h, m, s = int(stamp.group(1)), int(stamp.group(2)), float(stamp.group(3))
        t = time.localtime(kill_time)
        reform = (h * 3600 + m * 60 + s) - (t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec +
                                            kill_time % 1)
    new = first_seen.get(killed_after + 1) if killed_after else None
    loads = re.findall(r"> loaded \S+ \(iteration (\d+)\)|in-memory snapshot of iteration "
                       r"(\d+)", log)
    loads = [int(a or b) for a, b in loads]
    return dict(rc=agents["a"].returncode, reform=reform,
                kill_to_new=(new - kill_time) if new else None, killed_after=killed_after,
                retrained=(killed_after - (int(loads[-1]) if loads else 0)) if killed_after
                else None, losses=_losses(metrics), warm=warm_workers)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kill-at", type=int, default=4)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--cases", default="", help="comma-separated tags (default: all): "
                    "torchrun, launch-disk, launch-snap, launch-warm")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="elastic-recovery-")
    ref_metrics = os.path.join(work, "reference.jsonl")
    subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                    "pretrain_gpt.py", *TWIN, "--train-iters", str(a.iters), "--metrics-file",
                    ref_metrics], cwd=ROOT, check=True, capture_output=True)
    ref = _losses(ref_metrics)
    torchrun, launch = [PY, "-m", "torch.distributed.run"], [PY, "-m", "megalite.elastic.launch"]
    off = ["--snapshot-interval", "0"]
    cases = [("torchrun defaults, disk only", "torchrun", torchrun, 29731, off),
             ("megalite launch, disk only", "launch-disk", launch, 29732, off),
             ("megalite launch, snapshots", "launch-snap", launch, 29733, []),
             ("megalite launch, snapshots, warm", "launch-warm", [*launch, "--warm-spares", "2"],
              29734, [])]
    if a.cases:
        cases = [c for c in cases if c[1] in a.cases.split(",")]
    print(f"two agents x 2 workers on localhost, agent B SIGKILLed after iteration {a.kill_at}"
          f" of {a.iters}; load average {os.getloadavg()[0]:.1f}")
    print(f"  {'launcher, restart source':<34}{'kill -> re-formed':>18}{'kill -> new iteration':>23}"
          f"{'restart':>9}{'retrained':>11}{'losses = uninterrupted':>24}{'exit':>6}"
          f"{'warm workers':>14}")
    for name, tag, launcher, port, flags in cases:
        r = run_case(tag, launcher, work, a.iters, a.kill_at, port, flags)
        same = sorted(r["losses"]) == sorted(ref) and all(
            abs(r["losses"][i] - ref[i]) <= 1e-4 * abs(ref[i]) for i in ref)
        fmt = lambda v: "?" if v is None else f"{v:.1f} s"    # noqa: E731
        restart = r["kill_to_new"] - r["reform"] if r["kill_to_new"] and r["reform"] else None
        print(f"  {name:<34}{fmt(r['reform']):>18}{fmt(r['kill_to_new']):>23}{fmt(restart):>9}"
              f"{r['retrained'] if r['retrained'] is not None else '?':>11}"
              f"{'yes' if same else 'NO':>24}{r['rc']:>6}{r['warm']:>14}")
    print(f"logs: {work}")


if __name__ == "__main__":
    main()
