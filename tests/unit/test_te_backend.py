"""The Transformer Engine backend on CPU: selection and its messages, FP8 flag validation,
the parameter-name mapping (through real megalite checkpoints), and the TE spec's wiring
end to end with a stand-in TE package (``te_fake``) whose modules compute with torch.

What needs real TE and a GPU (kernels, TP=2, CP, FP8 numerics) is in tests/gpu/.
"""
import dataclasses
import os
import sys

import pytest
import torch

import te_fake
from tiny_model import tiny_model_cfg  # noqa: E402  (tests/ is on sys.path)
from megalite.cli.arguments import ConfigError, parse_args
from megalite.backends import context_parallel_spec, get_layer_spec
from megalite.backends import selection
from megalite.backends import te_names
from megalite.backends import transformer_engine as te_backend
from megalite.backends.transformer_engine import (TECoreAttention,
                                                  delayed_scaling_recipe)
from megalite.checkpointing.model_io import (full_state_dict_from_checkpoint,
                                             load_full_state_dict, load_model_shards,
                                             save_model_shards)
from megalite.config import MegaliteConfig, ModelConfig
from megalite.models.gpt import GPTModel, build_chunk, single_rank_state
from megalite.tensor_parallel.random import (AttachedTracker, attach_rng_tracker,
                                            model_parallel_tracker)
from megalite.transformer.spec import AttnMaskType

V, S, B = 70, 8, 2
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "8", "--vocab-size", "70", "--mock-data", "--train-iters", "1",
        "--lr", "1e-3"]


def mcfg(arch="llama", **over):
    return tiny_model_cfg(arch, seq_length=S, vocab_size=V, num_layers=over.pop("num_layers", 3),
                          num_query_groups=2, **over)


def model(m: ModelConfig, impl: str, seed: int = 7) -> GPTModel:
    cfg = MegaliteConfig(model=dataclasses.replace(m, transformer_impl=impl))
    cfg.training.seed = seed
    return build_chunk(cfg, single_rank_state(), device="cpu")


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)


@pytest.fixture
def fake_te(monkeypatch):
    for cached in (delayed_scaling_recipe, te_backend.autocast_group_keyword):
        cached.cache_clear()
    yield te_fake.install(monkeypatch)
    for cached in (delayed_scaling_recipe, te_backend.autocast_group_keyword):
        cached.cache_clear()


@pytest.fixture
def no_te(monkeypatch):
    te_fake.uninstall_for_import_error(monkeypatch)


@pytest.fixture
def cuda_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


# ---- selection ---------------------------------------------------------------------------

