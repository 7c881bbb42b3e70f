"""The Hugging Face families (Llama 3.x, Mistral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE) in one
process: an
imported model gives transformers' logits, the planner reads each config and counts HF's
parameters, export picks the family, and what megalite cannot express is one line naming
the key.  (tests/unit/test_hf_export_families.py checks each family's export;
tests/e2e/test_hf_families_e2e.py runs the same models through convert.py and
pretrain_gpt.py.)"""
import json

import pytest
import torch

from megalite.checkpointing import hf
from megalite.checkpointing.hf_adapters import UnsupportedModelError, adapter_for_model
from megalite.checkpointing.model_io import load_full_state_dict
from megalite.config import ConfigError, MegaliteConfig, ModelConfig
from megalite.models.gpt import build_model, single_rank_state
from megalite.planner import model_spec as ms
from megalite.transformer.rotary import rotary_frequencies

from hf_families import FAMILIES, VOCAB, hf_model, rel, save_hf_model  # noqa: E402

EXPECT = {   # what each family's import must set
    "llama": dict(use_rope_scaling=True, rope_scaling_factor=32.0,
                  rope_scaling_original_max_position_embeddings=16, kv_channels=8,
                  untie_embeddings_and_output_weights=False, rotary_base=500000),
    "mistral": dict(kv_channels=16, position_embedding_type="rope", qk_layernorm=False),
    "qwen2": dict(add_qkv_bias=True, untie_embeddings_and_output_weights=False,
                  add_bias_linear=False),
    "qwen3": dict(qk_layernorm=True, kv_channels=16, position_embedding_type="yarn",
                  rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=16),
    "phi3": dict(group_query_attention=True, num_query_groups=2, add_qkv_bias=False,
                 qk_layernorm=False, hidden_dropout=0.0),
    "smollm3": dict(no_rope_freq=2, untie_embeddings_and_output_weights=False,
                    position_embedding_type="rope"),
    "olmo2": dict(norm_placement="post", qk_layernorm=True, qk_layernorm_scope="projection",
                  num_query_groups=2),
    "qwen2_moe": dict(add_qkv_bias=True, num_experts=4, moe_router_topk=2,
                      moe_ffn_hidden_size=16, ffn_hidden_size=56, moe_layer_freq=[0, 1],
                      moe_router_pre_softmax=True, moe_shared_expert_intermediate_size=24,
                      moe_shared_expert_gate=True),
    "qwen3_moe": dict(qk_layernorm=True, kv_channels=16, num_experts=4, moe_layer_freq=[0, 1],
                      moe_router_pre_softmax=False, moe_shared_expert_intermediate_size=None,
                      moe_shared_expert_gate=False),
    # Gemma 2/3
    "gemma2": dict(activation="geglu", swiglu=False, apply_layernorm_1p=True,
                   norm_placement="sandwich", scale_embeddings=True,
                   softmax_scale=12 ** -0.5, window_size=(3, 0), window_attn_skip_freq=[1, 0],
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                   untie_embeddings_and_output_weights=False, qk_layernorm=False),
    "gemma3": dict(activation="geglu", norm_placement="sandwich", qk_layernorm=True,
                   window_size=(3, 0), window_attn_skip_freq=[1, 0], rotary_base=1000000,
                   rotary_base_local=10000, rotary_seq_len_interpolation_factor=8.0,
                   attn_logit_softcapping=None, final_logit_softcapping=None),
    "gpt_oss": dict(softmax_type="learnable", quick_geglu=True, glu_linear_offset=1.0,
                    activation_func_clamp_value=1.5, moe_expert_bias=True, add_bias_linear=True,
                    window_size=(3, 0), window_attn_skip_freq=[1, 0], num_experts=4,
                    position_embedding_type="yarn", yarn_correction_range_round_to_int=False),
    # Qwen3-Next (Gated DeltaNet hybrid)
    "qwen3_next": dict(experimental_attention_variant="gated_delta_net",
                       linear_attention_freq=2, attention_output_gate=True,
                       rotary_percent=0.25, apply_layernorm_1p=True, qk_layernorm=True,
                       linear_num_key_heads=2, linear_num_value_heads=4,
                       moe_shared_expert_gate=True, moe_layer_freq=[0, 1]),
}
EXPECT.update({   # Llama 4 and GLM-4.5 (and Phi-3's partial rotary)
    "phi4_mini": dict(rotary_percent=0.5, group_query_attention=True, qk_layernorm=False),
    "llama4": dict(attention_chunk_size=8, no_rope_freq=2, attn_temperature_tuning=True,
                   attn_temperature_floor_scale=4, attn_temperature_scale=0.1, qk_l2_norm=True,
                   num_experts=4, moe_router_topk=1, moe_layer_freq=[0, 1],
                   moe_apply_probs_on_input=True, moe_router_score_function="sigmoid",
                   ffn_hidden_size=64, moe_ffn_hidden_size=56,
                   moe_shared_expert_intermediate_size=56, qk_layernorm=False),
    "glm4_moe": dict(add_qkv_bias=True, qk_layernorm=True, rotary_percent=0.5, num_experts=4,
                     moe_router_topk=2, moe_layer_freq=[0, 1], moe_router_enable_expert_bias=True,
                     moe_router_num_groups=2, moe_router_group_topk=1,
                     moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=16),
})
EXPORTS_AS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
              "phi3": "llama", "smollm3": "smollm3", "olmo2": "olmo2",
              "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe",
              "gemma2": "gemma2", "gemma3": "gemma3",
              "gpt_oss": "gpt_oss",
              "qwen3_next": "qwen3_next",
              # Llama 4 and GLM-4.5
              "phi4_mini": "phi3", "llama4": "llama4", "glm4_moe": "glm4_moe"}
