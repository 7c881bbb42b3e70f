"""The submodule spec: per-layer MLP slot, core-attention slot, fused norm+linear slots, and
the single ``ModelConfig.is_moe_layer`` rule.

Stand-in modules plugged through the spec prove the slots; none of them is an MoE layer.
"""
import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import megalite.models.gpt as gpt
from megalite.cli.arguments import ConfigError, parse_args
from megalite.backends import get_layer_spec
from megalite.backends.local import NormColumnParallelLinear, fuse_norms
from megalite.config import MegaliteConfig, ModelConfig, parse_moe_layer_freq
from megalite.models.gpt import build_model, single_rank_state
from megalite.parallel_state import ParallelState, RankGrid
from megalite.planner import model_spec
from megalite.parallel_state import ModelCommGroups
from megalite.training.flops import flops_per_token
from megalite.transformer.attention import DotProductAttention
from megalite.transformer.mlp import MLP
from megalite.transformer.norms import IdentityNorm
from megalite.transformer.spec import AttnMaskType, ModuleSpec

V, S, B = 70, 8, 2


def mcfg(arch="llama", layers=4, **over):
    d = dict(num_layers=layers, hidden_size=32, num_attention_heads=8, seq_length=S,
             vocab_size=V, make_vocab_size_divisible_by=16, hidden_dropout=0.0,
             attention_dropout=0.0, init_method_std=0.05)
    if arch == "llama":
        d.update(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                 add_bias_linear=False, untie_embeddings_and_output_weights=True,
                 group_query_attention=True, num_query_groups=2)
    d.update(over)
    return ModelConfig(**d)


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)


@contextlib.contextmanager
def layer_spec(spec):
    """Models built meanwhile take ``spec`` as the run's spec choice (``build_model`` asks
    ``spec_choices`` and hands the constructor what it returns)."""
    original = gpt.spec_choices
    gpt.spec_choices = lambda cfg, state: spec
    try:
        yield
    finally:
        gpt.spec_choices = original


def with_layer_slots(spec, **slots):
    layer = dataclasses.replace(spec.layer.submodules, **slots)
    return dataclasses.replace(spec, layer=dataclasses.replace(spec.layer, submodules=layer))


def with_attention_slots(spec, params=None, **slots):
    attn = spec.layer.submodules.self_attention
    attn = dataclasses.replace(attn, params={**attn.params, **(params or {})},
                               submodules=dataclasses.replace(attn.submodules, **slots))
    return with_layer_slots(spec, self_attention=attn)


def loss_of(model, seed=0):
    ids, labels = data(seed)
    return model(ids, labels=labels)


# ---- the is_moe_layer rule ------------------------------------------------------------

def test_is_moe_layer_int_frequency_and_list_pattern():
    assert [mcfg(num_experts=4, moe_layer_freq=2).is_moe_layer(i) for i in range(4)] == \
        [True, False, True, False]
    assert [mcfg(num_experts=4, moe_layer_freq=3, layers=6).is_moe_layer(i)
            for i in range(6)] == [True, False, False, True, False, False]
    assert all(mcfg(num_experts=4).is_moe_layer(i) for i in range(4))  # default: every layer
    assert not any(mcfg(moe_layer_freq=2).is_moe_layer(i) for i in range(4))  # dense model
    pattern = mcfg(num_experts=4, moe_layer_freq=[0, 1, 1, 0])
    assert [pattern.is_moe_layer(i) for i in range(4)] == [False, True, True, False]
    with pytest.raises(ValueError, match="3 entries for 4 layers"):
        mcfg(num_experts=4, moe_layer_freq=[1, 0, 1]).is_moe_layer(0)


def test_planner_and_flops_use_the_same_rule():
    m = mcfg(num_experts=4, moe_layer_freq=[1, 1, 0, 0], moe_ffn_hidden_size=16)
    assert [model_spec.is_moe_layer(m, i) for i in range(4)] == [True, True, False, False]
    cfg = lambda mm: MegaliteConfig(model=mm)  # noqa: E731
    two_of_four = flops_per_token(cfg(m))
    assert two_of_four == flops_per_token(cfg(dataclasses.replace(m, moe_layer_freq=2)))
    assert two_of_four != flops_per_token(cfg(dataclasses.replace(m, moe_layer_freq=1)))
    assert model_spec.total_params(m) == model_spec.total_params(
        dataclasses.replace(m, moe_layer_freq=[0, 1, 0, 1]))


