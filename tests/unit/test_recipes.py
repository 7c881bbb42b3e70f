"""Launch recipes (launch/recipes/): every one dry-runs at its published scale, shapes come
from the model presets only, each twin keeps its recipe's parallel structure, and the
Llama 3 405B layout is the paper's and fits an 80 GB H100."""
import contextlib
import dataclasses
import io
import os

import pytest
import yaml

from megalite.cli.arguments import parse_args
from megalite.config import ConfigError
from megalite.cli.presets import preset_fields
from megalite.planner import model_spec as ms
from megalite.planner.layout import Layout
from megalite.planner.published_runs import BY_NAME
from megalite.cli.recipes import min_world, read_recipe_info, recipe_files
from megalite.planner.report import planner_estimate
from megalite.training.entry import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = os.path.join(ROOT, "launch", "recipes")
PUBLISHED = [f for f in recipe_files(RECIPES) if os.sep + "twins" + os.sep not in f]
TWINS = [f for f in recipe_files(RECIPES) if os.sep + "twins" + os.sep in f]
SHAPE_KEYS = {"num-layers", "hidden-size", "ffn-hidden-size", "num-attention-heads",
              "num-query-groups", "kv-channels", "vocab-size", "num-experts",
              "moe-ffn-hidden-size", "moe-router-topk", "moe-layer-freq"}


def _name(path):
    return os.path.relpath(path, RECIPES)


def _dry_run(path, *extra):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["--config", path, "--dry-run", *extra])
    return rc, out.getvalue()


def _cfg(path, *extra):
    return parse_args(["--config", path, "--dry-run", *extra])


def test_the_issue_lists_every_recipe_and_a_twin_each():
    names = sorted(os.path.basename(f)[:-5] for f in PUBLISHED)
    assert names == sorted(["deepseek-v3", "gpt3-175b", "llama3-405b",
                            "llama3-405b-long-context", "llama3-70b", "llama3-8b",
                            "mixtral-8x22b", "qwen3-235b-a22b"] +
                           ["gemma-3-27b"] +       # Gemma 3
                           ["gpt-oss-120b"] +      # gpt-oss
                           ["qwen3-next-80b-a3b"] +  # Qwen3-Next
                           # Llama 4 and GLM-4.5
                           ["llama-4-scout", "llama-4-maverick", "glm-4.5-air"])
    assert sorted(os.path.basename(f) for f in TWINS) == \
        sorted(os.path.basename(f) for f in PUBLISHED)


@pytest.mark.parametrize("path", PUBLISHED + TWINS, ids=_name)
def test_dry_run_prints_layout_memory_and_time(path):
    info = read_recipe_info(path)
    rc, out = _dry_run(path)
    assert rc == 0, out
    cfg = _cfg(path)
    assert cfg.world_size == info.num_gpus            # the published scale, no --world-size
    assert f"world {info.num_gpus} = " in out and "one group spans" in out
    assert "memory per GPU (most loaded rank, GiB)" in out and "step time" in out
    assert out.rstrip().splitlines()[-1].startswith("fits: ")


@pytest.mark.parametrize("path", PUBLISHED, ids=_name)
def test_shapes_come_from_the_preset_only(path):
    raw = yaml.safe_load(open(path))
    keys = {k for v in raw.values() if isinstance(v, dict) for k in v} | set(raw)
    assert not keys & SHAPE_KEYS, f"{path} copies model shapes {keys & SHAPE_KEYS}"
    info = read_recipe_info(path)
    cfg = _cfg(path)
    planner = ms.recipe(info.model)           # what `megalite plan --recipe NAME` sizes
    for field in preset_fields(info.model):
        if field != "seq_length":             # the long-context phase trains longer sequences
            assert getattr(cfg.model, field) == getattr(planner, field), field


def _structure(cfg):
    p, t = cfg.parallel, cfg.training
    return {"tp>1": p.tp > 1, "cp>1": p.cp > 1, "pp>1": p.pp > 1, "ep>1": p.ep > 1,
            "etp": "=tp" if p.etp == p.tp else p.etp, "dp>1": cfg.data_parallel_size > 1,
            "vpp>1": p.virtual_stages(cfg.model.num_layers) > 1, "sp": p.sequence_parallel,
            "dist-opt": p.use_distributed_optimizer, "recompute": t.recompute_granularity,
            "account": (p.account_for_embedding_in_pipeline_split,
                        p.account_for_loss_in_pipeline_split),
            "uneven": p.decoder_first_pipeline_num_layers is not None,
            "moe": bool(cfg.model.num_experts), "dense-first": cfg.model.num_experts and
            not cfg.model.is_moe_layer(0), "gqa": cfg.model.group_query_attention,
            "mla": cfg.model.multi_latent_attention, "mtp": bool(cfg.model.mtp_num_layers),
            "router": (cfg.model.moe_router_score_function,
                       cfg.model.moe_router_enable_expert_bias,
                       bool(cfg.model.moe_shared_expert_intermediate_size)),
            "arch": (cfg.model.normalization, cfg.model.position_embedding_type,
                     cfg.model.swiglu, cfg.model.add_bias_linear,
                     cfg.model.untie_embeddings_and_output_weights)}


