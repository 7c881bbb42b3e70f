"""launch/slurm/pretrain.sbatch as a good cluster citizen, on a real SLURM cluster (three
nodes, network namespaces, this machine).  One test per defect issue 27 lists; each failed
with the script of main before issue 27 (docs/fault_tolerance.md, "Cluster citizen"):

- the job's exit status is the training's: 2 for a user error, the failing worker's otherwise;
- the rendezvous port comes from the job id: two jobs on one node do not meet;
- one job, submitted from a folder outside the checkout, through a container prefix with
  quoted words, requeued mid-run: it runs there and logs there (nothing in the checkout), the
  container gets its words whole and runs its own python, each node's workers get all its
  CPUs, and the requeued attempt resumes from the checkpoint and keeps the first attempt's
  logs;
- a dead link does not hold the allocation: the other node goes on alone and the job ends.

Where the machine cannot (not root, no apt-get and no slurm, no network namespaces) the
tests skip and say why.
"""
import os
import re
import shlex
import subprocess
import time

import pytest

from slurm_local import (ITERS, PY, ROOT, SBATCH, TWIN, TWIN_FLAGS, IterationWatch,
                         assert_same_losses, cluster_fixture, job_env, losses,
                         reference_losses, run)

cluster = cluster_fixture(nodes=3)
ENTRY = "tests/e2e/exit_status_entry.py"
FAKE_CONTAINER = os.path.join(ROOT, "tests", "e2e", "fake_container.sh")


def _train(*flags, tp=1):
    return [SBATCH, TWIN, *TWIN_FLAGS, "--tensor-model-parallel-size", str(tp),
            "--train-iters", str(ITERS), *flags]


def _out(path):
    return path.read_text() if path.exists() else "(missing)"


def test_job_exit_status_is_the_trainings(cluster, tmp_path):
    """2 for a user error (layout), 3 when a worker exits with 3 (torchrun says 1; srun's
    --kill-on-bad-exit then SIGTERMed the other node: 143)."""
    user = cluster.sbatch("-N1", "-w", "node3", "-o", str(tmp_path / "user-%j.out"),
                          *_train("--micro-batch-size", "3"),
                          env=job_env(MEGALITE_NPROC_PER_NODE=2,
                                      MEGALITE_LOG_DIR=tmp_path / "user"))
    worker = cluster.sbatch("-N2", "-w", "node[1-2]", "-o", str(tmp_path / "worker-%j.out"),
                            SBATCH, TWIN, env=job_env(MEGALITE_ENTRY=ENTRY, FAIL_CODE=3,
                                                      MEGALITE_MAX_RESTARTS=0,
                                                      MEGALITE_LOG_DIR=tmp_path / "worker"))
    got = {"user error": cluster.wait_job(user), "worker exits 3": cluster.wait_job(worker)}
    assert got == {"user error": ("FAILED", "2:0"), "worker exits 3": ("FAILED", "3:0")}, (
        got, _out(tmp_path / f"user-{user}.out")[-2000:],
        _out(tmp_path / f"worker-{worker}.out")[-2000:])
    assert "training exited with status 2" in _out(tmp_path / f"user-{user}.out")


def test_rendezvous_port_comes_from_the_job_id(cluster, tmp_path, tmp_path_factory):
    """Two jobs on node1 at once: the second outlives the first and still completes."""
    ref = reference_losses(tmp_path_factory)
    share = ["--exclusive=user", "-N1", "-w", "node1"]
    env = job_env(MEGALITE_NPROC_PER_NODE=1)
    first = cluster.sbatch(*share, "-o", str(tmp_path / "a-%j.out"),
                           *_train("--metrics-file", str(tmp_path / "a.jsonl")),
                           env=dict(env, MEGALITE_LOG_DIR=str(tmp_path / "a")))
    try:
        IterationWatch(tmp_path / "a.jsonl").wait_for(1, job=first, cluster=cluster)
        second = cluster.sbatch(*share, "-o", str(tmp_path / "b-%j.out"),
                                *_train("--metrics-file", str(tmp_path / "b.jsonl")),
                                env=dict(env, MEGALITE_LOG_DIR=str(tmp_path / "b")))
        got = (cluster.wait_job(first), cluster.wait_job(second))
    finally:
        cluster.scancel(first)
    assert got == (("COMPLETED", "0:0"), ("COMPLETED", "0:0")), (
        got, _out(tmp_path / f"b-{second}.out")[-3000:])
    ports = [re.search(r"rendezvous node1:(\d+)", _out(tmp_path / d / "launch.txt")).group(1)
             for d in ("a", "b")]
    assert ports[0] != ports[1], ports
    for name in ("a", "b"):
        assert_same_losses(losses(tmp_path / f"{name}.jsonl"), ref, f"job {name}")


