"""Hugging Face Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3 text (``Gemma3ForCausalLM``,
``Gemma3TextConfig``) <-> megalite: Llama's tensors with Gemma's norms and scalings.

* Norms ``(1 + w)`` (``--apply-layernorm-1p``): HF stores the zero-centred ``w`` itself,
  which is what megalite stores, so norm weights copy unchanged (``hf_norm_offset`` 1).
* Sandwich norms (``--norm-placement sandwich``): HF's ``input_layernorm`` /
  ``pre_feedforward_layernorm`` are megalite's pre-norms, ``post_attention_layernorm`` /
  ``post_feedforward_layernorm`` its ``post_self_attn_layernorm`` / ``post_mlp_layernorm``.
* The embedding times sqrt(hidden) in the model dtype (``--scale-embeddings``), GeGLU with
  the tanh GeLU (``--activation geglu``), ``query_pre_attn_scalar`` s as
  ``--softmax-scale s**-0.5``, the soft-caps (``--attn-logit-softcapping``,
  ``--final-logit-softcapping``), the sliding window on the layers ``layer_types`` names
  (``--window-size W-1,0`` with a ``--window-attn-skip-freq`` pattern, ``sliding_window.py``).
* Gemma 3 adds per-head q/k norms (``--qk-layernorm``, zero-centred like the others) and
  one RoPE per layer type: ``full_attention``'s is ``--rotary-base`` (with its scaling:
  linear is ``--rotary-seq-len-interpolation-factor``), ``sliding_attention``'s plain base
  is ``--rotary-base-local``.

Refused in one line naming the key: another ``hidden_activation``,
``use_bidirectional_attention``, ``attention_bias``, a scaled RoPE on the sliding layers.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from megalite.checkpointing.hf_adapters.base import UnsupportedModelError
from megalite.checkpointing.hf_adapters.llama import GEMMA_FLAGS, LlamaAdapter, take
from megalite.checkpointing.hf_adapters.rope import rope_parameters_to_hf
from megalite.checkpointing.hf_adapters.sliding_window import (hf_window, layer_types,
                                                               windows_from_hf)
from megalite.config import ModelConfig

# megalite's post-sublayer norms <- HF's names
POST_NORMS = (("post_self_attn_layernorm", "post_attention_layernorm"),
              ("post_mlp_layernorm", "post_feedforward_layernorm"))
ACTIVATION = "gelu_pytorch_tanh"


def _scalar(softmax_scale: float):
    """query_pre_attn_scalar s of a softmax scale s**-0.5 (an int where it is one)."""
    s = softmax_scale ** -2
    return int(round(s)) if abs(s - round(s)) <= 1e-9 * s else s


class Gemma2Adapter(LlamaAdapter):
    family = "gemma2"
    architectures = ("Gemma2ForCausalLM",)
    model_type = "gemma2"
    norm_placement = "sandwich"
    activation = "geglu"
    hf_norm_offset = 1.0
    layer_norm_names = ("input_layernorm", "pre_feedforward_layernorm")
    writes = GEMMA_FLAGS[:4]
    every_other_slides = 2      # transformers' layer_types default: layer i slides unless
                                # (i + 1) % this == 0

    # -- configs -------------------------------------------------------------------------
    def family_fields_from_hf(self, hf: dict) -> dict:
        super().family_fields_from_hf(hf)           # no biases
        act = hf.get("hidden_activation") or hf.get("hidden_act") or ACTIVATION
        if act != ACTIVATION:
            raise UnsupportedModelError(f"hidden_activation '{act}' is not supported "
                                        f"({ACTIVATION})")
        if hf.get("use_bidirectional_attention"):
            raise UnsupportedModelError("use_bidirectional_attention: true is not supported "
                                        "(megalite's attention is causal)")
        layers = hf["num_hidden_layers"]
        default = [(i + 1) % self.every_other_slides != 0 for i in range(layers)]
        scalar = hf.get("query_pre_attn_scalar")
        return {"swiglu": False, "activation": "geglu", "apply_layernorm_1p": True,
                "norm_placement": "sandwich", "scale_embeddings": True,
                "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", True),
                "softmax_scale": None if scalar is None else float(scalar) ** -0.5,
                "attn_logit_softcapping": hf.get("attn_logit_softcapping"),
                "final_logit_softcapping": hf.get("final_logit_softcapping"),
                **windows_from_hf(hf, hf.get("sliding_window"), default)}

    def window_export_problems(self, mc) -> List[str]:
        return []                                   # layer_types says any pattern

    def family_export_problems(self, mc) -> List[str]:
        return [msg for bad, msg in ((not mc.apply_layernorm_1p, "--apply-layernorm-1p"),
                                     (not mc.scale_embeddings, "--scale-embeddings"),
                                     (mc.add_qkv_bias, "no --add-qkv-bias"),
                                     (mc.qk_layernorm, "no --qk-layernorm")) if bad]

    def family_config_to_hf(self, mc) -> dict:
        scale = mc.softmax_scale or mc.resolved_kv_channels() ** -0.5
        out = {"hidden_activation": ACTIVATION, "attention_bias": False,
               "query_pre_attn_scalar": _scalar(scale),
               "attn_logit_softcapping": mc.attn_logit_softcapping,
               "final_logit_softcapping": mc.final_logit_softcapping,
               "sliding_window": hf_window(mc), "layer_types": layer_types(mc),
               "use_bidirectional_attention": False}
        return out

    def config_to_hf(self, m: dict, torch_dtype: str = "float32") -> dict:
        hf = super().config_to_hf(m, torch_dtype)
        hf.pop("hidden_act")            # Gemma's key is hidden_activation
        return hf

    # -- state dicts ---------------------------------------------------------------------
    def from_hf(self, hf_sd: Dict[str, torch.Tensor], m: dict) -> Dict[str, torch.Tensor]:
        out = super().from_hf(hf_sd, m)
        shift = self.norm_shift(m)
        for i in range(m["num_layers"]):
            for ours, theirs in POST_NORMS:
                w = take(hf_sd, f"model.layers.{i}.{theirs}.weight").float()
                out[f"decoder.layers.{i}.{ours}.weight"] = w - shift
        return out

    def to_hf(self, sd: Dict[str, torch.Tensor], m: dict,
              dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
        out = super().to_hf(sd, m, dtype)
        shift = self.norm_shift(m)
        for i in range(m["num_layers"]):
            for ours, theirs in POST_NORMS:
                w = take(sd, f"decoder.layers.{i}.{ours}.weight").float() + shift
                out[f"model.layers.{i}.{theirs}.weight"] = w.to(dtype).clone()
        return out


class Gemma3Adapter(Gemma2Adapter):
    family = "gemma3"
    architectures = ("Gemma3ForCausalLM",)
    model_type = "gemma3_text"
    writes = GEMMA_FLAGS
    every_other_slides = 6      # transformers' sliding_window_pattern default

    def config_from_hf(self, hf: dict) -> dict:
        """The full layers' RoPE through Llama's mapping; the sliding layers' plain base."""
        params = hf.get("rope_parameters") or {}
        per_type = bool(params) and all(isinstance(v, dict) for v in params.values())
        full = params.get("full_attention", {}) if per_type else params
        local = params.get("sliding_attention", {}) if per_type else {}
        same = per_type and local == full      # the sliding layers rotate as the full
        if local.get("rope_type", "default") != "default" and not same:
            raise UnsupportedModelError(
                f"rope_parameters.sliding_attention.rope_type '{local['rope_type']}' is not "
                "supported (the sliding layers rotate with a plain base)")
        cfg = super().config_from_hf(dict(hf, rope_parameters=full))
        if cfg["window_size"] is not None and not same:
            base = local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))
            cfg["rotary_base_local"] = int(base) if float(base).is_integer() else base
        return cfg

    def family_fields_from_hf(self, hf: dict) -> dict:
        if "sliding_window_pattern" in hf and not hf.get("layer_types"):
            hf = dict(hf, layer_types=[
                "sliding_attention" if (i + 1) % hf["sliding_window_pattern"] else
                "full_attention" for i in range(hf["num_hidden_layers"])])
        return {**super().family_fields_from_hf(hf), "qk_layernorm": True}

    def family_export_problems(self, mc) -> List[str]:
        return [msg for bad, msg in ((not mc.apply_layernorm_1p, "--apply-layernorm-1p"),
                                     (not mc.scale_embeddings, "--scale-embeddings"),
                                     (mc.add_qkv_bias, "no --add-qkv-bias"),
                                     (not mc.qk_layernorm, "--qk-layernorm")) if bad]

    def config_to_hf(self, m: dict, torch_dtype: str = "float32") -> dict:
        hf = super().config_to_hf(m, torch_dtype)
        mc = ModelConfig(**m)
        local = mc.rotary_base_local
        full = rope_parameters_to_hf(mc)
        sliding = {"rope_type": "default", "rope_theta": mc.rotary_base if local is None
                   else local}
        if local is None and full["rope_type"] != "default":
            sliding = dict(full)        # no own base: the sliding layers rotate as the full
        hf["rope_parameters"] = {"full_attention": full, "sliding_attention": sliding}
        hf.pop("rope_scaling", None)    # Gemma 3 would merge it into full_attention
        hf["rope_local_base_freq"] = sliding["rope_theta"]
        return hf