@pytest.mark.parametrize("path", TWINS, ids=_name)
def test_twin_keeps_the_parallel_structure(path):
    info = read_recipe_info(path)
    original = os.path.join(RECIPES, info.twin_of + ".yaml")
    assert os.path.basename(path) == info.twin_of + ".yaml" and os.path.isfile(original)
    assert info.model == read_recipe_info(original).model
    twin, pub = _structure(_cfg(path)), _structure(_cfg(original))
    if pub["etp"] != "=tp":                   # expert-TP 1 decoupled from TP, in both
        assert twin["etp"] == pub["etp"]
    assert {k: v for k, v in twin.items() if k != "etp"} == \
        {k: v for k, v in pub.items() if k != "etp"}
    assert min_world(path) <= info.num_gpus <= 16    # CPU scale


def test_llama3_405b_is_the_papers_layout_and_fits_an_h100():
    cfg = _cfg(os.path.join(RECIPES, "llama3-405b.yaml"))
    p = cfg.parallel
    assert (cfg.world_size, p.tp, p.cp, p.pp, cfg.data_parallel_size) == (16384, 8, 1, 16, 128)
    assert cfg.model.seq_length == 8192
    assert cfg.training.global_batch_size * cfg.model.seq_length == 16 * 1024 * 1024
    run = BY_NAME["llama3-405b-8k-16384gpu"]         # the paper's row (planner/published_runs)
    pub = Layout(world=run.num_gpus, global_batch=run.global_batch, **run.layout)
    assert (pub.tp, pub.cp, pub.pp, pub.dp, run.num_gpus) == (8, 1, 16, 128, 16384)
    est, cluster, _ = planner_estimate(cfg, "h100-80gb", 8)
    assert est.fits and est.memory["total"] < 80e9 and cluster.gpu.name == "h100-80gb"
    long = _cfg(os.path.join(RECIPES, "llama3-405b-long-context.yaml"))
    assert (long.parallel.tp, long.parallel.cp, long.parallel.pp, long.model.seq_length) == \
        (8, 16, 16, 131072)


def test_a_layout_that_cannot_fit_fails_clearly(capsys):
    path = os.path.join(RECIPES, "llama3-405b.yaml")
    with pytest.raises(SystemExit) as exc:      # PP2 instead of PP16: 200B parameters a GPU
        _dry_run(path, "--world-size", "2048", "--pipeline-model-parallel-size", "2")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "does not fit: the planner predicts" in err and "h100-80gb" in err


def test_model_preset_then_config_then_command_line(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("recipe:\n  model: llama3-8b\n  num_gpus: 4\nmodel:\n  num-layers: 4\n"
                 "data:\n  mock-data: true\n")
    cfg = parse_args(["--config", str(f), "--dry-run", "--hidden-size", "256"])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.ffn_hidden_size) == \
        (4, 256, 14336)                          # config, command line, preset
    assert cfg.world_size == 4 and cfg.model.normalization == "RMSNorm"
    cfg = parse_args(["--model-preset", "gpt3-175b", "--mock-data", "--dry-run"])
    assert cfg.model.num_layers == 96 and cfg.world_size == 1
    with pytest.raises(ConfigError, match="unknown model preset"):
        parse_args(["--model-preset", "llama9", "--dry-run"])
    f.write_text("recipe:\n  modle: llama3-8b\n")
    with pytest.raises(ConfigError, match="unknown key"):
        parse_args(["--config", str(f), "--dry-run"])


def test_planner_reads_a_recipe_file_as_its_model():
    from megalite.commands.plan import plan

    out = io.StringIO()
    assert plan(["--recipe", os.path.join(RECIPES, "llama3-405b.yaml"), "--num-gpus", "16384",
                 "--global-batch-tokens", str(16 * 1024 * 1024), "--tp", "8", "--pp", "16",
                 "--top", "1"], out=out) == 0
    named = io.StringIO()
    plan(["--recipe", "llama3-405b", "--num-gpus", "16384", "--global-batch-tokens",
          str(16 * 1024 * 1024), "--tp", "8", "--pp", "16", "--top", "1"], out=named)
    assert out.getvalue().splitlines()[:3] == named.getvalue().splitlines()[:3]
    twin = io.StringIO()
    assert plan(["--recipe", os.path.join(RECIPES, "twins", "llama3-405b.yaml"), "--num-gpus",
                 "8", "--gpus-per-node", "2", "--global-batch-size", "8", "--top", "1"],
                out=twin) == 0
    assert "6 layers, hidden 64" in twin.getvalue()


