"""pretrain_gpt.py end to end with ``--transformer-impl transformer_engine`` on CPU, through
the stand-in TE (``tests/te_fake.py``, its modules built on the CPU instead of CUDA and the
"needs CUDA" refusal lifted in the child process only): the training loop, the DP strategy's
grad buffers, the optimizer, the grad norm and DCP checkpoints run over TE-named parameters.
Losses equal the local backend's within 1e-5 per iteration, and a checkpoint saved by one
backend resumes in the other with the uninterrupted run's losses."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(REPO, "tests")

# the child: install the stand-in TE, build its modules on the CPU, lift the CUDA refusal
LAUNCH = """
import sys
sys.path.insert(0, {tests!r})
import te_fake
te_fake.installed().__enter__()
import atexit
atexit.register(lambda: print("stand-in TE modules built:", len(te_fake.BUILT)))
import megalite.backends.transformer_engine as te_backend
from megalite.backends import selection
te_backend._te_device = lambda device: device or "cpu"
selection.backend_refusal = lambda cfg: None
from megalite.training.entry import main
sys.exit(main(sys.argv[1:]))
"""

ARGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--seq-length", "16",
        "--max-position-embeddings", "16", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--vocab-size", "128", "--mock-data",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
        "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--eval-iters", "0", "--log-interval", "1",
        "--device", "cpu", "--no-progress-bar", "--train-iters", "6"]


def run(tmp_path, name, impl, extra=()):
    metrics = str(tmp_path / f"{name}.jsonl")
    cmd = [sys.executable, "-c", LAUNCH.format(tests=TESTS), *ARGS,
           "--transformer-impl", impl, "--metrics-file", metrics, *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"transformer implementation: {impl}" in res.stdout + res.stderr
    built = int(res.stdout.rsplit("stand-in TE modules built:", 1)[1].split()[0])
    assert (built > 0) == (impl == "transformer_engine"), built   # 2 layers x 5 modules
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, open(metrics))
            if "split" not in r}


def close(a, b, tol=1e-5):
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    worst = max(abs(a[k] - b[k]) for k in a)
    print(f"max |loss difference| over {len(a)} iterations: {worst:.2e}")
    assert worst <= tol, (worst, a, b)


def test_training_and_checkpoints_across_backends(tmp_path):
    local = run(tmp_path, "local", "local")
    te = run(tmp_path, "te", "transformer_engine")
    close(te, local)
    ckpt = str(tmp_path / "ckpt")
    run(tmp_path, "te_first", "transformer_engine",
        ["--save", ckpt, "--save-interval", "3", "--exit-interval", "3"])
    resumed = run(tmp_path, "local_after", "local", ["--load", ckpt])
    close(resumed, {k: v for k, v in local.items() if k > 3})
