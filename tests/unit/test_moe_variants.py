"""The MoE variants of current model families, each exact against ``transformers``' MoE block
on the same weights (output, input gradient and weight gradients; one process):

* Qwen3-MoE: softmax top-k renormalized (``norm_topk_prob``) = megalite's default router;
* Qwen2-MoE: softmax over all experts, top-k not renormalized (``--moe-router-pre-softmax``),
  plus the shared expert with its sigmoid gate (``--moe-shared-expert-gate``);
* DeepSeek-V3: sigmoid scores + expert bias (``e_score_correction_bias``), group-limited
  routing, the top-k normalized then scaled (``--moe-router-topk-scaling-factor``), and a
  shared expert without gate.

The Qwen blocks go through the Hugging Face adapter's MLP mapping (so the mapping is tested
too); DeepSeek-V3's tensors are mapped by hand here.  Then the flags themselves: the scaling
factor against Megatron-Core's router, the gate's parameter spec, the one-line refusals,
and the planner's parameter count with a gated shared expert.
"""
import dataclasses

import pytest
import torch

from megalite.backends.local import local_spec
from megalite.checkpointing.hf_adapters import Qwen2MoeAdapter, Qwen3MoeAdapter
from megalite.checkpointing.hf_adapters.qwen_moe import qwen_moe_fields
from megalite.config import ModelConfig
from megalite.models.gpt import single_rank_state
from megalite.moe.moe_layer import MoELayer
from megalite.moe.router import TopKRouter
from megalite.param_spec import ParamTable
from megalite.parallel_state import ModelCommGroups

transformers = pytest.importorskip("transformers")

H, F, E, K, SHARED = 16, 8, 8, 2, 12


def hf_cfg_dict(**kw):
    d = dict(hidden_size=H, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=K,
             intermediate_size=20, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=2, vocab_size=32, hidden_act="silu")
    d.update(kw)
    return d


def model_cfg(**kw) -> ModelConfig:
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=2, seq_length=8,
                vocab_size=32, swiglu=True, ffn_hidden_size=20, add_bias_linear=False,
                normalization="RMSNorm", position_embedding_type="rope",
                moe_aux_loss_coeff=0.0)
    base.update(kw)
    return ModelConfig(**base)


def randomize(module, router_scale=4.0):
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.normal_(0, 0.5)
            if name.startswith("gate."):
                p.mul_(router_scale)        # a peaky router: a wrong weighting shows


def megalite_layer(m: ModelConfig, sd: dict) -> MoELayer:
    groups = ModelCommGroups.from_parallel_state(single_rank_state())
    layer = MoELayer(m, groups, submodules=local_spec().layer.submodules.moe_mlp.submodules,
                     sequence_parallel=False, layer_number=0)
    layer.load_state_dict(sd, strict=True)
    return layer


def through_adapter(adapter, block, m: ModelConfig) -> dict:
    """The block's tensors mapped by the adapter as a checkpoint of layer 0 would be."""
    hf_sd = {"model.layers.0.mlp." + k: v.detach() for k, v in block.state_dict().items()}

    def get(key):
        return hf_sd[key].float()

    full = adapter.mlp_from_hf(get, "model.layers.0.", "decoder.layers.0.",
                               dataclasses.asdict(m))
    return {k[len("decoder.layers.0.mlp."):]: v for k, v in full.items()}


def inputs():
    return torch.randn(2, 6, H, generator=torch.Generator().manual_seed(1))


def compare(hf_block, layer, pairs):
    """Same output, input gradient and weight gradients (``pairs``: HF param, megalite param,
    and how the megalite gradient reads as the HF one)."""
    x = inputs()
    g = torch.randn(2, 6, H, generator=torch.Generator().manual_seed(2))
    x_hf, x_mg = x.clone().requires_grad_(), x.transpose(0, 1).clone().requires_grad_()
    out_hf = hf_block(x_hf)
    out_mg = layer(x_mg).transpose(0, 1)
    assert rel(out_mg, out_hf) <= 1e-6
    (out_hf * g).sum().backward()
    (out_mg * g).sum().backward()
    assert rel(x_mg.grad.transpose(0, 1), x_hf.grad) <= 1e-6
    for hf_p, mg_p, as_hf in pairs:
        assert rel(as_hf(mg_p.grad), hf_p.grad) <= 1e-5