def test_moe_layer_freq_parses_megatron_list_expressions():
    assert parse_moe_layer_freq("3") == 3
    assert parse_moe_layer_freq("[1,0]*2") == [1, 0, 1, 0]
    assert parse_moe_layer_freq("([1]*3+[0]*1)*2") == [1, 1, 1, 0, 1, 1, 1, 0]
    assert parse_moe_layer_freq("2*[0, 1]") == [0, 1, 0, 1]
    for bad in ("[1,2]", "[1]*x", "__import__('os')", "[[1]]", "0", "-1", "[1]-[0]", "two"):
        with pytest.raises(ValueError):
            parse_moe_layer_freq(bad)
    base = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "8",
            "--seq-length", "8", "--vocab-size", "70"]
    cfg = parse_args(base + ["--moe-layer-freq", "[1,0]*2"], validate_config=False)
    assert cfg.model.moe_layer_freq == [1, 0, 1, 0]
    assert parse_args(base + ["--moe-layer-freq", "2"], validate_config=False).model \
        .moe_layer_freq == 2
    assert parse_args(base, validate_config=False).model.moe_layer_freq == 1
    with pytest.raises(ConfigError, match="entries must be 0 or 1"):
        parse_args(base + ["--moe-layer-freq", "[1,2]"], validate_config=False)
    with pytest.raises(ConfigError, match="must be >= 1"):
        parse_args(base + ["--moe-layer-freq", "0"], validate_config=False)


# ---- the MLP slot, chosen per layer -----------------------------------------------------

