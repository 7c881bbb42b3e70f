"""What Gated DeltaNet layers cost the planner: activation bytes and the recurrent state.

Why a file of its own: a hybrid model (``--experimental-attention-variant gated_delta_net``)
runs a DeltaNet token mixer instead of attention in the layers ``--linear-attention-freq``
marks, and memory.py's per-kind formulas count attention there.  memory.py's
``layer_activation_bytes(..., linear=True)`` puts ``gated_delta_net_mixer_bytes`` in
attention's place, and ``activation_bytes`` adds the difference for each such layer of a
stage (``linear_layer_counts``).  Parameters live in model_spec.py (``gated_delta_net_*``).

What megalite's chunked delta rule (transformer/delta_rule.py) keeps for backward, per
micro-batch on one rank, measured buffer by buffer with ``activation_memory.measure_saved``
(tests/unit/test_linear_attention_cost.py):

* the projections' input, the convolution's input (with its K - 1 leading tokens) and
  output, the activated q/k/v (one contiguous copy; under bf16 the fp32 q and k too);
* the gates: sigmoid(b) and softplus's fp32 input and output;
* inside the rule, in fp32 over the sequence padded to whole chunks of C: q, k, v,
  beta, k*beta, the UT-transform outputs u and w, q and k decayed to the chunk's ends, the
  exp of the cumulative decays; six [C, C] matrices per chunk and head (the pairwise
  decays, k_beta k^T, q k^T and the two unit-triangular systems -- this is the term that
  grows with C); per chunk the state entering it (heads x dk x dv, fp32) and the corrected
  values v_new -- the "per-chunk states" a fused kernel would recompute;
* the gated norm's fp32 input and statistics, its output, the fp32 gate and silu(gate),
  and the output projection's input.

The recurrent state itself (``recurrent_state_bytes``) is what generation keeps per
sequence instead of a KV cache, and what CP hands from rank to rank: it is not an
activation of training beyond the per-chunk copies above.  CP's state walk
(``cp_state_sends``) replaces ring attention's K/V transfers in those layers in
comm_model.py; its bytes equal comm.counter's (tests/distributed/test_hf_families_dist.py
at CP2, test_gated_delta_net_cp_dist.py at CP4, CP2 x TP2, CP2 x PP2 with recomputation).
The FLOPs are flops.py's ``gated_delta_net_forward_flops``.
"""
from __future__ import annotations

from typing import Dict

from megalite.config import ModelConfig
from megalite.planner import model_spec as ms

CHUNK = 64        # transformer/gated_delta_net.py's CHUNK_SIZE (no torch import here)


def _dims(m: ModelConfig, tp: int):
    """(local value heads, local q/k heads, dk, dv, local conv channels)."""
    hv, hk = m.linear_num_value_heads // tp, m.linear_num_key_heads // tp
    dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
    return hv, hk, dk, dv, 2 * hk * dk + hv * dv


def gated_delta_net_mixer_bytes(m: ModelConfig, tokens: int, micro_batch: int, tp: int,
                                sp: bool, e: int, chunk: int = CHUNK) -> int:
    """Bytes one Gated DeltaNet token mixer keeps for backward: ``tokens`` the sequence
    on this rank (CP: its share), ``e`` the activation element size (2 bf16, 4 fp32)."""
    H, G, dk, dv, ch = _dims(m, tp)
    b, s, K = micro_batch, tokens, m.linear_conv_kernel_dim
    T = s * b
    n = -(-s // chunk)
    N = n * chunk * b                       # padded tokens of the rule
    Tn = T // (tp if sp else 1)
    half = e != 4
    out = e * Tn * m.hidden_size                          # both projections' input
    out += e * b * ch * (s + K - 1) + e * T * ch          # conv input (with the tail), output
    # the activated q/k/v, one contiguous copy; a 16-bit run keeps fp32 q, k instead
    out += 4 * T * 2 * G * dk if half else e * T * ch
    out += 4 * T * 2 * G                                  # l2norm's rsqrt per q/k head
    out += e * T * H + 2 * 4 * T * H                      # sigmoid(b); softplus in, out
    if half or N != T:
        out += 4 * N * H                                  # beta in fp32 / padded
    # the rule, fp32 over whole chunks: q, k, k_beta, w, q and k decayed, and the bmm
    # copies of k_beta, q and k^T twice (dk); v, u, v_new (dv); three exp(cumulative
    # decay) per token; six C x C matrices per chunk and head
    out += 4 * N * H * (8 * dk + 3 * dv + 3 + 6 * chunk)
    out += 4 * n * b * H * dk * dv                        # the state entering each chunk
    out += 2 * (n - 1) * 4 * b * H * chunk * dk           # per-chunk copies for the scan
    out += chunk * chunk + 2 * 4 * chunk * chunk          # the causal mask (bool); two
    # fp32 [C, C] buffers the triangular solves keep (measured, whatever the sequence)
    # gated norm: rstd; fp32 input, normalized, weighted, fp32 gate, silu(gate), and the
    # output projection's input
    z = H * dv
    out += 4 * T * H + T * z * (3 * 4 + 3 * e)
    return out


def recurrent_state_bytes(m: ModelConfig, micro_batch: int, tp: int = 1) -> int:
    """The fp32 state a DeltaNet layer carries along the sequence on one rank (value heads
    x dk x dv per sequence) plus the convolution's tail of K - 1 tokens
    (``model_spec.gated_delta_net_state_elements``, split over TP): what CP passes per
    layer, micro-batch and hop, and what generation keeps instead of a KV cache.  In
    training it is the per-chunk state counted in ``gated_delta_net_mixer_bytes``."""
    return 4 * micro_batch * ms.gated_delta_net_state_elements(m) // tp


def cp_state_sends(m: ModelConfig, L, pp_rank: int) -> tuple:
    """(elements per send, sends per iteration) of CP's state passing on the busiest rank
    (context_parallel/delta_state.py): per DeltaNet layer and micro-batch a middle rank
    hands the state (and the convolution's tail) to both neighbours, an end rank to one;
    backward sends the gradients back as many times, full recomputation repeats the
    forward's.  Fp32 (4 bytes an element).  (0, 0) without CP or DeltaNet layers."""
    n = sum(linear_layer_counts(m, L, pp_rank).values())
    if L.cp == 1 or not n:
        return 0, 0
    neighbours = 2 if L.cp > 2 else 1
    passes = 3 if L.recompute == "full" else 2
    return (recurrent_state_bytes(m, L.micro_batch, L.tp) // 4,
            n * L.num_micro_batches * neighbours * passes)


def linear_layer_counts(m: ModelConfig, L, pp_rank: int) -> Dict[bool, int]:
    """{MoE?: Gated DeltaNet layers of that kind} on pipeline stage ``pp_rank`` (empty for
    a model without linear attention): memory.py swaps their mixer's bytes in."""
    if not m.experimental_attention_variant:
        return {}
    out: Dict[bool, int] = {}
    for i in ms.stage_layer_ids(m, L.pp, pp_rank, L.vpp, *L.stage_split):
        if m.is_linear_attention_layer(i):
            moe = bool(m.num_experts) and ms.is_moe_layer(m, i)
            out[moe] = out.get(moe, 0) + 1
    return out