def test_auto_on_cpu_is_local_without_importing_te(monkeypatch):
    def boom():
        raise AssertionError("auto on CPU must not try to import transformer_engine")
    monkeypatch.setattr(selection, "te_import_error", boom)
    assert selection.resolve_transformer_impl("auto", "cpu") == ("local", "auto: --device cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert selection.resolve_transformer_impl("auto", "auto") == ("local", "auto: no CUDA device")
    assert selection.describe_backend("auto", "cpu") == \
        "> transformer implementation: local (auto: --device cpu)"
    cfg = parse_args(BASE + ["--device", "cpu"])
    assert cfg.model.transformer_impl == "auto"          # still the default
    assert selection.resolve_backend_config(cfg, "cpu").model.transformer_impl == "local"


def test_auto_picks_te_when_it_imports_and_cuda_is_present(fake_te, cuda_visible):
    impl, why = selection.resolve_transformer_impl("auto", "auto")
    assert impl == "transformer_engine" and "transformer_engine imports" in why
    assert "transformer_engine (auto: CUDA" in selection.describe_backend("auto", "cuda")
    cfg = parse_args(BASE, validate_config=False)
    assert selection.resolve_backend_config(cfg, "cuda").model.transformer_impl == \
        "transformer_engine"
    # an explicit --device cpu wins over a visible GPU
    assert selection.resolve_transformer_impl("auto", "cpu")[0] == "local"


def test_auto_without_te_falls_back_with_the_install_command(no_te, cuda_visible):
    impl, why = selection.resolve_transformer_impl("auto", "cuda")
    assert impl == "local"
    assert "ModuleNotFoundError" in why and selection.TE_INSTALL in why
    line = selection.describe_backend("auto", "cuda")
    assert line.count("\n") == 0 and line.startswith("> transformer implementation: local")


def test_asking_for_te_without_it_is_one_line_with_the_install_command(no_te):
    with pytest.raises(ConfigError) as err:
        parse_args(BASE + ["--transformer-impl", "transformer_engine"])
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("--transformer-impl transformer_engine")
    assert "pip install --no-build-isolation transformer_engine[pytorch]" in msg
    # --dry-run only describes the layout: no refusal
    assert parse_args(BASE + ["--transformer-impl", "transformer_engine", "--dry-run"])


def test_te_present_but_no_cuda(fake_te, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"needs a CUDA GPU \(no CUDA device is visible\)"):
        parse_args(BASE + ["--transformer-impl", "transformer_engine"])
    with pytest.raises(ConfigError, match=r"needs a CUDA GPU \(--device cpu\)"):
        parse_args(BASE + ["--transformer-impl", "transformer_engine", "--device", "cpu"])
    assert selection.resolve_transformer_impl("auto", "auto")[0] == "local"


def test_te_with_cuda_validates(fake_te, cuda_visible):
    cfg = parse_args(BASE + ["--transformer-impl", "transformer_engine"])
    assert cfg.model.transformer_impl == "transformer_engine"
    for extra, match in ((["--use-torch-fsdp2"], "--use-torch-fsdp2 with Transformer Engine"),
                         (["--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                           "zero-bubble", "--world-size", "2"], "zero-bubble")):
        with pytest.raises(ConfigError, match=match):
            parse_args(BASE + ["--transformer-impl", "transformer_engine"] + extra)


# ---- FP8 flags ---------------------------------------------------------------------------

def test_fp8_flags_parse_into_the_model_config():
    cfg = parse_args(BASE + ["--fp8-format", "e4m3", "--fp8-amax-history-len", "16",
                             "--fp8-amax-compute-algo", "max", "--dry-run"])
    m = cfg.model
    assert (m.fp8_format, m.fp8_amax_history_len, m.fp8_amax_compute_algo) == ("e4m3", 16, "max")
    assert not cfg.accepted_flags           # real flags now, not "accepted, no effect"
    with pytest.raises(ConfigError, match="invalid choice"):
        parse_args(BASE + ["--fp8-format", "e5m2", "--dry-run"])


def test_fp8_without_te_or_cuda_is_refused_in_one_line(no_te):
    with pytest.raises(ConfigError) as err:
        parse_args(BASE + ["--device", "cpu", "--fp8-format", "hybrid"])
    msg = str(err.value)
    assert "\n" not in msg and "FP8 training needs Transformer Engine" in msg
    assert "device=cpu" in msg and "transformer_engine missing" in msg


def test_fp8_with_te_but_on_cpu_or_local_is_refused(fake_te, cuda_visible):
    with pytest.raises(ConfigError, match="device=cpu, transformer_engine installed"):
        parse_args(BASE + ["--device", "cpu", "--fp8-format", "hybrid"])
    with pytest.raises(ConfigError, match="--transformer-impl local"):
        parse_args(BASE + ["--transformer-impl", "local", "--fp8-format", "hybrid"])
    with pytest.raises(ConfigError, match="--fp8-amax-history-len must be a positive integer"):
        parse_args(BASE + ["--fp8-format", "hybrid", "--fp8-amax-history-len", "0"])
    with pytest.raises(ConfigError, match="outside the FP8 autocast"):
        parse_args(BASE + ["--fp8-format", "hybrid", "--recompute-granularity", "full",
                           "--recompute-method", "uniform"])
    cfg = parse_args(BASE + ["--fp8-format", "hybrid"])        # auto + TE + CUDA: accepted
    assert cfg.model.fp8_format == "hybrid"


def test_fp8_refused_when_the_gpu_has_none(fake_te, cuda_visible, monkeypatch):
    monkeypatch.setattr(fake_te, "is_fp8_available",
                        lambda return_reason=False: (False, "Device compute capability 8.9 "
                                                     "or higher required"))
    with pytest.raises(ConfigError, match="cannot run FP8 .Device compute capability 8.9"):
        parse_args(BASE + ["--fp8-format", "e4m3"])


# ---- parameter names ---------------------------------------------------------------------

def test_name_table_maps_the_fused_norms_only():
    assert te_names.te_to_local_name("decoder.layers.3.self_attention.linear_qkv."
                                     "layer_norm_weight") == "decoder.layers.3.input_layernorm.weight"
    assert te_names.local_to_te_name("decoder.layers.0.pre_mlp_layernorm.bias") == \
        "decoder.layers.0.mlp.linear_fc1.layer_norm_bias"
    assert te_names.local_to_te_name("decoder.layers.0.pre_mlp_layernorm.weight",
                                     fused_mlp_norm=False) == \
        "decoder.layers.0.pre_mlp_layernorm.weight"
    for same in ("decoder.layers.0.self_attention.linear_qkv.weight",
                 "decoder.final_layernorm.weight", "embedding.word_embeddings.weight"):
        assert te_names.te_to_local_name(same) == same == te_names.local_to_te_name(same)
    sd = {"a.mlp.linear_fc1.layer_norm_weight": 1, "a.mlp.linear_fc1._extra_state": 2}
    assert te_names.to_local_names(sd) == {"a.pre_mlp_layernorm.weight": 1}


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen"])
def test_state_dict_round_trip_and_shapes(fake_te, arch):
    m = mcfg(arch)
    local, te = model(m, "local"), model(m, "transformer_engine")
    lsd = {k: v for k, v in local.state_dict().items()}
    assert te_names.check_round_trip(lsd) is None
    te_sd = te_names.to_te_names(lsd)
    assert set(te_sd) == set(te.state_dict())                     # same names after mapping
    for k, v in te.state_dict().items():
        assert v.shape == te_sd[k].shape, k                       # and the same shapes
    back = te_names.to_local_names(te.state_dict())
    assert set(back) == set(lsd)
    for k in lsd:
        torch.testing.assert_close(back[k], lsd[k], rtol=0, atol=0)   # same init, bitwise
    # canonical names of the TE model are the local names, specs identical
    assert local.param_table.specs.keys() == te.param_table.specs.keys()
    for name, spec in local.param_table.specs.items():
        assert spec == te.param_table.specs[name], name


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_checkpoints_move_between_backends(fake_te, tmp_path, arch):
    """local -> checkpoint -> TE -> checkpoint -> local, through megalite's model_io."""
    m = mcfg(arch)
    cfg = MegaliteConfig(model=m)
    state = single_rank_state()
    local = model(m, "local", seed=1)
    with torch.no_grad():                              # make every value distinct from init
        for p in local.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    save_model_shards(str(tmp_path / "a"), 5, [local], cfg, state)
    te = model(m, "transformer_engine", seed=2)
    assert load_model_shards(str(tmp_path / "a"), [te], cfg, state) == 5
    qkv_norm = te.decoder.layers["0"].self_attention.linear_qkv.layer_norm_weight
    torch.testing.assert_close(qkv_norm, local.decoder.layers["0"].input_layernorm.weight,
                               rtol=0, atol=0)
    save_model_shards(str(tmp_path / "b"), 6, [te], cfg, state)
    _, full_a = full_state_dict_from_checkpoint(str(tmp_path / "a"))
    _, full_b = full_state_dict_from_checkpoint(str(tmp_path / "b"))
    assert full_a.keys() == full_b.keys()
    for k in full_a:
        torch.testing.assert_close(full_b[k], full_a[k], rtol=0, atol=0)
    back = model(m, "local", seed=3)
    load_full_state_dict([back], full_b, state)     # the HF converter's entry point
    for (n, p), (n2, q) in zip(local.named_parameters(), back.named_parameters()):
        assert n == n2
        if "word_embeddings" in n or "output_layer" in n:
            p, q = p[:V], q[:V]                        # padding rows are not checkpointed
        torch.testing.assert_close(q, p, rtol=0, atol=0)


def test_a_te_checkpoint_opens_without_te(fake_te, tmp_path, monkeypatch):
    """The metadata of a TE run's checkpoint does not tie CPU tools to TE."""
    from megalite.checkpointing.model_io import read_metadata
    from megalite.generate import load_for_inference

    m = dataclasses.replace(mcfg("llama"), transformer_impl="transformer_engine")
    te = model(m, "transformer_engine")
    save_model_shards(str(tmp_path), 3, [te], MegaliteConfig(model=m), single_rank_state())
    te_fake.uninstall_for_import_error(monkeypatch)
    assert read_metadata(str(tmp_path))["model"]["transformer_impl"] == "auto"
    loaded, _, _ = load_for_inference(str(tmp_path))
    ids, labels = batch()
    torch.testing.assert_close(loaded(ids, labels=labels), te(ids, labels=labels), rtol=1e-6,
                               atol=1e-6)


# ---- the TE spec end to end (stand-in TE) ------------------------------------------------

# the stand-in TE's DotProductAttention has no window: Gemma's layer without one here
NO_WINDOW = {"gemma": dict(window_size=None, window_attn_skip_freq=None, rotary_base_local=None)}


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen", "mla", "gemma"])
def test_te_spec_forward_and_grads_match_local(fake_te, arch):
    m = mcfg(arch, **NO_WINDOW.get(arch, {}))
    local, te = model(m, "local"), model(m, "transformer_engine")
    ids, labels = batch()
    lloss, tloss = local(ids, labels=labels), te(ids, labels=labels)
    torch.testing.assert_close(tloss, lloss, rtol=1e-6, atol=1e-6)
    lloss.mean().backward()
    tloss.mean().backward()
    lgrads = {n: p.grad for n, p in local.canonical_named_parameters()}
    for n, p in te.canonical_named_parameters():
        torch.testing.assert_close(p.grad, lgrads[n], rtol=1e-5, atol=1e-6, msg=n)


def test_te_spec_builds_te_modules_with_megalite_wiring(fake_te):
    m = mcfg("llama")
    te = model(m, "transformer_engine")
    layer = te.decoder.layers["1"]
    attn, mlp = layer.self_attention, layer.mlp
    assert type(attn.linear_qkv).__name__ == "LayerNormLinear"
    assert type(mlp.linear_fc1).__name__ == "LayerNormLinear"
    assert type(attn.linear_proj).__name__ == type(mlp.linear_fc2).__name__ == "Linear"
    assert type(layer.input_layernorm).__name__ == "IdentityNorm"
    assert isinstance(attn.core_attention, TECoreAttention)
    kw = {name: [k for n, k in te_fake.BUILT if n == name] for name in
          ("Linear", "LayerNormLinear", "DotProductAttention")}
    assert {k["parallel_mode"] for k in kw["LayerNormLinear"]} == {"column"}
    assert {k["parallel_mode"] for k in kw["Linear"]} == {"row"}
    assert all(k["normalization"] == "RMSNorm" and k["eps"] == m.norm_epsilon
               for k in kw["LayerNormLinear"])
    assert all(k["tp_size"] == 1 and k["tp_group"] is None and k["bias"] is False
               for k in kw["Linear"] + kw["LayerNormLinear"])
    dpa = kw["DotProductAttention"][1]
    assert (dpa["num_attention_heads"], dpa["num_gqa_groups"], dpa["kv_channels"]) == (8, 2, 4)
    assert dpa["attn_mask_type"] == "causal" and dpa["layer_number"] == 2
    # ffn rows for SwiGLU fc1: [gate; up] blocks, as the local layer
    assert te.param_table.spec("decoder.layers.1.mlp.linear_fc1.weight").split_over("tp") \
        .blocks == 2
    assert te.param_table.canonical("decoder.layers.1.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.1.pre_mlp_layernorm.weight"


def test_te_core_attention_forks_the_attached_tracker_and_sets_cp(fake_te, monkeypatch):
    m = mcfg("llama", attention_dropout=0.5)
    te = model(m, "transformer_engine")
    core = te.decoder.layers["0"].self_attention.core_attention
    assert isinstance(core.attention.rng_states_tracker, AttachedTracker)
    tracker = model_parallel_tracker(123, 0)
    te.train()
    ids, labels = batch()
    te(ids, labels=labels)                          # no tracker yet: dropout, no fork
    assert core.attention.forks == 1
    attach_rng_tracker(te, tracker)                 # what the parallelize step does
    before = tracker.get_states()["model-parallel-rng"]["cpu"].clone()
    te(ids, labels=labels)
    assert not torch.equal(tracker.get_states()["model-parallel-rng"]["cpu"], before)

    class G:      # a CP group as ModelCommGroups holds it
        def __init__(self, size):
            self.size, self.rank, self.ranks, self.handle = size, 0, list(range(size)), "pg"

    groups = type("Groups", (), {"tp": G(1), "cp": G(2)})()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # a CUDA machine's stream
    monkeypatch.setattr(torch.cuda, "Stream", lambda: "stream")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(te_backend, "_CP_STREAMS", {})
    core = TECoreAttention(m, groups, attn_mask_type=AttnMaskType.causal, cp_comm_type="a2a")
    assert core.attention.cp == ("pg", [0, 1], "stream", "a2a")
    spec = get_layer_spec("transformer_engine", m)
    assert context_parallel_spec(spec, "p2p") is spec   # TE keeps its own CP attention


@pytest.mark.parametrize("backend,want", [("flash", "100"), ("fused", "010"),
                                          ("unfused", "001"), ("auto", "keep")])
def test_attention_backend_sets_tes_kernel_switches(fake_te, monkeypatch, backend, want):
    names = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
    for name in names:
        monkeypatch.setenv(name, "keep")
    model(mcfg("llama", attention_backend=backend), "transformer_engine")
    got = [os.environ[name] for name in names]
    assert got == (["keep"] * 3 if want == "keep" else list(want))


def test_fp8_wraps_each_layer_in_te_autocast_with_the_recipe(fake_te):
    m = mcfg("llama", fp8_format="hybrid", fp8_amax_history_len=16, fp8_amax_compute_algo="max")
    te = model(m, "transformer_engine")
    ids, labels = batch()
    te(ids, labels=labels)
    assert len(te_fake.AUTOCASTS) == m.num_layers
    recipes = {id(r) for r, _ in te_fake.AUTOCASTS}
    assert len(recipes) == 1                           # one shared recipe object
    recipe, group = te_fake.AUTOCASTS[0]
    assert (recipe.fp8_format, recipe.amax_history_len, recipe.amax_compute_algo) == \
        (te_fake.Format.HYBRID, 16, "max")
    assert group is None and recipe.reduce_amax is False    # one rank: nothing to reduce
    te_fake.AUTOCASTS.clear()
    model(dataclasses.replace(m, fp8_format=None), "transformer_engine")(ids, labels=labels)
    assert te_fake.AUTOCASTS == []


def test_moe_model_keeps_the_pre_mlp_norm_unfused(fake_te):
    m = mcfg("llama", num_experts=2, moe_layer_freq=[1, 0, 1], moe_router_topk=1)
    te, local = model(m, "transformer_engine"), model(m, "local")
    dense = te.decoder.layers["1"]
    assert type(dense.pre_mlp_layernorm).__name__ == "RMSNorm"
    assert type(dense.mlp.linear_fc1).__name__ == "Linear"
    assert type(dense.self_attention.linear_qkv).__name__ == "LayerNormLinear"
    assert te.param_table.specs.keys() == local.param_table.specs.keys()
    ids, labels = batch()
    torch.testing.assert_close(te(ids, labels=labels), local(ids, labels=labels),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("variant", [
    dict(moe_router_pre_softmax=True, moe_shared_expert_intermediate_size=16,
         moe_shared_expert_gate=True),                                        # Qwen2-MoE
    dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
         moe_router_num_groups=2, moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5,
         moe_shared_expert_intermediate_size=16)])                            # DeepSeek-V3
def test_moe_variants_run_through_the_te_spec(fake_te, variant):
    """The shared expert (gate included) is a TE MLP in the TE spec; router variants are
    megalite's on both backends: same parameters and the same loss and gradients."""
    m = mcfg("llama", num_experts=4, moe_layer_freq=[0, 1, 1], moe_router_topk=2, **variant)
    te, local = model(m, "transformer_engine"), model(m, "local")
    shared = te.decoder.layers["1"].mlp.shared_experts
    assert type(shared.linear_fc1).__name__ == "Linear"
    assert hasattr(shared, "gate_weight") == bool(variant.get("moe_shared_expert_gate"))
    assert te.param_table.specs.keys() == local.param_table.specs.keys()
    ids, labels = batch()
    loss_te, loss_local = te(ids, labels=labels).mean(), local(ids, labels=labels).mean()
    torch.testing.assert_close(loss_te, loss_local, rtol=1e-6, atol=1e-6)
    loss_te.backward()
    loss_local.backward()
    grads = dict(te.canonical_named_parameters())
    for name, p in local.canonical_named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-6)


def test_megalite_import_does_not_import_te(tmp_path):
    import subprocess

    code = ("import sys, megalite, megalite.models.gpt, megalite.backends.transformer_engine, "
            "megalite.training.loop; print('transformer_engine' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


def test_te_spec_with_multi_latent_attention_uses_te_core_attention_and_projection(fake_te):
    """MLA through the TE spec: TE's DotProductAttention gets the (q/k, v) head dims and
    MLA's softmax scale, TE's row-parallel Linear is the output projection; the down/up
    projections and latent norms are megalite's, the input norm is back in its own slot."""
    from megalite.transformer.mla import mla_softmax_scale

    m = mcfg("mla")
    te = model(m, "transformer_engine")
    attn = te.decoder.layers["1"].self_attention
    assert type(attn.linear_proj).__name__ == "Linear"
    assert type(te.decoder.layers["1"].input_layernorm).__name__ == "RMSNorm"
    dpa = [k for n, k in te_fake.BUILT if n == "DotProductAttention"][0]
    assert dpa["kv_channels"] == (m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim)
    assert dpa["softmax_scale"] == mla_softmax_scale(m) != (6 + 4) ** -0.5   # YaRN's mscale^2