@pytest.fixture(scope="module")
def citizen_job(cluster, tmp_path_factory):
    """Submitted from a folder outside the checkout, through MEGALITE_CONTAINER with quoted
    words, no MEGALITE_PYTHON; 1 node x 2 processes (TP2); requeued after iteration 5."""
    ref = reference_losses(tmp_path_factory)
    submit = tmp_path_factory.mktemp("elsewhere")
    env = job_env(MEGALITE_NPROC_PER_NODE=2, FAKE_CONTAINER_LOG=submit / "container.txt",
                  FAKE_CONTAINER_PYTHON=PY,
                  MEGALITE_CONTAINER=f"bash {shlex.quote(FAKE_CONTAINER)} --env "
                                     f"'GREETING=hello world' megalite.sif")
    env.pop("MEGALITE_PYTHON")
    metrics = submit / "metrics.jsonl"
    job = cluster.sbatch("-N1", "-w", "node2", *_train(
        "--save", "ckpt", "--save-interval", "2", "--metrics-file", "metrics.jsonl", tp=2),
        env=env, cwd=str(submit))
    requeued = False
    try:
        IterationWatch(metrics).wait_for(5, job=job, cluster=cluster)
        run(cluster.on("node1", "scontrol", "requeue", job))
        requeued = True
        end = time.time() + 600
        while time.time() < end and cluster.job(job).get("Restarts", "0") == "0":
            time.sleep(0.5)
        state = cluster.wait_job(job)
    finally:
        cluster.scancel(job)
    logs = submit / "logs" / f"megalite-{job}"
    return dict(job=job, submit=submit, logs=logs, state=state, requeued=requeued, ref=ref,
                out=_out(submit / f"slurm-megalite-{job}.out"), metrics=metrics)


def test_submitted_from_another_folder_runs_there(citizen_job):
    assert citizen_job["state"] == ("COMPLETED", "0:0"), citizen_job["out"][-3000:]
    assert (citizen_job["submit"] / "ckpt" / "latest_checkpointed_iteration.txt").exists()


def test_logs_go_to_the_submit_folder_not_the_checkout(citizen_job):
    job, logs = citizen_job["job"], citizen_job["logs"]
    assert (citizen_job["submit"] / f"slurm-megalite-{job}.out").exists()
    assert (logs / "launch.txt").exists() and (logs / "node-node2.log").exists(), \
        sorted(os.listdir(citizen_job["submit"]))
    assert not os.path.exists(os.path.join(ROOT, "logs", f"megalite-{job}"))
    assert not os.path.exists(os.path.join(ROOT, f"slurm-megalite-{job}.out"))
    ignored = subprocess.run(["git", "check-ignore", "logs/megalite-1/node-0.log",
                              "slurm-megalite-1.out"], cwd=ROOT, capture_output=True, text=True)
    assert ignored.stdout.split() == ["logs/megalite-1/node-0.log", "slurm-megalite-1.out"]


def test_container_gets_quoted_words_and_runs_its_own_python(citizen_job):
    seen = _out(citizen_job["submit"] / "container.txt").splitlines()
    assert "image=megalite.sif" in seen and "env=GREETING=hello world" in seen, seen[:12]
    assert "arg=python3" in seen, seen[:12]          # the container's python, not a host path
    assert seen[seen.index("arg=python3") + 1:][:2] == ["arg=-m", "arg=megalite.elastic.launch"]


