"""ModelConfig: network shape and architecture switches, each with its domain (fields.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

from megalite.config.domain_checks import (moe_layer_freq_problem, no_rope_freq_problem,
                                           rope_type_problem, rotary_percent_problem,
                                           window_size_problem, window_skip_freq_problem)
from megalite.config.domain_checks import linear_attention_freq_problem
from megalite.config.fields import opt
from megalite.config.score_mods import kernel_check
from megalite.config.activations import (ACTIVATIONS, activation_of, choice_problem,
                                         glu_knob_problem)
from megalite.config.attention_variants import sinks_kernel_problem
from megalite.config.moe_layer_freq import (MoeLayerFreqError, parse_moe_layer_freq,  # noqa: F401
                                           parse_no_rope_freq)
from megalite.config.moe_layer_freq import parse_layer_pattern
from megalite.config.window import parse_window_size, parse_window_skip_freq


@dataclass
class ModelConfig:
    """Network shape and architecture switches (Megatron's 'network size' group)."""
    num_layers: Optional[int] = opt(None, "Number of transformer layers.", gt=0, checkpoint="shape")
    hidden_size: Optional[int] = opt(None, "Transformer hidden size.", gt=0, checkpoint="shape")
    ffn_hidden_size: Optional[int] = opt(
        None, "MLP hidden size; default 4*hidden, or Llama's 8/3*hidden rounded with SwiGLU.",
        gt=0, checkpoint="shape")
    num_attention_heads: Optional[int] = opt(None, "Number of attention heads.", gt=0,
        checkpoint="shape")
    group_query_attention: bool = opt(False, "Use grouped-query attention.", action="store_true")
    num_query_groups: Optional[int] = opt(
        None, "Number of key/value head groups with --group-query-attention.",
        gt=0, le="num_attention_heads")
    kv_channels: Optional[int] = opt(
        None, "Per-head dimension of q, k and v; default hidden/heads, and any other value "
        "is allowed (Qwen3-0.6B: 128 with hidden 1024 and 16 heads).", gt=0, checkpoint="shape")
    seq_length: Optional[int] = opt(None, "Sequence length of each training sample.", gt=0,
        checkpoint="shape")
    max_position_embeddings: Optional[int] = opt(
        None, "Size of the learned position table; default --seq-length.", gt=0, checkpoint="shape")
    vocab_size: Optional[int] = opt(
        None, "Vocabulary size (NullTokenizer / mock data); otherwise taken from the tokenizer.",
        gt=0, checkpoint="shape")
    make_vocab_size_divisible_by: int = opt(
        128, "Pad the vocabulary to a multiple of this times the tensor-parallel size.", gt=0,
        checkpoint="runtime")
    normalization: str = opt("LayerNorm", "Normalization layer.", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = opt(1e-5, "Epsilon of the normalization layers.", gt=0, lt=1)
    position_embedding_type: str = opt(
        "learned_absolute", "Position embedding: learned table, rotary (rope), rotary with "
        "YaRN frequency scaling (yarn, the --rotary-scaling-factor/--yarn-* flags) or none.",
        choices=["learned_absolute", "rope", "yarn", "none"])
    rotary_base: int = opt(10000, "Base period of rotary position embeddings.", gt=0)
    rotary_percent: float = opt(1.0, "Fraction of each head's channels rotated: the leading "
        "int(kv_channels * p) (GLM-4.5's partial_rotary_factor).", gt=0, le=1,
        check=rotary_percent_problem)
    # RoPE frequency scaling (transformer/rotary.py): Llama 3.1's and YaRN.
    use_rope_scaling: bool = opt(
        False, "Llama 3.x RoPE scaling (--position-embedding-type rope): low frequencies "
        "divided by --rope-scaling-factor, high ones kept, a smooth ramp between.",
        action="store_true", requires="position_embedding_type=rope")
    rope_scaling_factor: float = opt(8.0, "Llama 3.x RoPE scaling factor.", gt=0)
    rope_scaling_low_freq_factor: float = opt(
        1.0, "Llama 3.x RoPE scaling: wavelengths above original context / this are scaled "
        "(Megatron hard-codes 1).", gt=0)
    rope_scaling_high_freq_factor: float = opt(
        4.0, "Llama 3.x RoPE scaling: wavelengths below original context / this are kept "
        "(Megatron hard-codes 4).", gt="rope_scaling_low_freq_factor")
    rope_scaling_original_max_position_embeddings: int = opt(
        8192, "Llama 3.x RoPE scaling: the context length of pretraining (Megatron hard-codes "
        "8192).", gt=0)
    rotary_scaling_factor: float = opt(
        1.0, "YaRN: context extension factor (--position-embedding-type yarn).", gt=0)
    yarn_original_max_position_embeddings: Optional[int] = opt(
        None, "YaRN: the context length of pretraining (default 4096).", gt=0)
    yarn_beta_fast: Optional[float] = opt(
        None, "YaRN: rotations below which dimensions are interpolated fully (default 32).",
        gt=0)
    yarn_beta_slow: Optional[float] = opt(
        None, "YaRN: rotations above which dimensions are kept (default 1).", gt=0)
    yarn_correction_range_round_to_int: bool = opt(
        True, "YaRN: do not round the correction range to whole dimensions (gpt-oss).",
        flag="--no-yarn-correction-range-round-to-int", action="store_false")
    mscale: float = opt(1.0, "YaRN: mscale of the attention (concentration) factor "
                        "0.1*mscale*ln(factor)+1 that scales cos and sin.",
                        free="a coefficient of ln(factor): any real number")
    mscale_all_dim: float = opt(
        0.0, "YaRN: the factor above is divided by 0.1*mscale_all_dim*ln(factor)+1 "
        "(DeepSeek-V3: mscale = mscale_all_dim = 1, i.e. no scaling of cos and sin).",
        free="a coefficient of ln(factor): any real number")
    apply_layernorm_1p: bool = opt(
        False, "Zero-centred norm weights: stored as w - 1 (initialised to 0), applied as "
        "1 + w (LayerNorm and RMSNorm).",
        action="store_true")
    activation: Optional[str] = opt(
        None, "MLP activation (config/activations.py); default gelu. Megatron's "
        "switches (--swiglu, ...) name the same choice.", choices=list(ACTIVATIONS),
        check=choice_problem)
    swiglu: bool = opt(False, "Use SwiGLU in the MLP (gated SiLU): --activation swiglu.",
                       action="store_true", check=choice_problem)
    squared_relu: bool = opt(False, "Use squared ReLU in the MLP, relu(x)^2 (Nemotron): "
                             "--activation squared-relu.", action="store_true",
                             check=choice_problem)
    untie_embeddings_and_output_weights: bool = opt(
        False, "Give the output layer its own weight instead of the input embedding.",
        action="store_true")
    add_bias_linear: bool = opt(True, "Disable biases in linear layers.",
                                flag="--disable-bias-linear", action="store_false")
    add_qkv_bias: bool = opt(
        False, "A bias on the query/key/value projection even with --disable-bias-linear "
        "(Qwen2).", action="store_true")
    qk_layernorm: bool = opt(
        False, "Normalize each head's queries and keys over the head dimension (the "
        "--normalization kind, one weight of --kv-channels shared by all heads) before RoPE "
        "(Qwen3); with --multi-latent-attention, the q and kv latents instead (Megatron's "
        "meaning; DeepSeek's models have them).", action="store_true")
    # MuonClip (Kimi K2): Megatron's TransformerConfig fields (optimizer/qk_clip.py)
    qk_clip: bool = opt(
        False, "After each update, scale the Q and K rows of every query group whose largest "
        "attention logit of the step exceeded --qk-clip-threshold back to it.",
        action="store_true", checkpoint="trained")
    qk_clip_threshold: float = opt(100.0, "QK-clip: the attention-logit cap (tau).", gt=0,
                                   checkpoint="trained")
    qk_clip_alpha: float = opt(0.5, "QK-clip: the share of the scale on Q (K gets the rest).",
                               gt=0, lt=1, checkpoint="trained")
    init_method_std: float = opt(0.02, "Std of the normal initialization.", gt=0,
        checkpoint="trained")
    hidden_dropout: float = opt(0.1, "Dropout after attention and MLP outputs.", ge=0, lt=1,
        checkpoint="trained")
    attention_dropout: float = opt(0.1, "Dropout on attention probabilities.", ge=0, lt=1,
        checkpoint="trained")
    attention_backend: str = opt(
        "auto", "Core-attention kernel. Local layers: 'flash' / 'fused' (PyTorch SDPA), "
        "'unfused' / 'local' (explicit matmuls and softmax), 'auto' (unfused on CPU for short "
        "sequences, where it is faster; SDPA otherwise). Transformer Engine: its flash, fused "
        "or unfused kernel (NVTE_* switches, as Megatron), 'auto' = TE's choice.",
        choices=["auto", "flash", "fused", "unfused", "local"], checkpoint="runtime")
    # Gemma 2's soft-caps: x -> cap * tanh(x / cap), smooth and bounded by +-cap.
    attn_logit_softcapping: Optional[float] = opt(
        None, "Soft-cap the attention scores before the softmax at this value (Gemma 2: 50); "
        "the unfused core attention only.", gt=0,
        check=kernel_check("attn_logit_softcapping"))
    final_logit_softcapping: Optional[float] = opt(
        None, "Soft-cap the output layer's logits at this value (Gemma 2: 30).", gt=0)
    # Sliding-window attention (Megatron's flags): query i sees keys i-left .. i
    window_size: Optional[tuple] = opt(
        None, "Sliding-window attention 'left,right' (Megatron's form): query i attends keys "
        "i-left .. i (right must be 0: causal; Hugging Face's sliding_window W is W-1,0).",
        type=parse_window_size, check=window_size_problem)
    window_attn_skip_freq: Union[int, list, None] = opt(
        None, "Which layers use --window-size: an int N, every N-th layer (1-based) full "
        "attention and the others windowed (gpt-oss 2, Gemma 3 6), or a pattern with one 0/1 "
        "per layer, 1 = windowed ('[1,1,1,0]*3'); default every layer.",
        type=parse_window_skip_freq, check=window_skip_freq_problem)
    # Multi-Latent Attention (DeepSeek-V2/V3; transformer/mla.py), Megatron's MLA flags.
    multi_latent_attention: bool = opt(
        False, "Multi-Latent Attention: q and k/v through low-rank projections, a decoupled "
        "RoPE part shared by all heads (--qk-layernorm: norms on the latents).",
        action="store_true")
    q_lora_rank: Optional[int] = opt(
        None, "MLA: rank of the query's low-rank projection (none: one full-rank q "
        "projection).", gt=0, requires="multi_latent_attention")
    kv_lora_rank: int = opt(32, "MLA: rank of the compressed key/value latent.", gt=0)
    qk_head_dim: int = opt(128, "MLA: per-head q/k dimension without position encoding "
                           "(q/k heads are qk-head-dim + qk-pos-emb-head-dim wide).", gt=0)
    qk_pos_emb_head_dim: int = opt(
        64, "MLA: per-head q/k dimension that carries RoPE (even; the key's part is one head "
        "shared by all heads).", gt=0)
    v_head_dim: int = opt(128, "MLA: per-head value dimension.", gt=0)
    rope_type: Optional[str] = opt(
        None, "MLA's RoPE: rope or yarn (default yarn, as Megatron's MLA; YaRN with "
        "--rotary-scaling-factor 1 is plain RoPE); without MLA only rope, what common "
        "attention does anyway (Megatron's gpt-oss example passes it).", choices=["rope", "yarn"],
        check=rope_type_problem)
    # Multi-Token Prediction (DeepSeek-V3; transformer/mtp.py).
    mtp_num_layers: Optional[int] = opt(
        None, "Multi-Token Prediction: this many sequential MTP modules after the model, the "
        "k-th predicting the token k+1 positions ahead (on the last pipeline stage).", gt=0)
    mtp_loss_scaling_factor: float = opt(
        0.1, "Weight of the MTP loss: the mean of the depths' losses times this joins the "
        "objective.", ge=0, checkpoint="trained")
    # Mixture of experts.
    num_experts: Optional[int] = opt(None, "Number of routed experts (MoE); none = dense.", gt=0)
    moe_router_topk: int = opt(2, "Experts each token is routed to.", gt=0, le="num_experts")
    moe_ffn_hidden_size: Optional[int] = opt(None, "Hidden size of each expert MLP.", gt=0)
    moe_aux_loss_coeff: float = opt(0.0, "Load-balancing loss coefficient.", ge=0,
        checkpoint="trained")
    moe_layer_freq: Union[int, list] = opt(
        1, "MoE layers: every n-th layer from layer 0, or a 0/1 pattern with one entry per "
        "layer, e.g. '[1,0]*2' (Megatron's form).", type=parse_moe_layer_freq,
        check=moe_layer_freq_problem)
    moe_router_score_function: str = opt("softmax", "Router score: softmax or sigmoid.",
                                         choices=["softmax", "sigmoid"])
    moe_router_pre_softmax: bool = opt(
        False, "Softmax over all experts before top-k, the k weights left unnormalized "
        "(Qwen2-MoE's norm_topk_prob false); default: softmax over the top-k logits, i.e. "
        "renormalized over the top-k (Mixtral, Qwen3-MoE). No effect with sigmoid scores.",
        action="store_true")
    moe_router_load_balancing_type: str = opt(
        "aux_loss", "Load balancing: aux_loss (per micro-batch), seq_aux_loss (per sequence) or "
        "none.", choices=["aux_loss", "seq_aux_loss", "none"], checkpoint="trained")
    moe_z_loss_coeff: Optional[float] = opt(None, "Router z-loss coefficient (none = off).", ge=0,
        checkpoint="trained")
    moe_router_enable_expert_bias: bool = opt(
        False, "DeepSeek-V3 aux-loss-free balancing: a per-expert bias added to the scores "
        "for top-k selection only, nudged after each step.", action="store_true")
    moe_router_bias_update_rate: float = opt(1e-3, "Step of the expert-bias update.", ge=0,
        checkpoint="trained")
    moe_router_topk_scaling_factor: Optional[float] = opt(
        None, "Multiply each token's top-k routing weights by this factor after the score "
        "function and normalization (DeepSeek-V3's routed_scaling_factor 2.5; none = 1).",
        gt=0, requires="num_experts")
    moe_router_num_groups: Optional[int] = opt(
        None, "Group-limited routing (DeepSeek-V3): experts form this many equal groups "
        "(e.g. one per EP rank or node); each token picks --moe-router-group-topk groups first.",
        gt=0, le="num_experts", requires="moe_router_group_topk")
    moe_router_group_topk: Optional[int] = opt(
        None, "Groups each token may use with --moe-router-num-groups (ranked by the sum of "
        "their top topk/group-topk scores).",
        gt=0, le="moe_router_num_groups", requires="moe_router_num_groups")
    moe_expert_capacity_factor: Optional[float] = opt(
        None, "Expert capacity = factor x tokens x topk / experts; extra tokens are dropped "
        "(none = no dropping).", gt=0, checkpoint="trained")
    moe_token_drop_policy: str = opt("probs", "Which tokens an over-full expert drops: lowest "
                                     "probability (probs) or latest (position).",
                                     choices=["probs", "position"], checkpoint="trained")
    moe_shared_expert_intermediate_size: Optional[int] = opt(
        None, "Hidden size of the shared expert (a dense MLP every token goes through).", gt=0)
    moe_shared_expert_gate: bool = opt(
        False, "Scale the shared expert's output per token by sigmoid(x . w), w a learned "
        "[1, hidden] gate (Qwen2-MoE's shared_expert_gate); needs "
        "--moe-shared-expert-intermediate-size.", action="store_true",
        requires="moe_shared_expert_intermediate_size")
    moe_token_dispatcher_type: str = opt("alltoall", "Token dispatch over the EP group.",
                                         choices=["alltoall", "allgather"], checkpoint="runtime")
    transformer_impl: str = opt(
        "auto", "Hot-layer implementation: 'local' (pure PyTorch), 'transformer_engine', or "
        "'auto' (TE when CUDA and TE are present).", choices=["auto", "local", "transformer_engine"],
        checkpoint="runtime")
    fp8_format: Optional[str] = opt(
        None, "FP8 GEMMs through Transformer Engine: e4m3 (forward and backward) or hybrid "
        "(e4m3 forward, e5m2 gradients); needs TE on a CUDA GPU with FP8.",
        choices=["e4m3", "hybrid"], checkpoint="runtime")
    fp8_amax_history_len: int = opt(1, "FP8 delayed scaling: amax history length.", gt=0,
        checkpoint="runtime")
    fp8_amax_compute_algo: str = opt("most_recent", "FP8 delayed scaling: scale from the "
                                     "most recent amax or the max of the history.",
                                     choices=["most_recent", "max"], checkpoint="runtime")
    # Fused output layer + cross entropy (tensor_parallel/fused_cross_entropy.py).
    cross_entropy_loss_fusion: bool = opt(
        False, "Compute the output layer and the vocab-parallel loss chunk by chunk over "
        "tokens, never holding the whole fp32 logits.", action="store_true", checkpoint="runtime")
    cross_entropy_chunk_tokens: int = opt(
        0, "Tokens per chunk of --cross-entropy-loss-fusion (0: about 32 MiB of fp32 logits).",
        ge=0, checkpoint="runtime")
    # Multi-Latent Attention's q/kv latent norms (transformer/norms.py build_latent_norm).
    mla_latent_norm_epsilon: Optional[float] = opt(
        None, "Epsilon of the q and kv latent norms of --multi-latent-attention; default "
        "--norm-epsilon (transformers' DeepSeek-V3 keeps 1e-6 there whatever rms_norm_eps "
        "says).", gt=0, lt=1, requires="multi_latent_attention")
    # NoPE layers (SmolLM3, Llama 4): rotary skipped in some layers (transformer/layer.py).
    no_rope_freq: Optional[Union[int, list]] = opt(
        None, "Layers without rotary embedding (Megatron's flag): an int N (layers N-1, "
        "2N-1, ... skip RoPE; SmolLM3's no_rope_layer_interval) or a 0/1 pattern with one "
        "entry per layer, 1 = no RoPE, e.g. '([0]*3+[1])*2'; default: RoPE in every layer.",
        type=parse_no_rope_freq, check=no_rope_freq_problem)
    # OLMo 2's norms (transformer/layer.py, transformer/projection_norm.py).
    norm_placement: str = opt(
        "pre", "Where each layer's two norms sit: before attention and MLP (pre: x + "
        "attn(norm(x))), or on their outputs before the residual add (post: x + "
        "norm(attn(x)), OLMo 2); sandwich: both, four norms per layer (x + "
        "norm(attn(norm(x))), Gemma 2/3).", choices=["pre", "post", "sandwich"])
    qk_layernorm_scope: str = opt(
        "head", "What --qk-layernorm normalizes: each head's q and k over the head dim "
        "(head, Qwen3) or each token's whole q and whole k projection, one weight per "
        "channel (projection, OLMo 2; its mean square spans the TP shards).",
        choices=["head", "projection"], requires="qk_layernorm")
    # Gemma 2/3's scalings (models/gpt.py, transformer/attention.py, transformer/rotary.py)
    scale_embeddings: bool = opt(
        False, "Multiply the word embeddings by sqrt(--hidden-size), rounded to the model "
        "dtype (Gemma).", action="store_true")
    softmax_scale: Optional[float] = opt(
        None, "Scale of the attention scores q.k (Megatron's TransformerConfig.softmax_scale); "
        "default 1/sqrt(--kv-channels). Gemma: query_pre_attn_scalar ** -0.5.", gt=0)
    rotary_base_local: Optional[int] = opt(
        None, "Rotary base of the sliding-window layers (--window-size), unscaled (Gemma 3's "
        "rope_local_base_freq); default: the full layers' --rotary-base and scaling.", gt=0,
        requires="window_size")
    rotary_seq_len_interpolation_factor: Optional[float] = opt(
        None, "Linear RoPE scaling (Megatron's flag): the rotary frequencies divided by this "
        "factor (Hugging Face's rope_type linear; Gemma 3's full-attention layers).", gt=0,
        requires="position_embedding_type=rope")
    # gpt-oss: attention sinks, the clamped quick-GeGLU, MoE biases (Megatron's fields)
    softmax_type: str = opt(
        "vanilla", "Attention softmax: vanilla, off-by-one (1 added to the denominator) or "
        "learnable (a learned per-head logit in the denominator: gpt-oss's sinks, "
        "transformer/softmax_denominator.py).", choices=["vanilla", "off-by-one", "learnable"],
        check=sinks_kernel_problem)
    quick_geglu: bool = opt(
        False, "Use quick-GeGLU in the MLP, x*sigmoid(1.702x) gating (gpt-oss): "
        "--activation quick-geglu.", action="store_true", check=choice_problem)
    glu_linear_offset: float = opt(
        0.0, "Gated MLPs: act(gate) * (up + offset) (gpt-oss: 1).", check=glu_knob_problem,
        free="any real offset")
    activation_func_clamp_value: Optional[float] = opt(
        None, "Gated MLPs: clamp gate to <= v and up to [-v, v] before the activation "
        "(gpt-oss: 7).", gt=0, check=glu_knob_problem)
    moe_expert_bias: bool = opt(
        False, "Biases on the router and on each expert's fc1 / fc2 (gpt-oss); Megatron gives "
        "MoE layers these whenever linear biases are on, megalite only with this switch (its "
        "MoE checkpoints have none).", action="store_true", requires="num_experts")
    moe_router_dtype: Optional[str] = opt(
        None, "The router's logits matmul in fp32 or fp64 (default: the layer's dtype, the "
        "logits then in fp32).", choices=["fp32", "fp64"], requires="num_experts",
        checkpoint="runtime")
    # Qwen3-Next hybrids: Gated DeltaNet linear attention beside gated full attention
    # (transformer/gated_delta_net.py; Megatron-Core's experimental_attention_variant flags).
    experimental_attention_variant: Optional[str] = opt(
        None, "Linear-attention layers of a hybrid model: gated_delta_net (Qwen3-Next's Gated "
        "DeltaNet) in the layers --linear-attention-freq marks.",
        choices=["gated_delta_net"])
    linear_attention_freq: Union[int, list, None] = opt(
        None, "Which layers are linear attention (Megatron's form): an int N (N-1 linear "
        "layers, then one full-attention layer; Qwen3-Next 4) or a 0/1 pattern with one "
        "entry per layer, 1 = linear attention; default every layer.",
        type=lambda v: parse_layer_pattern(v, "--linear-attention-freq"),
        check=linear_attention_freq_problem, requires="experimental_attention_variant")
    linear_conv_kernel_dim: int = opt(4, "Gated DeltaNet: width of the causal depthwise "
                                      "convolution over q, k and v.", gt=0)
    linear_key_head_dim: int = opt(128, "Gated DeltaNet: per-head q/k dimension.", gt=0)
    linear_value_head_dim: int = opt(128, "Gated DeltaNet: per-head value dimension.", gt=0)
    linear_num_key_heads: int = opt(16, "Gated DeltaNet: q/k heads (split over TP).", gt=0)
    linear_num_value_heads: int = opt(
        32, "Gated DeltaNet: value heads, a multiple of --linear-num-key-heads (each q/k head "
        "serves that many value heads).", gt=0)
    attention_output_gate: bool = opt(
        False, "Full-attention layers gate their output per channel by sigmoid of a second "
        "query-sized projection (Qwen3-Next's gated attention).", action="store_true")
    # Llama 4's attention (transformer/attention.py, transformer/attention_masks.py): chunked
    # local attention on the layers that rotate, global NoPE layers with a query temperature,
    # L2-normalized q and k on the rotating layers.
    attention_chunk_size: Optional[int] = opt(
        None, "Chunked local attention (Llama 4's attention_chunk_size): on the layers that "
        "rotate (all but --no-rope-freq's NoPE layers) query i attends only the keys of its "
        "own chunk of this many sequence positions, floor(i/C)*C .. i.", gt=0)
    attn_temperature_tuning: bool = opt(
        False, "Llama 4's NoPE temperature: on --no-rope-freq's NoPE layers the query at "
        "position p is scaled by 1 + --attn-temperature-scale * log(1 + floor((p + 1) / "
        "--attn-temperature-floor-scale)).", action="store_true", requires="no_rope_freq")
    attn_temperature_floor_scale: int = opt(
        8192, "Positions per step of --attn-temperature-tuning's log (Llama 4's floor_scale).",
        gt=0, requires="attn_temperature_tuning")
    attn_temperature_scale: float = opt(
        0.1, "Slope of --attn-temperature-tuning's log (Llama 4's attn_scale).", gt=0,
        requires="attn_temperature_tuning")
    qk_l2_norm: bool = opt(
        False, "Normalize each head's q and k to unit RMS, no weight (Megatron-Core's "
        "qk_l2_norm, Llama 4's use_qk_norm), on the layers that rotate (Llama 4 leaves its "
        "NoPE layers unnormalized).", action="store_true")
    # Llama 4's MoE block (moe/moe_layer.py): the router's score scales the expert's input
    moe_apply_probs_on_input: bool = opt(
        False, "Multiply each token by its router score before the expert instead of the "
        "expert's output after it (Megatron-Core's moe_apply_probs_on_input, Llama 4's MoE; "
        "--moe-router-topk 1 only).", action="store_true", requires="num_experts")

    # ---- derived values -------------------------------------------------------------
    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` (0-based) holds experts: the one rule the model
        spec, the planner and the FLOP count all use."""
        if not self.num_experts:
            return False
        if layer >= self.num_layers and self.mtp_num_layers:
            # an MTP module's layer: built like the model's last layer (Megatron's MTP spec)
            return self.is_moe_layer(self.num_layers - 1)
        freq = parse_moe_layer_freq(self.moe_layer_freq)
        if isinstance(freq, int):
            return layer % freq == 0
        if len(freq) != self.num_layers:
            raise ValueError(f"--moe-layer-freq pattern has {len(freq)} entries for "
                             f"{self.num_layers} layers")
        return bool(freq[layer])

    def layer_window(self, layer: int) -> Optional[int]:
        """The sliding window (keys i-w .. i) of global layer ``layer`` (0-based), None for
        full attention: Megatron's ``is_layer_window_attention`` (1-based layer numbers).
        The one rule every core attention, the FLOP count and the HF adapters read."""
        if not self.window_size or self.window_size[0] < 0:
            return None
        if layer >= self.num_layers:      # an MTP module's layer: like the model's last
            return self.layer_window(self.num_layers - 1)
        freq = parse_window_skip_freq(self.window_attn_skip_freq)
        if freq is None:
            windowed = True
        elif isinstance(freq, int):
            windowed = (layer + 1) % freq != 0
        else:
            windowed = bool(freq[layer])
        return int(self.window_size[0]) if windowed else None

    def num_transformer_layers(self) -> int:
        """Decoder layers plus the MTP modules' layers (global numbers L .. L+D-1)."""
        return self.num_layers + (self.mtp_num_layers or 0)

    def resolved_moe_ffn_hidden_size(self) -> int:
        """Hidden size of one routed expert (``--moe-ffn-hidden-size``, else the MLP's)."""
        return self.moe_ffn_hidden_size or self.resolved_ffn_hidden_size()

    def resolved_ffn_hidden_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return activation_of(self).default_ffn(self.hidden_size)   # SwiGLU: Llama's 8h/3

    def layer_uses_rotary(self, layer: int) -> bool:
        """Whether global layer ``layer`` (0-based) rotates q and k: RoPE on, and the layer
        not a NoPE one of ``--no-rope-freq`` (the one rule the layers and the planner read)."""
        if not self.uses_rotary():
            return False
        if self.no_rope_freq is None or layer >= self.num_layers:
            return True
        freq = parse_no_rope_freq(self.no_rope_freq)
        if isinstance(freq, int):
            return (layer + 1) % freq != 0
        return not freq[layer]

    def layer_chunk(self, layer: int) -> Optional[int]:
        """The attention chunk of global layer ``layer`` (0-based): --attention-chunk-size on
        the layers that rotate, None (global attention) on the NoPE ones -- Llama 4's
        layout, the one rule the layers, the planner and the HF adapter read."""
        if self.attention_chunk_size is None or not self.layer_uses_rotary(layer):
            return None
        return int(self.attention_chunk_size)

    def layer_query_temperature(self, layer: int) -> Optional[tuple]:
        """(floor scale, scale) of --attn-temperature-tuning on NoPE layer ``layer``, None on
        the layers that rotate or without the flag."""
        if not self.attn_temperature_tuning or self.layer_uses_rotary(layer):
            return None
        return int(self.attn_temperature_floor_scale), float(self.attn_temperature_scale)

    def uses_rotary(self) -> bool:
        """Whether attention rotates q and k (plain RoPE or YaRN-scaled)."""
        return self.position_embedding_type in ("rope", "yarn")

    def mla_rope_kind(self) -> str:
        """Multi-Latent Attention's rope part: ``--rope-type``, default yarn (Megatron's)."""
        return self.rope_type or "yarn"

    def uses_yarn(self) -> bool:
        """Whether some rotation is YaRN-scaled (the --rotary-scaling-factor/--yarn-* flags
        mean something): --position-embedding-type yarn, or MLA's rope part."""
        if self.multi_latent_attention:
            return self.mla_rope_kind() == "yarn"
        return self.position_embedding_type == "yarn"

    def resolved_kv_channels(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def resolved_query_groups(self) -> int:
        if self.group_query_attention and self.num_query_groups:
            return self.num_query_groups
        return self.num_attention_heads

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        """Megatron's rule: round the vocabulary up to a multiple of divisor * TP."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    # Gemma 3: the windowed layers' own rotary base
    def layer_uses_local_rotary(self, layer: int) -> bool:
        """Whether global layer ``layer`` rotates with ``--rotary-base-local`` (a windowed
        layer of a model that gives one) rather than the full layers' tables."""
        return self.rotary_base_local is not None and self.layer_window(layer) is not None

    # Qwen3-Next hybrids: which layers are Gated DeltaNet
    def is_linear_attention_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` (0-based) is a linear-attention (Gated DeltaNet)
        layer: Megatron's ``linear_attention_freq`` rule (an int N: layers N-1, 2N-1, ...
        are full attention); the one rule the layers, the planner and the adapters read."""
        if not self.experimental_attention_variant:
            return False
        if layer >= self.num_layers:      # an MTP module's layer: like the model's last
            return self.is_linear_attention_layer(self.num_layers - 1)
        if self.linear_attention_freq is None:
            return True
        freq = parse_layer_pattern(self.linear_attention_freq, "--linear-attention-freq")
        if isinstance(freq, int):
            return (layer + 1) % freq != 0
        return bool(freq[layer])
