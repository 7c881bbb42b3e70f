"""README's "What works today" rows whose flags had no test that runs them as a user does:
the dry-run layout print, and pretrain_gpt.py under torchrun with sequence parallelism, the
CPU speed flags, an interleaved pipeline with recomputation and its timeline (drawn by
``megalite viz``), context parallelism, the distributed optimizer with overlapped reductions
and async, pruned checkpoints, FSDP2, and blended random training windows.  Each parallel run
gives the single-process losses (docs/architecture.md#numerical-contract: 1e-5 at step 1, 1e-4 after)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--seq-length", "32",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
RUN = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr",
       "1e-3", "--lr-warmup-iters", "1", "--eval-iters", "0", "--log-interval", "1",
       "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--split", "1,0,0",
       "--device", "cpu", "--no-progress-bar"]


def _run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, **kw)
    assert p.returncode == 0, f"{cmd}\nSTDOUT:\n{p.stdout[-3000:]}\nSTDERR:\n{p.stderr[-3000:]}"
    return p.stdout


def _losses(path):
    return [r["lm_loss"] for r in map(json.loads, open(path)) if "split" not in r]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from megalite.data.indexed_dataset import write_documents

    root = tmp_path_factory.mktemp("rows")
    rng = np.random.default_rng(0)
    return [write_documents(str(root / name), [list(rng.integers(1, 127, size=int(n)))
                                               for n in rng.integers(20, 200, size=40)],
                            np.uint16) for name in ("a", "b")]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / "one.jsonl"
    _run([PY, "pretrain_gpt.py", *MODEL, *RUN, "--data-path", corpus[0],
          "--transformer-impl", "local", "--metrics-file", str(path)])
    return _losses(path)


def _matches(losses, ref):
    assert len(losses) == len(ref) == 3
    assert abs(losses[0] - ref[0]) <= 1e-5 * ref[0], (losses, ref)
    assert all(abs(a - b) <= 1e-4 * b for a, b in zip(losses, ref)), (losses, ref)


def test_dry_run_prints_the_rank_layout():
    out = _run([PY, "-m", "megalite.parallel_state", "--world-size", "16", "--tp", "2", "--cp",
                "2", "--pp", "2"])
    assert "world 16: TP=2 CP=2 DP=2 PP=2" in out and "[0,8] [1,9]" in out
    out = _run([PY, "pretrain_gpt.py", *MODEL, "--dry-run", "--world-size", "16",
                "--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2",
                "--global-batch-size", "8", "--mock-data", "--vocab-size", "100"])
    assert "TP=2 CP=2 DP=2 PP=2" in out
    assert "micro-batch 2 x 2 micro-batches x DP 2 = global batch 8" in out
    assert "vocabulary 100 padded to 256" in out
    pp = [PY, "pretrain_gpt.py", *MODEL, "--dry-run", "--world-size", "2", "--pp", "2",
          "--mock-data", "--vocab-size", "100", "--global-batch-size", "4"]
    out = _run(pp + ["--num-virtual-stages-per-pipeline-rank", "2"])
    assert "layers per pipeline rank (virtual stages split by |): 0: 0 | 2; 1: 1 | 3" in out
    out = _run(pp + ["--pipeline-model-parallel-layout", "E|(tt|)*2L"])
    assert "layers per pipeline rank (virtual stages split by |): 0: embedding | 2-3; " \
        "1: 0-1 | loss (--pipeline-model-parallel-layout E|(tt|)*2L)" in out
    bad = subprocess.run(pp + ["--pipeline-model-parallel-layout", "Et|tt|L"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "megalite: error: --pipeline-model-parallel-layout 'Et|tt|L' has 3 stages, not a "
        "multiple of --pipeline-model-parallel-size (2); give PP x VPP stages"], bad.stderr


# (name, flags of a 2-process run); every one must give the single-process losses
LAYOUTS = {
    "tp2_sp_speed_flags": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                           "--precision", "fp32", "--cross-entropy-loss-fusion",
                           "--attention-backend", "unfused"],
    # interleaved by a Megatron layout string: chunks of 2, 1, 1 and 0 layers
    "pp2_interleaved_recompute": ["--pipeline-model-parallel-size", "2",
                                  "--pipeline-model-parallel-layout", "Ett|t|t|L",
                                  "--recompute-granularity", "full", "--recompute-method",
                                  "uniform"],
    "cp2_ring": ["--context-parallel-size", "2", "--cp-comm-type", "p2p"],
    "dp2_zero2_async_save": ["--use-distributed-optimizer", "--overlap-grad-reduce",
                             "--overlap-param-gather", "--save-interval", "1", "--async-save",
                             "--keep-last-n-checkpoints", "2"],
    "dp2_fsdp2": ["--use-torch-fsdp2"],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_torchrun_layout_gives_single_process_losses(name, corpus, reference, tmp_path):
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    extra = ["--save", str(ckpt)] if "--save-interval" in LAYOUTS[name] else []
    if name.startswith("pp2"):
        extra += ["--pipeline-timeline", str(tmp_path / "trace.json")]
    _run([*TORCHRUN, "pretrain_gpt.py", *MODEL, *RUN, "--data-path", corpus[0], *LAYOUTS[name],
          *extra, "--metrics-file", str(metrics)])
    _matches(_losses(metrics), reference)
    if extra and ckpt.exists():          # async saves every iteration, the oldest pruned
        assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000003",
                                            "latest_checkpointed_iteration.txt"]
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
        assert os.path.isfile(ckpt / "iter_0000003" / "manifest.json")
    if name.startswith("pp2"):
        trace = json.load(open(tmp_path / "trace.json"))
        ops = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        kinds = {e["cat"] for e in ops}
        assert "F" in kinds and kinds & {"B", "BW"} and {e["pid"] for e in ops} == {0, 1}
        _run([PY, "-m", "megalite.cli", "viz", "timeline", str(tmp_path / "trace.json"),
              "-o", str(tmp_path / "schedule.png")])
        assert (tmp_path / "schedule.png").stat().st_size > 1000


def test_blended_random_windows_train(corpus, reference, tmp_path):
    """--sample-windows random over a weighted --data-path blend: training runs on windows
    at random offsets of both corpora, so the losses are not the packed run's."""
    metrics = tmp_path / "r.jsonl"
    _run([PY, "pretrain_gpt.py", *MODEL, *RUN, "--data-path", "0.5", corpus[0], "0.5",
          corpus[1], "--sample-windows", "random", "--metrics-file", str(metrics)])
    losses = _losses(metrics)
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert abs(losses[0] - reference[0]) > 1e-4 * reference[0]
