"""Tiny random Hugging Face models of the dense families (tests/ is on sys.path), each with
the feature that family brings, built with ``transformers`` from a tiny config:

* ``llama``: Llama 3.2 -- ``llama3`` RoPE scaling (original context 16 < the sequences, so
  the scaling shows) and tied embeddings;
* ``mistral``: head_dim 16 != hidden / heads, ``sliding_window: null``;
* ``qwen2``: biases on q, k, v; tied embeddings;
* ``qwen3``: q/k RMSNorm, head_dim 16, and YaRN scaling;
* ``phi3``: fused ``qkv_proj`` and ``gate_up_proj`` (GQA: 4 heads, 2 kv heads);
* ``smollm3``: layer 1 without RoPE (``no_rope_layer_interval`` 2), tied embeddings;
* ``olmo2``: norms after attention and MLP, q/k RMSNorm over the whole projections;
* ``gemma2``: (1 + w) sandwich norms, scaled embedding, GeGLU, query_pre_attn_scalar 12 !=
  head_dim, both soft-caps, a 4-key window on layer 0;
* ``gemma3``: Gemma 2's without soft-caps, per-head (1 + w) q/k norms, the sliding layer's
  own RoPE base and linear RoPE scaling (factor 8) on the full layer;
* ``qwen2_moe``: Qwen2's q/k/v biases, a dense layer 0 (``mlp_only_layers``) before an MoE
  layer with 4 experts top-2 not renormalized and the sigmoid-gated shared expert;
* ``qwen3_moe``: Qwen3's q/k RMSNorm and head_dim 16, a dense layer 0, 4 experts top-2
  renormalized;
* ``phi4_mini``: Phi-3 with ``partial_rotary_factor`` 0.5 (Phi-4-mini's layout);
* ``llama4``: Llama 4 text -- chunked attention (chunks of 8 < the sequences) on layer 0,
  layer 1 NoPE with the query temperature (floor_scale 4) and MoE (4 experts, top-1 sigmoid
  scaling the expert input, a shared expert; ``interleave_moe_layer_step`` 2), L2 q/k norm,
  interleaved RoPE, a dense MLP of its own size (``intermediate_size_mlp``);
* ``glm4_moe``: GLM-4.5 -- q/k/v biases, per-head q/k RMSNorm, partial rotary 0.5, a dense
  layer 0 before a DeepSeek-V3-style MoE layer (sigmoid router with a non-zero
  ``e_score_correction_bias``, 2 groups top-1, 4 experts top-2, ``routed_scaling_factor``
  2.5, a shared expert).

Norm weights and biases are drawn away from their init, so a swapped mapping shows; the MoE
families' weights are drawn wider (peaky routers, logits far from uniform), so a wrong
routing rule moves the loss well past the tolerance.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 128, 16      # vocabulary needs no padding: the planner's count is HF's
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              rms_norm_eps=1e-5)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[0],
           rope_parameters=dict(rope_type="default", rope_theta=1e6))
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        head_dim=8, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=16))),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(
        head_dim=16, sliding_window=None, rope_parameters=dict(rope_type="default",
                                                               rope_theta=1e6))),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        head_dim=16, rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0,
                                          original_max_position_embeddings=16))),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        pad_token_id=None, bos_token_id=1, eos_token_id=2, sliding_window=None,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(
        no_rope_layer_interval=2, tie_word_embeddings=True, pad_token_id=None, bos_token_id=1,
        eos_token_id=2, rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(
        pad_token_id=None, bos_token_id=1, eos_token_id=2,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        MOE, shared_expert_intermediate_size=24, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        MOE, head_dim=16, norm_topk_prob=True)),
    # Gemma 2/3: a window of 4 keys (shorter than the sequences), sliding then full layer
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=8, query_pre_attn_scalar=12, sliding_window=4, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, rope_parameters=dict(rope_type="default",
                                                          rope_theta=10000.0))),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=8, query_pre_attn_scalar=12, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": dict(rope_type="linear", factor=8.0,
                                                rope_theta=1e6)})),
}
# gpt-oss: sinks, biases on q/k/v/o, the router and the experts, a 4-token window on layer 0
# (layer_types), the clamped quick-GeGLU (limit 1.5: the clamp shows), YaRN not truncated
FAMILIES["gpt_oss"] = ("GptOssConfig", "GptOssForCausalLM", dict(
    head_dim=8, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
    sliding_window=4, layer_types=["sliding_attention", "full_attention"], swiglu_limit=1.5,
    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                         beta_slow=1.0, truncate=False, original_max_position_embeddings=16)))
# Qwen3-Next: a Gated DeltaNet layer 0 (2 q/k heads serving 4 value heads) and a gated
# full-attention layer 1 with partial rotary 0.25 and an MoE block with the gated shared expert
FAMILIES["qwen3_next"] = ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
    MOE, head_dim=16, shared_expert_intermediate_size=24, norm_topk_prob=True,
    layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4, pad_token_id=None, bos_token_id=1, eos_token_id=2,
    rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.25)))
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "gpt_oss", "qwen3_next")
# Llama 4 and GLM-4.5
FAMILIES.update({
    "phi4_mini": ("Phi3Config", "Phi3ForCausalLM", dict(
        pad_token_id=None, bos_token_id=1, eos_token_id=2, sliding_window=None,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                             partial_rotary_factor=0.5))),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        head_dim=8, attention_chunk_size=8, no_rope_layer_interval=2, floor_scale=4,
        attn_scale=0.1, attn_temperature_tuning=True, use_qk_norm=True, num_local_experts=4,
        num_experts_per_tok=1, interleave_moe_layer_step=2, intermediate_size_mlp=64,
        pad_token_id=None, bos_token_id=1, eos_token_id=2,
        rope_parameters=dict(rope_type="default", rope_theta=500000.0))),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        attention_bias=True, use_qk_norm=True, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, num_mtp_layers=0,
        pad_token_id=None, bos_token_id=1, eos_token_id=2,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                             partial_rotary_factor=0.5))),
})
MOE_FAMILIES += ("llama4", "glm4_moe")


def hf_model(family: str, seed: int = 0):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith(".bias") or n.endswith("_bias") or n.endswith(".sinks"):
                p.normal_(0, 0.5)
            elif family in MOE_FAMILIES and p.dim() > 1:    # logits far from uniform, so
                p.normal_(0, 0.5 if n.endswith("mlp.gate.weight") else 0.15)   # routing shows
        for n, b in model.named_buffers():              # DeepSeek-style aux-free bias
            if n.endswith("e_score_correction_bias"):
                b.uniform_(-0.05, 0.05)
    return model


def save_hf_model(family: str, path: str, seed: int = 0):
    model = hf_model(family, seed)
    model.save_pretrained(path)
    return model


def hf_loss(model, windows: torch.Tensor) -> float:
    """Mean next-token cross entropy over ``windows`` [n, SEQ + 1] (fp32)."""
    with torch.no_grad():
        logits = model(windows[:, :-1]).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             windows[:, 1:].reshape(-1)).item()


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()
