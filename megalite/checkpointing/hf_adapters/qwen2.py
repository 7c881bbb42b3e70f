"""Hugging Face Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``) <-> megalite: Llama plus a bias on
q, k and v (``--add-qkv-bias``; o_proj and the MLP have none).

Small Qwen2 models tie their embeddings (``tie_word_embeddings``).  The config's sliding
window is off in every release (``use_sliding_window: false``); a config that turns it on
slides from layer ``max_window_layers`` on (or as its ``layer_types`` say):
``--window-size sliding_window-1,0`` with a ``--window-attn-skip-freq`` pattern
(``sliding_window.py``).  Qwen2 has no ``head_dim`` key of its own, but transformers reads one when
present, so a megalite head dimension other than hidden / heads exports too.
"""
from __future__ import annotations

from typing import List

from megalite.checkpointing.hf_adapters.llama import LlamaAdapter
from megalite.checkpointing.hf_adapters.sliding_window import (hf_window, layer_types,
                                                               layer_windows, windows_from_hf)


class Qwen2Adapter(LlamaAdapter):
    family = "qwen2"
    architectures = ("Qwen2ForCausalLM",)
    model_type = "qwen2"

    def family_fields_from_hf(self, hf: dict) -> dict:
        layers, first = hf["num_hidden_layers"], hf.get("max_window_layers", 28)
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        return {"add_qkv_bias": True,
                **windows_from_hf(hf, window, [i >= first for i in range(layers)])}

    def window_export_problems(self, mc) -> List[str]:
        slides = [w is not None for w in layer_windows(mc)]
        ok = slides == sorted(slides)          # full layers first, then the sliding ones
        return [] if ok else ["--window-size on the last layers only (Qwen2's "
                              "max_window_layers)"]

    def family_export_problems(self, mc) -> List[str]:
        return [msg for bad, msg in ((not mc.add_qkv_bias, "--add-qkv-bias"),
                                     (mc.qk_layernorm, "no --qk-layernorm")) if bad]

    def family_config_to_hf(self, mc) -> dict:
        window = hf_window(mc)
        full = sum(w is None for w in layer_windows(mc))
        return {"use_sliding_window": window is not None, "sliding_window": window,
                "max_window_layers": full, "layer_types": layer_types(mc)}
