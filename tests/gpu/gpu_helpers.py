"""Helpers of the GPU tests (imported by tests/gpu/*; conftest.py holds the fixtures)."""
import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def te_status():
    """(TE usable, one line saying why or why not)."""
    from megalite.backends.selection import TE_INSTALL, te_import_error

    if not torch.cuda.is_available():
        return False, "no CUDA device"
    err = te_import_error()
    if err:
        return False, f"transformer_engine does not import ({err}); install: {TE_INSTALL}"
    import transformer_engine

    return True, f"transformer_engine {getattr(transformer_engine, '__version__', '?')}"


def need_gpus(n: int):
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < n:
        pytest.skip(f"needs {n} GPUs (NCCL cannot put two ranks on one GPU); this machine has "
                    f"{have}")


LLAMA_TINY = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8",
              "--group-query-attention", "--num-query-groups", "4", "--ffn-hidden-size", "512",
              "--seq-length", "256", "--max-position-embeddings", "256",
              "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
              "--disable-bias-linear", "--untie-embeddings-and-output-weights",
              "--vocab-size", "1024", "--mock-data", "--micro-batch-size", "2",
              "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine",
              "--lr-warmup-iters", "2", "--weight-decay", "0.1", "--clip-grad", "1.0",
              "--bf16", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
              "--eval-iters", "0", "--log-interval", "1", "--device", "cuda",
              "--no-progress-bar"]


def train(tmp_path, name: str, extra: list, nproc: int = 1, timeout: int = 300) -> list:
    """Run pretrain_gpt.py (torchrun for nproc > 1); the per-iteration metric records."""
    metrics = str(tmp_path / f"{name}.jsonl")
    args = LLAMA_TINY + ["--metrics-file", metrics] + extra
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", os.path.join(REPO, "pretrain_gpt.py"), *args]
    else:
        cmd = [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *args]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=timeout)
    assert res.returncode == 0, res.stderr[-4000:] + res.stdout[-2000:]
    return [json.loads(x) for x in open(metrics) if '"split"' not in x]
