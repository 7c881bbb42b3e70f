"""Zero-bubble B/W split: B touches no weight grad, B + W equals one full backward."""
import copy

import pytest
import torch

from megalite.config import MegaliteConfig, ModelConfig
from megalite.models.gpt import build_chunk, single_rank_state
from megalite.pipeline_parallel.weight_grad import backward_input


def _cfg(arch, recompute=False):
    m = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=50,
             make_vocab_size_divisible_by=16, hidden_dropout=0.0, attention_dropout=0.0)
    if arch == "llama":
        m.update(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                 add_bias_linear=False, group_query_attention=True, num_query_groups=2)
    cfg = MegaliteConfig(model=ModelConfig(**m))
    if recompute:
        cfg.training.recompute_granularity, cfg.training.recompute_method = "full", "uniform"
    return cfg


def _run(model, pre, x, ids, labels, split):
    captured, hook = {}, None
    inp = None
    if pre:
        hook = model.embedding.register_forward_hook(lambda m, a, o: captured.setdefault("x", o))
    else:
        inp = x.clone().requires_grad_()
        model.set_input_tensor(inp)
    loss = model(ids, labels=labels).sum()
    if hook:
        hook.remove()
        inp = captured["x"]
    if not split:
        loss.backward()
        return inp.grad if not pre else None
    grads, pending = backward_input([loss], [None], [inp], list(model.parameters()))
    assert all(p.grad is None for p in model.parameters()), "B must not produce weight grads"
    assert len(pending.stash) and not pending.fallback, "the linears' dW must be deferred"
    pending.run()
    return grads[0] if not pre else None


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("pre", [True, False])
@pytest.mark.parametrize("recompute", [False, True])
def test_split_equals_full_backward(arch, pre, recompute):
    torch.manual_seed(0)
    cfg = _cfg(arch, recompute)
    ref = build_chunk(cfg, single_rank_state(), pre_process=pre, post_process=True,
                   layer_numbers=[0, 1])
    split = copy.deepcopy(ref)
    x = torch.randn(8, 2, 32)
    ids, labels = torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8))
    g_ref = _run(ref, pre, x, ids, labels, False)
    g_split = _run(split, pre, x, ids, labels, True)
    if not pre:
        assert torch.equal(g_ref, g_split)
    for (name, a), b in zip(ref.named_parameters(), split.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-7), name


def test_weight_grads_accumulate_and_fire_hooks():
    """W accumulates into existing grads through AccumulateGrad (bf16 main_grad hooks)."""
    lin = torch.nn.Linear(4, 4)
    fired = []
    lin.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    x = torch.randn(3, 4, requires_grad=True)
    lin.weight.grad = torch.ones_like(lin.weight)
    out = lin(x)
    g = torch.randn(3, 4)
    (gx,), pending = backward_input([out], [g], [x], list(lin.parameters()))
    assert torch.allclose(gx, g @ lin.weight)
    pending.run()
    assert torch.allclose(lin.weight.grad, 1 + g.t() @ x)
    assert torch.allclose(lin.bias.grad, g.sum(0))
    assert fired == [lin.weight]


