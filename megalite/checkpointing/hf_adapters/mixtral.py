"""Hugging Face Mixtral (``MixtralForCausalLM``) <-> megalite: Llama plus an MoE block.

Everything outside the MLP is Llama's mapping (``LlamaAdapter``).  Per layer i:

    decoder.layers.i.mlp.router.weight              <- block_sparse_moe.gate.weight [E, h]
    decoder.layers.i.mlp.experts.linear_fc1.weight  <- [w1 (gate); w3 (up)] of each expert
                                                       stacked: [E, 2F, h]
    decoder.layers.i.mlp.experts.linear_fc2.weight  <- w2 (down) stacked: [E, h, F]

Checkpoints on disk use these per-expert names; ``transformers`` >= 5 holds the same
tensors fused in memory (``mlp.gate``, ``mlp.experts.gate_up_proj`` [E, 2F, h] and
``down_proj`` [E, h, F]), which are read too.  Mixtral's routing -- softmax over all
experts, top-k, renormalize -- equals megalite's default softmax over the top-k logits.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from megalite.checkpointing.hf_adapters.base import UnsupportedModelError, softmax_router_problems
from megalite.checkpointing.hf_adapters.llama import LlamaAdapter
from megalite.config import ModelConfig


class MixtralAdapter(LlamaAdapter):
    family = "mixtral"
    architectures = ("MixtralForCausalLM",)
    model_type = "mixtral"

    def config_from_hf(self, hf: dict) -> dict:
        if hf.get("sliding_window"):
            raise UnsupportedModelError("Mixtral with sliding-window attention is not supported")
        if hf.get("router_jitter_noise"):
            raise UnsupportedModelError("router_jitter_noise is not supported")
        cfg = super().config_from_hf(hf)
        missing = [k for k in ("num_local_experts", "num_experts_per_tok") if k not in hf]
        if missing:
            raise UnsupportedModelError(f"Mixtral config lacks {', '.join(missing)}")
        cfg.update(num_experts=hf["num_local_experts"], moe_router_topk=hf["num_experts_per_tok"],
                   moe_ffn_hidden_size=hf["intermediate_size"], moe_layer_freq=1,
                   moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)))
        return cfg

    def export_problems(self, m: dict) -> List[str]:
        mc = ModelConfig(**m)
        llama = [p for p in super().export_problems(m) if p != "no --num-experts"]
        return llama + [msg for bad, msg in (
            (not mc.num_experts, "--num-experts"),
            (bool(mc.num_experts) and not all(mc.is_moe_layer(i) for i in range(mc.num_layers)),
             "MoE in every layer (--moe-layer-freq 1)"),
            (mc.moe_router_pre_softmax, "softmax over the top-k (no --moe-router-pre-softmax)"),
            (bool(mc.moe_shared_expert_intermediate_size),
             "no --moe-shared-expert-intermediate-size")) if bad] + softmax_router_problems(mc)

    def config_to_hf(self, m: dict, torch_dtype: str = "float32") -> dict:
        hf = super().config_to_hf(m, torch_dtype)
        mc = ModelConfig(**m)
        for key in ("attention_bias", "mlp_bias", "head_dim"):
            hf.pop(key, None)
        hf.update(architectures=list(self.architectures), model_type=self.model_type,
                  intermediate_size=mc.resolved_moe_ffn_hidden_size(),
                  num_local_experts=mc.num_experts, num_experts_per_tok=mc.moe_router_topk,
                  router_aux_loss_coef=mc.moe_aux_loss_coeff, router_jitter_noise=0.0,
                  sliding_window=None, output_router_logits=False)
        if mc.resolved_kv_channels() != mc.hidden_size // mc.num_attention_heads:
            hf["head_dim"] = mc.resolved_kv_channels()
        return hf

    def mlp_from_hf(self, get, hf: str, mg: str, m: dict) -> Dict[str, torch.Tensor]:
        E = m["num_experts"]

        def has(key):
            try:
                get(key)
                return True
            except UnsupportedModelError:
                return False

        if has(hf + "mlp.experts.gate_up_proj"):          # transformers >= 5, in memory
            return {mg + "mlp.router.weight": get(hf + "mlp.gate.weight"),
                    mg + "mlp.experts.linear_fc1.weight": get(hf + "mlp.experts.gate_up_proj"),
                    mg + "mlp.experts.linear_fc2.weight": get(hf + "mlp.experts.down_proj")}
        moe = hf + "block_sparse_moe."
        fc1 = [torch.cat([get(f"{moe}experts.{e}.w1.weight"), get(f"{moe}experts.{e}.w3.weight")])
               for e in range(E)]
        return {mg + "mlp.router.weight": get(moe + "gate.weight"),
                mg + "mlp.experts.linear_fc1.weight": torch.stack(fc1),
                mg + "mlp.experts.linear_fc2.weight": torch.stack(
                    [get(f"{moe}experts.{e}.w2.weight") for e in range(E)])}

    def mlp_to_hf(self, get, put, mg: str, hf: str, m: dict) -> Dict[str, torch.Tensor]:
        moe = hf + "block_sparse_moe."
        fc1, fc2 = get(mg + "mlp.experts.linear_fc1.weight"), get(mg + "mlp.experts.linear_fc2.weight")
        out = {moe + "gate.weight": put(get(mg + "mlp.router.weight"))}
        for e in range(fc1.shape[0]):
            gate, up = fc1[e].chunk(2, dim=0)
            out[f"{moe}experts.{e}.w1.weight"] = put(gate)
            out[f"{moe}experts.{e}.w3.weight"] = put(up)
            out[f"{moe}experts.{e}.w2.weight"] = put(fc2[e])
        return out
