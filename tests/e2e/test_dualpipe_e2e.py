"""``pretrain_gpt.py --pipeline-schedule dualpipev`` and ``zbv`` (the two V-shaped
schedules) as a user runs them: torchrun, 2 CPU processes, PP 2; DualPipeV with the
overlapped F&B flags (``--overlap-moe-expert-parallel-comm --delay-wgrad-compute``: the
pairs run as two cooperative halves, the paired backwards split into B + W), ZB-V plain.
One launch per schedule checks the training losses and grad norms and the evaluation
loss (the forward-only program) against one single-process run of the same flags, the
metrics writer sitting on pp rank 0 (where the V ends, tied embeddings: one matrix there)
and the pipeline timeline trace;
a too-small global batch is refused in one line, exit 2."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--mock-data", "--vocab-size", "100", "--lr", "1e-3",
         "--global-batch-size", "4",
         "--micro-batch-size", "1", "--train-iters", "2", "--eval-interval", "2",
         "--eval-iters", "1", "--log-interval", "1", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--device", "cpu"]
OVERLAP = ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
# schedule: (its extra flags, the fewest micro-batches it runs at PP 2)
SCHEDULES = {"dualpipev": (OVERLAP, 4), "zbv": ([], 3)}


def _run(cmd, ok=True):
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    if ok:
        assert p.returncode == 0, f"{cmd}\nSTDOUT:\n{p.stdout[-3000:]}\nSTDERR:\n{p.stderr[-3000:]}"
    return p


def _rows(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if "split" not in r], [r for r in rows if r.get("split") == "valid"]


def _close(a, b, tol):
    return abs(a - b) <= tol * abs(b)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The single-process run both schedules are held to (its rows: train, valid)."""
    one = tmp_path_factory.mktemp("one") / "one.jsonl"
    _run([PY, "pretrain_gpt.py", *FLAGS, "--metrics-file", str(one)])
    return _rows(one)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_pretrain_gpt_v_schedule_matches_one_process(tmp_path, one_process, schedule):
    extra, fewest = SCHEDULES[schedule]
    pipeline = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule]
    two, trace = tmp_path / "two.jsonl", tmp_path / "trace.json"
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = _run([*torchrun, "pretrain_gpt.py", *FLAGS, *pipeline, *extra,
                "--metrics-file", str(two),
                "--pipeline-timeline", str(trace)]).stdout
    assert "iteration        2/       2" in out
    (ref, ref_valid), (got, got_valid) = one_process, _rows(two)
    assert [r["iteration"] for r in got] == [1, 2]
    for key in ("lm_loss", "grad_norm"):
        assert _close(got[0][key], ref[0][key], 1e-5), (key, got, ref)
        assert _close(got[1][key], ref[1][key], 1e-4), (key, got, ref)
    assert got_valid and _close(got_valid[-1]["lm_loss"], ref_valid[-1]["lm_loss"], 1e-4)
    meta = json.loads(trace.read_text())["metadata"]
    assert meta["schedule"] == schedule and meta["pp"] == 2 and meta["vpp"] == 2

    small = _run([PY, "pretrain_gpt.py", *FLAGS, *pipeline, "--world-size", "2",
                  "--global-batch-size", "2", "--dry-run"], ok=False)
    lines = [l for l in (small.stdout + small.stderr).splitlines()
             if l.startswith("megalite: error:")]
    assert small.returncode == 2 and len(lines) == 1, small.stdout + small.stderr
    assert f"--pipeline-schedule {schedule} needs at least {fewest} micro-batches" in lines[0]
    assert "Traceback" not in small.stderr
