"""The launch scripts on a real SLURM cluster: two nodes (network namespaces) on this machine.

launch/slurm/local_cluster.sh stands up Debian's slurmctld, slurmd and munge with two nodes,
each a network namespace with its own address and hostname.  Then:

- the project's own launch/slurm/pretrain.sbatch, unchanged, runs the Llama-3 405B CPU twin
  (TP2 PP2 with 2 virtual stages) on 2 nodes x 2 processes; its per-iteration losses equal the
  same layout launched with plain torchrun on one node;
- a two-node torchrun with --max-restarts 1 loses a worker to kill -9, restarts, resumes from
  the last checkpoint (--load of the save folder) and ends on the uninterrupted run's loss.

Where the machine cannot (not root, no apt-get and no slurm, no network namespaces) the tests
skip and say why.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
CLUSTER = os.path.join(ROOT, "launch", "slurm", "local_cluster.sh")
TWIN = "launch/recipes/twins/llama3-405b.yaml"
ITERS = 10
REL_TOL = 1e-6


def _run(cmd, timeout=600, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout, **kw)
    assert p.returncode == 0, f"{cmd}\nSTDOUT:\n{p.stdout[-3000:]}\nSTDERR:\n{p.stderr[-3000:]}"
    return p.stdout


def _losses(path):
    """iteration -> lm loss; a re-logged iteration (after a restart) keeps its last value."""
    out = {}
    with open(path) as fh:
        for line in fh:
            rec = json.loads(line)
            if "split" not in rec:
                out[rec["iteration"]] = rec["lm_loss"]
    return out


def _assert_same_losses(got, ref, what):
    assert sorted(got) == sorted(ref), f"{what}: iterations {sorted(got)} vs {sorted(ref)}"
    for it in sorted(ref):
        assert abs(got[it] - ref[it]) <= REL_TOL * abs(ref[it]), \
            f"{what}: iteration {it}: {got[it]!r} vs torchrun one node {ref[it]!r}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    check = subprocess.run(["bash", CLUSTER, "check"], capture_output=True, text=True)
    if check.returncode != 0:
        reason = f"no local SLURM cluster on this machine: {check.stdout.strip()}"
        print(reason)
        pytest.skip(reason)
    d = str(tmp_path_factory.mktemp("slurm"))
    up = subprocess.run(["bash", CLUSTER, "up", d], capture_output=True, text=True, timeout=600)
    if up.returncode in (3, 4):          # cannot (no root / install failed): say why, skip
        print(up.stderr.strip())
        pytest.skip(up.stderr.strip().splitlines()[-1])
    assert up.returncode == 0, f"local cluster did not start:\n{up.stdout}\n{up.stderr}"
    print(up.stdout.strip())
    try:
        yield d
    finally:
        subprocess.run(["bash", CLUSTER, "down", d], capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The twin at world 4 with plain torchrun on one node: the losses to match."""
    d = tmp_path_factory.mktemp("reference")
    _run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
          "pretrain_gpt.py", "--config", TWIN, "--train-iters", str(ITERS),
          "--metrics-file", str(d / "metrics.jsonl")])
    return _losses(d / "metrics.jsonl")


def _on(cluster, node, *cmd):
    return [os.path.join(cluster, "on"), node, *cmd]


def _wait_job(cluster, job, timeout=600):
    end = time.time() + timeout
    while time.time() < end:
        q = subprocess.run(_on(cluster, "node1", "squeue", "-h", "-j", job),
                           capture_output=True, text=True)
        if not q.stdout.strip():
            break
        time.sleep(0.2)
    info = _run(_on(cluster, "node1", "scontrol", "show", "job", job))
    fields = dict(tok.split("=", 1) for tok in info.split() if "=" in tok)
    return fields.get("JobState"), fields.get("ExitCode")


