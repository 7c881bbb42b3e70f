"""Model presets: the one table of model shapes.

``megalite plan --recipe NAME`` sizes these models, and the launch recipes
(``launch/recipes/*.yaml``) name one with ``recipe: {model: NAME}`` (or ``--model-preset NAME``
on the command line) instead of copying its shapes.  Pure data plus two readers; imports only
``megalite.config``, so both the argument parser and the planner can read it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict

from megalite.config import ConfigError, ModelConfig

_LLAMA = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
              untie_embeddings_and_output_weights=True, add_bias_linear=False,
              group_query_attention=True, hidden_dropout=0.0, attention_dropout=0.0,
              vocab_size=128256, rotary_base=500000, seq_length=8192)
_GPT = dict(normalization="LayerNorm", position_embedding_type="learned_absolute", swiglu=False,
            untie_embeddings_and_output_weights=False, add_bias_linear=True,
            hidden_dropout=0.1, attention_dropout=0.1, seq_length=2048)


def _gpt2021(heads, hidden, layers):
    """A model of Narayanan et al. 2021, Table 1 (seq 2048, vocab 51200); the runs themselves
    are rows of megalite/planner/published_runs.py."""
    return dict(_GPT, num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                vocab_size=51200, ffn_hidden_size=4 * hidden)


MODEL_PRESETS = {
    "llama3-8b": dict(_LLAMA, num_layers=32, hidden_size=4096, num_attention_heads=32,
                      num_query_groups=8, ffn_hidden_size=14336),
    "llama3-70b": dict(_LLAMA, num_layers=80, hidden_size=8192, num_attention_heads=64,
                       num_query_groups=8, ffn_hidden_size=28672),
    "llama3-405b": dict(_LLAMA, num_layers=126, hidden_size=16384, num_attention_heads=128,
                        num_query_groups=8, ffn_hidden_size=53248),
    "gpt3-175b": dict(_GPT, num_layers=96, hidden_size=12288, num_attention_heads=96,
                      ffn_hidden_size=4 * 12288, vocab_size=50257),
    "mixtral-8x7b": dict(_LLAMA, num_layers=32, hidden_size=4096, num_attention_heads=32,
                         num_query_groups=8, ffn_hidden_size=14336, moe_ffn_hidden_size=14336,
                         num_experts=8, moe_router_topk=2, vocab_size=32000, rotary_base=1000000,
                         seq_length=4096),
    "gpt-1.7b": _gpt2021(24, 2304, 24),
    "gpt-3.6b": _gpt2021(32, 3072, 30),
    "gpt-7.5b": _gpt2021(32, 4096, 36),
    "gpt-18.4b": _gpt2021(48, 6144, 40),
    "gpt-39.1b": _gpt2021(64, 8192, 48),
    "gpt-76.1b": _gpt2021(80, 10240, 60),
    "gpt-145.6b": _gpt2021(96, 12288, 80),
    "gpt-310.1b": _gpt2021(128, 16384, 96),
    "gpt-529.6b": _gpt2021(128, 20480, 105),
    "gpt-1t": _gpt2021(160, 25600, 128),
}

# MoE presets of the launch recipes (launch/recipes/). Shapes from the models' published configs.
MODEL_PRESETS.update({
    # Mistral AI, Mixtral-8x22B-v0.1 config.json.
    "mixtral-8x22b": dict(_LLAMA, num_layers=56, hidden_size=6144, num_attention_heads=48,
                          num_query_groups=8, ffn_hidden_size=16384, moe_ffn_hidden_size=16384,
                          num_experts=8, moe_router_topk=2, vocab_size=32768,
                          rotary_base=1000000, seq_length=4096),
    # Qwen3-235B-A22B config.json: every layer MoE, softmax top-k renormalized (norm_topk_prob),
    # no shared expert, per-head q/k RMSNorm; intermediate_size (dense MLP) unused.
    "qwen3-235b-a22b": dict(_LLAMA, num_layers=94, hidden_size=4096, num_attention_heads=64,
                            num_query_groups=4, kv_channels=128, qk_layernorm=True,
                            ffn_hidden_size=12288, moe_ffn_hidden_size=1536, num_experts=128,
                            moe_router_topk=8, vocab_size=151936, rotary_base=1000000,
                            norm_epsilon=1e-6, seq_length=4096),
    # DeepSeek-V3 (DeepSeek-AI 2024; the HF config.json): 61 layers, the first 3 dense;
    # Multi-Latent Attention (q rank 1536, kv rank 512, heads 128 + 64 rope / 128 v) with
    # YaRN x40 over a 4k original context; 256 routed experts top-8 with a sigmoid router,
    # aux-free expert bias, 8 groups top-4, weights x2.5, one shared expert; one MTP module
    # (loss weight 0.1, the Megatron-MoE model zoo's); the sequence-wise aux loss 1e-4.
    "deepseek-v3": dict(_LLAMA, num_layers=61, hidden_size=7168, num_attention_heads=128,
                        group_query_attention=False, ffn_hidden_size=18432,
                        multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512,
                        qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
                        qk_layernorm=True, rope_type="yarn", rotary_scaling_factor=40.0,
                        mscale=1.0, mscale_all_dim=1.0,
                        yarn_original_max_position_embeddings=4096,
                        moe_ffn_hidden_size=2048, num_experts=256, moe_router_topk=8,
                        moe_layer_freq=[0] * 3 + [1] * 58,
                        moe_shared_expert_intermediate_size=2048,
                        moe_router_score_function="sigmoid",
                        moe_router_enable_expert_bias=True, moe_router_num_groups=8,
                        moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5,
                        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4,
                        mtp_num_layers=1, mtp_loss_scaling_factor=0.1,
                        vocab_size=129280, rotary_base=10000, norm_epsilon=1e-6,
                        seq_length=4096),
})
# gpt-oss (openai/gpt-oss-120b config.json): 36 layers, every one MoE (128 experts F 2880
# top-4, softmax over the top-k, biased router and experts), the clamped quick-GeGLU
# (swiglu_limit 7), learned sinks, biases on q/k/v/o, a 128-token window on alternate layers
# (layer 0 first), YaRN x32 over a 4k original context, not truncated.
MODEL_PRESETS.update({
    "gpt-oss-120b": dict(_LLAMA, swiglu=False, quick_geglu=True, glu_linear_offset=1.0,
                         activation_func_clamp_value=7.0, softmax_type="learnable",
                         add_bias_linear=True, num_layers=36, hidden_size=2880,
                         num_attention_heads=64, num_query_groups=8, kv_channels=64,
                         ffn_hidden_size=2880, moe_ffn_hidden_size=2880, num_experts=128,
                         moe_router_topk=4, moe_expert_bias=True, window_size=(127, 0),
                         window_attn_skip_freq=2, position_embedding_type="yarn",
                         rotary_scaling_factor=32.0, yarn_original_max_position_embeddings=4096,
                         yarn_beta_fast=32.0, yarn_beta_slow=1.0,
                         yarn_correction_range_round_to_int=False, rotary_base=150000,
                         vocab_size=201088, norm_epsilon=1e-5, seq_length=4096),
})

# Qwen3-Next (Gated DeltaNet hybrid): Qwen/Qwen3-Next-80B-A3B-Instruct's config.json -- 48
# layers, every 4th full attention (16 heads / 2 KV groups of 256, output gate, q/k RMSNorm,
# partial rotary 0.25, theta 1e7) and the others Gated DeltaNet (16 q/k heads of 128 serving
# 32 value heads of 128, conv 4); zero-centred RMSNorms; 512 experts (F 512) top-10
# renormalized with a sigmoid-gated shared expert (512) in every layer.
MODEL_PRESETS.update({
    "qwen3-next-80b-a3b": dict(
        _LLAMA, num_layers=48, hidden_size=2048, num_attention_heads=16, num_query_groups=2,
        kv_channels=256, qk_layernorm=True, apply_layernorm_1p=True, ffn_hidden_size=5120,
        rotary_percent=0.25, rotary_base=10000000, attention_output_gate=True,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=4,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=32, moe_ffn_hidden_size=512,
        num_experts=512, moe_router_topk=10, moe_shared_expert_intermediate_size=512,
        moe_shared_expert_gate=True, vocab_size=151936, norm_epsilon=1e-6, seq_length=4096),
})

# Llama 4 and GLM-4.5 presets of the launch recipes (launch/recipes/llama-4-*.yaml,
# glm-4.5-air.yaml).
_LLAMA4 = dict(_LLAMA, num_layers=48, hidden_size=5120, num_attention_heads=40,
               num_query_groups=8, kv_channels=128, ffn_hidden_size=16384,
               moe_ffn_hidden_size=8192, moe_shared_expert_intermediate_size=8192,
               moe_router_topk=1, moe_router_score_function="sigmoid",
               moe_apply_probs_on_input=True, vocab_size=202048, rotary_base=500000,
               no_rope_freq=4, attention_chunk_size=8192, attn_temperature_tuning=True,
               norm_epsilon=1e-5, seq_length=8192)
MODEL_PRESETS.update({
    # Llama 4 Scout (17B active, 16 experts; Megatron-Bridge's Llama4Experts16ModelProvider,
    # megatron/bridge/models/llama/llama_provider.py, and the HF text_config): 48 layers, every
    # one MoE (top-1 sigmoid scaling the expert input, one shared expert), chunked attention
    # of 8192 on the RoPE layers, every 4th layer NoPE with the query temperature, L2 q/k norm,
    # Llama 3 RoPE scaling x8.
    "llama-4-scout": dict(_LLAMA4, num_experts=16, qk_l2_norm=True, use_rope_scaling=True,
                          rope_scaling_factor=8.0),
    # Llama 4 Maverick (17B active, 128 experts; Llama4Experts128ModelProvider): MoE on every
    # other layer (moe_layer_freq [0, 1] * 24, dense MLPs of 16384 between), no q/k norm, no
    # RoPE scaling.
    "llama-4-maverick": dict(_LLAMA4, num_experts=128, moe_layer_freq=[0, 1] * 24),
    # GLM-4.5-Air (106B, 12B active; zai-org/GLM-4.5-Air config.json, transformers'
    # Glm4MoeConfig defaults): 46 layers, the first dense (10944), 128 experts (1408) top-8
    # with a sigmoid router and the aux-free expert bias, one shared expert; 96 query heads /
    # 8 groups of dim 128, q/k/v biases, half of each head rotated (partial_rotary_factor 0.5),
    # RoPE 1e6; one MTP layer (loss weight 0.3, Megatron-Bridge's recipe).
    "glm-4.5-air": dict(_LLAMA, num_layers=46, hidden_size=4096, num_attention_heads=96,
                        num_query_groups=8, kv_channels=128, ffn_hidden_size=10944,
                        moe_ffn_hidden_size=1408, num_experts=128, moe_router_topk=8,
                        moe_layer_freq=[0] + [1] * 45, moe_shared_expert_intermediate_size=1408,
                        moe_router_score_function="sigmoid",
                        moe_router_enable_expert_bias=True, add_qkv_bias=True,
                        rotary_percent=0.5, rotary_base=1000000, vocab_size=151552,
                        norm_epsilon=1e-5, mtp_num_layers=1, mtp_loss_scaling_factor=0.3,
                        seq_length=4096),
})


def preset_fields(name: str) -> Dict[str, Any]:
    """The ``ModelConfig`` fields of preset ``name`` (its ``published`` notes left out)."""
    key = name.lower()
    if key not in MODEL_PRESETS:
        raise ConfigError(f"unknown model preset '{name}'; choose from {', '.join(MODEL_PRESETS)}")
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return {k: v for k, v in MODEL_PRESETS[key].items() if k in names}


def preset_model(name: str) -> ModelConfig:
    return ModelConfig(**preset_fields(name))

# Gemma 3 (text): google/gemma-3-27b's text_config (Gemma3TextConfig): (1 + w) sandwich
# norms and per-head q/k norms, scaled embedding, GeGLU, query_pre_attn_scalar 168, a 1024
# window on 5 of every 6 layers with RoPE base 1e4, the others 1e6 with linear scaling 8; tied
MODEL_PRESETS.update({
    "gemma-3-27b": dict(_LLAMA, swiglu=False, activation="geglu",
                        untie_embeddings_and_output_weights=False, num_layers=62,
                        hidden_size=5376, ffn_hidden_size=21504, num_attention_heads=32,
                        num_query_groups=16, kv_channels=128, vocab_size=262208,
                        norm_epsilon=1e-6, apply_layernorm_1p=True, norm_placement="sandwich",
                        scale_embeddings=True, softmax_scale=168 ** -0.5, qk_layernorm=True,
                        window_size=(1023, 0), window_attn_skip_freq=6, rotary_base=1000000,
                        rotary_base_local=10000, rotary_seq_len_interpolation_factor=8.0,
                        seq_length=4096),
})
