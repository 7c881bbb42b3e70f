"""Hugging Face Qwen3 (``Qwen3ForCausalLM``) <-> megalite: Llama plus an RMSNorm over each
head's q and k before RoPE (``--qk-layernorm``: ``self_attn.q_norm`` / ``k_norm``, one
weight of ``head_dim``), and a head dimension independent of hidden / heads
(``head_dim`` -> ``--kv-channels``; Qwen3-0.6B: 128 with hidden 1024 and 16 heads).

``attention_bias: true`` (biases on q, k, v *and* o_proj) and sliding windows are refused.
"""
from __future__ import annotations

from typing import List

from megalite.checkpointing.hf_adapters.base import UnsupportedModelError
from megalite.checkpointing.hf_adapters.llama import LlamaAdapter, refuse_sliding_window


class Qwen3Adapter(LlamaAdapter):
    family = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    model_type = "qwen3"

    def family_fields_from_hf(self, hf: dict) -> dict:
        if hf.get("attention_bias"):
            raise UnsupportedModelError("attention_bias: true is not supported for Qwen3 "
                                        "(biases on q/k/v and o_proj; megalite's "
                                        "--add-qkv-bias covers q/k/v only)")
        refuse_sliding_window(hf)
        return {"qk_layernorm": True}

    def family_export_problems(self, mc) -> List[str]:
        return [msg for bad, msg in ((not mc.qk_layernorm, "--qk-layernorm"),
                                     (mc.add_qkv_bias, "no --add-qkv-bias")) if bad]

    def family_config_to_hf(self, mc) -> dict:
        return {"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
                "max_window_layers": mc.num_layers,
                "layer_types": ["full_attention"] * mc.num_layers}