QWEN3_235B_HF = {   # Qwen/Qwen3-235B-A22B config.json (the model fields)
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 94, "num_attention_heads": 64,
    "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 1536, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "max_position_embeddings": 40960,
    "hidden_act": "silu", "attention_bias": False, "router_aux_loss_coef": 0.001}


def test_qwen3_235b_recipe_is_the_published_model_and_layout(tmp_path):
    """The preset is what Qwen's config.json describes (235B parameters, 22B active), and the
    recipe is Megatron-Core's H100 row: TP2 PP8 VPP4 EP32, expert-TP 1, 256 GPUs."""
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_235B_HF))
    hf_model, preset = ms.from_hf_config(str(path)), ms.recipe("qwen3-235b-a22b")
    assert ms.total_params(hf_model) == ms.total_params(preset)
    assert round(ms.total_params(preset) / 1e9) == 235
    assert round(ms.active_params(preset) / 1e9) == 22
    for field in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                  "kv_channels", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
                  "vocab_size", "rotary_base", "norm_epsilon", "moe_router_pre_softmax",
                  "moe_shared_expert_intermediate_size", "untie_embeddings_and_output_weights",
                  "qk_layernorm"):
        assert getattr(hf_model, field) == getattr(preset, field), field
    cfg = _cfg(os.path.join(RECIPES, "qwen3-235b-a22b.yaml"))
    p = cfg.parallel
    assert (cfg.world_size, p.tp, p.pp, p.virtual_stages(94), p.ep, p.etp) == \
        (256, 2, 8, 4, 32, 1)
    assert (cfg.training.micro_batch_size, cfg.training.global_batch_size,
            cfg.model.seq_length) == (1, 2048, 4096)


def test_gpt_oss_120b_recipe_is_the_published_model_and_layout(tmp_path):
    """The preset is what openai/gpt-oss-120b's config.json describes (117B parameters,
    5.1B active besides the input embedding), and the recipe is Megatron-Bridge's H100
    pretraining layout: TP2 PP4 EP16, expert-TP 1, SP, 64 GPUs; its step counts the window
    (half the layers see 128 keys of 4096) and the sinks (64 parameters per layer)."""
    import json

    from megalite.planner.flops import kind_forward_flops

    hf = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", num_hidden_layers=36,
              num_local_experts=128, vocab_size=201088, hidden_size=2880,
              intermediate_size=2880, head_dim=64, num_attention_heads=64,
              num_key_value_heads=8, sliding_window=128, tie_word_embeddings=False,
              max_position_embeddings=131072, rms_norm_eps=1e-5, num_experts_per_tok=4,
              swiglu_limit=7.0, attention_bias=True, router_aux_loss_coef=0.9,
              layer_types=["sliding_attention", "full_attention"] * 18,
              rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0,
                                   beta_fast=32.0, beta_slow=1.0, truncate=False,
                                   original_max_position_embeddings=4096))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    hf_model, preset = ms.from_hf_config(str(path)), ms.recipe("gpt-oss-120b")
    assert ms.total_params(hf_model) == ms.total_params(preset)
    assert round(ms.total_params(preset) / 1e9) == 117
    embedding = preset.vocab_size * preset.hidden_size
    assert round((ms.active_params(preset) - embedding) / 1e8) == 51
    for field in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                  "kv_channels", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
                  "vocab_size", "rotary_base", "norm_epsilon", "softmax_type", "quick_geglu",
                  "glu_linear_offset", "activation_func_clamp_value", "moe_expert_bias",
                  "add_bias_linear", "window_size", "rotary_scaling_factor",
                  "yarn_correction_range_round_to_int"):
        assert getattr(hf_model, field) == getattr(preset, field), field
    assert [preset.layer_window(i) for i in range(4)] == \
        [hf_model.layer_window(i) for i in range(4)] == [127, None, 127, None]
    full = dataclasses.replace(preset, window_size=None)
    assert kind_forward_flops(preset, True, 4096)["core"] < \
        0.6 * kind_forward_flops(full, True, 4096)["core"]
    cfg = _cfg(os.path.join(RECIPES, "gpt-oss-120b.yaml"))
    p = cfg.parallel
    assert (cfg.world_size, p.tp, p.pp, p.ep, p.etp, p.sequence_parallel) == \
        (64, 2, 4, 16, 1, True)
    assert (cfg.training.micro_batch_size, cfg.training.global_batch_size,
            cfg.model.seq_length) == (1, 512, 4096)
