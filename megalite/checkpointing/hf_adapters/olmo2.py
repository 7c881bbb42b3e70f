"""Hugging Face OLMo 2 (``Olmo2ForCausalLM``) <-> megalite: Llama's tensors with OLMo 2's
norms.

* Post-norm (``--norm-placement post``): each layer is x + norm(attn(x)), then
  x + norm(mlp(x)); HF's ``post_attention_layernorm`` / ``post_feedforward_layernorm`` are
  megalite's two norm slots (``input_layernorm`` / ``pre_mlp_layernorm``, which normalize the
  sublayer outputs under post-norm).  There is no input norm.
* q/k norm over the whole projection (``--qk-layernorm --qk-layernorm-scope projection``):
  ``self_attn.q_norm`` has ``heads * head_dim`` weights, ``k_norm`` ``kv_heads * head_dim``,
  in head order (``transformer/projection_norm.py``; split over TP with the heads).

``attention_bias: true`` and a non-default RoPE beyond ``rope.py``'s are refused in one line.
"""
from __future__ import annotations

from typing import List

from megalite.checkpointing.hf_adapters.llama import LlamaAdapter


class Olmo2Adapter(LlamaAdapter):
    family = "olmo2"
    architectures = ("Olmo2ForCausalLM",)
    model_type = "olmo2"
    norm_placement = "post"
    qk_layernorm_scope = "projection"
    layer_norm_names = ("post_attention_layernorm", "post_feedforward_layernorm")

    def family_fields_from_hf(self, hf: dict) -> dict:
        super().family_fields_from_hf(hf)           # no biases
        return {"norm_placement": "post", "qk_layernorm": True,
                "qk_layernorm_scope": "projection"}

    def family_export_problems(self, mc) -> List[str]:
        return [msg for bad, msg in ((not mc.qk_layernorm, "--qk-layernorm"),
                                     (mc.add_qkv_bias, "no --add-qkv-bias")) if bad]

    def family_config_to_hf(self, mc) -> dict:
        return {"attention_bias": False, "bos_token_id": None, "eos_token_id": None,
                "pad_token_id": None}
