"""Helpers for the tests that run on a real SLURM cluster on this machine
(launch/slurm/local_cluster.sh: slurmctld, slurmd and munge, each node a network namespace).

``cluster_fixture(nodes)`` makes a module fixture that stands a cluster up (or skips, saying
why) and takes ``LOCK`` for the module's duration, so that two test runs on one machine do
not train at the same time (their clusters never meet anyway: own namespaces, own munged).
"""
import fcntl
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
CLUSTER = os.path.join(ROOT, "launch", "slurm", "local_cluster.sh")
SBATCH = os.path.join(ROOT, "launch", "slurm", "pretrain.sbatch")
LOCK = "/tmp/megalite-slurm-tests.lock"
# The twin every elastic / cluster-citizen test trains: GPT-3 175B's (TP2 PP2), without PP
# so that it fits small worlds (each test gives TP), 12 iterations.
TWIN = "launch/recipes/twins/gpt3-175b.yaml"
TWIN_FLAGS = ["--pipeline-model-parallel-size", "1"]
ITERS = 12
REL_TOL = 1e-4           # docs/architecture.md#numerical-contract: across layouts, after 10 steps


def run(cmd, timeout=600, check=True, **kw):
    kw.setdefault("cwd", ROOT)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check:
        assert p.returncode == 0, f"{cmd}\nSTDOUT:\n{p.stdout[-3000:]}\nSTDERR:\n{p.stderr[-3000:]}"
    return p


def cluster_fixture(nodes: int, ctl: bool = False):
    """``ctl``: slurmctld on a host of its own (local_cluster.sh up ... ctl), so that a test
    can kill node1 as any other node; client commands then run on that host."""
    @pytest.fixture(scope="module")
    def cluster(tmp_path_factory):
        check = subprocess.run(["bash", CLUSTER, "check"], capture_output=True, text=True)
        if check.returncode != 0:
            reason = f"no local SLURM cluster on this machine: {check.stdout.strip()}"
            print(reason)
            pytest.skip(reason)
        with open(LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)      # another run's SLURM tests finish first
            d = str(tmp_path_factory.mktemp("slurm"))
            up = subprocess.run(["bash", CLUSTER, "up", d, str(nodes), *(["ctl"] if ctl else [])],
                                capture_output=True,
                                text=True, timeout=600)
            if up.returncode in (3, 4):    # cannot (no root / install failed): say why, skip
                print(up.stderr.strip())
                pytest.skip(up.stderr.strip().splitlines()[-1])
            assert up.returncode == 0, f"local cluster did not start:\n{up.stdout}\n{up.stderr}"
            print(up.stdout.strip())
            try:
                yield Cluster(d, client="ctl" if ctl else "node1")
            finally:
                subprocess.run(["bash", CLUSTER, "down", d], capture_output=True, timeout=120)
    return cluster


class Cluster:
    def __init__(self, path, client="node1"):
        self.path, self.client = path, client      # where sbatch, scontrol, sinfo run

    def on(self, node, *cmd):
        return [os.path.join(self.path, "on"), node, *cmd]

    def ctl(self, *args):
        """local_cluster.sh ARGS[0] DIR ARGS[1:] (kill-node, start-node, link)."""
        return run(["bash", CLUSTER, args[0], self.path, *args[1:]])

    def sbatch(self, *args, env=None, cwd=ROOT):
        out = run(self.on(self.client, "sbatch", "--parsable", *args), env=env, cwd=cwd).stdout
        return out.strip().split(";")[0]

    def job(self, job) -> dict:
        info = run(self.on(self.client, "scontrol", "show", "job", "-o", job), check=False).stdout
        return dict(tok.split("=", 1) for tok in info.split() if "=" in tok)

    def wait_job(self, job, timeout=600, final=True):
        """(JobState, ExitCode) once the job has ended (or the timeout passed).  ``final=False``
        returns as soon as the batch script has ended: a job whose dead node cannot clean up
        stays COMPLETING (holding only that node) until the node returns or is marked down."""
        done = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED")
        if not final:
            done += ("COMPLETING",)
        end = time.time() + timeout
        fields = {}
        while time.time() < end:
            fields = self.job(job)
            if fields.get("JobState") in done:
                break
            time.sleep(0.3)
        return fields.get("JobState"), fields.get("ExitCode")

    def wait_idle(self, nodes, timeout=120):
        end = time.time() + timeout
        while time.time() < end:
            out = run(self.on(self.client, "sinfo", "-h", "-N", "-o", "%N %T"), check=False).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if all(states.get(n) == "idle" for n in nodes):
                return
            time.sleep(0.5)
        raise AssertionError(f"nodes {nodes} not idle: {out}")

    def wait_responding(self, node, timeout=120):
        """Until ``node``'s slurmd answers the controller again (after start-node)."""
        end = time.time() + timeout
        while time.time() < end:
            out = run(self.on(self.client, "scontrol", "ping"), check=False)
            state = run(self.on(self.client, "sinfo", "-h", "-n", node, "-o", "%T"),
                        check=False).stdout.strip()
            if out.returncode == 0 and state and not state.endswith("*"):
                return state
            time.sleep(0.5)
        raise AssertionError(f"{node} does not respond: {state}")

    def scancel(self, job):
        run(self.on(self.client, "scancel", job), check=False)


