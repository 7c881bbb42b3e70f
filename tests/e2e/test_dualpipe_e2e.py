"""``pretrain_gpt.py --pipeline-schedule dualpipev`` as a user runs it: torchrun, 2 CPU
processes, PP 2, with the overlapped F&B flags (``--overlap-moe-expert-parallel-comm
--delay-wgrad-compute``: the pairs run as two cooperative halves, the paired backwards split
into B + W).  One launch checks the training losses and grad norms and the evaluation
loss (the forward-only program) against a single-process run of the same flags, the
metrics writer sitting on pp rank 0 (where the V ends, tied embeddings: one matrix there)
and the pipeline timeline trace;
a too-small global batch is refused in one line, exit 2."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--mock-data", "--vocab-size", "100", "--lr", "1e-3",
         "--global-batch-size", "4",
         "--micro-batch-size", "1", "--train-iters", "2", "--eval-interval", "2",
         "--eval-iters", "1", "--log-interval", "1", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--device", "cpu"]
DUALPIPEV = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "dualpipev"]
OVERLAP = ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]


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


def test_pretrain_gpt_dualpipev_matches_one_process(tmp_path):
    one, two, trace = tmp_path / "one.jsonl", tmp_path / "two.jsonl", tmp_path / "trace.json"
    _run([PY, "pretrain_gpt.py", *FLAGS, "--metrics-file", str(one)])
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = _run([*torchrun, "pretrain_gpt.py", *FLAGS, *DUALPIPEV, *OVERLAP,
                "--metrics-file", str(two),
                "--pipeline-timeline", str(trace)]).stdout
    assert "iteration        2/       2" in out
    (ref, ref_valid), (got, got_valid) = _rows(one), _rows(two)
    assert [r["iteration"] for r in got] == [1, 2]
    for key in ("lm_loss", "grad_norm"):
        assert _close(got[0][key], ref[0][key], 1e-5), (key, got, ref)
        assert _close(got[1][key], ref[1][key], 1e-4), (key, got, ref)
    assert got_valid and _close(got_valid[-1]["lm_loss"], ref_valid[-1]["lm_loss"], 1e-4)
    meta = json.loads(trace.read_text())["metadata"]
    assert meta["schedule"] == "dualpipev" and meta["pp"] == 2 and meta["vpp"] == 2

    small = _run([PY, "pretrain_gpt.py", *FLAGS, *DUALPIPEV, "--world-size", "2",
                  "--global-batch-size", "2", "--dry-run"], ok=False)
    lines = [l for l in (small.stdout + small.stderr).splitlines()
             if l.startswith("megalite: error:")]
    assert small.returncode == 2 and len(lines) == 1, small.stdout + small.stderr
    assert "--pipeline-schedule dualpipev needs at least 4 micro-batches" in lines[0]
    assert "Traceback" not in small.stderr
