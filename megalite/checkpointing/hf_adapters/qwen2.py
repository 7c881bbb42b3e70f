"""Hugging Face Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``) <-> megalite: Llama plus a bias on
q, k and v (``--add-qkv-bias``; o_proj and the MLP have none).

Small Qwen2 models tie their embeddings (``tie_word_embeddings``).  The config's sliding
window is off in every release (``use_sliding_window: false``); a config that turns it on
is refused.  Qwen2 has no ``head_dim`` key of its own, but transformers reads one when
present, so a megalite head dimension other than hidden / heads exports too.
"""
from __future__ import annotations

from typing import List

from megalite.checkpointing.hf_adapters.llama import LlamaAdapter, refuse_sliding_window


class Qwen2Adapter(LlamaAdapter):
    family = "qwen2"
    architectures = ("Qwen2ForCausalLM",)
    model_type = "qwen2"

    def family_fields_from_hf(self, hf: dict) -> dict:
        refuse_sliding_window(hf)
        return {"add_qkv_bias": True}

    def family_export_problems(self, mc) -> List[str]:
        return [msg for bad, msg in ((not mc.add_qkv_bias, "--add-qkv-bias"),
                                     (mc.qk_layernorm, "no --qk-layernorm")) if bad]

    def family_config_to_hf(self, mc) -> dict:
        return {"use_sliding_window": False, "sliding_window": None,
                "max_window_layers": mc.num_layers,
                "layer_types": ["full_attention"] * mc.num_layers}