def job_env(**extra):
    env = dict(os.environ, MEGALITE_PYTHON=PY, GLOO_SOCKET_IFNAME="eth0")
    env.pop("MEGALITE_ROOT", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def losses(path) -> dict:
    """iteration -> lm loss (training records; a re-logged iteration keeps its last value)."""
    out = {}
    if not os.path.exists(path):
        return out
    with open(path) as fh:
        for line in fh:
            try:
                rec = json.loads(line)
            except ValueError:          # a line being written
                continue
            if "split" not in rec and "lm_loss" in rec:
                out[rec["iteration"]] = rec["lm_loss"]
    return out


def assert_same_losses(got: dict, ref: dict, what: str, tol: float = REL_TOL):
    assert sorted(got) == sorted(ref), f"{what}: iterations {sorted(got)} vs {sorted(ref)}"
    for it in sorted(ref):
        assert abs(got[it] - ref[it]) <= tol * abs(ref[it]), \
            f"{what}: iteration {it}: {got[it]!r} vs the uninterrupted run's {ref[it]!r}"


def reference_losses(tmp_path_factory, iters: int = ITERS) -> dict:
    """The uninterrupted run: the twin on one process (computed once per session)."""
    base = tmp_path_factory.getbasetemp()
    cache = base / f"slurm-reference-{iters}.json"
    if cache.exists():
        return {int(k): v for k, v in json.loads(cache.read_text()).items()}
    metrics = base / f"slurm-reference-{iters}.jsonl"
    run([PY, "pretrain_gpt.py", "--config", TWIN, *TWIN_FLAGS, "--tensor-model-parallel-size",
         "1", "--train-iters", str(iters),
         "--metrics-file", str(metrics)], env=dict(os.environ, MEGALITE_DEBUG="0"))
    ref = losses(metrics)
    cache.write_text(json.dumps(ref))
    return ref


class IterationWatch:
    """When each iteration of a metrics file first appeared (the file is read as it grows;
    a restart that starts over truncates it)."""

    def __init__(self, path):
        self.path, self.first_seen = path, {}

    def poll(self) -> int:
        now = time.time()
        for it in losses(self.path):
            self.first_seen.setdefault(it, now)
        return max(self.first_seen, default=0)

    def wait_for(self, iteration, timeout=600, job=None, cluster=None) -> float:
        end = time.time() + timeout
        while time.time() < end:
            if self.poll() >= iteration:
                return self.first_seen[min(i for i in self.first_seen if i >= iteration)]
            if job and cluster and not cluster.job(job).get("JobState", "").startswith(
                    ("RUNNING", "PENDING", "CONFIGURING")):
                raise AssertionError(f"job {job} ended before iteration {iteration}: "
                                     f"{cluster.job(job).get('JobState')}")
            time.sleep(0.05)
        raise AssertionError(f"iteration {iteration} not reached in {timeout} s")
