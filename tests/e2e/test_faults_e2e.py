"""Faults as a long run meets them, through torchrun (tiny models, short timeouts):

* a hung (SIGSTOPped) peer: a TP collective and a PP receive each fail within
  --distributed-timeout-minutes (not torch's 30-minute default for new groups), naming the
  group, the op and the peer;
* a NaN on the last stage of PP=2 ends *both* ranks at once, naming the iteration and rank;
* SIGUSR1 to one rank with --exit-signal-handler: every rank saves and exits 0;
* --exit-duration-in-mins saves and exits;
* torchrun --max-restarts 1 recovers a kill -9'd rank from the latest complete checkpoint
  and ends with the uninterrupted run's loss.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--mock-data", "--vocab-size", "100", "--lr", "1e-3",
        "--global-batch-size", "4", "--micro-batch-size", "1", "--eval-iters", "0",
        "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _torchrun(n, *args, restarts=0):
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
            "--max-restarts", str(restarts), *args]


def _run(cmd, timeout=300):
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=timeout)
    return p, time.monotonic() - t0


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_hung_peer_is_an_error_naming_group_op_peer(layout):
    p, _ = _run(_torchrun(2, "tests/e2e/hung_peer.py", layout), timeout=200)
    line = next((l for l in p.stdout.splitlines() if l.startswith("ERROR after")), None)
    assert line is not None, p.stdout[-2000:] + p.stderr[-2000:]
    seconds = float(line.split()[2].rstrip("s:"))
    assert seconds <= 6 + 30, line                     # timeout 0.1 min + 30 s
    if layout == "tp":
        assert "all_reduce on group 'tp' with ranks [0, 1]" in line, line
    else:
        assert "recv from [1] on group 'pp' with peer rank(s) [1]" in line, line


def test_nan_on_last_stage_ends_every_rank_promptly():
    """The default timeout is 10 minutes; the run must end in far less, both ranks."""
    p, took = _run(_torchrun(2, "pretrain_gpt.py", *TINY, "--pipeline-model-parallel-size",
                             "2", "--train-iters", "5", "--init-method-std", "1e20"))
    assert p.returncode != 0
    assert took < 120, took
    err = p.stderr
    assert "[rank 1] error, ending every rank: FloatingPointError: rank 1: loss is nan at " \
           "iteration 1" in err, err[-3000:]
    assert "[rank 0] error, ending every rank: CommError" in err, err[-3000:]


def test_check_for_nan_in_grad_names_iteration_and_rank():
    p, _ = _run([PY, "pretrain_gpt.py", *TINY, "--train-iters", "3", "--init-method-std",
                 "1e20", "--check-for-nan-in-loss-and-grad"])
    assert p.returncode != 0
    assert "rank 0: loss is nan at iteration 1" in p.stderr, p.stderr[-2000:]


def _children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def _wait_for_iteration(metrics, n, proc, limit=240):
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        assert proc.poll() is None, proc.communicate()
        if os.path.isfile(metrics):
            recs = [json.loads(l) for l in open(metrics).read().splitlines() if l.strip()]
            if recs and recs[-1]["iteration"] >= n:
                return
        time.sleep(0.05)
    raise AssertionError(f"iteration {n} never reached")


def test_sigusr1_on_one_rank_saves_and_exits(tmp_path):
    metrics, ckpt = str(tmp_path / "m.jsonl"), str(tmp_path / "ckpt")
    proc = subprocess.Popen(_torchrun(2, "pretrain_gpt.py", *TINY, "--train-iters", "100000",
                                      "--tensor-model-parallel-size", "2", "--save", ckpt,
                                      "--exit-signal-handler", "--metrics-file", metrics),
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        _wait_for_iteration(metrics, 3, proc)
        os.kill(_children(proc.pid)[-1], signal.SIGUSR1)     # one worker only
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert took < 30, took
    assert "received SIGUSR1" in out or "peer received a signal" in out, out[-2000:]
    it = int(open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read())
    last = [json.loads(l) for l in open(metrics).read().splitlines()][-1]["iteration"]
    assert it == last >= 3


def test_exit_duration_in_mins_saves_and_exits(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    p, _ = _run([PY, "pretrain_gpt.py", *TINY, "--train-iters", "100000", "--save", ckpt,
                 "--exit-duration-in-mins", "0.0001"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert "--exit-duration-in-mins 0.0001 reached" in p.stdout
    assert int(open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read()) >= 1


def test_torchrun_restart_recovers_a_killed_rank(tmp_path):
    """4 processes (TP2 x DP2), checkpoint every 4 iterations into the --load directory;
    kill -9 one rank after iteration 10; torchrun restarts everyone, the run resumes from
    iteration 8 and its final loss equals an uninterrupted run's bit for bit."""
    flags = [*TINY, "--tensor-model-parallel-size", "2", "--train-iters", "40",
             "--save-interval", "4"]
    ref_metrics = str(tmp_path / "ref.jsonl")
    p, _ = _run(_torchrun(4, "pretrain_gpt.py", *flags, "--metrics-file", ref_metrics))
    assert p.returncode == 0, p.stderr[-2000:]
    ref = [json.loads(l) for l in open(ref_metrics).read().splitlines()]

    metrics, ckpt = str(tmp_path / "m.jsonl"), str(tmp_path / "ckpt")
    proc = subprocess.Popen(_torchrun(4, "pretrain_gpt.py", *flags, "--save", ckpt, "--load",
                                      ckpt, "--metrics-file", metrics, restarts=1),
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        _wait_for_iteration(metrics, 10, proc)
        os.kill(_children(proc.pid)[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "> loaded" in out, out[-2000:]
    recs = [json.loads(l) for l in open(metrics).read().splitlines()]
    assert recs[-1]["iteration"] == 40
    assert len(recs) > 40                         # iterations after the checkpoint ran twice
    assert recs[-1]["lm_loss"] == ref[-1]["lm_loss"], (recs[-1], ref[-1])
