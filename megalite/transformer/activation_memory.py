"""What a transformer layer keeps for backward: measured, and predicted term by term.

``measure_saved`` runs a forward under ``saved_tensors_hooks`` and counts every saved
tensor's *storage* once (views share storage: ``v`` sliced out of the fused qkv output
keeps the whole qkv buffer alive), skipping parameters, plus the inputs checkpoint
regions keep for recomputation (``recompute.probe_checkpoint_inputs``).

``layer_terms`` is the exact expectation for OUR kernels, in elements (x element size =
bytes).  Korthikanti et al. 2022 count sbh(34 + 5as/h) bytes in 16-bit for a GPT layer
with unfused attention and dropout; docs/pipeline.md explains each difference.
Symbols: s sequence, b micro-batch, h hidden, a heads, g query groups, d head dim,
f ffn hidden, t tensor-parallel size (sequence parallel: norms see s/t tokens).
"""
from __future__ import annotations

from typing import Callable, Dict

import torch

from megalite.config import score_mods
from megalite.config.activations import activation_of
from megalite.transformer.recompute import probe_checkpoint_inputs


def measure_saved(fn: Callable, *args, ignore=()) -> Dict[int, int]:
    """{storage id: bytes} of what ``fn(*args)`` leaves for backward (``ignore``: tensors
    whose storage does not count, e.g. parameters)."""
    skip = {t.untyped_storage().data_ptr() for t in ignore}
    seen: Dict[int, int] = {}

    def note(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()

    def pack(t):
        note(t)
        return t.detach()  # t itself would make saved outputs a reference cycle

    def probe(tensors):
        for t in tensors:
            note(t)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            probe_checkpoint_inputs(probe):
        out = fn(*args)
    return seen, out


def layer_terms(m, s: int, b: int, t: int = 1, sp: bool = False, sdpa: str = "flash",
                recompute: tuple = ()) -> Dict[str, int]:
    """Saved elements of one layer, one entry per distinct buffer.

    ``sdpa``: 'flash' (the fused kernel CPU and CUDA pick for causal attention without a
    mask), 'math' (SDPA's fallback; MHA only here) or 'unfused' (megalite's explicit
    kernel, ``--attention-backend unfused``); ``recompute``: ('full',) or any
    of 'core_attn', 'mlp', 'layernorm'.  With SP the norms see s/t tokens and so do the
    column-parallel linears' saved inputs: ``linear_with_sp_gather`` keeps the sequence
    shard and all-gathers it again in backward, so every term is divided by t (only the
    RoPE tables, shared by all layers, are not)."""
    h, a = m.hidden_size, m.num_attention_heads
    d, g, f = m.resolved_kv_channels(), m.resolved_query_groups(), m.resolved_ffn_hidden_size()
    rms, rope = m.normalization == "RMSNorm", m.uses_rotary()
    sn = s // t if sp else s                        # tokens a norm sees
    if "full" in recompute:
        return {"layer input (checkpoint input)": sn * b * h}
    T: Dict[str, int] = {}
    for name in ("input norm", "pre-MLP norm"):
        if "layernorm" in recompute:
            T[f"{name}: input x (checkpoint input)"] = sn * b * h
        elif rms:   # decomposed rms_norm: x, x * rsqrt, rsqrt
            T[f"{name}: x, x*rsqrt, rsqrt"] = 2 * sn * b * h + sn * b
        else:       # native layer_norm: x, mean, rstd
            T[f"{name}: x, mean, rstd"] = sn * b * h + 2 * sn * b
    if m.norm_placement == "sandwich":  # Gemma: norms on the two sublayer outputs, whose
        for name in ("post-attention norm", "post-MLP norm"):   # input is a fresh buffer
            T[f"{name}: x, x*rsqrt, rsqrt" if rms else f"{name}: x, mean, rstd"] = \
                (2 * sn * b * h + sn * b) if rms else (sn * b * h + 2 * sn * b)
    T["qkv linear input = input-norm output (sequence shard with SP)"] = sn * b * h
    T["qkv linear output (v is a view of it)"] = s * b * (a + 2 * g) * d // t
    qk_norm = m.qk_layernorm
    if qk_norm:     # their input x is a view of the qkv output
        if rms:
            T["q/k norms: x*rsqrt, rsqrt"] = s * b * (a + g) * (d + 1) // t
        else:
            T["q/k norms: mean, rstd"] = 2 * s * b * (a + g) // t
    if rope:
        T["q, k after RoPE"] = s * b * (a + g) * d // t
        T["RoPE cos, sin tables (fp32, shared by all layers)"] = 2 * s * d
    elif qk_norm:   # core attention keeps the normalized q, k (q already per head)
        T["q, k after the q/k norms"] = s * b * (a + g) * d // t
    elif g != a:
        T["q regrouped per head (copy)"] = s * b * a * d // t
    # The fused kernel lays its output out like q: when q is a view of the [s, b, ...] qkv
    # buffer (MHA, no RoPE, no q/k norm) the output is [s, b, a, d]-ordered and the reshape
    # feeding the proj linear is a view -- one buffer, not two.
    shared_out = sdpa == "flash" and not rope and not qk_norm and g == a
    if "core_attn" not in recompute:
        if sdpa == "flash":
            if not shared_out:
                T["SDPA output"] = s * b * a * d // t
            T["SDPA logsumexp (fp32)"] = a * s * b // t
        elif sdpa == "unfused":     # attention_kernels.unfused_attention, any GQA
            T["unfused: softmax probabilities"] = a * s * s * b // t
            for mod, _ in score_mods.active(m):      # what each keeps for its backward
                if mod.saved_scores:
                    T[f"unfused: {mod.flag} keeps"] = mod.saved_scores * a * s * s * b // t
        elif g == a:
            T["math SDPA: q*sqrt(scale), k*sqrt(scale)"] = 2 * s * b * a * d // t
            T["math SDPA: softmax probabilities"] = a * s * s * b // t
        else:
            raise ValueError("math-path accounting is derived for MHA only")
    T["proj linear input (attention output" + (", = SDPA output)" if shared_out
                                                else ", copied)")] = s * b * a * d // t
    if "mlp" in recompute:
        T["mlp input = pre-MLP-norm output (checkpoint input)"] = sn * b * h
    else:
        T["fc1 input = pre-MLP-norm output (sequence shard with SP)"] = sn * b * h
        for term, multiple in activation_of(m).saved:
            T[term] = multiple * s * b * f // t
    return T


def korthikanti_bytes(s: int, b: int, h: int, a: int, t: int = 1, selective: bool = False,
                      full: bool = False) -> float:
    """The paper's 16-bit bytes per layer (TP + SP: everything / t)."""
    if full:
        return 2 * s * b * h
    per = s * b * h * 34 + (0 if selective else 5 * a * s * s * b)
    return per / t
