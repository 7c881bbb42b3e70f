"""Hugging Face Qwen2-MoE (``Qwen2MoeForCausalLM``) and Qwen3-MoE (``Qwen3MoeForCausalLM``)
<-> megalite: the attention of Qwen2 (q/k/v biases as the config's ``qkv_bias`` says:
``--add-qkv-bias``) or Qwen3 (per-head q/k RMSNorm: ``--qk-layernorm``), and an MLP slot
holding, per layer, a dense MLP or an MoE block.

MoE block of layer i (megalite name <- HF name, ``model.layers.i.mlp.`` left out):

    router.weight                      <- gate.weight [E, h]
    experts.linear_fc1.weight          <- [gate_proj; up_proj] of each expert, stacked [E, 2F, h]
    experts.linear_fc2.weight          <- down_proj of each expert, stacked [E, h, F]
    shared_experts.linear_fc1.weight   <- [shared_expert.gate_proj; up_proj]   (Qwen2-MoE)
    shared_experts.linear_fc2.weight   <- shared_expert.down_proj              (Qwen2-MoE)
    shared_experts.gate_weight         <- shared_expert_gate.weight [1, h]     (Qwen2-MoE)

Checkpoints on disk name each expert (``experts.{e}.gate_proj.weight``); ``transformers`` 5
holds them fused in memory (``experts.gate_up_proj`` [E, 2F, h], ``experts.down_proj``),
which is read too.  Export writes the on-disk names.

Routing, in Megatron's terms (``megalite.moe.router``): HF's softmax over all experts, top-k,
and with ``norm_topk_prob`` a renormalization over the k, is megalite's default (softmax over
the top-k logits); without it, ``--moe-router-pre-softmax``.  Qwen2-MoE's shared expert is
``--moe-shared-expert-intermediate-size`` with ``--moe-shared-expert-gate``.  Which layers
are sparse (HF: layer i unless in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``)
becomes a ``--moe-layer-freq`` 0/1 pattern; dense layers use ``intermediate_size``.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from megalite.checkpointing.hf_adapters.base import UnsupportedModelError, softmax_router_problems
from megalite.checkpointing.hf_adapters.llama import refuse_sliding_window
from megalite.checkpointing.hf_adapters.qwen2 import Qwen2Adapter
from megalite.checkpointing.hf_adapters.qwen3 import Qwen3Adapter
from megalite.config import ModelConfig


def sparse_layer_pattern(hf: dict) -> List[int]:
    """HF's rule for which decoder layers hold the MoE block, as a 0/1 list."""
    step = hf.get("decoder_sparse_step", 1) or 1
    dense = set(hf.get("mlp_only_layers") or [])
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    return [int(experts > 0 and i not in dense and (i + 1) % step == 0)
            for i in range(hf["num_hidden_layers"])]


def qwen_moe_fields(hf: dict) -> dict:
    """The ``ModelConfig`` MoE fields of a Qwen2-MoE / Qwen3-MoE config.json (the planner's
    ``--hf-config`` reads these too)."""
    pattern = sparse_layer_pattern(hf)
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    if not any(pattern):
        return dict(num_experts=None)
    shared = hf.get("shared_expert_intermediate_size") or None
    return dict(
        num_experts=experts, moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_layer_freq=1 if all(pattern) else pattern,
        moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
        moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=bool(shared),
        moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)))


def layer_of(prefix: str) -> int:
    """The layer index of a per-layer prefix such as ``decoder.layers.3.``."""
    return int(prefix.rstrip(".").rsplit(".", 1)[1])


def _has(get, key: str) -> bool:
    try:
        get(key)
        return True
    except UnsupportedModelError:
        return False


