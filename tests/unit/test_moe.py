"""MoE pieces on one process: the router's selection, terms and capacity dropping, the
dispatchers against a per-token reference (including experts that get no token), the
chunk sort, the expert parameter specs over EP x expert-TP, and the expert-bias update."""
import dataclasses

import pytest
import torch

from megalite.config import ModelConfig
from megalite.models.gpt import single_rank_state
from megalite.moe.experts import GroupedMLP
from megalite.moe.moe_layer import MoELayer
from megalite.moe.router import AUX_LOSS, Z_LOSS, TopKRouter, capacity
from megalite.moe.token_dispatcher import (AllGatherDispatcher, AllToAllDispatcher,
                                           inverse_permutation, sort_chunks)
from megalite.parallel_state import ModelCommGroups
from megalite.tensor_parallel.random import init_parameters
from megalite.param_spec import ParamTable, group_coords
from megalite.transformer.extra_losses import collect_extra_losses

E, H, K = 4, 8, 2


def mcfg(**kw):
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=2, seq_length=6, vocab_size=50,
                num_experts=E, moe_router_topk=K, moe_ffn_hidden_size=6, swiglu=True,
                moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
    base.update(kw)
    return ModelConfig(**base)


def groups():
    return ModelCommGroups.from_parallel_state(single_rank_state())


def initialized(module):
    init_parameters(ParamTable.from_module(module).named(module), 1234,
                    group_coords(single_rank_state()))
    return module


def test_softmax_router_terms_match_megatron_formulas():
    torch.manual_seed(0)
    router = initialized(TopKRouter(mcfg(), groups(), sequence_parallel=False, layer_number=0))
    x = torch.randn(12, H)
    with collect_extra_losses((AUX_LOSS, Z_LOSS)) as extra:
        probs, idx, keep = router(x, 3)
    logits = x @ router.weight.t()
    top, ref_idx = torch.topk(logits, K)
    assert torch.equal(idx, ref_idx) and keep is None       # no capacity factor: all kept
    torch.testing.assert_close(probs, torch.softmax(top, -1))
    counts = torch.zeros(E).scatter_add_(0, idx.reshape(-1), torch.ones(12 * K))
    aux = (torch.softmax(logits, -1).sum(0) * counts).sum() * E * 1e-2 / (K * 12 * 12)
    z = torch.logsumexp(logits, -1).square().mean() * 1e-3
    terms = dict(extra.terms)
    torch.testing.assert_close(terms[AUX_LOSS], aux)
    torch.testing.assert_close(terms[Z_LOSS], z)
    assert router.last_stats["counts"].tolist() == counts.tolist()


def test_sigmoid_router_with_expert_bias_selects_on_biased_scores_weights_unbiased():
    router = initialized(TopKRouter(mcfg(moe_router_score_function="sigmoid",
                                         moe_router_enable_expert_bias=True), groups(),
                                    sequence_parallel=False, layer_number=0))
    router.expert_bias.copy_(torch.tensor([10.0, 0, 0, 0]))    # expert 0 always chosen
    x = torch.randn(5, H)
    probs, idx, _ = router(x, 1)
    assert (idx == 0).any(-1).all()
    scores = torch.sigmoid(x @ router.weight.t()).gather(1, idx)
    torch.testing.assert_close(probs, scores / scores.sum(-1, keepdim=True))


def test_capacity_factor_drops_the_lowest_probability_pairs():
    cfg = mcfg(moe_expert_capacity_factor=1.0, moe_router_load_balancing_type="none",
               moe_z_loss_coeff=None)
    router = initialized(TopKRouter(cfg, groups(), sequence_parallel=False, layer_number=0))
    with torch.no_grad():
        router.weight.zero_()
        router.weight[0, 0] = router.weight[1, 0] = 5.0    # every token wants experts 0, 1
    x = torch.randn(8, H)
    x[:, 0] = torch.linspace(0.1, 2.0, 8)
    probs, idx, keep = router(x, 1)
    cap = capacity(8, E, K, 1.0)
    assert cap == 4
    for e in range(E):
        assert int((keep & (idx == e)).sum()) <= cap
    assert int(keep.sum()) < 8 * K                          # something was dropped


