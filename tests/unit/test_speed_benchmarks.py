"""benchmarks/step_time.py: its FLOP count is the training FLOP model's, and it refuses to
report on a contended machine unless told otherwise."""
import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import step_time  # noqa: E402

from megalite.cli.arguments import parse_args  # noqa: E402
from megalite.training.flops import flops_per_iteration  # noqa: E402

REFERENCE = dict(hidden=256, ffn=688, layers=4, heads=8, kv_heads=4, vocab=32000, seq=256,
                 batch=8, warmup=1, reps=1)
TINY = ["--hidden", "32", "--ffn", "48", "--layers", "1", "--heads", "4", "--kv-heads", "2",
        "--vocab", "100", "--seq", "16", "--batch", "2", "--reps", "1", "--warmup", "1",
        "--threads", "1", "--modes", "megalite fp32,megalite bf16 fused,hf fp32"]


def test_step_matmul_flops_equal_the_training_flop_model():
    args = argparse.Namespace(**REFERENCE)
    flops = sum(c * b * 2 * m * k * n for c, b, m, k, n in step_time.step_matmuls(args))
    cfg = parse_args(step_time.megalite_flags(args, bf16=False, fused=False))
    assert flops == pytest.approx(flops_per_iteration(cfg), rel=1e-12)
    assert flops == pytest.approx(142.74e9, rel=1e-4)          # the "about 143 GFLOP"


def test_refuses_when_contended_and_reports_when_allowed(capsys):
    assert step_time.main(TINY + ["--min-cpu-share", "2.0"]) == 3
    out = capsys.readouterr()
    assert "REFUSED: the machine is contended" in out.err and "tokens/s" not in out.out
    assert step_time.main(TINY + ["--min-cpu-share", "2.0", "--allow-contended"]) == 0
    out = capsys.readouterr().out
    assert "CPU: " in out and "matmul flags:" in out and "vs HF best" in out
    for mode in ("megalite fp32", "megalite bf16 fused", "hf fp32"):
        assert mode in out
    assert "megalite best (" in out and "efficiency" in out
