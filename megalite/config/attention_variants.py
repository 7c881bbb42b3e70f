"""Attention variants beyond the score modifications (config/score_mods.py): what each one is
to the parts of megalite that are not its kernel, one entry each.

An entry (``AttentionVariant``) says when the variant is on, the rules it brings to the rule
engine (``rules``: a refusal by an implementation that cannot run it, or a relation with
another feature, each with its reason; megalite/cli/features.py walks them), the
parameters it adds to an attention layer (``params``: the planner's count), the work it
keeps on a layer (``layer_keep``: (window, documents per sequence) of the planner's FLOPs),
the logit it adds to the softmax denominator (``denominator``) and what Transformer
Engine's attention is told (``te_kwargs``).  So a new variant of a kind that exists (a
mask: attention_masks.keep; a softmax denominator term: transformer/softmax_denominator.py)
is its field in config/model.py and its entry here (+ one test); the core attentions, the
CP ring and all-to-all, TE, the planner and the rule engine ask this table
(docs/extending.md measured it).

Attention sinks (``--softmax-type``, Megatron's field) are one of them: a logit per head
that joins the softmax denominator and no value, so a query may attend "nowhere".

    vanilla     softmax(s)_j = e^s_j / sum_k e^s_k
    off-by-one  e^s_j / (1 + sum_k e^s_k)            (the sink logit is 0)
    learnable   e^s_j / (e^sink_h + sum_k e^s_k)     (gpt-oss: ``self_attn.sinks``)

The sink is a key with score ``sink_h`` and value 0: a denominator term, which the
attentions fold in as ``transformer/softmax_denominator.py`` says.  SDPA's kernels have no
such key, so the local core attention runs its unfused kernel with it, as with a score
modification; TE's DotProductAttention has its own (``softmax_type``, its
``softmax_offset``).

Importing this module does not import torch (the rule engine and the planner read it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple, Union

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def _sink(m) -> Optional[str]:
    """The sink as a denominator term: None (vanilla), "constant" (off-by-one: logit 0) or
    "learned" (learnable: ``softmax_offset`` [heads], split over TP)."""
    return {"off-by-one": "constant", "learnable": "learned"}.get(
        getattr(m, "softmax_type", "vanilla"))


def sinks_kernel_problem(value, cfg) -> Optional[str]:
    """only with the unfused core attention (--attention-backend auto, unfused or local) or TE"""
    backend = cfg.model.attention_backend
    te = cfg.model.transformer_impl == "transformer_engine"
    if value not in (None, "vanilla") and backend in ("flash", "fused") and not te:
        return (f"--softmax-type {value}: SDPA's kernels (--attention-backend {backend}) have "
                "no sink term in the softmax; use --attention-backend unfused (or auto)")
    return None


sinks_kernel_problem.invalid = []


@dataclass(frozen=True)
class VariantRule:
    """One rule of the engine: ``refused_by`` (a feature name: "te") refuses it when
    ``when(cfg)``; without one it is a relation (``when(cfg)`` is the bad combination)."""
    name: str
    when: Callable
    reason: Union[str, Callable]
    refused_by: Optional[str] = None


@dataclass(frozen=True)
class AttentionVariant:
    field: str                                       # the ModelConfig field that turns it on
    flag: str
    summary: str
    on: Callable                                     # (MegaliteConfig) -> bool
    rules: Tuple[VariantRule, ...] = ()
    params: Callable = lambda m, tp: 0               # parameters added per attention layer
    layer_keep: Optional[Callable] = None            # (ModelConfig, layer, seq) -> dict
    # (ModelConfig) -> a logit per head in the softmax denominator: None, "constant" (0)
    # or "learned" (a parameter [heads], split over TP with the heads)
    denominator: Callable = lambda m: None
    # (ModelConfig, layer) -> TE DotProductAttention's keyword arguments for the variant
    te_kwargs: Callable = lambda m, layer: {}


def _cp(cfg) -> bool:
    return cfg.parallel.cp > 1


def _chunks(m, layer: int, seq: int) -> dict:
    """Llama 4's chunks on the rotating layers: seq / C equal documents of C tokens."""
    chunk = m.layer_chunk(layer)
    return {"documents": max(1.0, seq / chunk)} if chunk else {}


def _window(m, layer: int, seq: int) -> dict:
    window = m.layer_window(layer)
    return {"window": window} if window is not None else {}


def _te_window(m, layer: int) -> dict:
    """TE's own sliding window: (left, right) keys beside the query."""
    window = m.layer_window(layer)
    return {"window_size": (window, 0)} if window is not None else {}



