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
