"""--attention-backend: the unfused kernel equals SDPA (values and gradients, GQA, causal or
not), the rule ``auto`` follows, the flag reaching the layer, and the planner's activation
bytes for each kernel against the tensor meter's measured step peak."""
import json

import pytest
import torch
import torch.nn.functional as F

from megalite.cli.arguments import parse_args
from megalite.config import ConfigError
from megalite.parallel_state import ParallelState, RankGrid
from megalite.planner.step_peak import predict_step_peak
from megalite.training.loop import Trainer
from megalite.training.metrics import TrainingLogger
from megalite.transformer import attention as attention_module
from megalite.transformer.attention_kernels import core_attention_kernel, unfused_attention


def _qkv(dtype, b=2, heads=8, groups=2, s=24, d=16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, heads, s, d, generator=g, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(b, groups, s, d, generator=g, dtype=torch.float64).to(dtype)
            for _ in range(2))
    return [t.requires_grad_(True) for t in (q, k, v)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("groups", [8, 2, 1])
def test_unfused_equals_sdpa_values_and_gradients(causal, groups):
    q, k, v = _qkv(torch.float32, groups=groups)
    out = unfused_attention(q, k, v, causal=causal)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=groups < 8)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_unfused_gradcheck_with_in_place_scale_and_mask():
    q, k, v = _qkv(torch.float64, b=1, heads=4, groups=2, s=6, d=4)
    assert torch.autograd.gradcheck(lambda q, k, v: unfused_attention(q, k, v, causal=True),
                                    (q, k, v))


def test_unfused_dropout_drops_probabilities_and_rescales():
    q, k, v = _qkv(torch.float32, groups=8)
    v = torch.eye(24).expand(2, 8, 24, 24).requires_grad_(True)    # output = probabilities
    q, k = q[..., :8], k[..., :8]
    torch.manual_seed(3)
    dropped = unfused_attention(q, k, v, causal=True, dropout_p=0.5)
    probs = unfused_attention(q, k, v, causal=True)
    kept = dropped != 0
    assert 0.35 < kept[probs > 0].float().mean() < 0.65
    torch.testing.assert_close(dropped[kept], 2 * probs[kept])
    assert (dropped[probs == 0] == 0).all()                         # the mask still holds


@pytest.mark.parametrize("backend,device,seq,dtype,dropout,want", [
    ("auto", "cpu", 64, torch.float32, 0.0, "unfused"),
    ("auto", "cpu", 128, torch.float32, 0.0, "unfused"),
    ("auto", "cpu", 256, torch.float32, 0.0, "flash"),
    ("auto", "cpu", 256, torch.bfloat16, 0.0, "unfused"),
    ("auto", "cpu", 512, torch.bfloat16, 0.0, "flash"),
    ("auto", "cpu", 512, torch.bfloat16, 0.1, "math"),
    ("auto", "cuda", 64, torch.bfloat16, 0.1, "flash"),
    ("flash", "cpu", 64, torch.bfloat16, 0.0, "flash"),
    ("fused", "cpu", 64, torch.float32, 0.1, "math"),
    ("unfused", "cuda", 4096, torch.bfloat16, 0.0, "unfused"),
    ("local", "cpu", 4096, torch.float32, 0.0, "unfused"),
])
def test_auto_rule(backend, device, seq, dtype, dropout, want):
    assert core_attention_kernel(backend, device, seq, dtype, dropout) == want


def test_flag_reaches_the_layer_and_bad_values_are_refused(monkeypatch):
    from megalite.models.gpt import build_chunk

    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    losses = {}
    for backend in ("flash", "unfused"):
        cfg = parse_args(["--world-size", "1", "--num-layers", "2", "--hidden-size", "32",
                          "--num-attention-heads", "4", "--seq-length", "16",
                          "--vocab-size", "64", "--attention-backend", backend,
                          "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data",
                          "--train-iters", "1", "--global-batch-size", "2", "--lr", "1e-3"])
        assert cfg.model.attention_backend == backend
        torch.manual_seed(0)
        model = build_chunk(cfg, ParallelState.build(RankGrid(1), 0, create_groups=False))
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        n = len(calls)
        losses[backend] = model(ids, None, labels=ids).mean()
        assert (len(calls) > n) == (backend == "flash")
    torch.testing.assert_close(losses["flash"], losses["unfused"], rtol=1e-5, atol=1e-6)
    with pytest.raises((ConfigError, SystemExit)):
        parse_args(["--world-size", "1", "--num-layers", "2", "--hidden-size", "32",
                    "--num-attention-heads", "4", "--attention-backend", "fastest"])


@pytest.mark.parametrize("backend,dropout,recompute", [
    ("flash", "0", []), ("unfused", "0", []), ("unfused", "0.1", []), ("auto", "0.1", []),
    ("unfused", "0", ["--recompute-granularity", "selective"]),
    ("unfused", "0", ["--recompute-granularity", "full", "--recompute-method", "uniform",
                      "--recompute-num-layers", "1"])])
def test_planner_activation_bytes_match_the_measured_peak(tmp_path, backend, dropout, recompute):
    """Eight heads at sequence 128 and hidden 32: the probabilities are most of the
    activations, so a wrong count for a kernel would miss the 10% band."""
    cfg = parse_args(["--world-size", "1", "--num-layers", "2", "--hidden-size", "32",
                      "--num-attention-heads", "8", "--seq-length", "128", "--vocab-size", "64",
                      "--mock-data", "--lr", "1e-3", "--train-iters", "2", "--eval-iters", "0",
                      "--global-batch-size", "4", "--micro-batch-size", "4",
                      "--hidden-dropout", "0", "--attention-dropout", dropout,
                      "--attention-backend", backend, "--no-progress-bar",
                      "--metrics-file", str(tmp_path / "m.jsonl"), *recompute])
    trainer = Trainer(cfg, ParallelState.build(RankGrid(1), 0, create_groups=False), "cpu")
    trainer.memory_reporter.start()
    trainer.setup()
    logger = TrainingLogger(trainer.cfg, True, trainer.train_iters)
    trainer.train(logger)
    logger.close()
    mem = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    mem = [r for r in mem if r.get("split") == "memory"][0]
    want = predict_step_peak(trainer.cfg, 0)
    probs = 2 * 4 * 8 * 128 * 128 * 4                  # layers x b x heads x s x s x fp32
    if backend == "flash" or recompute:
        assert want["activations"] < probs
    else:
        assert want["activations"] > probs
    assert 0.9 <= mem["measured_peak_bytes"] / want["total"] <= 1.1, (mem, want)
