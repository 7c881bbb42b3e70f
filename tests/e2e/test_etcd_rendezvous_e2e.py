"""``python -m megalite.elastic.launch --rdzv-backend etcd-v2`` on one host, as a user runs it:
three local etcd members (tests/e2e/etcd_local.py), the launcher given all three.

- The member the launcher talks to first is SIGKILLed once the workers are up, then a worker
  fails: the agent's restart re-forms through the surviving members (the client fails
  over) and the run finishes with exit status 0 (a two-process worker, a few seconds).
  The same launch keeps two warm spares (``--warm-spares 2``): both restarted workers run
  in them.
- The same with training (long tier): the member dies after iteration KILL_ETCD_AT, a worker
  after KILL_WORKER_AT; the workers resume from the in-memory snapshot with the
  uninterrupted run's losses.
- No member answers, or an endpoint that is not HOST:PORT: one line, exit status 2.

Skips (saying why) where the machine has no etcd binary or no python-etcd client.
"""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from megalite.testing import process_tree
import etcd_local
from slurm_local import ROOT, TWIN, TWIN_FLAGS, assert_same_losses, losses, reference_losses

PY = sys.executable
ENTRY = os.path.join(ROOT, "tests", "e2e", "etcd_restart_entry.py")
ITERS = 8
KILL_ETCD_AT = 2
KILL_WORKER_AT = 4

pytestmark = pytest.mark.skipif(etcd_local.unavailable() is not None,
                                reason=f"etcd rendezvous: {etcd_local.unavailable()}")


def _launcher(endpoint, *args):
    return [PY, "-m", "megalite.elastic.launch", "--nnodes", "1:2", "--nproc-per-node", "2",
            "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", endpoint, "--rdzv-id", "etcd-e2e",
            "--max-restarts", "1", *args]


def _warm_ready(launcher_pid, count):
    """Whether ``count`` warm processes of the launcher wait in its pool (their sockets)."""
    pools = set()
    for pid in process_tree(launcher_pid, include_self=False):
        try:
            cmd = open(f"/proc/{pid}/cmdline").read().split("\0")
        except OSError:
            continue
        if "megalite.elastic.warm" in cmd and "serve" in cmd:
            pools.add(cmd[cmd.index("serve") + 1])
    return sum(len([f for f in os.listdir(p) if f.endswith(".sock")]) for p in pools) >= count


def _wait_iteration(metrics, it, proc, timeout=300):
    end = time.time() + timeout
    while time.time() < end:
        got = losses(metrics)
        if got and max(got) >= it:
            return max(got)
        assert proc.poll() is None, f"the launcher ended before iteration {it}"
        time.sleep(0.05)
    raise AssertionError(f"iteration {it} not reached in {timeout} s")


def test_first_etcd_member_dies_then_a_restart_re_forms_through_the_others(tmp_path):
    go = tmp_path / "go"
    with etcd_local.LocalEtcd(str(tmp_path)) as etcd:
        log = open(tmp_path / "launch.log", "w")
        proc = subprocess.Popen(_launcher(etcd.endpoint, "--warm-spares", "2", ENTRY),
                                cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, GO_FILE=str(go)))
        try:
            end = time.time() + 400        # warm processes import torch: slow on a loaded machine
            while "rank 1 attempt 0 up" not in (tmp_path / "launch.log").read_text() or \
                    not _warm_ready(proc.pid, 2):
                assert proc.poll() is None and time.time() < end, \
                    (tmp_path / "launch.log").read_text()[-3000:]
                time.sleep(0.05)
            etcd.kill(0)                       # the member the launcher was handed
            go.write_text("")                  # rank 1 fails: the agent re-forms
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
    out = (tmp_path / "launch.log").read_text()
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"worker group failed \(status [^)]*3[^)]*\); 1 restart\(s\) left", out), \
        out[-4000:]
    assert re.search(r"rendezvous done in [\d.]+ s: node 0 of 1, world 2, restart 1", out), \
        out[-4000:]
    assert "rank 0 attempt 1 done" in out and "rank 1 attempt 1 done" in out, out[-4000:]
    assert "attempt 0 up (warm)" not in out, out[-4000:]     # the first start is cold
    assert "rank 0 attempt 1 up (warm)" in out and "rank 1 attempt 1 up (warm)" in out, \
        out[-4000:]


def test_first_etcd_member_and_a_worker_die_training_finishes(tmp_path, tmp_path_factory):
    ref = reference_losses(tmp_path_factory, ITERS)
    metrics = tmp_path / "metrics.jsonl"
    with etcd_local.LocalEtcd(str(tmp_path)) as etcd:
        log = open(tmp_path / "launch.log", "w")
        proc = subprocess.Popen(
            _launcher(etcd.endpoint, "pretrain_gpt.py", "--config", TWIN, *TWIN_FLAGS,
                      "--tensor-model-parallel-size", "1", "--train-iters", str(ITERS),
                      "--elastic", "--metrics-file", str(metrics)),
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            env=dict(os.environ, MEGALITE_SNAPSHOT_DIR=str(tmp_path / "shm")))
        try:
            _wait_iteration(metrics, KILL_ETCD_AT, proc)
            etcd.kill(0)                       # the member the launcher was handed
            _wait_iteration(metrics, KILL_WORKER_AT, proc)
            workers = [p for p in process_tree(proc.pid, include_self=False)
                       if "pretrain_gpt.py" in open(f"/proc/{p}/cmdline").read()]
            assert workers, "no worker found"
            os.kill(workers[-1], signal.SIGKILL)
            proc.wait(timeout=400)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
    out = (tmp_path / "launch.log").read_text()
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"rendezvous done in [\d.]+ s: node 0 of 1, world 2, restart 1", out), \
        out[-4000:]
    assert re.search(r"> resuming \(.*\) from the in-memory snapshot of iteration \d+", out), \
        out[-4000:]
    assert_same_losses(losses(metrics), ref, "etcd member 0 and a worker killed")


def test_no_etcd_member_answers_is_one_line(tmp_path):
    p = subprocess.run(_launcher("127.0.0.1:1,127.0.0.1:2", "pretrain_gpt.py"), cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "megalite launch: error: --rdzv-endpoint 127.0.0.1:1,127.0.0.1:2: no etcd member can "
        "be used (127.0.0.1:1: no etcd answers"), p.stderr
    p = subprocess.run(_launcher("node1:x", "pretrain_gpt.py"), cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip() == (
        "megalite launch: error: --rdzv-endpoint: 'node1:x' is not HOST[:PORT] (an etcd "
        "member's client address, e.g. node1:2379)"), p.stderr