def reference_moe(x, probs, idx, keep, experts):
    """Per-token loop: out[t] = sum_k p * expert_e(x_t)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            if keep[t, j]:
                e = int(idx[t, j])
                counts = [0] * E
                counts[e] = 1
                out[t] += probs[t, j] * experts(x[t:t + 1], counts)[0]
    return out


@pytest.mark.parametrize("kind", ["alltoall", "allgather"])
def test_dispatchers_equal_the_per_token_reference_with_idle_experts(kind):
    cfg = mcfg()
    g = groups()
    experts = initialized(GroupedMLP(cfg, g))
    x = torch.randn(10, H)
    idx = torch.tensor([[0, 1]] * 6 + [[1, 3]] * 4)         # expert 2 receives no token
    probs = torch.rand(10, K)
    keep = torch.ones(10, K, dtype=torch.bool)
    keep[0, 1] = False                                        # a dropped pair
    disp = AllToAllDispatcher(E, g.ep, g.expert_tp) if kind == "alltoall" else \
        AllGatherDispatcher(E, g.ep, g.tp_ep)
    out = disp(x, probs, idx, keep, experts)
    assert disp.last_tokens_per_local_expert == [6, 9, 0, 4]
    torch.testing.assert_close(out, reference_moe(x, probs, idx, keep, experts))


def test_sort_chunks_reorders_source_major_to_expert_major():
    sizes = torch.tensor([[1, 0, 2], [2, 1, 0]])             # [source, expert]
    rows = torch.tensor([0, 2, 2, 10, 10, 11])                # value = 10*source + expert
    perm = sort_chunks(sizes)
    assert rows[perm].tolist() == [0, 10, 10, 11, 2, 2]
    assert torch.equal(rows[perm][inverse_permutation(perm)], rows)


def test_expert_params_split_over_ep_and_expert_tp_in_the_spec_table():
    cfg = mcfg()
    layer = MoELayer(cfg, groups(), submodules=_local_moe_submodules(), sequence_parallel=False,
                     layer_number=0, device="meta")
    specs = ParamTable.from_module(layer).specs
    fc1, fc2 = specs["experts.linear_fc1.weight"], specs["experts.linear_fc2.weight"]
    assert fc1.expert and fc2.expert and not specs["router.weight"].expert
    assert fc1.full_shape == (E, 12, H) and fc2.full_shape == (E, H, 6)
    assert fc1.local_shape({"ep": 2, "expert-tp": 2}) == (2, 6, H)
    # rank (ep 1, expert-tp 1) holds experts 2..3, the second half of gate and of up
    chunks = fc1.chunks({"ep": (1, 2), "expert-tp": (1, 2)})
    assert [(c.offsets, c.sizes) for c in chunks] == [((2, 3, 0), (2, 3, H)),
                                                      ((2, 9, 0), (2, 3, H))]
    assert fc1.replica_groups() == ("expert-dp",)


def _local_moe_submodules():
    from megalite.backends.local import local_spec

    return local_spec().layer.submodules.moe_mlp.submodules


def test_expert_bias_moves_toward_the_underloaded_experts():
    cfg = mcfg(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
    layer = MoELayer(cfg, groups(), submodules=_local_moe_submodules(), sequence_parallel=False,
                     layer_number=0)
    layer.update_expert_bias(torch.tensor([8.0, 0.0, 4.0, 4.0]), 0.1)
    assert layer.router.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.0])
    dense = dataclasses.replace(cfg, moe_router_enable_expert_bias=False)
    assert TopKRouter(dense, groups(), sequence_parallel=False, layer_number=0).expert_bias \
        is None


@pytest.mark.parametrize("path", ["grouped_mm", "loop"])
def test_grouped_linear_forward_and_grads_equal_per_expert_matmuls(path, monkeypatch):
    from megalite.moe import experts as experts_mod

    if path == "grouped_mm":
        if not experts_mod.grouped_mm_supported("cpu", torch.float32):
            pytest.skip("torch._grouped_mm is not available in this torch")
    else:
        monkeypatch.setattr(experts_mod, "grouped_mm_supported", lambda *a: False)
    torch.manual_seed(0)
    counts = [5, 0, 3, 8]                          # expert 1 receives no token
    x = torch.randn(16, 16, requires_grad=True)
    w = torch.randn(4, 32, 16, requires_grad=True)
    y = experts_mod.grouped_linear(x, w, torch.tensor(counts))
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    ref = torch.cat([rows @ w[e].t() for e, rows in enumerate(x.split(counts))])
    rgx, rgw = torch.autograd.grad(ref, (x, w), g)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(gx, rgx)
    torch.testing.assert_close(gw, rgw)
    assert gw[1].abs().sum() == 0


def test_all_kept_pairs_permute_by_gathers_with_the_same_values_and_grads_as_scatter():
    """The no-dropping fast path (keep=None: gathers both ways) equals the general path
    (an explicit all-True keep: index_select + index_put) in output and gradients."""
    cfg = mcfg(moe_ffn_hidden_size=16)
    g = groups()
    experts = initialized(GroupedMLP(cfg, g))
    torch.manual_seed(1)
    x = torch.randn(10, H, requires_grad=True)
    probs = torch.rand(10, K, requires_grad=True)
    choices = torch.tensor([[0, 1], [1, 3], [3, 0], [0, 3], [1, 0]])   # never expert 2
    idx = choices[torch.randint(len(choices), (10,))]
    outs = []
    for keep in (None, torch.ones(10, K, dtype=torch.bool)):
        disp = AllToAllDispatcher(E, g.ep, g.expert_tp)
        out = disp(x, probs, idx, keep, experts)
        assert disp.last_tokens_per_local_expert[2] == 0
        outs.append((out, *torch.autograd.grad(out, (x, probs, experts.linear_fc1.weight),
                                               torch.ones_like(out))))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("path", ["grouped_mm", "looped"])
def test_zero_bubble_split_defers_expert_weight_grads_to_w(path, monkeypatch):
    """B (input gradient) accumulates no weight gradient; the experts' grouped GEMMs leave
    their dW to W as the dense linears do (stored input and dY), the router's is formed in
    B and held; B + W equals one full backward."""
    from megalite.moe import experts as experts_mod
    from megalite.pipeline_parallel.weight_grad import backward_input

    if path == "looped":
        monkeypatch.setattr(experts_mod, "grouped_mm_supported", lambda *a: False)
    elif not experts_mod.grouped_mm_supported("cpu", torch.float32):
        pytest.skip("torch._grouped_mm does not run here")
    cfg = mcfg(hidden_size=16, moe_ffn_hidden_size=16, num_attention_heads=2)
    torch.manual_seed(0)
    layer = initialized(MoELayer(cfg, groups(), submodules=_local_moe_submodules(),
                                 sequence_parallel=False, layer_number=0))
    params = list(layer.parameters())
    x = torch.randn(6, 2, 16, requires_grad=True)
    full = torch.autograd.grad(layer(x).square().sum(), [x, *params])
    out = layer(x).square().sum()
    (gx,), pending = backward_input([out], [None], [x], params)
    assert not pending.fallback
    assert len(pending.stash) == 2                    # fc1 and fc2 expert GEMMs wait for W
    assert all(p.grad is None for p in params)        # B computed no weight gradient
    pending.run()
    torch.testing.assert_close(gx, full[0])
    for p, ref in zip(params, full[1:]):
        torch.testing.assert_close(p.grad, ref)


@pytest.mark.parametrize("score,pre_softmax,bias", [("softmax", False, False),
                                                    ("softmax", True, False),
                                                    ("sigmoid", False, True)])
def test_group_limited_routing_matches_megatron_core(score, pre_softmax, bias):
    """Megatron-Core's ``topk_routing_with_score_function`` is the oracle: 16 experts in 4
    groups, 2 groups per token, top-4."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    cfg = mcfg(num_experts=16, moe_router_topk=4, moe_router_num_groups=4,
               moe_router_group_topk=2, moe_router_score_function=score,
               moe_router_pre_softmax=pre_softmax, moe_router_enable_expert_bias=bias,
               moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)
    router = initialized(TopKRouter(cfg, groups(), sequence_parallel=False, layer_number=0))
    torch.manual_seed(3)
    with torch.no_grad():
        router.weight.normal_()
        if bias:
            router.expert_bias.copy_(torch.randn(16) * 0.3)
    x = torch.randn(64, H)
    probs, idx, _ = router(x, 1)
    ref_probs, ref_map = moe_utils.topk_routing_with_score_function(
        x @ router.weight.t(), 4, use_pre_softmax=pre_softmax, num_groups=4, group_topk=2,
        score_function=score, expert_bias=router.expert_bias)
    routing_map = torch.zeros(64, 16, dtype=torch.bool).scatter_(1, idx, True)
    assert torch.equal(routing_map, ref_map)
    torch.testing.assert_close(torch.zeros(64, 16).scatter_(1, idx, probs), ref_probs)
    groups_used = routing_map.view(64, 4, 4).any(-1).sum(-1)
    assert groups_used.max() <= 2 and groups_used.min() >= 1
    plain = torch.zeros(64, 16, dtype=torch.bool).scatter_(
        1, torch.topk(x @ router.weight.t(), 4).indices, True)
    assert (plain.view(64, 4, 4).any(-1).sum(-1) > 2).any()   # the limit binds


