"""A lost node costs one iteration: two ``python -m megalite.elastic.launch`` agents on this
machine stand for two nodes (``--nnodes 1:2``, c10d rendezvous on localhost, one worker
each: the GPT-3 twin at DP2, no ``--save`` at all), each with a snapshot folder of its own
(``MEGALITE_SNAPSHOT_DIR``: its node's shared memory).  After iteration KILL_AT agent B and
its worker are SIGKILLed for good and B's folder is removed (its node's memory is gone).
Agent A re-forms alone and resumes from the newest snapshot: its own shard from its folder,
B's from the replica B sent it.  At most one iteration is trained twice, every loss is the
uninterrupted run's, and A exits 0.
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

from megalite.testing import process_tree
from slurm_local import ITERS, ROOT, TWIN, TWIN_FLAGS, assert_same_losses, losses, reference_losses

PY = sys.executable
KILL_AT = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port, proc, timeout=120):
    end = time.time() + timeout
    while time.time() < end and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"agent A's rendezvous store is not listening on port {port}")


def test_lost_agent_resumes_from_the_survivors_snapshot(tmp_path, tmp_path_factory):
    ref = reference_losses(tmp_path_factory)
    metrics = tmp_path / "metrics.jsonl"
    port = _free_port()
    cmd = [PY, "-m", "megalite.elastic.launch", "--nnodes", "1:2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "snap", "--max-restarts", "3", "pretrain_gpt.py", "--config", TWIN,
           *TWIN_FLAGS, "--tensor-model-parallel-size", "1", "--train-iters", str(ITERS),
           "--elastic", "--metrics-file", str(metrics)]
    agents, logs = {}, {}
    cores = sorted(os.sched_getaffinity(0))
    for i, n in enumerate("ab"):
        logs[n] = open(tmp_path / f"agent-{n}.log", "w")
        env = dict(os.environ, MEGALITE_SNAPSHOT_DIR=str(tmp_path / f"shm-{n}"))
        # a core per "node" where there are two: each worker then runs as many threads as
        # its node has cores, as on a cluster (sharing both, 2 x 2 threads stall each other)
        pin = ["taskset", "-c", str(cores[i % len(cores)])] if len(cores) >= 2 else []
        agents[n] = subprocess.Popen(pin + cmd, cwd=ROOT, env=env, stdout=logs[n],
                                     stderr=subprocess.STDOUT)
        if n == "a":                  # A hosts the rendezvous store (the first node's role)
            _wait_listening(port, agents["a"])
    first_seen, kill_time, killed_after = {}, None, None
    deadline = time.time() + 400
    try:
        while agents["a"].poll() is None and time.time() < deadline:
            now = time.time()
            for it in losses(metrics):
                first_seen.setdefault(it, now)
            if kill_time is None and max(first_seen, default=0) >= KILL_AT:
                kill_time = time.time()
                for pid in process_tree(agents["b"].pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                shutil.rmtree(tmp_path / "shm-b")           # the node's memory is gone too
                killed_after = max(losses(metrics))
            time.sleep(0.05)
    finally:
        for p in agents.values():
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in logs.values():
            f.close()
    log = (tmp_path / "agent-a.log").read_text()
    assert agents["a"].returncode == 0, log[-4000:]
    found = re.findall(r"> resuming \(.*\) from the in-memory snapshot of iteration (\d+) held "
                       r"by the survivors \((\d+) of (\d+) old ranks' shards from replicas\)", log)
    assert found, log[-4000:]
    resumed_at, from_replicas, old_world = map(int, found[-1])
    assert (from_replicas, old_world) == (1, 2), found
    retrained = killed_after - resumed_at
    kill_to_new = first_seen[killed_after + 1] - kill_time
    print(f"agent B killed after iteration {killed_after}; resumed from the snapshot of "
          f"iteration {resumed_at} ({retrained} trained twice); next new iteration "
          f"{kill_to_new:.1f} s after the kill")
    assert 0 <= retrained <= 1, (killed_after, resumed_at)
    assert re.search(r"> snapshot: iteration \d+: \d+ snapshot\(s\) of [\d.]+ MiB per rank: "
                     r"stall [\d.]+ ms", log), log[-3000:]
    assert_same_losses(losses(metrics), ref, f"agent B lost after iteration {killed_after}")
    assert not os.listdir(tmp_path / "shm-a"), "a completed run leaves no snapshot behind"
