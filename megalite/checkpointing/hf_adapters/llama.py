"""Hugging Face Llama (``LlamaForCausalLM``) <-> megalite.

Mapping of one layer i (megalite name <- HF name):

    decoder.layers.i.input_layernorm.weight         <- model.layers.i.input_layernorm.weight
    decoder.layers.i.self_attention.linear_qkv.weight <- q/k/v_proj, fused per query group
        [q_g0 (r*d rows), k_g0 (d), v_g0 (d), q_g1, ...], r = heads / kv heads
    decoder.layers.i.self_attention.linear_proj.weight <- o_proj
    decoder.layers.i.pre_mlp_layernorm.weight       <- post_attention_layernorm
    decoder.layers.i.mlp.linear_fc1.weight          <- [gate_proj; up_proj]
    decoder.layers.i.mlp.linear_fc2.weight          <- down_proj

plus embed_tokens, model.norm and lm_head (absent when tied).  Both sides use the
``rotate_half`` RoPE convention, so q/k rows need no permutation.  Imported tensors are
converted to fp32 (megalite keeps fp32 master weights); export writes fp32 by default.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

import torch

from megalite.checkpointing.hf_adapters.base import HFAdapter, UnsupportedModelError


def rope_theta(hf: dict) -> float:
    """RoPE base of a HF config (only the default, unscaled RoPE maps)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise UnsupportedModelError(f"rope type '{kind}' is not supported (only default RoPE)")
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    return int(theta) if float(theta).is_integer() else float(theta)


def take(sd: dict, key: str) -> torch.Tensor:
    """``sd[key]``, or a one-line error naming the missing tensor."""
    if key not in sd:
        raise UnsupportedModelError(f"checkpoint has no tensor '{key}'")
    return sd[key]


def attention_shape(m: dict) -> Tuple[int, int, int, int]:
    """(heads, query groups, head dim, layers) of a ``ModelConfig`` dict."""
    from megalite.config import ModelConfig

    mc = ModelConfig(**m)
    return (mc.num_attention_heads, mc.resolved_query_groups(), mc.resolved_kv_channels(),
            mc.num_layers)