IDS = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_gives_hf_logits_and_the_planner_counts_hf_parameters(tmp_path, family):
    ref = save_hf_model(family, str(tmp_path))
    model_cfg, full = hf.import_hf(str(tmp_path))
    for key, value in EXPECT[family].items():
        assert model_cfg[key] == value, key
    model = build_model(MegaliteConfig(model=ModelConfig(**model_cfg)), single_rank_state())
    load_full_state_dict(model.eval(), full, single_rank_state())
    with torch.no_grad():               # 40 positions: past the scalings' original 16
        assert rel(model(IDS)[..., :VOCAB], ref(IDS).logits) <= 1e-5
    planned = ms.from_hf_config(str(tmp_path / "config.json"))
    assert ms.total_params(planned) == ref.num_parameters() == \
        sum(p.numel() for p in model.parameters())
    assert planned.qk_layernorm == model_cfg["qk_layernorm"]
    assert adapter_for_model(model_cfg).family == EXPORTS_AS[family]


def test_export_picks_the_family_or_names_what_the_model_lacks(tmp_path):
    qwen3 = hf.hf_config_to_model_config(hf_model("qwen3").config.to_dict())
    assert adapter_for_model(qwen3, "Qwen3ForCausalLM").family == "qwen3"
    with pytest.raises(UnsupportedModelError, match="does not export as Qwen2ForCausalLM; it "
                       "needs --add-qkv-bias, no --qk-layernorm"):
        adapter_for_model(qwen3, "Qwen2ForCausalLM")
    with pytest.raises(UnsupportedModelError, match="does not export as LlamaForCausalLM; "
                       "it needs no --qk-layernorm"):
        adapter_for_model(qwen3, "LlamaForCausalLM")
    llama = hf.hf_config_to_model_config(hf_model("llama").config.to_dict())
    out = hf.model_config_to_hf_config(llama)
    assert out["rope_parameters"]["rope_type"] == "llama3" == out["rope_scaling"]["rope_type"]
    mistral = adapter_for_model(llama, "MistralForCausalLM").config_to_hf(llama)
    assert mistral["architectures"] == ["MistralForCausalLM"] and mistral["sliding_window"] is None
    with pytest.raises(UnsupportedModelError, match="no Hugging Face adapter writes 'Foo'"):
        adapter_for_model(llama, "Foo")


def _cfg(family, **change):
    d = hf_model(family).config.to_dict()
    d.update(change)
    return d


