"""The DeepSeek-V3 expert bias against its closed form, not only across layouts (a bug every
layout shares passes equivalence): the bias picks the experts but never weights them, and
one step's update is ``bias += rate * sign(mean(counts) - counts)`` over the counts of
*every* micro-batch of the step (Megatron-Core's ``get_updated_expert_bias``)."""
import pytest
import torch

from megalite.config import MegaliteConfig, ModelConfig
from megalite.models.gpt import single_rank_state
from megalite.moe.metrics import moe_step_metrics
from megalite.moe.moe_layer import MoELayer
from megalite.moe.router import AUX_LOSS, Z_LOSS, TopKRouter
from megalite.parallel_state import ModelCommGroups
from megalite.transformer.extra_losses import collect_extra_losses

E, H, K, RATE = 6, 8, 2, 0.25


def _cfg(**kw):
    return ModelConfig(**dict(dict(
        num_layers=2, hidden_size=H, num_attention_heads=2, seq_length=5, vocab_size=50,
        num_experts=E, moe_router_topk=K, moe_ffn_hidden_size=6, swiglu=True,
        moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
        moe_router_bias_update_rate=RATE, moe_aux_loss_coeff=0.0), **kw))


def _groups():
    return ModelCommGroups.from_parallel_state(single_rank_state())


def _layer(cfg):
    from megalite.backends.local import local_spec

    torch.manual_seed(0)
    layer = MoELayer(cfg, _groups(), submodules=local_spec().layer.submodules.moe_mlp.submodules,
                     sequence_parallel=False, layer_number=0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    return layer


def _oracle(weight, bias, tokens):
    """(experts chosen [T, K], their weights [T, K]): top-k of sigmoid + bias; the weights
    are the unbiased sigmoid scores of the chosen, normalized."""
    scores = torch.sigmoid(tokens @ weight.t())
    idx = torch.topk(scores + bias, K, dim=-1).indices
    w = scores.gather(1, idx)
    return idx, w / w.sum(-1, keepdim=True)


def test_the_bias_chooses_the_experts_and_the_scores_weight_them():
    router = TopKRouter(_cfg(), _groups(), sequence_parallel=False, layer_number=0)
    torch.manual_seed(1)
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
        router.expert_bias.copy_(torch.tensor([2.0, 0, 0, 0, 0, -2.0]))   # flips choices
    tokens = torch.randn(10, H)
    probs, idx, _ = router(tokens, 2)
    want_idx, want_w = _oracle(router.weight, router.expert_bias, tokens)
    assert (idx == 0).any(dim=1).all() and not (idx == E - 1).any()
    assert torch.equal(torch.sort(idx, -1).values, torch.sort(want_idx, -1).values)
    order = [sorted(range(K), key=lambda j: int(r[j])) for r in idx]
    want_order = [sorted(range(K), key=lambda j: int(r[j])) for r in want_idx]
    got = torch.stack([p[o] for p, o in zip(probs, order)])
    want = torch.stack([w[o] for w, o in zip(want_w, want_order)])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_one_step_moves_the_bias_by_the_sign_of_the_whole_steps_load():
    cfg = _cfg()
    layer = _layer(cfg).train()
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, E))
    before = layer.router.expert_bias.clone()
    torch.manual_seed(2)
    micro_batches = [torch.randn(5, 2, H) for _ in range(3)]
    counts = torch.zeros(E)
    for hidden in micro_batches:
        idx, _ = _oracle(layer.router.weight, before, hidden.reshape(-1, H))
        counts += torch.bincount(idx.reshape(-1), minlength=E).float()
        with collect_extra_losses((AUX_LOSS, Z_LOSS)):
            layer(hidden)
    assert counts.sum() == 3 * 10 * K and len(set(counts.tolist())) > 2
    out = moe_step_metrics([layer], MegaliteConfig(model=cfg), single_rank_state())
    assert out["moe_layer_0_tokens_per_expert"] == [int(c) for c in counts]
    assert out["moe_layer_0_load_balance"] == pytest.approx(float(counts.max() / counts.mean()))
    want = before + RATE * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(layer.router.expert_bias, want, rtol=0, atol=1e-7)
    assert layer.step_stats is None                     # cleared for the next step
