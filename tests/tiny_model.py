"""One tiny model config for the layer-spec and backend tests (tests/ is on sys.path):
2-3 layers of hidden 32, GPT-2-style (LayerNorm, learned positions, tied, biases) or
Llama-style (RMSNorm, RoPE, SwiGLU, untied, no biases, GQA), Qwen-style (Llama plus
qkv bias, q/k norms, head dim 8) or DeepSeek-style attention (Llama with Multi-Latent
Attention: latents with their norms, a YaRN rope part, v narrower than q/k), dropout off."""
from __future__ import annotations

from megalite.config import ModelConfig


def tiny_model_cfg(arch: str = "llama", *, seq_length: int = 8, vocab_size: int = 70,
                   num_layers: int = 2, num_query_groups: int = 4, **over) -> ModelConfig:
    d = dict(num_layers=num_layers, hidden_size=32, num_attention_heads=8,
             seq_length=seq_length, vocab_size=vocab_size, make_vocab_size_divisible_by=16,
             hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.05)
    if arch in ("llama", "qwen", "mla"):
        d.update(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                 add_bias_linear=False, untie_embeddings_and_output_weights=True,
                 group_query_attention=True, num_query_groups=num_query_groups)
    if arch == "qwen":     # Qwen2/3's attention: qkv bias, q/k norms, head dim != hidden/heads
        d.update(add_qkv_bias=True, qk_layernorm=True, kv_channels=8)
    if arch == "mla":      # MHA: one K/V head per query head
        d.update(group_query_attention=False, num_query_groups=None,
                 multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=6,
                 qk_pos_emb_head_dim=4, v_head_dim=5, qk_layernorm=True,
                 rotary_scaling_factor=4.0, mscale_all_dim=1.0,
                 yarn_original_max_position_embeddings=4)
    if arch == "gemma":    # Gemma 3's layer: Llama with its norms and scalings, tied
        d.update(normalization="RMSNorm", position_embedding_type="rope", activation="geglu",
                 add_bias_linear=False, group_query_attention=True,
                 num_query_groups=num_query_groups, apply_layernorm_1p=True,
                 norm_placement="sandwich", scale_embeddings=True, softmax_scale=0.3,
                 qk_layernorm=True, window_size=(3, 0), window_attn_skip_freq=2,
                 rotary_base_local=100, rotary_seq_len_interpolation_factor=4.0,
                 final_logit_softcapping=2.0)
    d.update(over)
    return ModelConfig(**d)


def tiny_forward_backward(model, vocab_size: int, batch: int, seq_length: int, state=None):
    """One seeded forward + backward of the per-token loss's mean (SP-replicated grads summed
    over TP when ``state`` is given); returns the detached per-token loss."""
    import torch

    from megalite.tensor_parallel import allreduce_sequence_parallel_grads

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (batch, seq_length), generator=g)
    labels = torch.randint(0, vocab_size, (batch, seq_length), generator=g)
    loss = model(ids, labels=labels)
    loss.mean().backward()
    if state is not None:
        allreduce_sequence_parallel_grads(model, state)
    return loss.detach()