class RecordingMLP(MLP):
    """The dense MLP (same parameter names, so the same name-seeded init) that records
    which layer called it and with what input."""

    def __init__(self, *args, calls, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = calls

    def forward(self, x):
        self.calls.append((self.layer_number, tuple(x.shape)))
        return super().forward(x)


class ZeroMLP(nn.Module):
    """A parameter-free MLP slot that contributes nothing and records its calls."""

    def __init__(self, model_cfg, comm_groups, *, sequence_parallel, layer_number,
                 device=None, dtype=None, calls):
        super().__init__()
        self.layer_number, self.calls = layer_number, calls

    def forward(self, x):
        self.calls.append((self.layer_number, tuple(x.shape)))
        return torch.zeros_like(x)


def test_mlp_slot_picks_a_module_per_layer_by_the_moe_rule():
    local = get_layer_spec("local")
    dense_mlp = local.layer.submodules.mlp
    calls = []
    recording = ModuleSpec(RecordingMLP, params={"calls": calls},
                           submodules=dense_mlp.submodules)
    m = mcfg(num_experts=4, moe_layer_freq=2)
    with layer_spec(with_layer_slots(local, moe_mlp=recording)):
        model = build_model(MegaliteConfig(model=m), single_rank_state())
    kinds = {n: type(layer.mlp) for n, layer in model.decoder.layers.items()}
    assert kinds == {"0": RecordingMLP, "1": MLP, "2": RecordingMLP, "3": MLP}
    reference = build_model(MegaliteConfig(model=mcfg()), single_rank_state())
    assert [n for n, _ in model.named_parameters()] == \
        [n for n, _ in reference.named_parameters()]          # names (and init) unchanged
    torch.testing.assert_close(loss_of(model), loss_of(reference))
    assert calls == [(0, (S, B, 32)), (2, (S, B, 32))]


def test_a_different_mlp_on_pattern_layers_leaves_the_dense_layers_alone():
    calls = []
    m = mcfg(num_experts=4, moe_layer_freq=[0, 1, 1, 0])
    spec = with_layer_slots(get_layer_spec("local"),
                            moe_mlp=ModuleSpec(ZeroMLP, params={"calls": calls}))
    with layer_spec(spec):
        model = build_model(MegaliteConfig(model=m), single_rank_state())
    reference = build_model(MegaliteConfig(model=mcfg()), single_rank_state())
    params, ref = dict(model.named_parameters()), dict(reference.named_parameters())
    assert set(ref) - set(params) == {f"decoder.layers.{n}.mlp.{w}.weight"
                                      for n in (1, 2) for w in ("linear_fc1", "linear_fc2")}
    for name, p in params.items():
        assert torch.equal(p, ref[name]), name                # name-seeded init unchanged
    x = torch.randn(S, B, 32, generator=torch.Generator().manual_seed(3))
    for n in ("0", "3"):
        torch.testing.assert_close(model.decoder.layers[n].mlp(x),
                                   reference.decoder.layers[n].mlp(x), rtol=0, atol=0)
    loss_of(model)
    assert calls == [(1, (S, B, 32)), (2, (S, B, 32))]


def test_moe_slot_follows_is_moe_layer_and_a_spec_without_it_refuses():
    model = build_model(MegaliteConfig(model=mcfg(num_experts=4, moe_layer_freq=2)),
                        single_rank_state())
    kinds = [type(layer.mlp).__name__ for layer in model.decoder.layers.values()]
    assert kinds == ["MoELayer", "MLP", "MoELayer", "MLP"]
    with layer_spec(with_layer_slots(get_layer_spec("local"), moe_mlp=None)):
        with pytest.raises(NotImplementedError, match="layer 0 is an MoE layer.*no MoE module"):
            build_model(MegaliteConfig(model=mcfg(num_experts=4)), single_rank_state())
    # without experts the MoE slot is never consulted
    spec = with_layer_slots(get_layer_spec("local"), moe_mlp=ModuleSpec(ZeroMLP))
    with layer_spec(spec):
        model = build_model(MegaliteConfig(model=mcfg(moe_layer_freq=2)), single_rank_state())
    assert all(type(layer.mlp) is MLP for layer in model.decoder.layers.values())


# ---- the core-attention slot ------------------------------------------------------------

class SbhdAttention(nn.Module):
    """A core attention in Megatron/TE's [s, b, heads, d] layout that records what the slot
    hands it and computes attention itself."""
    qkv_format = "sbhd"

    def __init__(self, model_cfg, comm_groups, *, layer_number, attn_mask_type, seen):
        super().__init__()
        self.causal = attn_mask_type == AttnMaskType.causal
        self.seen = seen
        seen.append(dict(groups=comm_groups, mask=attn_mask_type, layer=layer_number))

    def forward(self, q, k, v):
        self.seen.append(dict(shapes=(tuple(q.shape), tuple(k.shape), tuple(v.shape))))
        rep = q.shape[2] // k.shape[2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))              # [b, h, s, d]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return ctx.permute(2, 0, 1, 3)                                   # [s, b, heads, d]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_core_attention_slot_gets_its_layout_groups_and_mask(arch):
    seen = []
    m = mcfg(arch, layers=2)
    spec = with_attention_slots(get_layer_spec("local"),
                                core_attention=ModuleSpec(SbhdAttention, params={"seen": seen}))
    state = single_rank_state()
    with layer_spec(spec):
        model = build_model(MegaliteConfig(model=m), state)
    reference = build_model(MegaliteConfig(model=m), single_rank_state())
    torch.testing.assert_close(loss_of(model), loss_of(reference))
    built = [s for s in seen if "groups" in s]
    assert [s["layer"] for s in built] == [0, 1]
    for s in built:
        assert s["mask"] is AttnMaskType.causal
        assert s["groups"] == ModelCommGroups.from_parallel_state(state)
        assert s["groups"].tp is state["tp"] and s["groups"].cp is state["cp"]
    groups = 2 if arch == "llama" else 8
    assert [s["shapes"] for s in seen if "shapes" in s] == \
        [((S, B, 8, 4), (S, B, groups, 4), (S, B, groups, 4))] * 2


def test_attention_mask_type_comes_from_the_spec():
    seen = []
    m = mcfg(layers=1)
    no_mask = with_attention_slots(get_layer_spec("local"),
                                   params={"attn_mask_type": AttnMaskType.no_mask})
    with layer_spec(with_attention_slots(no_mask, core_attention=ModuleSpec(
            SbhdAttention, params={"seen": seen}))):
        stand_in = build_model(MegaliteConfig(model=m), single_rank_state())
    with layer_spec(no_mask):
        local = build_model(MegaliteConfig(model=m), single_rank_state())
    causal = build_model(MegaliteConfig(model=m), single_rank_state())
    assert seen[0]["mask"] is AttnMaskType.no_mask
    assert not local.decoder.layers["0"].self_attention.core_attention.is_causal
    torch.testing.assert_close(loss_of(local), loss_of(stand_in))
    assert not torch.allclose(loss_of(local), loss_of(causal))   # the mask really changed


def test_core_attention_refuses_what_it_cannot_do():
    m = mcfg(layers=1)
    cp2 = ModelCommGroups.from_parallel_state(
        ParallelState.build(RankGrid(2, cp=2), 0, create_groups=False))
    with pytest.raises(ValueError, match="context parallelism"):
        DotProductAttention(m, cp2)

    class NoLayout(SbhdAttention):
        qkv_format = "bshd"

    spec = with_attention_slots(get_layer_spec("local"),
                                core_attention=ModuleSpec(NoLayout, params={"seen": []}))
    with layer_spec(spec), pytest.raises(ValueError, match="qkv_format"):
        build_model(MegaliteConfig(model=m), single_rank_state())


# ---- fused norm + linear slots ----------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_fused_norm_linear_slots_match_separate_norms(arch):
    m = mcfg(arch, layers=2)
    reference = build_model(MegaliteConfig(model=m), single_rank_state())
    with layer_spec(fuse_norms(get_layer_spec("local"), m)):
        fused = build_model(MegaliteConfig(model=m), single_rank_state())
    layer = fused.decoder.layers["0"]
    assert type(layer.input_layernorm) is IdentityNorm
    assert type(layer.pre_mlp_layernorm) is IdentityNorm
    assert type(layer.self_attention.linear_qkv) is NormColumnParallelLinear
    assert type(layer.mlp.linear_fc1) is NormColumnParallelLinear
    ref_params = dict(reference.named_parameters())
    moved = {"input_layernorm.": "self_attention.linear_qkv.layer_norm.",
             "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm."}
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # non-trivial norm parameters, the same in both models
        for name, p in fused.named_parameters():
            ref_name = name
            for old, new in moved.items():
                ref_name = ref_name.replace(new, old)
            ref = ref_params.pop(ref_name)
            if "layer_norm" in name:
                ref.copy_(torch.rand(ref.shape, generator=g) + 0.5)
                p.copy_(ref)
            assert torch.equal(p, ref), name   # linears keep their names, hence their init
    assert not ref_params
    torch.testing.assert_close(loss_of(fused), loss_of(reference))