class QwenMoeMixin:
    """The MoE parts Qwen2-MoE and Qwen3-MoE share, in front of their dense family's adapter
    (which maps the attention).  ``shared_expert``: whether the family's MoE block has
    Qwen2-MoE's gated shared expert (it always does there, never in Qwen3-MoE)."""
    shared_expert = False

    # -- configs -------------------------------------------------------------------------
    def config_from_hf(self, hf: dict) -> dict:
        missing = [k for k in ("num_experts_per_tok", "moe_intermediate_size") if k not in hf]
        if missing:
            raise UnsupportedModelError(f"{self.architectures[0]} config lacks "
                                        f"{', '.join(missing)}")
        cfg = super().config_from_hf(hf)
        cfg.update(qwen_moe_fields(hf))
        return cfg

    def export_problems(self, m: dict) -> List[str]:
        mc = ModelConfig(**m)
        shared = bool(mc.moe_shared_expert_intermediate_size)
        body = [p for p in super().export_problems(m) if p != "no --num-experts"]
        return body + [msg for bad, msg in (
            (not mc.num_experts, "--num-experts"),
            (self.shared_expert and not (shared and mc.moe_shared_expert_gate),
             "--moe-shared-expert-intermediate-size with --moe-shared-expert-gate"),
            (not self.shared_expert and shared, "no --moe-shared-expert-intermediate-size"),
        ) if bad] + softmax_router_problems(mc)

    def config_to_hf(self, m: dict, torch_dtype: str = "float32") -> dict:
        hf = super().config_to_hf(m, torch_dtype)     # raises on export_problems
        mc = ModelConfig(**m)
        hf.pop("mlp_bias", None)
        hf.update(
            num_experts=mc.num_experts, num_experts_per_tok=mc.moe_router_topk,
            moe_intermediate_size=mc.resolved_moe_ffn_hidden_size(),
            intermediate_size=mc.resolved_ffn_hidden_size(), decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(mc.num_layers) if not mc.is_moe_layer(i)],
            norm_topk_prob=not mc.moe_router_pre_softmax,
            router_aux_loss_coef=mc.moe_aux_loss_coeff, output_router_logits=False)
        if self.shared_expert:
            hf["shared_expert_intermediate_size"] = mc.moe_shared_expert_intermediate_size
        return hf

    # -- state dicts ---------------------------------------------------------------------
    def mlp_from_hf(self, get, hf: str, mg: str, m: dict) -> Dict[str, torch.Tensor]:
        if not ModelConfig(**m).is_moe_layer(layer_of(mg)):
            return super().mlp_from_hf(get, hf, mg, m)
        src, dst = hf + "mlp.", mg + "mlp."
        out = {dst + "router.weight": get(src + "gate.weight")}
        if _has(get, src + "experts.gate_up_proj"):       # transformers >= 5, in memory
            out[dst + "experts.linear_fc1.weight"] = get(src + "experts.gate_up_proj")
            out[dst + "experts.linear_fc2.weight"] = get(src + "experts.down_proj")
        else:
            E = m["num_experts"]
            out[dst + "experts.linear_fc1.weight"] = torch.stack(
                [torch.cat([get(f"{src}experts.{e}.gate_proj.weight"),
                            get(f"{src}experts.{e}.up_proj.weight")]) for e in range(E)])
            out[dst + "experts.linear_fc2.weight"] = torch.stack(
                [get(f"{src}experts.{e}.down_proj.weight") for e in range(E)])
        if self.shared_expert:
            shared = src + "shared_expert."
            out[dst + "shared_experts.linear_fc1.weight"] = torch.cat(
                [get(shared + "gate_proj.weight"), get(shared + "up_proj.weight")])
            out[dst + "shared_experts.linear_fc2.weight"] = get(shared + "down_proj.weight")
            out[dst + "shared_experts.gate_weight"] = get(src + "shared_expert_gate.weight")
        return out

    def mlp_to_hf(self, get, put, mg: str, hf: str, m: dict) -> Dict[str, torch.Tensor]:
        if not ModelConfig(**m).is_moe_layer(layer_of(mg)):
            return super().mlp_to_hf(get, put, mg, hf, m)
        src, dst = mg + "mlp.", hf + "mlp."
        fc1, fc2 = get(src + "experts.linear_fc1.weight"), get(src + "experts.linear_fc2.weight")
        out = {dst + "gate.weight": put(get(src + "router.weight"))}
        for e in range(fc1.shape[0]):
            gate, up = fc1[e].chunk(2, dim=0)
            out[f"{dst}experts.{e}.gate_proj.weight"] = put(gate)
            out[f"{dst}experts.{e}.up_proj.weight"] = put(up)
            out[f"{dst}experts.{e}.down_proj.weight"] = put(fc2[e])
        if self.shared_expert:
            gate, up = get(src + "shared_experts.linear_fc1.weight").chunk(2, dim=0)
            out[dst + "shared_expert.gate_proj.weight"] = put(gate)
            out[dst + "shared_expert.up_proj.weight"] = put(up)
            out[dst + "shared_expert.down_proj.weight"] = put(
                get(src + "shared_experts.linear_fc2.weight"))
            out[dst + "shared_expert_gate.weight"] = put(get(src + "shared_experts.gate_weight"))
        return out


class Qwen2MoeAdapter(QwenMoeMixin, Qwen2Adapter):
    """Qwen2's attention, but the q/k/v biases are a config switch (``qkv_bias``, true in
    every release)."""
    family = "qwen2_moe"
    architectures = ("Qwen2MoeForCausalLM",)
    model_type = "qwen2_moe"
    shared_expert = True

    def family_fields_from_hf(self, hf: dict) -> dict:
        refuse_sliding_window(hf)
        if not hf.get("shared_expert_intermediate_size"):
            raise UnsupportedModelError("Qwen2MoeForCausalLM: shared_expert_intermediate_size "
                                        "0 is not supported (the block always has its gate)")
        return {"add_qkv_bias": bool(hf.get("qkv_bias", True))}

    def family_export_problems(self, mc) -> List[str]:
        return ["no --qk-layernorm"] if mc.qk_layernorm else []

    def family_config_to_hf(self, mc) -> dict:
        return dict(super().family_config_to_hf(mc), qkv_bias=bool(mc.add_qkv_bias))


class Qwen3MoeAdapter(QwenMoeMixin, Qwen3Adapter):
    """Qwen3's attention (per-head q/k RMSNorm, head_dim of its own)."""
    family = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    model_type = "qwen3_moe"
