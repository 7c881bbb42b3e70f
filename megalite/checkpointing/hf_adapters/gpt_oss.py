"""Hugging Face gpt-oss (``GptOssForCausalLM``) <-> megalite: Llama's attention with biases
and sinks, a sliding window on alternate layers, an MoE block with biases in every layer.

Per layer i (megalite <- HF), beyond Llama's q/k/v/o and norms:

    self_attention.linear_qkv.bias / linear_proj.bias <- q/k/v_proj.bias, o_proj.bias
                                                   (attention_bias: --add-bias-linear)
    self_attention.core_attention.softmax_offset  <- self_attn.sinks [heads]
                                                   (--softmax-type learnable)
    mlp.router.weight / .bias                     <- mlp.router.weight [E, h] / .bias [E]
    mlp.experts.linear_fc1.weight [E, 2F, h]      <- mlp.experts.gate_up_proj [E, h, 2F]
        transposed, its columns de-interleaved: HF's are gate_0, up_0, gate_1, ...;
        megalite's fc1 is [gate; up] (the gated activations' layout)
    mlp.experts.linear_fc1.bias [E, 2F]           <- gate_up_proj_bias, de-interleaved
    mlp.experts.linear_fc2.weight [E, h, F]       <- mlp.experts.down_proj [E, F, h]^T
    mlp.experts.linear_fc2.bias [E, h]            <- down_proj_bias

The experts' activation is ``--quick-geglu --glu-linear-offset 1
--activation-func-clamp-value swiglu_limit`` (gpt-oss's clamped SwiGLU: its sigmoid gain
``swiglu_alpha`` must be quick-GeGLU's 1.702); the router is softmax over the top-k logits
(megalite's default); ``layer_types`` / ``sliding_window`` map as ``sliding_window.py``
says; YaRN as ``rope.py``.  A quantized checkpoint (MXFP4 experts) is refused by
``base.adapter_for_hf``.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from megalite.checkpointing.hf_adapters.base import UnsupportedModelError, softmax_router_problems
from megalite.checkpointing.hf_adapters.llama import LlamaAdapter
from megalite.checkpointing.hf_adapters.rope import rope_export_problems
from megalite.checkpointing.hf_adapters.sliding_window import (hf_window, layer_types,
                                                               windows_from_hf)
from megalite.config import ModelConfig
from megalite.config.activations import activation_of

QUICK_GELU_ALPHA = 1.702          # quick-GeGLU's gain (config/activations.py)


def deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[g0, u0, g1, u1, ...] along ``dim`` -> [g0, g1, ...; u0, u1, ...]."""
    n = t.shape[dim]
    return torch.cat([t.narrow(dim, 0, n).unflatten(dim, (n // 2, 2)).select(dim + 1, j)
                      for j in (0, 1)], dim=dim)


def interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of ``deinterleave``."""
    gate, up = t.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


class GptOssAdapter(LlamaAdapter):
    family = "gpt_oss"
    architectures = ("GptOssForCausalLM",)
    model_type = "gpt_oss"

    def family_fields_from_hf(self, hf: dict) -> dict:
        missing = [k for k in ("num_local_experts", "num_experts_per_tok") if k not in hf]
        if missing:
            raise UnsupportedModelError(f"GptOssForCausalLM config lacks {', '.join(missing)}")
        alpha = float(hf.get("swiglu_alpha", QUICK_GELU_ALPHA))
        if alpha != QUICK_GELU_ALPHA:
            raise UnsupportedModelError(f"swiglu_alpha {alpha} is not supported (quick-GeGLU's "
                                        f"{QUICK_GELU_ALPHA})")
        if hf.get("router_jitter_noise"):
            raise UnsupportedModelError("router_jitter_noise is not supported")
        layers = hf["num_hidden_layers"]
        bias = bool(hf.get("attention_bias", True))
        limit = hf.get("swiglu_limit", 7.0)
        return {"add_bias_linear": bias, "swiglu": False, "quick_geglu": True,
                "glu_linear_offset": 1.0,
                "activation_func_clamp_value": None if limit is None else float(limit),
                "softmax_type": "learnable", "num_experts": hf["num_local_experts"],
                "moe_router_topk": hf["num_experts_per_tok"],
                "moe_ffn_hidden_size": hf["intermediate_size"], "moe_layer_freq": 1,
                "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.0)),
                "moe_expert_bias": True,
                **windows_from_hf(hf, hf.get("sliding_window"),
                                  [i % 2 == 0 for i in range(layers)])}

    def export_problems(self, m: dict) -> List[str]:
        mc = ModelConfig(**m)
        act = activation_of(mc)
        every = bool(mc.num_experts) and all(mc.is_moe_layer(i) for i in range(mc.num_layers))
        return [msg for bad, msg in (
            (mc.normalization != "RMSNorm", "--normalization RMSNorm"),
            (act.name != "quick-geglu" or mc.glu_linear_offset != 1.0,
             "--quick-geglu --glu-linear-offset 1"),
            (mc.softmax_type != "learnable", "--softmax-type learnable"),
            (not every, "MoE in every layer (--num-experts, --moe-layer-freq 1)"),
            (not mc.moe_expert_bias, "--moe-expert-bias"),
            (mc.add_qkv_bias and not mc.add_bias_linear,
             "biases on q/k/v and o together (attention_bias), not --add-qkv-bias alone"),
            (mc.moe_router_pre_softmax, "softmax over the top-k (no --moe-router-pre-softmax)"),
            (bool(mc.moe_shared_expert_intermediate_size),
             "no --moe-shared-expert-intermediate-size"),
            (mc.multi_latent_attention, "no --multi-latent-attention"),
            (bool(mc.mtp_num_layers), "no --mtp-num-layers"),
            (mc.no_rope_freq is not None, "no --no-rope-freq"),
            (mc.qk_layernorm, "no --qk-layernorm"),
            (mc.norm_placement != "pre", "--norm-placement pre")) if bad] + \
            rope_export_problems(mc) + softmax_router_problems(mc)

    def family_config_to_hf(self, mc) -> dict:
        """Llama's keys (``LlamaAdapter.config_to_hf``) plus the experts, sinks and windows."""
        return dict(architectures=list(self.architectures), model_type=self.model_type,
                    intermediate_size=mc.resolved_moe_ffn_hidden_size(),
                    num_local_experts=mc.num_experts, num_experts_per_tok=mc.moe_router_topk,
                    router_aux_loss_coef=mc.moe_aux_loss_coeff,
                    attention_bias=mc.add_bias_linear,
                    swiglu_limit=mc.activation_func_clamp_value,
                    swiglu_alpha=QUICK_GELU_ALPHA, sliding_window=hf_window(mc),
                    layer_types=layer_types(mc), output_router_logits=False)

    # -- state dicts ---------------------------------------------------------------------
    def attention_from_hf(self, get, norm, hf: str, mg: str, m: dict) -> Dict[str, torch.Tensor]:
        out = super().attention_from_hf(get, norm, hf, mg, m)
        out[mg + "self_attention.core_attention.softmax_offset"] = get(hf + "self_attn.sinks")
        return out

    def attention_to_hf(self, get, put, norm, mg: str, hf: str, m: dict
                        ) -> Dict[str, torch.Tensor]:
        out = super().attention_to_hf(get, put, norm, mg, hf, m)
        out[hf + "self_attn.sinks"] = put(get(mg + "self_attention.core_attention.softmax_offset"))
        return out

    def mlp_from_hf(self, get, hf: str, mg: str, m: dict) -> Dict[str, torch.Tensor]:
        e, x = hf + "mlp.experts.", mg + "mlp.experts."
        return {mg + "mlp.router.weight": get(hf + "mlp.router.weight"),
                mg + "mlp.router.bias": get(hf + "mlp.router.bias"),
                x + "linear_fc1.weight": deinterleave(get(e + "gate_up_proj").transpose(1, 2), 1),
                x + "linear_fc1.bias": deinterleave(get(e + "gate_up_proj_bias"), 1),
                x + "linear_fc2.weight": get(e + "down_proj").transpose(1, 2),
                x + "linear_fc2.bias": get(e + "down_proj_bias")}

    def mlp_to_hf(self, get, put, mg: str, hf: str, m: dict) -> Dict[str, torch.Tensor]:
        e, x = hf + "mlp.experts.", mg + "mlp.experts."
        return {hf + "mlp.router.weight": put(get(mg + "mlp.router.weight")),
                hf + "mlp.router.bias": put(get(mg + "mlp.router.bias")),
                e + "gate_up_proj": put(interleave(get(x + "linear_fc1.weight"), 1)
                                        .transpose(1, 2)),
                e + "gate_up_proj_bias": put(interleave(get(x + "linear_fc1.bias"), 1)),
                e + "down_proj": put(get(x + "linear_fc2.weight").transpose(1, 2)),
                e + "down_proj_bias": put(get(x + "linear_fc2.bias"))}
