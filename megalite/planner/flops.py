"""Floating-point operations per iteration (GQA-, SwiGLU- and MoE-aware).

Forward FLOPs per token and layer, counting a multiply-add as 2:
  QKV 2h(a+2g)d, scores QK^T 2s*a*d, scores x V 2s*a*d, projection 2*a*d*h,
  MLP 2*h*f*(3 if SwiGLU else 2)  (MoE: router 2hE + top-k experts + shared expert
  + its gate 2h),
plus the logits 2hV once per token.  Biases (--add-qkv-bias) and norms (--qk-layernorm
too) are elementwise and not counted, as in Megatron; d is --kv-channels, which need not
be h/a.  Multi-Latent Attention replaces QKV and the projection by its down/up projections
(``mla_projection_flops``) and its scores use q/k heads of qk + rope and values of
v_head_dim; each MTP depth adds eh_proj 4h^2, one more layer and the logits again
(``mtp_forward_flops``, as Megatron's ``num_floating_point_operations``).  Backward is
twice the forward, so training is 3x --
the same total as Megatron-LM's ``num_floating_point_operations`` (docs/planner.md).
Recomputation re-runs forwards: full adds one layer forward (4x instead of 3x, Narayanan
et al. 2021's 96*B*s*l*h^2 formula), selective adds the attention core only.

Gated DeltaNet layers (``--experimental-attention-variant``) replace the attention of the
layers ``--linear-attention-freq`` marks by their projections and a core linear in the
sequence (``gated_delta_net_forward_flops``); a kind's count is the mean over its layers.

Masks that remove work scale the attention core by the causal (query, key) pairs they keep
(``attention_work_fraction``), as each variant's ``layer_keep`` says
(config/attention_variants.py): a sliding window (``--window-size``, per layer) and Llama 4's
chunks (``--attention-chunk-size``, on the rotating layers: seq / C documents of C tokens) in
every count; packed documents (``--reset-attention-mask``) depend on the data, so only a caller
that knows the documents per sequence passes them (benchmarks/attention_masks.py).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

from megalite.config import ModelConfig
from megalite.config.attention_variants import keeps_less, layer_keep
from megalite.planner import model_spec as ms
from megalite.config.activations import activation_of


def mla_projection_flops(m: ModelConfig, split: Optional[str] = None) -> float:
    """Per-token forward FLOPs of MLA's projections (``model_spec.mla_projections``): q (down
    + up, or one), kv down (latent + shared rope key), kv up (k nope + v per head), output;
    ``split="column"``: the up projections alone (what ``mla_up_proj`` recomputes)."""
    return float(sum(2 * i * o for _, i, o, how in ms.mla_projections(m)
                     if split is None or how == split))


def causal_pairs_kept(seq: int, window: Optional[int] = None, documents: int = 1) -> float:
    """(query, key) pairs a causal mask keeps over ``seq`` tokens cut into ``documents``
    equal documents, each query seeing at most ``window`` keys back (None: all)."""
    n = seq / documents
    if window is None or window >= n - 1:
        return documents * n * (n + 1) / 2
    return documents * ((window + 1) * n - window * (window + 1) / 2)


def attention_work_fraction(seq: int, window: Optional[int] = None,
                            documents: int = 1) -> float:
    """The share of the causal attention core a window and / or a document mask keep."""
    return causal_pairs_kept(seq, window, documents) / causal_pairs_kept(seq)


def kind_forward_flops(m: ModelConfig, moe: bool, seq: int) -> Dict[str, float]:
    """Per-token forward FLOPs of one dense or MoE layer, split into GEMMs and the
    attention core (MLA: scores over q/k heads of qk + rope, values of v_head_dim); the
    core scaled by the mean share of it the sliding windows of that kind's layers keep."""
    h, a, g, d = m.hidden_size, m.num_attention_heads, m.resolved_query_groups(), \
        m.resolved_kv_channels()
    gate = activation_of(m).matmuls
    if m.multi_latent_attention:
        linear = mla_projection_flops(m)
    else:
        linear = 2 * h * (a + 2 * g) * d + 2 * a * d * h
    if moe:
        linear += 2 * h * m.num_experts + m.moe_router_topk * 2 * h * ms.moe_ffn(m) * gate
        linear += 2 * h * (m.moe_shared_expert_intermediate_size or 0) * gate
        if m.moe_shared_expert_intermediate_size and m.moe_shared_expert_gate:
            linear += 2 * h                                     # the shared expert's gate
    else:
        linear += 2 * h * m.resolved_ffn_hidden_size() * gate
    _, _, dqk, dv = ms.attention_head_dims(m)
    core = 2 * seq * a * (dqk + dv)                # q k^T and p v
    per_layer = keeps_less(m)                      # config/attention_variants.py
    same = [0]                                     # this kind's layers, when they differ
    if per_layer or m.experimental_attention_variant:
        same = [i for i in range(m.num_layers) if ms.is_moe_layer(m, i) == moe] or [0]
    if per_layer:
        core *= sum(attention_work_fraction(seq, **layer_keep(m, i, seq))
                    for i in same) / len(same)
    if m.attention_output_gate:
        linear += 2 * h * a * d                    # the gate rows of linear_qkv
    if m.experimental_attention_variant:           # Gated DeltaNet layers of this kind
        share = sum(m.is_linear_attention_layer(i) for i in same) / len(same)
        mixer = 2 * h * a * d * (2 if m.attention_output_gate else 1) + 4 * g * d * h
        gdn = gated_delta_net_forward_flops(m)
        linear += share * (gdn["linear"] - mixer)
        core = (1 - share) * core + share * gdn["core"]
    return {"linear": float(linear), "core": float(core)}


