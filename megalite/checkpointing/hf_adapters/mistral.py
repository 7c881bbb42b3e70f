"""Hugging Face Mistral (``MistralForCausalLM``) <-> megalite: Llama's tensors and config.

Current Mistral releases (v0.3, Nemo, Small) have ``sliding_window: null``: full causal
attention, exactly Llama's layer with its own ``head_dim``.  Mistral 7B v0.1's
``sliding_window: 4096`` slides on every layer: ``--window-size 4095,0``
(``sliding_window.py``).  Export writes Mistral only when asked (``convert.py
--hf-architecture MistralForCausalLM``) or when every layer slides: a full-attention model
also exports as Llama, the first registered fit.
"""
from __future__ import annotations

from typing import List

from megalite.checkpointing.hf_adapters.llama import LlamaAdapter
from megalite.checkpointing.hf_adapters.sliding_window import (hf_window, layer_windows,
                                                               windows_from_hf)


class MistralAdapter(LlamaAdapter):
    family = "mistral"
    architectures = ("MistralForCausalLM",)
    model_type = "mistral"

    def family_fields_from_hf(self, hf: dict) -> dict:
        return windows_from_hf(hf, hf.get("sliding_window"),
                               [True] * hf["num_hidden_layers"])

    def window_export_problems(self, mc) -> List[str]:
        windows = layer_windows(mc)
        return [] if len(set(windows)) == 1 else \
            ["--window-size on every layer or none (Mistral's one sliding_window)"]

    def family_config_to_hf(self, mc) -> dict:
        return {"sliding_window": hf_window(mc)}
