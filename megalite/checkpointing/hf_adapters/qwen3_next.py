"""Hugging Face Qwen3-Next (``Qwen3NextForCausalLM``) <-> megalite: Gated DeltaNet layers
beside gated full-attention layers (``layer_types`` / ``full_attention_interval`` ->
``--linear-attention-freq``), Qwen2-MoE's MoE block (gated shared expert), zero-centred
RMSNorms ((1 + w): ``--apply-layernorm-1p``) and partial rotary (``partial_rotary_factor``
-> ``--rotary-percent``).

A linear-attention layer i (megalite ``decoder.layers.i.self_attention.`` <- HF
``model.layers.i.linear_attn.``):

    in_proj_qkvz.weight, in_proj_ba.weight <- the same (both laid out per q/k head group)
    conv_weight [channels, K]              <- conv1d.weight [channels, 1, K], its channels
                                              regrouped from [q; k; v] to [q_g, k_g, v_g]
                                              per group (as in_proj_qkvz)
    A_log, dt_bias, norm.weight, out_proj.weight <- the same

A full-attention layer: Qwen3's mapping, with q_proj's per-head [q_h; gate_h] rows split
and the gates appended to each query group of ``linear_qkv`` ([q_g, k_g, v_g, gate_g],
``--attention-output-gate``).  HF stores the zero-centred norms' w itself (applied as
1 + w), which is what megalite stores with ``--apply-layernorm-1p``: no shift.  The gated
norm of the DeltaNet layers is a plain weight on both sides.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from megalite.checkpointing.hf_adapters.base import UnsupportedModelError
from megalite.checkpointing.hf_adapters.llama import attention_shape
from megalite.checkpointing.hf_adapters.qwen3 import Qwen3Adapter
from megalite.checkpointing.hf_adapters.qwen_moe import QwenMoeMixin, layer_of
from megalite.config import ModelConfig

LINEAR_KEYS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
               "linear_num_key_heads", "linear_num_value_heads")


def hf_layer_types(hf: dict) -> List[str]:
    """HF's rule: ``layer_types``, else every ``full_attention_interval``-th layer full."""
    types = hf.get("layer_types")
    if types:
        return list(types)
    interval = hf.get("full_attention_interval", 4)
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(hf["num_hidden_layers"])]


def linear_attention_fields(hf: dict) -> dict:
    """The ``ModelConfig`` fields of a Qwen3-Next config's layer pattern and Gated DeltaNet
    shape (the planner's ``--hf-config`` reads these too)."""
    types = hf_layer_types(hf)
    other = sorted(set(types) - {"linear_attention", "full_attention"})
    if other:
        raise UnsupportedModelError(f"layer_types {other} are not supported "
                                    "(linear_attention, full_attention)")
    pattern = [int(t == "linear_attention") for t in types]
    n = len(pattern)
    interval = next((f for f in range(1, n + 1) if pattern == [
        int((i + 1) % f != 0) for i in range(n)]), None)
    return dict({k: hf[k] for k in LINEAR_KEYS if k in hf},
                experimental_attention_variant="gated_delta_net" if any(pattern) else None,
                linear_attention_freq=interval if interval is not None else pattern,
                attention_output_gate=True)


def _conv_groups(m: dict):
    mc = ModelConfig(**m)
    g, r = mc.linear_num_key_heads, mc.linear_num_value_heads // mc.linear_num_key_heads
    return g, mc.linear_key_head_dim, r * mc.linear_value_head_dim


