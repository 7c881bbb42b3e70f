"""Hugging Face Mistral (``MistralForCausalLM``) <-> megalite: Llama's tensors and config.

Current Mistral releases (v0.3, Nemo, Small) have ``sliding_window: null``: full causal
attention, exactly Llama's layer with its own ``head_dim``.  A set sliding window is
refused (megalite has no sliding-window attention).  Export writes Mistral only when asked
(``convert.py --hf-architecture MistralForCausalLM``): the same model also exports as
Llama, the first registered fit.
"""
from __future__ import annotations

from megalite.checkpointing.hf_adapters.base import UnsupportedModelError
from megalite.checkpointing.hf_adapters.llama import LlamaAdapter


class MistralAdapter(LlamaAdapter):
    family = "mistral"
    architectures = ("MistralForCausalLM",)
    model_type = "mistral"

    def family_fields_from_hf(self, hf: dict) -> dict:
        if hf.get("sliding_window") is not None:
            raise UnsupportedModelError(
                f"sliding_window {hf['sliding_window']} is not supported (megalite has no "
                "sliding-window attention); current Mistral configs have sliding_window: null")
        return {}

    def family_config_to_hf(self, mc) -> dict:
        return {"sliding_window": None}
