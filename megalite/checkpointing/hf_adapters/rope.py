"""Hugging Face RoPE settings (``rope_parameters`` / ``rope_scaling``) <-> megalite's flags.

Shared by every family: ``transformers`` picks the rotary function by ``rope_type`` for
any architecture, so a Qwen2 or Mistral config may carry Llama 3's or YaRN's scaling too.

    default  -> --position-embedding-type rope --rotary-base THETA
    linear   -> ... --rotary-seq-len-interpolation-factor F
    llama3   -> ... --use-rope-scaling --rope-scaling-factor F
                --rope-scaling-{low,high}-freq-factor --rope-scaling-original-max-position-embeddings
    yarn     -> --position-embedding-type yarn --rotary-scaling-factor F
                --yarn-original-max-position-embeddings --yarn-beta-fast/-slow
                (--no-yarn-correction-range-round-to-int) --mscale --mscale-all-dim

Both sides compute the tables with the same operations (``megalite.transformer.rotary``).
``partial_rotary_factor`` p -> ``--rotary-percent p`` for the families whose transformers
code rotates the leading int(d * p) channels of each head, half-split inside them
(Phi-3, GLM-4.5: ``partial_rotary=True``); elsewhere, and any other kind (linear, dynamic,
longrope, per-layer RoPE), a one-line refusal naming the key.
"""
from __future__ import annotations

import math
from typing import Dict

from megalite.checkpointing.hf_adapters.base import UnsupportedModelError
from megalite.config.domain_checks import rotary_dim
from megalite.transformer.rotary import (YARN_BETA_FAST, YARN_BETA_SLOW,
                                         YARN_ORIGINAL_MAX_POSITION_EMBEDDINGS,
                                         yarn_concentration_factor)

ROPE_TYPES = ("default", "llama3", "yarn", "linear")


def _number(value):
    """An int where the value is integral (rotary_base is an int flag)."""
    return int(value) if float(value).is_integer() else float(value)


def hf_rope_parameters(hf: dict) -> dict:
    """The flat RoPE dict of a config.json: ``rope_parameters`` (transformers >= 5) over
    ``rope_scaling`` (older), ``rope_theta`` from either or the top level."""
    params = hf.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError(
            f"rope_parameters: per-layer-type RoPE ({', '.join(params)}) is not supported")
    out = dict(hf.get("rope_scaling") or {})
    out.update(params)
    out.setdefault("rope_type", out.get("type", "default"))
    out.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    return out


def rope_fields_from_hf(hf: dict, partial_rotary: bool = False) -> Dict[str, object]:
    """``ModelConfig`` fields for a HF config's rotary embedding (raises if unsupported);
    ``partial_rotary``: whether the family's transformers code rotates part of each head."""
    p = hf_rope_parameters(hf)
    kind = p["rope_type"]
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(f"rope_parameters.rope_type '{kind}' is not supported "
                                    f"(megalite maps {', '.join(ROPE_TYPES)})")
    partial = p.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial is None:
        partial = 1.0
    if partial != 1.0 and not partial_rotary:
        raise UnsupportedModelError(f"partial_rotary_factor {partial} is not supported "
                                    "(this family's transformers code rotates whole heads)")
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    rot = rotary_dim(head_dim, float(partial))
    if rot < 2 or rot % 2:
        raise UnsupportedModelError(f"partial_rotary_factor {partial} rotates {rot} of "
                                    f"{head_dim} channels: megalite rotates an even number")
    out = {"position_embedding_type": "rope", "rotary_base": _number(p["rope_theta"]),
           "rotary_percent": float(partial)}
    # transformers: the pretraining length falls back to a top-level key (Phi3), then
    # max_position_embeddings
    original = hf.get("original_max_position_embeddings") or \
        p.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
    if kind == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in p]
        if missing:
            raise UnsupportedModelError(f"rope_parameters (llama3) lacks {', '.join(missing)}")
        out.update(use_rope_scaling=True, rope_scaling_factor=float(p["factor"]),
                   rope_scaling_low_freq_factor=float(p["low_freq_factor"]),
                   rope_scaling_high_freq_factor=float(p["high_freq_factor"]),
                   rope_scaling_original_max_position_embeddings=int(original))
    elif kind == "yarn":
        out.update(yarn_fields_from_hf(p, hf, int(original)))
    elif kind == "linear":           # frequencies / factor (Gemma 3's global layers)
        if "factor" not in p:
            raise UnsupportedModelError("rope_parameters (linear) lacks factor")
        out["rotary_seq_len_interpolation_factor"] = float(p["factor"])
    return out


