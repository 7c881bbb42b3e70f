"""Hugging Face GLM-4.5 (``Glm4MoeForCausalLM``: GLM-4.5, GLM-4.5-Air) <-> megalite.

Attention: Llama's GQA projections (``llama.py``) with biases on q, k and v alone
(``attention_bias`` -> ``--add-qkv-bias``), per-head q/k RMSNorm (``use_qk_norm`` ->
``--qk-layernorm``, ``self_attn.q_norm`` / ``k_norm``) and partial rotary
(``partial_rotary_factor``, 0.5 in the releases -> ``--rotary-percent``: the leading half of
each head rotates, half-split, as transformers' ``apply_rotary_pos_emb`` here).

MLP slot: the first ``first_k_dense_replace`` layers dense (``intermediate_size``), the
rest DeepSeek-V3's MoE block under DeepSeek-V3's names (``deepseek_v3.py``, whose pieces
this reuses): a sigmoid router with ``e_score_correction_bias`` (the aux-free expert bias),
group-limited top-k (``n_group`` / ``topk_group``), normalized top-k weights times
``routed_scaling_factor``, and ``n_shared_experts`` shared experts of
``moe_intermediate_size``.

The releases' Multi-Token Prediction layer (``num_mtp_layers``, stored as
``model.layers.{L}.*``) is not read by transformers' model either: import skips it (a note
says so) and export writes ``num_mtp_layers: 0``.  Refused in one line naming the key:
``norm_topk_prob: false`` and top-1 routing (megalite's sigmoid router normalizes top-k >= 2),
``hidden_act`` other than silu.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from megalite.checkpointing.hf_adapters.base import UnsupportedModelError
from megalite.checkpointing.hf_adapters.deepseek_v3 import (EXPERT_BIAS, moe_mlp_tensors,
                                                            sigmoid_moe_export_problems,
                                                            sigmoid_moe_fields,
                                                            sigmoid_moe_to_hf)
from megalite.checkpointing.hf_adapters.llama import LlamaAdapter
from megalite.checkpointing.hf_adapters.llama4 import layer_index
from megalite.config import ModelConfig


def _first_moe(mc) -> int:
    return next((i for i in range(mc.num_layers) if mc.is_moe_layer(i)), mc.num_layers)


class Glm4MoeAdapter(LlamaAdapter):
    family = "glm4_moe"
    architectures = ("Glm4MoeForCausalLM",)
    model_type = "glm4_moe"
    partial_rotary = True

    # -- configs -------------------------------------------------------------------------
    def config_from_hf(self, hf: dict) -> dict:
        cfg = super().config_from_hf(hf)
        L = hf["num_hidden_layers"]
        experts = hf.get("n_routed_experts") or 0
        first = min(hf.get("first_k_dense_replace") or 0, L)
        if experts and first < L:
            for bad, key in ((not hf.get("norm_topk_prob", True), "norm_topk_prob: false"),
                             ((hf.get("num_experts_per_tok") or 1) < 2,
                              f"num_experts_per_tok {hf.get('num_experts_per_tok')}")):
                if bad:
                    raise UnsupportedModelError(
                        f"{key} is not supported for Glm4MoeForCausalLM (megalite's sigmoid "
                        "router normalizes the top-k, k >= 2)")
            cfg.update(sigmoid_moe_fields(hf, experts, first, "GLM-4.5"))
        return cfg

    def family_fields_from_hf(self, hf: dict) -> dict:
        return {"add_qkv_bias": bool(hf.get("attention_bias")),
                "qk_layernorm": bool(hf.get("use_qk_norm"))}

    def export_problems(self, m: dict) -> List[str]:
        mc = ModelConfig(**m)
        body = [p for p in super().export_problems(m) if p != "no --num-experts"]
        dense_then_moe = all(mc.is_moe_layer(i) == (i >= _first_moe(mc))
                             for i in range(mc.num_layers))
        return body + (["dense layers first, then MoE (--moe-layer-freq)"]
                       if mc.num_experts and not dense_then_moe else []) + \
            sigmoid_moe_export_problems(mc)

    def family_export_problems(self, mc) -> List[str]:
        return []                       # q/k/v biases and per-head q/k norms both map

    def family_config_to_hf(self, mc) -> dict:
        out = {"attention_bias": bool(mc.add_qkv_bias), "use_qk_norm": bool(mc.qk_layernorm),
               "first_k_dense_replace": _first_moe(mc), "num_mtp_layers": 0,
               # the special token ids are the tokenizer's: what the import recorded
               "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
        if mc.num_experts:
            out.update(sigmoid_moe_to_hf(mc))
        else:                           # transformers builds MoE from first_k_dense_replace on
            out.update(n_routed_experts=1, num_experts_per_tok=1, n_shared_experts=0,
                       moe_intermediate_size=mc.resolved_ffn_hidden_size())
        return out

    def config_to_hf(self, m: dict, torch_dtype: str = "float32") -> dict:
        hf = super().config_to_hf(m, torch_dtype)
        hf.pop("rope_scaling", None)         # Glm4MoeConfig is strict: rope_parameters only
        hf.pop("rope_theta", None)
        return hf

    # -- state dicts ---------------------------------------------------------------------
    def from_hf(self, hf_sd: Dict[str, torch.Tensor], m: dict) -> Dict[str, torch.Tensor]:
        L = m["num_layers"]
        if any(k.startswith(f"model.layers.{L}.") for k in hf_sd):
            print(f"> note: the checkpoint's Multi-Token Prediction layer (model.layers.{L}.*) "
                  "is not imported (transformers' Glm4MoeForCausalLM does not run it either)")
        return super().from_hf(hf_sd, m)

    def mlp_from_hf(self, get, hf: str, mg: str, m: dict) -> Dict[str, torch.Tensor]:
        def has(key):
            try:
                get(key)
                return True
            except UnsupportedModelError:
                return False

        moe = ModelConfig(**m).is_moe_layer(layer_index(mg))
        return {k: v for k, v in moe_mlp_tensors(get, has, hf, mg, moe).items()
                if v is not None}

    def mlp_to_hf(self, get, put, mg: str, hf: str, m: dict) -> Dict[str, torch.Tensor]:
        mc = ModelConfig(**m)

        def read(key):                  # no bias kept: transformers' zeros
            if key.endswith(EXPERT_BIAS):
                try:
                    return get(key)
                except UnsupportedModelError:
                    return torch.zeros(mc.num_experts)
            return get(key)

        def has(key):
            try:
                get(key)
                return True
            except UnsupportedModelError:
                return False

        out = moe_mlp_tensors(read, has, hf, mg, mc.is_moe_layer(layer_index(mg)), to_hf=True)
        return {k: put(v) for k, v in out.items()}