def gated_delta_net_forward_flops(m: ModelConfig, chunk: int = 64) -> Dict[str, float]:
    """Per-token forward FLOPs of one Gated DeltaNet token mixer (transformer/
    gated_delta_net.py): ``linear`` its projections (in_proj_qkvz, in_proj_ba, out_proj),
    ``core`` the convolution and the chunked delta rule, per value head: the in-chunk
    products k_beta k^T and q k^T (2C dk each), the two triangular solves (C dv, C dk),
    the in-chunk output (2C dv) and the state read twice and written once (6 dk dv).  Linear
    in the sequence: a DeltaNet layer's core does not grow with --seq-length."""
    h, hk, hv = m.hidden_size, m.linear_num_key_heads, m.linear_num_value_heads
    dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
    channels = 2 * hk * dk + hv * dv
    linear = 2 * h * (channels + hv * dv) + 2 * h * 2 * hv + 2 * hv * dv * h
    core = 2 * m.linear_conv_kernel_dim * channels + hv * (
        4 * chunk * dk + chunk * (dk + dv) + 2 * chunk * dv + 6 * dk * dv)
    return {"linear": float(linear), "core": float(core)}


def mtp_forward_flops(m: ModelConfig, seq: int, padded_vocab: Optional[int] = None
                      ) -> Dict[str, float]:
    """Per-token forward FLOPs of the MTP modules: per depth eh_proj (2h -> h), a layer like
    the model's last, and the shared output layer once more.  Besides the totals: ``layer``
    (the transformer layers: what full recomputation re-runs), ``proj`` (eh_proj) and
    ``logits`` (the extra output-layer passes)."""
    if not m.mtp_num_layers:
        return {"linear": 0.0, "core": 0.0, "layer": 0.0, "proj": 0.0, "logits": 0.0}
    f = kind_forward_flops(m, ms.is_moe_layer(m, m.num_layers), seq)
    D = m.mtp_num_layers
    proj = D * 4.0 * m.hidden_size * m.hidden_size
    logits = D * logits_forward_flops(m, padded_vocab)
    return {"linear": D * f["linear"] + proj + logits, "core": D * f["core"],
            "layer": D * (f["linear"] + f["core"]), "proj": proj, "logits": logits}


