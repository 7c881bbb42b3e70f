"""``python -m megalite.elastic.launch`` on one machine, as a user runs it (no SLURM needed):

- its exit status is the failing worker's (torchrun's is 1), a user error (status 2) is not
  restarted, and the result file says how the agent ended;
- ``pretrain_gpt.py --elastic`` on a world the layout does not fit: the largest fitting world
  trains, the other rank waits as a spare and is released at the end; the losses are the
  uninterrupted run's.
"""
import os
import re
import subprocess
import sys

from slurm_local import (ITERS, ROOT, TWIN, TWIN_FLAGS, assert_same_losses, losses,
                         reference_losses)

PY = sys.executable
ENTRY = os.path.join(ROOT, "tests", "e2e", "exit_status_entry.py")


def _launch(tmp_path, name, *args, env=None, timeout=400):
    result = tmp_path / f"{name}.txt"
    p = subprocess.run([PY, "-m", "megalite.elastic.launch", "--result-file", str(result),
                        "--standalone", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout, env=dict(os.environ, **(env or {})))
    return p, result.read_text().split() if result.exists() else []


def test_exit_status_is_the_workers_and_user_errors_are_not_restarted(tmp_path):
    p, res = _launch(tmp_path, "fail", "--nproc-per-node", "2", "--max-restarts", "1", ENTRY,
                     env={"FAIL_CODE": "3"})
    assert p.returncode == 3, p.stderr[-3000:]
    assert res[0] == "3" and res[3] == "failed", res
    assert p.stderr.count("exitcode: 3") >= 2, "one restart, then the same failure"
    assert "Root Cause" in p.stderr and "rank      : 1" in p.stderr
    p, res = _launch(tmp_path, "user", "--nproc-per-node", "2", "--max-restarts", "3",
                     "pretrain_gpt.py", "--config", TWIN, *TWIN_FLAGS, "--micro-batch-size", "3")
    assert p.returncode == 2, p.stderr[-3000:]
    # printed once by the workers and nothing else (no failure summary, no torch shutdown
    # lines, no timeline with --standalone), no restart after a user error (it would print
    # the line again); the result file says how the run ended
    printed = re.findall(r"^megalite: error: --global-batch-size \(8\) is not divisible",
                         p.stderr, re.M)
    assert len(printed) == 1, p.stderr[-3000:]
    assert "Root Cause" not in p.stderr and "rendezvous done" not in p.stderr, p.stderr[-3000:]
    assert "Sending process" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert res[:1] == ["2"] and res[3] == "failed" and res[4:] == \
        ["rank", res[5], "exited", "with", "status", "2"], res
    # a launcher killed with SIGKILL leaves its scratch folder; the next one on the host
    # removes it (its pid is gone) and leaves a live launcher's alone
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    dead = subprocess.run([PY, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp / f"megalite-launch-{dead}-abc123" / "warm").mkdir(parents=True)
    (tmp / f"megalite-launch-{os.getpid()}-def456").mkdir()
    p, res = _launch(tmp_path, "ok", "--nproc-per-node", "2", ENTRY,
                     env={"FAIL_CODE": "0", "TMPDIR": str(tmp)})
    assert p.returncode == 0 and res[0] == "0" and res[3] == "done", p.stderr[-3000:]
    assert sorted(x.name for x in tmp.iterdir() if x.name.startswith("megalite-launch-")) \
        == [f"megalite-launch-{os.getpid()}-def456"]


def test_misfit_world_trains_on_the_largest_fitting_part_with_a_spare(tmp_path,
                                                                     tmp_path_factory):
    ref = reference_losses(tmp_path_factory)
    metrics = tmp_path / "metrics.jsonl"
    p, res = _launch(tmp_path, "spare", "--nproc-per-node", "3", "pretrain_gpt.py",
                     "--config", TWIN, *TWIN_FLAGS, "--tensor-model-parallel-size", "1",
                     "--train-iters", str(ITERS), "--elastic", "--metrics-file", str(metrics),
                     timeout=600)
    assert p.returncode == 0 and res[3] == "done", p.stdout[-2000:] + p.stderr[-3000:]
    assert "> elastic: world 3 does not fit the layout (--global-batch-size (8) is not " \
           "divisible" in p.stdout, p.stdout[-2000:]
    assert "the largest world that does, 2, trains (TP1 CP1 PP1 DP2, 4 micro-batches of 1 " \
           "per DP rank, global batch 8) and rank 2 waits as a spare" in p.stdout
    assert "> rank 2: spare (the layout trains on ranks 0-1); waiting" in p.stdout
    assert_same_losses(losses(metrics), ref, "world 3 -> 2 trainers + 1 spare")