class LlamaAdapter(HFAdapter):
    family = "llama"
    architectures = ("LlamaForCausalLM",)
    model_type = "llama"

    # -- configs -------------------------------------------------------------------------
    def config_from_hf(self, hf: dict) -> dict:
        from megalite.config import ModelConfig

        archs = hf.get("architectures") or []
        if hf.get("model_type") != self.model_type or \
                any(a not in self.architectures for a in archs):
            raise UnsupportedModelError(
                f"unsupported architecture {archs or hf.get('model_type')}; only "
                f"{', '.join(self.architectures)} (model_type '{self.model_type}') converts")
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(
                f"hidden_act '{hf['hidden_act']}' is not supported (silu)")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise UnsupportedModelError(
                "Llama variants with attention/MLP biases are not supported")
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        max_pos = hf.get("max_position_embeddings", 4096)
        cfg = dataclasses.asdict(ModelConfig())
        cfg.update(
            num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
            ffn_hidden_size=hf["intermediate_size"], num_attention_heads=heads,
            group_query_attention=kv_heads != heads, num_query_groups=kv_heads,
            kv_channels=head_dim, seq_length=max_pos, max_position_embeddings=max_pos,
            vocab_size=hf["vocab_size"], normalization="RMSNorm",
            norm_epsilon=hf.get("rms_norm_eps", 1e-6), position_embedding_type="rope",
            rotary_base=rope_theta(hf), swiglu=True,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
            add_bias_linear=False, init_method_std=hf.get("initializer_range", 0.02),
            hidden_dropout=0.0, attention_dropout=float(hf.get("attention_dropout", 0.0)))
        return cfg

    def export_problems(self, m: dict) -> List[str]:
        from megalite.config import ModelConfig

        mc = ModelConfig(**m)
        return [msg for bad, msg in (
            (mc.normalization != "RMSNorm", "--normalization RMSNorm"),
            (mc.position_embedding_type != "rope", "--position-embedding-type rope"),
            (not mc.swiglu, "--swiglu"), (mc.add_bias_linear, "--disable-bias-linear"),
            (bool(mc.num_experts), "no --num-experts")) if bad]

    def config_to_hf(self, m: dict, torch_dtype: str = "float32") -> dict:
        from megalite.config import ModelConfig

        problems = self.export_problems(m)
        if problems:
            raise UnsupportedModelError("only Llama-style models export to Hugging Face; needs "
                                        + ", ".join(problems))
        mc = ModelConfig(**m)
        theta = mc.rotary_base
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": mc.vocab_size, "hidden_size": mc.hidden_size,
            "intermediate_size": mc.resolved_ffn_hidden_size(),
            "num_hidden_layers": mc.num_layers, "num_attention_heads": mc.num_attention_heads,
            "num_key_value_heads": mc.resolved_query_groups(),
            "head_dim": mc.resolved_kv_channels(), "hidden_act": "silu",
            "max_position_embeddings": mc.max_position_embeddings or mc.seq_length,
            "rms_norm_eps": mc.norm_epsilon, "rope_theta": theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta},
            "tie_word_embeddings": not mc.untie_embeddings_and_output_weights,
            "attention_bias": False, "mlp_bias": False, "attention_dropout": mc.attention_dropout,
            "initializer_range": mc.init_method_std, "torch_dtype": torch_dtype,
            "dtype": torch_dtype,
        }

    # -- state dicts ---------------------------------------------------------------------
    def from_hf(self, hf_sd: Dict[str, torch.Tensor], m: dict) -> Dict[str, torch.Tensor]:
        heads, groups, d, layers = attention_shape(m)
        r = heads // groups
        get = lambda k: take(hf_sd, k).float()  # noqa: E731
        shift = 1.0 if m.get("apply_layernorm_1p") else 0.0    # into a zero-centred model
        norm = lambda k: get(k) - shift  # noqa: E731
        out = {"embedding.word_embeddings.weight": get("model.embed_tokens.weight"),
               "decoder.final_layernorm.weight": norm("model.norm.weight")}
        for i in range(layers):
            hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
            q, k, v = (get(hf + f"self_attn.{n}_proj.weight") for n in "qkv")
            h = q.shape[1]
            out[mg + "self_attention.linear_qkv.weight"] = torch.cat(
                [q.view(groups, r * d, h), k.view(groups, d, h), v.view(groups, d, h)],
                dim=1).reshape(-1, h)
            out[mg + "self_attention.linear_proj.weight"] = get(hf + "self_attn.o_proj.weight")
            out[mg + "input_layernorm.weight"] = norm(hf + "input_layernorm.weight")
            out[mg + "pre_mlp_layernorm.weight"] = norm(hf + "post_attention_layernorm.weight")
            out.update(self.mlp_from_hf(get, hf, mg, m))
        if m["untie_embeddings_and_output_weights"]:
            out["output_layer.weight"] = get("lm_head.weight")
        return out

    def mlp_from_hf(self, get, hf: str, mg: str, m: dict) -> Dict[str, torch.Tensor]:
        """One layer's MLP tensors (a subclass maps its MoE block here)."""
        return {mg + "mlp.linear_fc1.weight": torch.cat(
                    [get(hf + "mlp.gate_proj.weight"), get(hf + "mlp.up_proj.weight")], dim=0),
                mg + "mlp.linear_fc2.weight": get(hf + "mlp.down_proj.weight")}

    def mlp_to_hf(self, get, put, mg: str, hf: str, m: dict) -> Dict[str, torch.Tensor]:
        gate, up = get(mg + "mlp.linear_fc1.weight").chunk(2, dim=0)
        return {hf + "mlp.gate_proj.weight": put(gate), hf + "mlp.up_proj.weight": put(up),
                hf + "mlp.down_proj.weight": put(get(mg + "mlp.linear_fc2.weight"))}

    def to_hf(self, sd: Dict[str, torch.Tensor], m: dict,
              dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
        heads, groups, d, layers = attention_shape(m)
        r = heads // groups

        def put(t):  # a fresh tensor each: safetensors refuses tensors that share storage
            return t.to(dtype).clone(memory_format=torch.contiguous_format)

        def norm(key):   # --apply-layernorm-1p stores w - 1; HF stores the scale itself
            w = take(sd, key)
            return put(w.float() + 1 if m.get("apply_layernorm_1p") else w)

        out = {"model.embed_tokens.weight": put(take(sd, "embedding.word_embeddings.weight")),
               "model.norm.weight": norm("decoder.final_layernorm.weight")}
        for i in range(layers):
            hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
            qkv = take(sd, mg + "self_attention.linear_qkv.weight")
            h = qkv.shape[1]
            q, k, v = qkv.view(groups, r + 2, d, h).split([r, 1, 1], dim=1)
            out[hf + "self_attn.q_proj.weight"] = put(q.reshape(heads * d, h))
            out[hf + "self_attn.k_proj.weight"] = put(k.reshape(groups * d, h))
            out[hf + "self_attn.v_proj.weight"] = put(v.reshape(groups * d, h))
            out[hf + "self_attn.o_proj.weight"] = put(
                take(sd, mg + "self_attention.linear_proj.weight"))
            out[hf + "input_layernorm.weight"] = norm(mg + "input_layernorm.weight")
            out[hf + "post_attention_layernorm.weight"] = norm(mg + "pre_mlp_layernorm.weight")
            out.update(self.mlp_to_hf(lambda k: take(sd, k), put, mg, hf, m))
        if m["untie_embeddings_and_output_weights"]:
            out["lm_head.weight"] = put(take(sd, "output_layer.weight"))
        return out