class Qwen3NextAdapter(QwenMoeMixin, Qwen3Adapter):
    family = "qwen3_next"
    architectures = ("Qwen3NextForCausalLM",)
    model_type = "qwen3_next"
    shared_expert = True
    linear_attention = True
    partial_rotary = True    # its own config_from_hf reads partial_rotary_factor (0.25)

    # -- configs -------------------------------------------------------------------------
    def config_from_hf(self, hf: dict) -> dict:
        partial = (hf.get("rope_parameters") or {}).get(
            "partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
        plain = dict(hf, rope_parameters={k: v for k, v in (hf.get(
            "rope_parameters") or {}).items() if k != "partial_rotary_factor"})
        plain.pop("partial_rotary_factor", None)
        plain.pop("layer_types", None)   # refused by Qwen3's rule; read here instead
        cfg = super().config_from_hf(plain)
        cfg.update(linear_attention_fields(hf), rotary_percent=float(partial),
                   apply_layernorm_1p=True)
        return cfg

    def family_fields_from_hf(self, hf: dict) -> dict:
        if hf.get("attention_bias"):
            raise UnsupportedModelError("attention_bias: true is not supported for "
                                        "Qwen3-Next (megalite's gated attention has no biases)")
        if not hf.get("shared_expert_intermediate_size"):
            raise UnsupportedModelError("Qwen3NextForCausalLM: shared_expert_intermediate_size "
                                        "0 is not supported (the block always has its gate)")
        return {"qk_layernorm": True}

    def family_export_problems(self, mc) -> List[str]:
        return super().family_export_problems(mc) + [msg for bad, msg in (
            (not mc.apply_layernorm_1p, "--apply-layernorm-1p"),
            (not mc.attention_output_gate, "--attention-output-gate")) if bad]

    def config_to_hf(self, m: dict, torch_dtype: str = "float32") -> dict:
        hf = super().config_to_hf(m, torch_dtype)
        mc = ModelConfig(**m)
        hf.update({k: getattr(mc, k) for k in LINEAR_KEYS})
        hf["layer_types"] = ["linear_attention" if mc.is_linear_attention_layer(i)
                             else "full_attention" for i in range(mc.num_layers)]
        hf["rope_parameters"]["partial_rotary_factor"] = mc.rotary_percent
        hf["partial_rotary_factor"] = mc.rotary_percent
        for key in ("use_sliding_window", "sliding_window", "max_window_layers"):
            hf.pop(key, None)
        return hf

    # -- state dicts ---------------------------------------------------------------------
    def from_hf(self, hf_sd: Dict[str, torch.Tensor], m: dict) -> Dict[str, torch.Tensor]:
        # HF's zero-centred weights are megalite's --apply-layernorm-1p ones: no shift
        return super().from_hf(hf_sd, dict(m, apply_layernorm_1p=False))

    def to_hf(self, sd: Dict[str, torch.Tensor], m: dict,
              dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
        return super().to_hf(sd, dict(m, apply_layernorm_1p=False), dtype)

    def attention_from_hf(self, get, norm, hf: str, mg: str, m: dict
                          ) -> Dict[str, torch.Tensor]:
        if ModelConfig(**m).is_linear_attention_layer(layer_of(mg)):
            return self._linear_from_hf(get, hf + "linear_attn.", mg + "self_attention.", m)
        heads, groups, d, _ = attention_shape(m)
        r = heads // groups
        q_gate = get(hf + "self_attn.q_proj.weight").view(heads, 2, d, -1)
        q, gate = q_gate[:, 0].reshape(heads * d, -1), q_gate[:, 1].reshape(heads * d, -1)
        plain = {hf + "self_attn.q_proj.weight": q}
        out = super().attention_from_hf(lambda k: plain[k] if k in plain else get(k),
                                        norm, hf, mg, m)
        key = mg + "self_attention.linear_qkv.weight"
        rows = out[key].view(groups, (r + 2) * d, -1)
        out[key] = torch.cat([rows, gate.view(groups, r * d, -1)], dim=1).reshape(
            -1, rows.shape[-1])
        return out

    def attention_to_hf(self, get, put, norm, mg: str, hf: str, m: dict
                        ) -> Dict[str, torch.Tensor]:
        if ModelConfig(**m).is_linear_attention_layer(layer_of(mg)):
            return self._linear_to_hf(get, put, mg + "self_attention.", hf + "linear_attn.", m)
        heads, groups, d, _ = attention_shape(m)
        r = heads // groups
        key = mg + "self_attention.linear_qkv.weight"
        fused = get(key)
        rows = fused.view(groups, (2 * r + 2) * d, -1)
        qkv, gate = rows.split([(r + 2) * d, r * d], dim=1)
        plain = {key: qkv.reshape(-1, fused.shape[-1])}
        out = super().attention_to_hf(lambda k: plain[k] if k in plain else get(k),
                                      put, norm, mg, hf, m)
        q = out[hf + "self_attn.q_proj.weight"].view(heads, 1, d, -1)
        out[hf + "self_attn.q_proj.weight"] = put(torch.cat(
            [q, gate.reshape(heads, 1, d, -1).to(q.dtype)], dim=1).reshape(2 * heads * d, -1))
        return out

    def _linear_from_hf(self, get, a: str, s: str, m: dict) -> Dict[str, torch.Tensor]:
        g, dk, vdim = _conv_groups(m)
        conv = get(a + "conv1d.weight").squeeze(1)                 # [q; k; v] channels
        q, k, v = conv.split([g * dk, g * dk, g * vdim])
        conv = torch.cat([q.view(g, dk, -1), k.view(g, dk, -1), v.view(g, vdim, -1)], dim=1)
        out = {s + "conv_weight": conv.reshape(-1, conv.shape[-1])}
        for name in ("in_proj_qkvz.weight", "in_proj_ba.weight", "A_log", "dt_bias",
                     "norm.weight", "out_proj.weight"):
            out[s + name] = get(a + name)
        return out

    def _linear_to_hf(self, get, put, s: str, a: str, m: dict) -> Dict[str, torch.Tensor]:
        g, dk, vdim = _conv_groups(m)
        conv = get(s + "conv_weight")
        q, k, v = conv.view(g, 2 * dk + vdim, -1).split([dk, dk, vdim], dim=1)
        K = conv.shape[-1]
        out = {a + "conv1d.weight": put(torch.cat(
            [q.reshape(-1, K), k.reshape(-1, K), v.reshape(-1, K)])[:, None, :])}
        for name in ("in_proj_qkvz.weight", "in_proj_ba.weight", "A_log", "dt_bias",
                     "norm.weight", "out_proj.weight"):
            out[a + name] = put(get(s + name))
        return out
