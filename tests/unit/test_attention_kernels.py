"""--attention-backend: the unfused kernel equals SDPA (values and gradients, GQA, causal or
not), the rule ``auto`` follows, the flag reaching the layer, and the planner's activation
bytes for each kernel against the tensor meter's measured step peak."""

import pytest
import torch
import torch.nn.functional as F

from megalite.cli import features
from megalite.cli.arguments import parse_args
from megalite.config import ConfigError
from megalite.config.score_mods import SCORE_MODS
from megalite.models.gpt import build_chunk
from megalite.parallel_state import ParallelState, RankGrid
from megalite.transformer import attention as attention_module
from megalite.transformer.attention_kernels import core_attention_kernel, unfused_attention
from cpu_trainer import metered_step_peak  # noqa: E402  (tests/ is on sys.path)


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
    measured, want = metered_step_peak(
        ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "8",
         "--seq-length", "128", "--vocab-size", "64", "--mock-data", "--lr", "1e-3",
         "--train-iters", "2", "--eval-iters", "0", "--global-batch-size", "4",
         "--micro-batch-size", "4", "--hidden-dropout", "0", "--attention-dropout", dropout,
         "--attention-backend", backend, "--no-progress-bar", *recompute],
        tmp_path / "m.jsonl")
    probs = 2 * 4 * 8 * 128 * 128 * 4                  # layers x b x heads x s x s x fp32
    if backend == "flash" or recompute:
        assert want["activations"] < probs
    else:
        assert want["activations"] > probs
    assert 0.9 <= measured / want["total"] <= 1.1, (measured, want)


# ---- Gemma 2's soft-caps (--attn-logit-softcapping, --final-logit-softcapping) ----------------
def SOFTCAP(cap):
    """The score modification --attn-logit-softcapping CAP (config/score_mods.py)."""
    return [(SCORE_MODS["attn_logit_softcapping"], cap)]


SOFTCAP_ARGS = ["--world-size", "1", "--num-layers", "2", "--hidden-size", "32",
                "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "64",
                "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data",
                "--train-iters", "1", "--global-batch-size", "2", "--lr", "1e-3"]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("groups", [8, 2])
def test_softcapped_scores_equal_transformers_gemma2_attention(causal, groups):
    """The unfused kernel with a cap against transformers' Gemma 2 eager attention (scores
    -> cap * tanh(scores / cap), then the mask, then the softmax), values and gradients."""
    gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
    q, k, v = _qkv(torch.float64, groups=groups)
    cap, s = 0.7, q.shape[2]
    ours = unfused_attention(q, k, v, causal=causal, score_mods=SOFTCAP(cap))
    mask = torch.zeros(s, s, dtype=q.dtype).masked_fill(
        torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")) if causal else None
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = q.shape[1] // groups, False
    ref, _ = gemma2.eager_attention_forward(
        module, q, k, v, None if mask is None else mask[None, None], scaling=q.shape[-1] ** -0.5,
        softcap=cap)
    # (transformers' softmax runs in fp32 whatever the inputs: fp32 tolerances)
    torch.testing.assert_close(ours, ref.transpose(1, 2), rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(ours.square().sum(), (q, k, v))
    want = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the cap bites: without it the scores (|q.k| / sqrt(d) up to ~3) give another output
    assert (unfused_attention(q, k, v, causal=causal) - ours).abs().max() > 1e-2
    if causal and groups == 2:          # numerical gradients (slow): the case with most parts
        assert torch.autograd.gradcheck(
            lambda *t: unfused_attention(*t, causal=causal, score_mods=SOFTCAP(cap)),
            [t.detach()[:1, :, :4, :4].requires_grad_() for t in (q, k, v)])


@pytest.mark.parametrize("causal", [True, False])
def test_ring_block_kernels_softcap_forward_and_backward_equal_unfused(causal):
    """Ring CP's block kernels with the cap (``block_attention``, --cp-comm-type p2p) on two
    key blocks merged by log-sum-exp, backward from the final LSE: the unfused kernel's
    output and autograd gradients."""
    from megalite.context_parallel.block_attention import (block_backward, block_forward,
                                                           merge)
    q, k, v = _qkv(torch.float64, groups=2, s=16)
    cap, s, scale, c = 0.7, q.shape[2], q.shape[-1] ** -0.5, q.shape[2] // 2
    want = unfused_attention(q, k, v, causal=causal, score_mods=SOFTCAP(cap))
    dout = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    q, k, v = (t.detach() for t in (q, k, v))
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=q.dtype)
    # key blocks [0, c) and [c, s): the first block is causal for the first query half
    blocks = [(slice(0, c), slice(0, c), causal), (slice(c, s), slice(0, c), False),
              (slice(c, s), slice(c, s), causal)]
    if not causal:
        blocks.append((slice(0, c), slice(c, s), False))
    for qs, ks, masked in blocks:
        bo, bl = block_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], scale, masked,
                               mods=SOFTCAP(cap))
        merge(out[:, :, qs], lse[:, :, qs], bo, bl)
    torch.testing.assert_close(out, want.detach(), rtol=1e-10, atol=1e-12)
    delta = (dout * out).sum(-1)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for qs, ks, masked in blocks:
        dq, dk, dv = block_backward(dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks],
                                    lse[:, :, qs], delta[:, :, qs], scale, masked,
                                    mods=SOFTCAP(cap))
        grads[0][:, :, qs] += dq
        grads[1][:, :, ks] += dk
        grads[2][:, :, ks] += dv
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_softcaps_reach_the_model_and_auto_runs_unfused(monkeypatch):
    """--attn-logit-softcapping picks the unfused kernel under auto (SDPA never runs);
    --final-logit-softcapping caps the output layer's logits (closed form) and the loss."""
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    state = ParallelState.build(RankGrid(1), 0, create_groups=False)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    models = {}
    for name, extra in (("plain", []), ("attn", ["--attn-logit-softcapping", "0.05"]),
                        ("final", ["--final-logit-softcapping", "0.02"])):
        cfg = parse_args(SOFTCAP_ARGS + ["--attention-backend", "flash"
                                         if name != "attn" else "auto"] + extra)
        torch.manual_seed(0)
        models[name] = build_chunk(cfg, state)
        n = len(calls)
        with torch.no_grad():
            models[name].logits = models[name](ids, None)
        assert (len(calls) > n) == (name != "attn"), name
    plain = models["plain"].logits
    assert (models["attn"].logits - plain).abs().max() > 1e-6      # the cap changes scores
    cap = 0.02
    torch.testing.assert_close(models["final"].logits, cap * torch.tanh(plain / cap))
    loss = models["final"](ids, None, labels=ids)
    want = F.cross_entropy(models["final"].logits[..., :64].reshape(-1, 64), ids.reshape(-1),
                           reduction="none").view(2, 16)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("extra,words", [
    (["--attn-logit-softcapping", "50", "--attention-backend", "flash"],
     ["--attn-logit-softcapping", "--attention-backend flash", "unfused"]),
    (["--attn-logit-softcapping", "0"], ["--attn-logit-softcapping must be"]),
])
def test_softcap_refusals_are_one_line(extra, words):
    with pytest.raises(ConfigError) as e:
        parse_args(SOFTCAP_ARGS + extra)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_softcap_refused_with_transformer_engine():
    cfg = parse_args(SOFTCAP_ARGS + ["--attn-logit-softcapping", "50"])
    cfg.model.transformer_impl = "transformer_engine"     # TE is absent on CPU: the rule alone
    assert "--attn-logit-softcapping with Transformer Engine layers" in features.refusal(cfg)