def test_sbatch_two_nodes_equals_torchrun_one_node(cluster, reference, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    env = dict(os.environ, MEGALITE_NPROC_PER_NODE="2", MEGALITE_PYTHON=PY,
               GLOO_SOCKET_IFNAME="eth0", MEGALITE_LOG_DIR=str(tmp_path / "logs"))
    start = time.time()
    job = _run(_on(cluster, "node1", "sbatch", "--parsable", "-N", "2",
                   "-o", str(tmp_path / "slurm-%j.out"), "launch/slurm/pretrain.sbatch", TWIN,
                   "--train-iters", str(ITERS), "--metrics-file", str(metrics)),
               env=env).strip().split(";")[0]
    first = None
    while first is None and time.time() - start < 600:
        if metrics.exists() and metrics.stat().st_size:
            first = time.time() - start
        time.sleep(0.05)
    state, code = _wait_job(cluster, job)
    out = open(tmp_path / f"slurm-{job}.out").read()
    assert (state, code) == ("COMPLETED", "0:0"), f"job {job}: {state} {code}\n{out[-3000:]}"
    assert "on 2 node(s) x 2 process(es)" in out and "training exited with status 0" in out
    assert sorted(os.listdir(tmp_path / "logs")) == ["launch.txt", "node-0.log", "node-1.log"]
    print(f"sbatch -> first iteration: {first:.1f} s; job done after {time.time() - start:.1f} s")
    _assert_same_losses(_losses(metrics), reference, "sbatch 2 nodes x 2")


def _descendants(pid):
    """Every live process under ``pid`` (read from /proc: the test's own processes only)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_two_node_restart_after_kill_resumes_from_checkpoint(cluster, reference, tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    common = ["pretrain_gpt.py", "--config", TWIN, "--train-iters", str(ITERS),
              "--save", str(ckpt), "--save-interval", "2"]
    # A first checkpoint (iteration 2) so that every attempt below starts with --load.
    _run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", *common,
          "--exit-interval", "2"])
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    launch = [PY, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
              "--rdzv-backend", "c10d", "--rdzv-endpoint", "node1:29511", "--rdzv-id", "restart",
              "--rdzv-conf", "join_timeout=120", "--max-restarts", "1", *common,
              "--load", str(ckpt), "--metrics-file", str(metrics)]
    logs = {n: open(tmp_path / f"{n}.log", "w") for n in ("node1", "node2")}
    procs = {n: subprocess.Popen(_on(cluster, n, *launch), cwd=ROOT, env=env, stdout=logs[n],
                                 stderr=subprocess.STDOUT) for n in ("node1", "node2")}
    try:
        killed, deadline = None, time.time() + 300
        while killed is None and time.time() < deadline:
            if metrics.exists() and max(_losses(metrics) or [0]) >= 5:
                workers = [p for p in _descendants(procs["node2"].pid)
                           if "pretrain_gpt.py" in _cmdline(p)
                           and "torch.distributed.run" not in _cmdline(p)]
                if workers:
                    killed = workers[0]
                    os.kill(killed, signal.SIGKILL)
            time.sleep(0.05)
        assert killed, "the run never reached iteration 5"
        kill_time = time.time()
        rcs = {n: p.wait(timeout=600) for n, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        for f in logs.values():
            f.close()
    out = {n: open(tmp_path / f"{n}.log").read() for n in logs}
    assert rcs == {"node1": 0, "node2": 0}, f"exit codes {rcs}\n{out['node2'][-4000:]}"
    restarted = [line for line in out["node2"].splitlines()
                 if "Worker group FAILED" in line or "restart" in line.lower()]
    assert restarted, f"no restart in the launcher's log:\n{out['node2'][-3000:]}"
    got = _losses(metrics)
    records = [json.loads(line) for line in open(metrics)]
    order = [r["iteration"] for r in records if "split" not in r]    # training lines only
    # a resumed run keeps the metrics file's records up to its checkpoint: one clean series
    assert order == list(range(3, ITERS + 1)), order
    loads = [int(n) for n in re.findall(r"> loaded \S+ \(iteration (\d+)\)", out["node1"])]
    assert len(loads) == 2 and loads[0] == 2 and loads[1] > 3, \
        f"expected the restart to load the latest checkpoint (not the seed's 2): {loads}"
    print(f"killed worker {killed}; the restart resumed from iteration {loads[1]} and finished "
          f"{time.time() - kill_time:.1f} s after the kill")
    _assert_same_losses(got, {i: v for i, v in reference.items() if i > 2},
                        "two-node restart after kill -9")