def yarn_fields_from_hf(p: dict, hf: dict, original: int) -> Dict[str, object]:
    """YaRN's fields.  transformers and Megatron differ in one corner: transformers uses
    ``mscale`` only when ``mscale_all_dim`` is set too (else 0.1 ln(factor) + 1), which is
    megalite's mscale 1, mscale_all_dim 0.  An explicit ``attention_factor`` becomes the
    mscale that gives it (with mscale_all_dim 0)."""
    factor = p.get("factor")
    if factor is None:                   # DeepSeek-style: the ratio of the two lengths
        factor = hf["max_position_embeddings"] / original
    factor = float(factor)
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        mscale, mscale_all_dim = 1.0, 0.0
    given = p.get("attention_factor")
    if given is not None and not math.isclose(
            float(given), yarn_concentration_factor(factor, mscale, mscale_all_dim),
            rel_tol=1e-12):
        if factor <= 1:
            raise UnsupportedModelError(
                f"rope_parameters.attention_factor {given} with factor {factor} <= 1 is not "
                "expressible (YaRN's factor is then 1)")
        mscale, mscale_all_dim = (float(given) - 1.0) / (0.1 * math.log(factor)), 0.0
    return dict(position_embedding_type="yarn", rotary_scaling_factor=factor,
                yarn_original_max_position_embeddings=int(original),
                yarn_beta_fast=float(p.get("beta_fast") or 32),
                yarn_beta_slow=float(p.get("beta_slow") or 1),
                yarn_correction_range_round_to_int=bool(p.get("truncate", True)),
                mscale=float(mscale), mscale_all_dim=float(mscale_all_dim))


def rope_parameters_to_hf(mc) -> dict:
    """The ``rope_parameters`` dict of a megalite ``ModelConfig`` (transformers >= 5)."""
    out = {"rope_type": "default", "rope_theta": mc.rotary_base}
    if mc.rotary_percent != 1.0:
        out["partial_rotary_factor"] = mc.rotary_percent
    if mc.position_embedding_type == "rope" and mc.use_rope_scaling:
        out.update(rope_type="llama3", factor=mc.rope_scaling_factor,
                   low_freq_factor=mc.rope_scaling_low_freq_factor,
                   high_freq_factor=mc.rope_scaling_high_freq_factor,
                   original_max_position_embeddings=mc.rope_scaling_original_max_position_embeddings)
    elif mc.position_embedding_type == "rope" and \
            mc.rotary_seq_len_interpolation_factor:
        out.update(rope_type="linear", factor=mc.rotary_seq_len_interpolation_factor)
    elif mc.position_embedding_type == "yarn":
        out.update(rope_type="yarn", factor=mc.rotary_scaling_factor,
                   original_max_position_embeddings=(mc.yarn_original_max_position_embeddings or
                                                     YARN_ORIGINAL_MAX_POSITION_EMBEDDINGS),
                   beta_fast=YARN_BETA_FAST if mc.yarn_beta_fast is None else mc.yarn_beta_fast,
                   beta_slow=YARN_BETA_SLOW if mc.yarn_beta_slow is None else mc.yarn_beta_slow,
                   truncate=mc.yarn_correction_range_round_to_int)
        if mc.mscale and mc.mscale_all_dim:          # transformers' ratio rule applies
            out.update(mscale=mc.mscale, mscale_all_dim=mc.mscale_all_dim)
        elif mc.mscale != 1.0 or mc.mscale_all_dim:  # a factor only Megatron's rule gives
            out["attention_factor"] = yarn_concentration_factor(
                mc.rotary_scaling_factor, mc.mscale, mc.mscale_all_dim)
    return out


def rope_export_problems(mc) -> list:
    """What a megalite model's rotary embedding lacks to be written to Hugging Face."""
    if not mc.uses_rotary():
        return ["--position-embedding-type rope or yarn"]
    both = mc.use_rope_scaling and mc.rotary_seq_len_interpolation_factor
    return ["one RoPE scaling (--use-rope-scaling or --rotary-seq-len-interpolation-factor)"] \
        if both else []
