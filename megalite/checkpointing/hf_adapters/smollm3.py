"""Hugging Face SmolLM3 (``SmolLM3ForCausalLM``) <-> megalite: Llama's tensors, and layers
without rotary embedding (NoPE) at an interval.

SmolLM3's ``no_rope_layers`` has one entry per layer, 1 = RoPE, 0 = NoPE; transformers
derives it from ``no_rope_layer_interval`` N as layers N-1, 2N-1, ... without RoPE, which is
Megatron's ``--no-rope-freq N``.  Import writes ``--no-rope-freq N`` when the list is that
interval pattern, else the 0/1 pattern (1 = NoPE, Megatron's polarity), and nothing when
every layer rotates; export writes both keys back.  Sliding windows
(``use_sliding_window``, ``layer_types``) and biases are refused in one line.
"""
from __future__ import annotations

from megalite.checkpointing.hf_adapters.base import UnsupportedModelError
from megalite.checkpointing.hf_adapters.llama import LlamaAdapter, refuse_sliding_window
from megalite.config import ModelConfig


def no_rope_freq_from_hf(hf: dict):
    """SmolLM3's ``no_rope_layers`` / ``no_rope_layer_interval`` as ``--no-rope-freq``."""
    layers = hf["num_hidden_layers"]
    interval = hf.get("no_rope_layer_interval") or 4
    rope = hf.get("no_rope_layers")
    if rope is None:
        rope = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(rope) != layers or any(v not in (0, 1) for v in rope):
        raise UnsupportedModelError(f"no_rope_layers {rope} is not one 0/1 per layer "
                                    f"({layers} layers)")
    if all(rope):
        return None
    if rope == [int((i + 1) % interval != 0) for i in range(layers)]:
        return interval
    return [1 - v for v in rope]


class SmolLM3Adapter(LlamaAdapter):
    family = "smollm3"
    architectures = ("SmolLM3ForCausalLM",)
    model_type = "smollm3"
    nope_layers = True

    def family_fields_from_hf(self, hf: dict) -> dict:
        super().family_fields_from_hf(hf)           # no biases
        refuse_sliding_window(hf)
        return {"no_rope_freq": no_rope_freq_from_hf(hf)}

    def family_config_to_hf(self, mc: ModelConfig) -> dict:
        freq = mc.no_rope_freq
        return {"attention_bias": False, "mlp_bias": False, "use_sliding_window": False,
                "sliding_window": None, "layer_types": ["full_attention"] * mc.num_layers,
                "no_rope_layers": [int(mc.layer_uses_rotary(i)) for i in range(mc.num_layers)],
                "no_rope_layer_interval": freq if isinstance(freq, int) else 4,
                "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
