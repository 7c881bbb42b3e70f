"""Hugging Face Llama (``LlamaForCausalLM``) <-> megalite, and the base of every Llama-like
family (Mistral, Qwen2, Qwen3, Mixtral, ...).

Mapping of one layer i (megalite name <- HF name):

    decoder.layers.i.input_layernorm.weight         <- model.layers.i.input_layernorm.weight
    decoder.layers.i.self_attention.linear_qkv.weight <- q/k/v_proj, fused per query group
        [q_g0 (r*d rows), k_g0 (d), v_g0 (d), q_g1, ...], r = heads / kv heads
    decoder.layers.i.self_attention.linear_qkv.bias <- q/k/v_proj biases, same grouping
                                                       (--add-qkv-bias: Qwen2)
    decoder.layers.i.self_attention.q_layernorm.weight <- self_attn.q_norm (--qk-layernorm:
    decoder.layers.i.self_attention.k_layernorm.weight <- self_attn.k_norm  Qwen3)
    decoder.layers.i.self_attention.linear_proj.weight <- o_proj
    decoder.layers.i.pre_mlp_layernorm.weight       <- post_attention_layernorm
    decoder.layers.i.mlp.linear_fc1.weight          <- [gate_proj; up_proj]
    decoder.layers.i.mlp.linear_fc2.weight          <- down_proj

plus embed_tokens, model.norm and lm_head (absent when tied).  Both sides use the
``rotate_half`` RoPE convention, so q/k rows need no permutation; RoPE scaling maps in
``rope.py``.  Imported tensors are converted to fp32 (megalite keeps fp32 master weights);
export writes fp32 by default.

A family subclass states what it is (``family``, ``architectures``, ``model_type``), what
its config means (``family_fields_from_hf``, ``family_config_to_hf``) and what it cannot
be (``family_export_problems``); the tensor mapping above is shared.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

import torch

from megalite.checkpointing.hf_adapters.base import HFAdapter, UnsupportedModelError
from megalite.checkpointing.hf_adapters.sliding_window import hf_window
from megalite.checkpointing.hf_adapters.rope import (rope_export_problems, rope_fields_from_hf,
                                                     rope_parameters_to_hf)
from megalite.config.activations import activation_of
from megalite.config import ModelConfig


REQUIRED_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size",
                 "num_attention_heads", "vocab_size")


# Gemma's scalings: a family that cannot write one refuses a model that sets it
GEMMA_FLAGS = ("--scale-embeddings", "--softmax-scale", "--attn-logit-softcapping",
               "--final-logit-softcapping", "--rotary-base-local")


def _set(mc, flag: str) -> bool:
    value = getattr(mc, flag[2:].replace("-", "_"))
    return value is not None and value is not False


def take(sd: dict, key: str) -> torch.Tensor:
    """``sd[key]``, or a one-line error naming the missing tensor."""
    if key not in sd:
        raise UnsupportedModelError(f"checkpoint has no tensor '{key}'")
    return sd[key]


def attention_shape(m: dict) -> Tuple[int, int, int, int]:
    """(heads, query groups, head dim, layers) of a ``ModelConfig`` dict."""
    mc = ModelConfig(**m)
    return (mc.num_attention_heads, mc.resolved_query_groups(), mc.resolved_kv_channels(),
            mc.num_layers)


def refuse_sliding_window(hf: dict) -> None:
    """Qwen2/Qwen3/Mistral configs: only full attention in every layer maps."""
    if hf.get("use_sliding_window"):
        raise UnsupportedModelError("use_sliding_window: true is not supported for this "
                                    "family (megalite maps the windows of Mistral, Qwen2, "
                                    "Phi-3, Gemma and gpt-oss)")
    types = hf.get("layer_types") or []
    other = sorted({t for t in types if t != "full_attention"})
    if other:
        raise UnsupportedModelError(f"layer_types {other} are not supported (only "
                                    "full_attention)")


class LlamaAdapter(HFAdapter):
    family = "llama"
    architectures = ("LlamaForCausalLM",)
    model_type = "llama"
    nope_layers = False      # whether the family writes layers without RoPE (--no-rope-freq)
    norm_placement = "pre"   # the family's --norm-placement and --qk-layernorm-scope
    qk_layernorm_scope = "head"
    # the HF names of megalite's two layer norms (input_layernorm, pre_mlp_layernorm)
    layer_norm_names = ("input_layernorm", "post_attention_layernorm")
    activation = "swiglu"    # the family's MLP activation (config/activations.py)
    writes: Tuple[str, ...] = ()   # which of GEMMA_FLAGS the family's config can say
    # what HF stores for a norm of scale s: s - hf_norm_offset (Gemma: 1, it applies 1 + w)
    hf_norm_offset = 0.0
    # Qwen3-Next: whether the family writes Gated DeltaNet layers and gated attention
    linear_attention = False
    partial_rotary = False   # whether the family rotates part of each head (rope.py)
    llama4_attention = False  # chunks, L2 q/k norms, NoPE temperature (llama4.py)

    # -- configs -------------------------------------------------------------------------
    def config_from_hf(self, hf: dict) -> dict:
        archs = hf.get("architectures") or []
        if hf.get("model_type") != self.model_type or \
                any(a not in self.architectures for a in archs):
            raise UnsupportedModelError(
                f"unsupported architecture {archs or hf.get('model_type')}; only "
                f"{', '.join(self.architectures)} (model_type '{self.model_type}') converts")
        missing = [k for k in REQUIRED_KEYS if k not in hf]
        if missing:
            raise UnsupportedModelError(f"{self.architectures[0]} config lacks "
                                        f"{', '.join(missing)}")
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(
                f"hidden_act '{hf['hidden_act']}' is not supported (silu)")
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
            norm_epsilon=hf.get("rms_norm_eps", 1e-6), swiglu=True,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
            add_bias_linear=False, init_method_std=hf.get("initializer_range", 0.02),
            hidden_dropout=0.0, attention_dropout=float(hf.get("attention_dropout", 0.0)))
        cfg.update(rope_fields_from_hf(hf, self.partial_rotary))
        cfg.update(self.family_fields_from_hf(hf))
        return cfg

    def family_fields_from_hf(self, hf: dict) -> dict:
        """What this family's config adds to (or refuses of) the Llama mapping."""
        for key in ("attention_bias", "mlp_bias"):
            if hf.get(key):
                raise UnsupportedModelError(f"{key}: true is not supported for "
                                            f"{self.architectures[0]} (no biases)")
        return {}

    def export_problems(self, m: dict) -> List[str]:
        mc = ModelConfig(**m)
        return [msg for bad, msg in (
            (mc.normalization != "RMSNorm", "--normalization RMSNorm"),
            (activation_of(mc).name != self.activation, "--swiglu" if self.activation ==
             "swiglu" else f"--activation {self.activation}"),
            (mc.add_bias_linear, "--disable-bias-linear"),
            (bool(mc.num_experts), "no --num-experts"),
            (mc.multi_latent_attention, "no --multi-latent-attention"),
            (bool(mc.mtp_num_layers), "no --mtp-num-layers"),
            (mc.no_rope_freq is not None and not self.nope_layers, "no --no-rope-freq"),
            (mc.norm_placement != self.norm_placement,
             f"--norm-placement {self.norm_placement}"),
            (mc.qk_layernorm and mc.qk_layernorm_scope != self.qk_layernorm_scope,
             f"--qk-layernorm-scope {self.qk_layernorm_scope}"),
            (mc.rotary_percent != 1.0 and not self.partial_rotary, "no --rotary-percent"),
            (mc.attention_chunk_size is not None and not self.llama4_attention,
             "no --attention-chunk-size"),
            (mc.qk_l2_norm and not self.llama4_attention, "no --qk-l2-norm"),
            (mc.attn_temperature_tuning and not self.llama4_attention,
             "no --attn-temperature-tuning"))
            if bad] + \
            [f"no {flag}" for flag in GEMMA_FLAGS
             if flag not in self.writes and _set(mc, flag)] + \
            rope_export_problems(mc) + self.window_export_problems(mc) + \
            self.linear_attention_export_problems(mc) + self.family_export_problems(mc)

    def linear_attention_export_problems(self, mc) -> List[str]:
        """Qwen3-Next's switches: only a family that writes them may export them."""
        if self.linear_attention:
            return []
        return [msg for bad, msg in (
            (mc.experimental_attention_variant is not None,
             "no --experimental-attention-variant"),
            (mc.attention_output_gate, "no --attention-output-gate")) if bad]

    def window_export_problems(self, mc) -> List[str]:
        """Llama has no sliding window (Mistral and Qwen2 override)."""
        return ["no --window-size"] if hf_window(mc) is not None else []

    def family_export_problems(self, mc) -> List[str]:
        """Llama has neither q/k norms nor q/k/v biases."""
        return [msg for bad, msg in ((mc.add_qkv_bias, "no --add-qkv-bias"),
                                     (mc.qk_layernorm, "no --qk-layernorm")) if bad]

    def config_to_hf(self, m: dict, torch_dtype: str = "float32") -> dict:
        problems = self.export_problems(m)
        if problems:
            raise UnsupportedModelError(f"this model does not export as "
                                        f"{self.architectures[0]}; it needs "
                                        + ", ".join(problems))
        mc = ModelConfig(**m)
        rope = rope_parameters_to_hf(mc)
        hf = {
            "architectures": list(self.architectures[:1]), "model_type": self.model_type,
            "vocab_size": mc.vocab_size, "hidden_size": mc.hidden_size,
            "intermediate_size": mc.resolved_ffn_hidden_size(),
            "num_hidden_layers": mc.num_layers, "num_attention_heads": mc.num_attention_heads,
            "num_key_value_heads": mc.resolved_query_groups(),
            "head_dim": mc.resolved_kv_channels(), "hidden_act": "silu",
            "max_position_embeddings": mc.max_position_embeddings or mc.seq_length,
            "rms_norm_eps": mc.norm_epsilon, "rope_theta": mc.rotary_base,
            "rope_parameters": rope,
            "tie_word_embeddings": not mc.untie_embeddings_and_output_weights,
            "attention_dropout": mc.attention_dropout,
            "initializer_range": mc.init_method_std, "torch_dtype": torch_dtype,
            "dtype": torch_dtype,
        }
        if rope["rope_type"] != "default":
            hf["rope_scaling"] = dict(rope)     # what transformers < 5 reads
        hf.update(self.family_config_to_hf(mc))
        return hf

    def family_config_to_hf(self, mc) -> dict:
        return {"attention_bias": False, "mlp_bias": False}

    # -- state dicts ---------------------------------------------------------------------
    def from_hf(self, hf_sd: Dict[str, torch.Tensor], m: dict) -> Dict[str, torch.Tensor]:
        layers = attention_shape(m)[3]
        get = lambda k: take(hf_sd, k).float()  # noqa: E731
        shift = self.norm_shift(m)
        norm = lambda k: get(k) - shift  # noqa: E731
        out = {"embedding.word_embeddings.weight": get("model.embed_tokens.weight"),
               "decoder.final_layernorm.weight": norm("model.norm.weight")}
        for i in range(layers):
            hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
            out.update(self.attention_from_hf(get, norm, hf, mg, m))
            first, second = self.layer_norm_names
            out[mg + "input_layernorm.weight"] = norm(f"{hf}{first}.weight")
            out[mg + "pre_mlp_layernorm.weight"] = norm(f"{hf}{second}.weight")
            out.update(self.mlp_from_hf(get, hf, mg, m))
        if m["untie_embeddings_and_output_weights"]:
            out["output_layer.weight"] = get("lm_head.weight")
        return out

    def norm_shift(self, m: dict) -> float:
        """HF's norm weight minus megalite's: --apply-layernorm-1p stores scale - 1, HF
        stores scale - ``hf_norm_offset``."""
        return (1.0 if m.get("apply_layernorm_1p") else 0.0) - self.hf_norm_offset

    def attention_from_hf(self, get, norm, hf: str, mg: str, m: dict
                          ) -> Dict[str, torch.Tensor]:
        """One layer's attention tensors: q/k/v fused per query group (weights, and biases
        with --add-qkv-bias), the q/k norms with --qk-layernorm, o_proj."""
        heads, groups, d, _ = attention_shape(m)
        r = heads // groups
        a = hf + "self_attn."

        def fuse(kind: str) -> torch.Tensor:
            q, k, v = (get(f"{a}{n}_proj.{kind}") for n in "qkv")
            tail = q.shape[1:]                     # (hidden,) for weights, () for biases
            return torch.cat([q.view(groups, r * d, *tail), k.view(groups, d, *tail),
                              v.view(groups, d, *tail)], dim=1).reshape(-1, *tail)

        out = {mg + "self_attention.linear_qkv.weight": fuse("weight"),
               mg + "self_attention.linear_proj.weight": get(a + "o_proj.weight")}
        if m.get("add_qkv_bias") or m.get("add_bias_linear"):
            out[mg + "self_attention.linear_qkv.bias"] = fuse("bias")
        if m.get("add_bias_linear"):
            out[mg + "self_attention.linear_proj.bias"] = get(a + "o_proj.bias")
        if m.get("qk_layernorm"):
            out[mg + "self_attention.q_layernorm.weight"] = norm(a + "q_norm.weight")
            out[mg + "self_attention.k_layernorm.weight"] = norm(a + "k_norm.weight")
        return out

    def attention_to_hf(self, get, put, norm, mg: str, hf: str, m: dict
                        ) -> Dict[str, torch.Tensor]:
        heads, groups, d, _ = attention_shape(m)
        r = heads // groups
        a, s = hf + "self_attn.", mg + "self_attention."

        def split(kind: str) -> Dict[str, torch.Tensor]:
            fused = get(s + f"linear_qkv.{kind}")
            tail = fused.shape[1:]
            q, k, v = fused.view(groups, r + 2, d, *tail).split([r, 1, 1], dim=1)
            return {f"{a}q_proj.{kind}": put(q.reshape(heads * d, *tail)),
                    f"{a}k_proj.{kind}": put(k.reshape(groups * d, *tail)),
                    f"{a}v_proj.{kind}": put(v.reshape(groups * d, *tail))}

        out = split("weight")
        out[a + "o_proj.weight"] = put(get(s + "linear_proj.weight"))
        if m.get("add_qkv_bias") or m.get("add_bias_linear"):
            out.update(split("bias"))
        if m.get("add_bias_linear"):
            out[a + "o_proj.bias"] = put(get(s + "linear_proj.bias"))
        if m.get("qk_layernorm"):
            out[a + "q_norm.weight"] = norm(s + "q_layernorm.weight")
            out[a + "k_norm.weight"] = norm(s + "k_layernorm.weight")
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
        layers = attention_shape(m)[3]

        def put(t):  # a fresh tensor each: safetensors refuses tensors that share storage
            return t.to(dtype).clone(memory_format=torch.contiguous_format)

        def norm(key):
            w = take(sd, key)
            return put(w.float() + self.norm_shift(m) if self.norm_shift(m) else w)

        get = lambda k: take(sd, k)  # noqa: E731
        out = {"model.embed_tokens.weight": put(get("embedding.word_embeddings.weight")),
               "model.norm.weight": norm("decoder.final_layernorm.weight")}
        for i in range(layers):
            hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
            out.update(self.attention_to_hf(get, put, norm, mg, hf, m))
            first, second = self.layer_norm_names
            out[f"{hf}{first}.weight"] = norm(mg + "input_layernorm.weight")
            out[f"{hf}{second}.weight"] = norm(mg + "pre_mlp_layernorm.weight")
            out.update(self.mlp_to_hf(get, put, mg, hf, m))
        if m["untie_embeddings_and_output_weights"]:
            out["lm_head.weight"] = put(get("output_layer.weight"))
        return out