def _count_layer_forwards(model):
    calls = []
    layers = model.decoder.layers
    for layer in (layers.values() if isinstance(layers, torch.nn.ModuleDict) else layers):
        layer.register_forward_pre_hook(lambda m, a: calls.append(m))
    return calls


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_w_runs_only_the_deferred_gemms_and_recomputes_nothing(arch):
    """Full recompute: B re-runs each checkpointed layer once (as a plain backward does),
    W none -- it holds (input, dY) per linear and runs only their dW GEMMs, no graph
    replay.  Grads equal the plain backward's."""
    torch.manual_seed(0)
    cfg = _cfg(arch, recompute=True)
    ref = build_chunk(cfg, single_rank_state(), pre_process=False, post_process=True,
                      layer_numbers=[0, 1])
    split = copy.deepcopy(ref)
    x = torch.randn(8, 2, 32)
    ids, labels = torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8))
    g_ref = _run(ref, False, x, ids, labels, False)

    calls = _count_layer_forwards(split)
    inp = x.clone().requires_grad_()
    split.set_input_tensor(inp)
    loss = split(ids, labels=labels).sum()
    assert len(calls) == 2
    (gx,), pending = backward_input([loss], [None], [inp], list(split.parameters()))
    assert len(calls) == 4, "B recomputes each layer once"
    linears = [m for m in split.modules() if type(m).__name__.endswith("ParallelLinear")]
    assert len(pending.stash) == len(linears)      # every linear's dW waits for W
    pending.run()
    assert len(calls) == 4, "W must not recompute"
    assert torch.equal(gx, g_ref)
    for (name, a), b in zip(ref.named_parameters(), split.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-7), name


def test_deferred_linear_plain_backward_and_bf16_main_grad_hook():
    """``deferred_wgrad.linear`` is ``F.linear`` outside a B: a plain backward computes
    every gradient, ``autograd.grad`` w.r.t. the input alone computes no dW.  Inside B the
    dW waits for W, which accumulates it through AccumulateGrad: a bf16 ``main_grad`` hook
    fires once per micro-batch and sums into fp32."""
    from megalite.tensor_parallel.deferred_wgrad import linear

    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(4, 3, 8, generator=g), torch.randn(4, 3, 6, generator=g)
    w, b = torch.randn(6, 8, generator=g), torch.randn(6, generator=g)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    torch.nn.functional.linear(xr, wr, br).backward(dy)
    xa, wa, ba = (t.clone().requires_grad_() for t in (x, w, b))
    linear(xa, wa, ba).backward(dy)
    for got, want in ((xa, xr), (wa, wr), (ba, br)):
        assert torch.equal(got.grad, want.grad)
    (gx,) = torch.autograd.grad(linear(xa, wa, ba), [xa], dy)
    assert torch.equal(gx, xr.grad)

    wb = torch.nn.Parameter(w.bfloat16())
    wb.main_grad = torch.zeros(6, 8)
    fired = []

    def to_main(p):
        fired.append(1)
        p.main_grad += p.grad.float()
        p.grad = None
    wb.register_post_accumulate_grad_hook(to_main)
    for mb in range(2):
        xi = x.bfloat16().requires_grad_()
        y = linear(xi, wb)
        (gx,), pending = backward_input([y], [dy.bfloat16()], [xi], [wb])
        assert wb.grad is None and len(fired) == mb       # B: nothing accumulated
        assert len(pending.stash) == 1 and not pending.held
        pending.run()
    assert len(fired) == 2
    want = 2 * (dy.bfloat16().reshape(-1, 6).t() @ x.bfloat16().reshape(-1, 8)).float()
    assert torch.allclose(wb.main_grad, want, rtol=1e-2, atol=1e-2)


def test_weight_shared_with_another_op_is_formed_in_b_and_its_bias_still_deferred():
    """A weight that also feeds a non-deferring op is one of B's inputs (its dW is formed
    in B); the same linear's bias is not wanted by B and waits for W."""
    from megalite.tensor_parallel.deferred_wgrad import linear

    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g) for s in ((5, 4), (3, 4), (3,)))
    dy = torch.randn(5, 3, generator=g)

    def run(split):
        wp, bp = torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())
        xi = x.clone().requires_grad_()
        y = linear(torch.tanh(xi), wp, bp) + wp.sum(1)       # wp also used outside
        if not split:
            y.backward(dy)
            return xi.grad, wp.grad, bp.grad
        (gx,), pending = backward_input([y], [dy], [xi], [wp, bp])
        assert [p for p, _ in pending.held] == [wp] and len(pending.stash) == 1
        pending.run()
        return gx, wp.grad, bp.grad
    for got, want in zip(run(True), run(False)):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