def logits_forward_flops(m: ModelConfig, padded_vocab: Optional[int] = None) -> float:
    """Output layer per token; the planner counts the vocabulary padded for TP = 1, a run
    passes the padded size it really multiplies by."""
    return 2.0 * m.hidden_size * (m.padded_vocab_size(1) if padded_vocab is None
                                  else padded_vocab)


def layers_forward_flops(m: ModelConfig, seq: int) -> Tuple[float, float]:
    """(GEMM, attention-core) forward FLOPs per token summed over the decoder's layers."""
    n_moe = sum(ms.is_moe_layer(m, i) for i in range(m.num_layers)) if m.num_experts else 0
    lin = core = 0.0
    for n, moe in ((m.num_layers - n_moe, False), (n_moe, True)):
        if not n:
            continue
        f = kind_forward_flops(m, moe, seq)
        lin, core = lin + n * f["linear"], core + n * f["core"]
    return lin, core


def core_forward_flops(m: ModelConfig, seq: int) -> float:
    """Attention-core forward FLOPs per token over the decoder's layers and the MTP layers
    (what a causal count halves: Megatron and Bridge halve every layer's, MTP's too)."""
    return layers_forward_flops(m, seq)[1] + mtp_forward_flops(m, seq)["core"]


def forward_flops_per_token(m: ModelConfig, seq: int, padded_vocab: Optional[int] = None
                            ) -> float:
    """All layers plus the output layer (and the MTP modules), per token (training = 3x
    this)."""
    lin, core = layers_forward_flops(m, seq)
    mtp = mtp_forward_flops(m, seq, padded_vocab)
    return lin + core + logits_forward_flops(m, padded_vocab) + mtp["linear"] + mtp["core"]


def iteration_flops(m: ModelConfig, seq: int, global_batch: int, recompute: str = "none"
                    ) -> Dict[str, float]:
    """``model`` FLOPs (what MFU counts) and ``hardware`` FLOPs (plus recomputation)."""
    tokens = float(seq) * global_batch
    lin, core = layers_forward_flops(m, seq)
    mtp = mtp_forward_flops(m, seq)
    model = 3 * tokens * (lin + core + logits_forward_flops(m) + mtp["linear"] + mtp["core"])
    extra = {"none": 0.0, "selective": tokens * (core + mtp["core"]),
             "full": tokens * (lin + core + mtp["layer"])}[recompute]
    return {"model": model, "hardware": model + extra}


def stage_flops_per_microbatch(m: ModelConfig, kinds, seq: int, micro_batch: int,
                               last: bool, recompute: str) -> Dict[str, float]:
    """FLOPs of one micro-batch through a stage (all its ranks together).

    ``fwd``; ``bwd`` = input grads + weight grads (2x forward) + ``recompute``; ``core`` is
    the attention-core part of the forward (what CP's ring overlaps with).
    """
    tokens = float(seq) * micro_batch
    fwd = core = rec = 0.0
    for n, moe in zip(kinds, (False, True)):       # kinds = (dense layers, MoE layers)
        if not n:
            continue
        f = kind_forward_flops(m, moe, seq)
        one = n * tokens * (f["linear"] + f["core"])
        fwd += one
        core += n * tokens * f["core"]
        rec += {"none": 0.0, "selective": n * tokens * f["core"], "full": one}[recompute]
    if last:
        lo = tokens * logits_forward_flops(m)
        fwd += lo
        mtp = mtp_forward_flops(m, seq)              # the MTP modules live on the last stage
        fwd += tokens * (mtp["linear"] + mtp["core"])
        core += tokens * mtp["core"]
        rec += {"none": 0.0, "selective": tokens * mtp["core"],
                "full": tokens * mtp["layer"]}[recompute]
    return {"fwd": fwd, "bwd": 2 * fwd + rec, "recompute": rec, "core": core}