VARIANTS: Dict[str, AttentionVariant] = {
    "sinks": AttentionVariant(
        "softmax_type", "--softmax-type", "a per-head sink logit in the softmax denominator (gpt-oss)",
        lambda c: _sink(c.model) is not None,
        rules=(VariantRule(
            "--softmax-type with CP", lambda c: _sink(c.model) is not None and _cp(c),
            lambda c: f"--softmax-type {c.model.softmax_type} with Transformer Engine and "
            "--context-parallel-size > 1: TE's context-parallel attention is not given the "
            "sinks here; use --transformer-impl local (ring and all-to-all CP fold them in) "
            "or CP 1", refused_by="te"),),
        params=lambda m, tp: m.num_attention_heads // tp if _sink(m) == "learned" else 0,
        denominator=_sink,
        te_kwargs=lambda m, layer: {"softmax_type": m.softmax_type} if _sink(m) else {}),
    "chunked": AttentionVariant(
        "attention_chunk_size", "--attention-chunk-size", "chunked local attention on the rotating layers (Llama 4)",
        lambda c: c.model.attention_chunk_size is not None,
        rules=(VariantRule(
            "--attention-chunk-size with CP",
            lambda c: c.model.attention_chunk_size is not None and _cp(c),
            "--attention-chunk-size with Transformer Engine and --context-parallel-size > 1: "
            "TE's ring has no chunk mask and its packed (THD) ring splits each chunk itself; "
            "use --transformer-impl local (ring or all-to-all CP) or CP 1", refused_by="te"),
            VariantRule(
            "--qk-clip excludes --attention-chunk-size",
            lambda c: c.model.qk_clip and c.model.attention_chunk_size is not None,
            "--qk-clip records each head's largest causal logit, not the one inside a chunk "
            "(it would clip on pairs attention never sees): drop --qk-clip or "
            "--attention-chunk-size"),
            VariantRule(
            "--attention-chunk-size excludes --multi-latent-attention",
            lambda c: c.model.multi_latent_attention and c.model.attention_chunk_size is not None,
            "--attention-chunk-size acts on linear_qkv's heads and the layers that rotate; "
            "Multi-Latent Attention has neither: drop it or --multi-latent-attention")),
        layer_keep=_chunks),
    # packed documents and sliding windows: TE maps the document mask onto its THD format
    # without CP only (its THD ring splits each document itself, a layout get_batch does
    # not make); TE's ring has no sliding window
    "window": AttentionVariant(
        "window_size", "--window-size", "a sliding window, per layer (Mistral, Gemma, gpt-oss)",
        lambda c: bool(c.model.window_size),
        rules=(VariantRule(
            "--reset-attention-mask or --window-size with CP",
            lambda c: (c.data.reset_attention_mask or c.model.window_size) and _cp(c),
            "--reset-attention-mask / --window-size with Transformer Engine and "
            "--context-parallel-size > 1: TE's packed (THD) ring needs its own per-document "
            "split and its ring has no window; use --transformer-impl local (ring or "
            "all-to-all CP apply both masks) or CP 1", refused_by="te"),
            VariantRule(
            "--qk-clip excludes --reset-attention-mask and --window-size",
            lambda c: c.model.qk_clip and (c.data.reset_attention_mask or c.model.window_size),
            "--qk-clip records each head's largest causal logit, not the one under a document "
            "mask or a sliding window (it would clip on pairs attention never sees): drop "
            "--qk-clip or the mask")),
        layer_keep=_window, te_kwargs=_te_window),
}


def keeps_less(m) -> bool:
    """Whether a variant on ``m`` may keep less than the causal core on some layer (the
    planner's fast path: its search asks for every layout)."""
    return any(v.layer_keep is not None and getattr(m, v.field, None)
               for v in VARIANTS.values())


def layer_keep(m, layer: int, seq: int) -> dict:
    """What the variants on ``m`` keep of layer ``layer``'s causal attention core, as the
    keyword arguments of ``planner.flops.attention_work_fraction`` (window, documents)."""
    out: dict = {}
    for v in VARIANTS.values():
        if v.layer_keep is not None:
            out.update(v.layer_keep(m, layer, seq))
    return out


def attention_params(m, tp: int) -> int:
    """Parameters the variants add to one attention layer on a TP rank."""
    return sum(v.params(m, tp) for v in VARIANTS.values())


def denominator_logit(m) -> Optional[str]:
    """The softmax denominator term the variants on ``m`` add ("constant", "learned") or
    None: what the core attentions build (``softmax_denominator.build_denominator_logits``)
    and whether their kernel must be the unfused one (SDPA has no such term)."""
    return next((kind for kind in (v.denominator(m) for v in VARIANTS.values()) if kind),
                None)


def te_attention_kwargs(m, layer: int) -> dict:
    """TE DotProductAttention's keyword arguments of the variants on ``m`` at ``layer``."""
    out: dict = {}
    for v in VARIANTS.values():
        out.update(v.te_kwargs(m, layer))
    return out