def rel(a, b):
    """Largest difference relative to the largest entry (as the HF interop tests measure)."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


def same(t):
    return t


def test_qwen3_moe_normalized_topk_is_the_default_router():
    hf = hf_cfg_dict(norm_topk_prob=True)
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(
        transformers.Qwen3MoeConfig(**hf))
    randomize(block)
    fields = qwen_moe_fields(hf)
    assert not fields["moe_router_pre_softmax"] and not fields["moe_shared_expert_gate"]
    m = model_cfg(**fields)
    layer = megalite_layer(m, through_adapter(Qwen3MoeAdapter(), block, m))
    compare(block, layer, [(block.gate.weight, layer.router.weight, same),
                           (block.experts.gate_up_proj, layer.experts.linear_fc1.weight, same),
                           (block.experts.down_proj, layer.experts.linear_fc2.weight, same)])


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen2_moe_unnormalized_topk_and_gated_shared_expert(norm_topk_prob):
    hf = hf_cfg_dict(norm_topk_prob=norm_topk_prob, shared_expert_intermediate_size=SHARED,
                     qkv_bias=False)
    block = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(
        transformers.Qwen2MoeConfig(**hf))
    randomize(block)
    fields = qwen_moe_fields(hf)
    assert fields["moe_router_pre_softmax"] is (not norm_topk_prob)
    assert fields["moe_shared_expert_gate"] and \
        fields["moe_shared_expert_intermediate_size"] == SHARED
    m = model_cfg(**fields)
    layer = megalite_layer(m, through_adapter(Qwen2MoeAdapter(), block, m))
    shared = layer.shared_experts

    def gate_part(grad):
        return grad[:SHARED]

    compare(block, layer, [
        (block.gate.weight, layer.router.weight, same),
        (block.experts.gate_up_proj, layer.experts.linear_fc1.weight, same),
        (block.shared_expert.gate_proj.weight, shared.linear_fc1.weight, gate_part),
        (block.shared_expert.down_proj.weight, shared.linear_fc2.weight, same),
        (block.shared_expert_gate.weight, shared.gate_weight, same)])


def test_deepseek_v3_sigmoid_bias_groups_scaling_and_shared_expert():
    n_shared, scale = 2, 2.5
    cfg = transformers.DeepseekV3Config(
        hidden_size=H, moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=4,
        n_group=4, topk_group=2, n_shared_experts=n_shared, routed_scaling_factor=scale,
        norm_topk_prob=True, num_hidden_layers=1, num_attention_heads=2, vocab_size=32,
        intermediate_size=20)
    block = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(cfg)
    randomize(block)
    with torch.no_grad():
        block.gate.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.3, E))
    # HF ranks groups by their top-2 scores; Megatron by their top topk/group-topk = 4/2
    m = model_cfg(num_experts=E, moe_router_topk=4, moe_ffn_hidden_size=F,
                  moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_router_num_groups=4, moe_router_group_topk=2,
                  moe_router_topk_scaling_factor=scale,
                  moe_shared_expert_intermediate_size=F * n_shared)
    s = block.shared_experts
    sd = {"router.weight": block.gate.weight.detach(),
          "experts.linear_fc1.weight": block.experts.gate_up_proj.detach(),
          "experts.linear_fc2.weight": block.experts.down_proj.detach(),
          "shared_experts.linear_fc1.weight": torch.cat([s.gate_proj.weight, s.up_proj.weight]),
          "shared_experts.linear_fc2.weight": s.down_proj.weight.detach(),
          "router.expert_bias": block.gate.e_score_correction_bias.detach()}
    layer = megalite_layer(m, sd)
    with torch.no_grad():   # each part matters on this input: without it the output moves
        expected = block(inputs())
        no_groups = dataclasses.replace(m, moe_router_num_groups=None, moe_router_group_topk=None)
        no_bias = dataclasses.replace(m, moe_router_enable_expert_bias=False)
        for other, tensors in ((no_groups, sd), (no_bias, {k: v for k, v in sd.items()
                                                           if k != "router.expert_bias"})):
            assert rel(megalite_layer(other, tensors)(inputs().transpose(0, 1)).transpose(0, 1),
                       expected) > 1e-3
    compare(block, layer, [(block.gate.weight, layer.router.weight, same),
                           (block.experts.down_proj, layer.experts.linear_fc2.weight, same),
                           (s.down_proj.weight, layer.shared_experts.linear_fc2.weight, same)])


def test_topk_scaling_factor_matches_megatron_core():
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    torch.manual_seed(0)
    logits = torch.randn(10, E)
    for score, pre in (("softmax", False), ("softmax", True), ("sigmoid", False)):
        m = model_cfg(num_experts=E, moe_router_topk=K, moe_router_score_function=score,
                      moe_router_pre_softmax=pre, moe_router_topk_scaling_factor=2.5)
        router = TopKRouter(m, ModelCommGroups.from_parallel_state(single_rank_state()),
                            sequence_parallel=False, layer_number=0)
        probs, idx, _ = router._select(logits, need_aux=False)
        ref, _ = moe_utils.topk_routing_with_score_function(
            logits, K, use_pre_softmax=pre, scaling_factor=2.5, score_function=score)
        torch.testing.assert_close(torch.zeros(10, E).scatter_(1, idx, probs), ref)


@pytest.mark.parametrize("flags,words", [
    (["--moe-shared-expert-gate"],
     "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size"),
    (["--moe-router-topk-scaling-factor", "0"],
     "--moe-router-topk-scaling-factor must be a positive number, got 0.0"),
])
def test_bad_variant_flags_are_one_line_errors(capsys, flags, words):
    from megalite.training.entry import main

    with pytest.raises(SystemExit) as exc:
        main(["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
              "--seq-length", "8", "--mock-data", "--vocab-size", "32", "--train-iters", "1",
              "--lr", "1e-3", "--num-experts", "4", "--dry-run", *flags])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and words in err and err.count("\n") == 1, err


def test_planner_counts_what_the_shared_expert_gate_keeps_for_backward():
    """The gate's product keeps the shared expert's output and the gate: the planner's MoE
    activation bytes grow by exactly what autograd saves in addition (measured with
    saved-tensor hooks; parameters and tensors saved twice counted once)."""
    from megalite.planner import memory as mem
    from megalite.planner.layout import Layout

    def saved_bytes(m):
        groups = ModelCommGroups.from_parallel_state(single_rank_state())
        layer = MoELayer(m, groups, submodules=local_spec().layer.submodules.moe_mlp.submodules,
                         sequence_parallel=False, layer_number=0)
        params = {p.data_ptr() for p in layer.parameters()}
        seen = {}

        def pack(t):
            if t.data_ptr() not in params:
                seen[t.data_ptr()] = t.numel() * t.element_size()
            return t

        x = torch.randn(8, 2, H, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(x)
        return sum(seen.values())

    base = model_cfg(num_experts=E, moe_router_topk=K, moe_ffn_hidden_size=F,
                     moe_shared_expert_intermediate_size=SHARED)
    gated = dataclasses.replace(base, moe_shared_expert_gate=True)
    measured = saved_bytes(gated) - saved_bytes(base)
    tokens = 16
    planned = mem.local_moe_bytes(gated, Layout(world=1), tokens, 4) - \
        mem.local_moe_bytes(base, Layout(world=1), tokens, 4)
    assert measured == planned == 4 * tokens * (H + 1)