def test_workers_get_all_cpus_of_their_node(citizen_job):
    log = _out(citizen_job["logs"] / "node-node2.log")
    cores = os.cpu_count()
    assert f"> torch threads per process: {max(1, cores // 2)} ({cores} usable cores / 2 local " \
           "processes)" in log, re.findall(r"> torch threads.*", log)


def test_requeued_job_resumes_from_its_checkpoint_and_keeps_both_attempts_logs(citizen_job):
    assert citizen_job["requeued"] and citizen_job["state"] == ("COMPLETED", "0:0")
    out, logs = citizen_job["out"], citizen_job["logs"]
    assert "attempt 0 (SLURM_RESTART_COUNT)" in out and "attempt 1 (SLURM_RESTART_COUNT)" in out
    first, second = _out(logs / "node-node2.log"), _out(logs / "node-node2.requeue-1.log")
    assert re.search(r"iteration +5/", first), first[-2000:]
    # from the newest state of the run: the nodes' peer snapshots (an --elastic job takes
    # them every iteration, and the requeue ran on the same nodes), else its checkpoint
    assert "> resuming (SLURM requeue 1) from the " in second, second[-3000:]
    loaded = re.findall(r"> loaded checkpoint \S+ \(iteration (\d+)\)", second) or \
        re.findall(r"from the in-memory snapshot of iteration (\d+)", second)
    assert loaded and int(loaded[0]) >= 4, loaded
    assert_same_losses(losses(citizen_job["metrics"]), citizen_job["ref"], "requeued job")


def test_dead_link_does_not_hold_the_allocation(cluster, tmp_path, tmp_path_factory):
    """node2's link goes down for good after iteration 4: the collectives time out
    (--distributed-timeout-minutes 0.2), node1 re-forms alone, finishes, and the job ends;
    only node2, which SLURM cannot reach, stays completing until the link is back."""
    ref = reference_losses(tmp_path_factory)
    metrics = tmp_path / "metrics.jsonl"
    start = time.time()
    job = cluster.sbatch("-N2", "-w", "node[1-2]", "-o", str(tmp_path / "slurm-%j.out"),
                         *_train("--save", str(tmp_path / "ckpt"), "--save-interval", "2",
                                 "--distributed-timeout-minutes", "0.2",
                                 "--metrics-file", str(metrics)),
                         env=job_env(MEGALITE_NPROC_PER_NODE=1, MEGALITE_LOG_DIR=tmp_path / "l"))
    watch = IterationWatch(metrics)
    try:
        first = watch.wait_for(1, job=job, cluster=cluster) - start
        watch.wait_for(4, job=job, cluster=cluster)
        cut = time.time()
        cluster.ctl("link", "node2", "down")
        step = (watch.first_seen[4] - watch.first_seen[2]) / 2       # s per iteration at DP2
        # the collectives' timeout, a restart as slow as the first start, the rest of the
        # run at DP1 (twice the work per rank), the script's grace for the other node, slack
        bound = 12 + first + (ITERS - 2) * 2 * step + 20 + 60
        batch_state, _ = cluster.wait_job(job, timeout=bound, final=False)
        ended = time.time() - cut
    finally:
        cluster.ctl("link", "node2", "up")
        cluster.scancel(job)
    state, code = cluster.wait_job(job, timeout=400)
    out = _out(tmp_path / f"slurm-{job}.out")
    print(f"link cut after iteration 4; the batch script ended {ended:.1f} s later "
          f"(bound {bound:.0f} s; first start {first:.1f} s, {step:.1f} s per iteration)")
    assert batch_state in ("COMPLETING", "COMPLETED"), \
        f"job {job} still {batch_state} {ended:.0f} s after the link went down\n{out[-3000:]}"
    assert (state, code) == ("COMPLETED", "0:0"), out[-3000:]
    assert_same_losses(losses(metrics), ref, "node2 cut off after iteration 4")