REFUSALS = [
    ("mistral", dict(sliding_window=0), "sliding_window 0 is not supported"),
    ("qwen2", dict(layer_types=["chunked_attention", "full_attention"]),
     r"layer_types \['chunked_attention'\] are not supported"),
    ("qwen3", dict(layer_types=["sliding_attention", "full_attention"]),
     r"layer_types \['sliding_attention'\] are not supported"),
    ("qwen3", dict(attention_bias=True), "attention_bias: true is not supported for Qwen3"),
    ("llama", dict(attention_bias=True), "attention_bias: true is not supported for Llama"),
    ("llama", dict(mlp_bias=True), "mlp_bias: true is not supported"),
    ("llama", dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    ("llama", dict(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)),
     "rope_parameters.rope_type 'dynamic' is not supported"),
    ("qwen2", dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5 is not supported"),
    ("llama", dict(rope_parameters=dict(rope_type="llama3", rope_theta=1e4, factor=8.0)),
     r"rope_parameters \(llama3\) lacks low_freq_factor, high_freq_factor"),
    ("qwen3", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=1.0,
                                        original_max_position_embeddings=16,
                                        attention_factor=2.0)),
     r"rope_parameters.attention_factor 2.0 with factor 1.0 <= 1 is not expressible"),
    ("llama", dict(rope_parameters={"full_attention": dict(rope_type="default"),
                                    "sliding_attention": dict(rope_type="default")}),
     "rope_parameters: per-layer-type RoPE"),
    ("qwen2_moe", dict(use_sliding_window=True), "use_sliding_window: true is not supported"),
    ("qwen2_moe", dict(shared_expert_intermediate_size=0),
     "shared_expert_intermediate_size 0 is not supported"),
    ("qwen3_moe", dict(attention_bias=True), "attention_bias: true is not supported for Qwen3"),
    ("smollm3", dict(use_sliding_window=True, sliding_window=8),
     "use_sliding_window: true is not supported"),
    ("smollm3", dict(no_rope_layers=[1, 0, 1]), r"no_rope_layers \[1, 0, 1\] is not one 0/1 "
     "per layer"),
    ("smollm3", dict(mlp_bias=True), "mlp_bias: true is not supported"),
    ("olmo2", dict(attention_bias=True), "attention_bias: true is not supported for Olmo2"),
    ("phi3", dict(rope_parameters=dict(rope_type="longrope", rope_theta=1e4,
                                       short_factor=[1.0] * 4, long_factor=[2.0] * 4)),
     "rope_type 'longrope' is not supported"),
    # Gemma 2/3
    ("gemma2", dict(hidden_activation="gelu"), "hidden_activation 'gelu' is not supported"),
    ("gemma2", dict(attention_bias=True), "attention_bias: true is not supported for Gemma2"),
    ("gemma3", dict(use_bidirectional_attention=True),
     "use_bidirectional_attention: true is not supported"),
    ("gemma3", dict(rope_parameters={
        "sliding_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e4),
        "full_attention": dict(rope_type="default", rope_theta=1e6)}),
     "rope_parameters.sliding_attention.rope_type 'linear' is not supported"),
    ("gemma3", dict(rope_parameters={
        "sliding_attention": dict(rope_type="default", rope_theta=1e4),
        "full_attention": dict(rope_type="dynamic", factor=2.0, rope_theta=1e6)}),
     "rope_parameters.rope_type 'dynamic' is not supported"),
    # gpt-oss
    ("gpt_oss", dict(swiglu_alpha=1.5), "swiglu_alpha 1.5 is not supported"),
    ("gpt_oss", dict(layer_types=["chunked_attention", "full_attention"]),
     r"layer_types \['chunked_attention'\] are not supported"),
    ("gpt_oss", dict(sliding_window=None),
     "layer_types has sliding_attention layers but the config sets no sliding_window"),
    ("gpt_oss", dict(router_jitter_noise=0.1), "router_jitter_noise is not supported"),
    # Qwen3-Next
    ("qwen3_next", dict(layer_types=["linear_attention", "sliding_attention"]),
     r"layer_types \['sliding_attention'\] are not supported"),
    ("qwen3_next", dict(attention_bias=True), "attention_bias: true is not supported for "
     "Qwen3-Next"),
    # Llama 4 and GLM-4.5
    ("phi3", dict(rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                       partial_rotary_factor=0.4)),
     "partial_rotary_factor 0.4 rotates 3 of 8 channels"),
    ("llama4", dict(attention_bias=True), "attention_bias: True is not supported for Llama4"),
    ("llama4", dict(num_experts_per_tok=2), "num_experts_per_tok 2 is not supported"),
    ("llama4", dict(router_jitter_noise=0.1), "router_jitter_noise: 0.1 is not supported"),
    ("llama4", dict(layer_types=["full_attention", "chunked_attention"]),
     r"layer_types \['full_attention', 'chunked_attention'\] is not supported: megalite "
     "chunks exactly the layers with RoPE"),
    ("glm4_moe", dict(norm_topk_prob=False), "norm_topk_prob: false is not supported"),
    ("glm4_moe", dict(num_experts_per_tok=1), "num_experts_per_tok 1 is not supported"),
    ("glm4_moe", dict(n_group=2, topk_group=2), "group-limited routing ranks groups"),
    ("glm4_moe", dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
]


@pytest.mark.parametrize("family,change,message", REFUSALS,
                         ids=[f"{f}-{next(iter(c))}" for f, c, _ in REFUSALS])
def test_what_megalite_cannot_express_is_one_line_naming_the_key(family, change, message):
    with pytest.raises(UnsupportedModelError, match=message) as err:
        hf.hf_config_to_model_config(_cfg(family, **change))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=message):            # the planner says the same
        ms._from_adapter(_cfg(family, **change), "config.json")


def test_yarn_round_trips_through_transformers_rules():
    """transformers ignores mscale unless mscale_all_dim is set too; megalite's Megatron
    rule does not: export writes the factor itself where the two would differ."""
    base = hf.hf_config_to_model_config(hf_model("qwen3").config.to_dict())
    for mscale, all_dim, key in ((1.0, 0.0, None), (0.7, 0.0, "attention_factor"),
                                 (0.0, 0.5, "attention_factor"), (1.0, 1.0, "mscale")):
        m = dict(base, mscale=mscale, mscale_all_dim=all_dim)
        out = hf.model_config_to_hf_config(m)
        rp = out["rope_parameters"]
        assert (key is None and "attention_factor" not in rp and "mscale" not in rp) or key in rp
        _, ours = rotary_frequencies(ModelConfig(**m))
        if "attention_factor" in rp:
            assert rp["attention_factor"] == ours
        back = hf.hf_config_to_model_config(json.loads(json.dumps(out)))
        assert rotary_frequencies(ModelConfig(**back))[1] == pytest.approx(ours, rel=1e-14)
