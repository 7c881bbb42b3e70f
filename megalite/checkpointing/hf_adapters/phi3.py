"""Hugging Face Phi-3 (``Phi3ForCausalLM``) <-> megalite: Llama's layer with fused weights.

Phi-3 stores q, k and v as one ``self_attn.qkv_proj`` ([q of all heads; k; v], rows in
that order) and the MLP's gate and up as one ``mlp.gate_up_proj`` ([gate; up]).  Import
splits ``qkv_proj`` into q/k/v and fuses them per query group as Llama's are; export
concatenates them back.  ``gate_up_proj`` is megalite's ``linear_fc1`` row for row.

``partial_rotary_factor`` < 1 (Phi-4-mini) is ``--rotary-percent`` (``rope.py``: Phi-3
rotates the leading channels, half-split).  A set ``sliding_window`` (Phi-3-mini-4k has
2047) slides every layer, as Mistral's (``--window-size W-1,0``, ``sliding_window.py``).
Refused in one line: the 128k variants' ``longrope`` scaling (``rope.py``).  Like Mistral, the model also exports as
Llama (the first registered fit): ``convert.py --hf-architecture Phi3ForCausalLM`` writes
Phi-3.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from megalite.checkpointing.hf_adapters.llama import LlamaAdapter, attention_shape
from megalite.checkpointing.hf_adapters.sliding_window import (hf_window, layer_windows,
                                                               windows_from_hf)


class Phi3Adapter(LlamaAdapter):
    family = "phi3"
    architectures = ("Phi3ForCausalLM",)
    model_type = "phi3"
    partial_rotary = True

    def family_fields_from_hf(self, hf: dict) -> dict:
        super().family_fields_from_hf(hf)           # no biases
        return {"hidden_dropout": float(hf.get("resid_pdrop") or 0.0),
                **windows_from_hf(hf, hf.get("sliding_window"),
                                  [True] * hf["num_hidden_layers"])}

    def window_export_problems(self, mc) -> List[str]:
        windows = layer_windows(mc)
        return [] if len(set(windows)) == 1 else \
            ["--window-size on every layer or none (Phi-3's one sliding_window)"]

    def family_config_to_hf(self, mc) -> dict:
        # the special token ids are the tokenizer's: what the import recorded, else unset
        # (Phi3Config's defaults name a 32k vocabulary)
        return {"sliding_window": hf_window(mc), "resid_pdrop": mc.hidden_dropout,
                "embd_pdrop": mc.hidden_dropout, "bos_token_id": None, "eos_token_id": None,
                "pad_token_id": None}

    @staticmethod
    def _qkv_rows(m: dict):
        heads, groups, d, _ = attention_shape(m)
        return [heads * d, groups * d, groups * d]

    def attention_from_hf(self, get, norm, hf: str, mg: str, m: dict
                          ) -> Dict[str, torch.Tensor]:
        a = hf + "self_attn."
        q, k, v = get(a + "qkv_proj.weight").split(self._qkv_rows(m))
        parts = {a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v}
        return super().attention_from_hf(lambda key: parts[key] if key in parts else get(key),
                                         norm, hf, mg, m)

    def attention_to_hf(self, get, put, norm, mg: str, hf: str, m: dict
                        ) -> Dict[str, torch.Tensor]:
        out = super().attention_to_hf(get, put, norm, mg, hf, m)
        a = hf + "self_attn."
        out[a + "qkv_proj.weight"] = put(torch.cat([out.pop(f"{a}{n}_proj.weight")
                                                    for n in "qkv"]))
        return out

    def mlp_from_hf(self, get, hf: str, mg: str, m: dict) -> Dict[str, torch.Tensor]:
        return {mg + "mlp.linear_fc1.weight": get(hf + "mlp.gate_up_proj.weight"),
                mg + "mlp.linear_fc2.weight": get(hf + "mlp.down_proj.weight")}

    def mlp_to_hf(self, get, put, mg: str, hf: str, m: dict) -> Dict[str, torch.Tensor]:
        return {hf + "mlp.gate_up_proj.weight": put(get(mg + "mlp.linear_fc1.weight")),
                hf + "mlp.down_proj.weight": put(get(mg + "mlp.linear_fc2.weight"))}