def test_grouped_mm_probe_is_not_fooled_by_a_no_grad_first_call():
    """The first expert forward may be an evaluation under no_grad; the cached probe must
    still see what the device supports in training."""
    from megalite.moe import experts as experts_mod

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is not available in this torch")
    experts_mod.grouped_mm_supported.cache_clear()
    try:
        with torch.no_grad():
            under_no_grad = experts_mod.grouped_mm_supported("cpu", torch.float32)
        experts_mod.grouped_mm_supported.cache_clear()
        assert under_no_grad == experts_mod.grouped_mm_supported("cpu", torch.float32)
    finally:
        experts_mod.grouped_mm_supported.cache_clear()


def test_grouped_mm_probe_inside_a_recomputed_forward_keeps_the_checkpoint_consistent():
    """The probe's own autograd graph, run on the first expert forward, must not count among
    the tensors a checkpointed forward saves (the recomputation no longer probes): found by
    the qwen3-235b-a22b twin, whose first MoE forward is under full recomputation."""
    from torch.utils.checkpoint import checkpoint

    from megalite.moe import experts as experts_mod

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is not available in this torch")
    cfg = mcfg(hidden_size=16, moe_ffn_hidden_size=16)
    layer = initialized(MoELayer(cfg, groups(), submodules=_local_moe_submodules(),
                                 sequence_parallel=False, layer_number=0))
    x = torch.randn(4, 2, 16, requires_grad=True)
    experts_mod.grouped_mm_supported.cache_clear()
    try:
        checkpoint(layer, x, use_reentrant=False).sum().backward()
    finally:
        experts_mod.grouped_mm_supported.cache_clear()
    assert x.grad is not None and layer.experts.linear_fc1.weight.grad is not None
