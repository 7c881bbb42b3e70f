"""Hugging Face Llama 4, text (``Llama4ForCausalLM``, ``Llama4TextConfig``) <-> megalite.

Attention: Llama's GQA projections, with
  * chunked local attention (``attention_chunk_size`` -> ``--attention-chunk-size``) on the
    layers that rotate and global attention on the NoPE ones (``no_rope_layers``, 1 = RoPE,
    or ``no_rope_layer_interval`` -> ``--no-rope-freq``, as SmolLM3's); a ``layer_types``
    other than that split is refused;
  * the NoPE layers' query temperature (``attn_temperature_tuning``, ``floor_scale``,
    ``attn_scale`` -> ``--attn-temperature-*``) and the rotating layers' weightless L2 q/k
    norm (``use_qk_norm`` -> ``--qk-l2-norm``);
  * RoPE on interleaved pairs (channels 2i, 2i+1, as complex numbers): the q and k rows of
    each head are permuted to megalite's half-split layout on import ([0, 2, ..., 1, 3, ...],
    DeepSeek-V3's permutation over the whole head) and back on export -- the scores, the
    L2 norm and the temperature are unchanged by it.

MLP slot, per layer (``moe_layers``, else every ``interleave_moe_layer_step``-th from
step - 1 -> a ``--moe-layer-freq`` 0/1 pattern; megalite name <- HF, ``mlp.`` <-
``feed_forward.``):

    dense:  linear_fc1 <- [gate_proj; up_proj] (``intermediate_size_mlp``), linear_fc2 <- down_proj
    MoE:    router.weight <- router.weight [E, h]: top-1 (``num_experts_per_tok`` 1) on the
              logits, the sigmoid of the chosen logit scaling the expert's INPUT
              (``--moe-router-score-function sigmoid --moe-apply-probs-on-input``);
            experts.linear_fc1 [E, 2F, h] <- experts.gate_up_proj [E, h, 2F] transposed
              (its columns [gate; up]); experts.linear_fc2 [E, h, F] <- experts.down_proj
              [E, F, h] transposed (F = ``intermediate_size``);
            shared_experts.linear_fc1/fc2 <- shared_expert.[gate_proj; up_proj] / down_proj.

Refused in one line naming the key: ``attention_bias``, ``num_experts_per_tok`` != 1,
``router_jitter_noise``, a ``layer_types`` that is not the RoPE/NoPE split.  The vision
tower and ``Llama4ForConditionalGeneration`` are not this adapter's (their architecture is
refused by the registry).
"""
from __future__ import annotations

from typing import Dict, List

import torch

from megalite.checkpointing.hf_adapters.base import UnsupportedModelError
from megalite.checkpointing.hf_adapters.deepseek_v3 import rope_permutation
from megalite.checkpointing.hf_adapters.llama import LlamaAdapter, attention_shape
from megalite.checkpointing.hf_adapters.smollm3 import no_rope_freq_from_hf
from megalite.config import ModelConfig


def hf_moe_layers(hf: dict) -> List[int]:
    """The MoE layers of a Llama 4 config: ``moe_layers``, else transformers' rule."""
    if hf.get("moe_layers") is not None:
        return list(hf["moe_layers"])
    step = hf.get("interleave_moe_layer_step", 1) or 1
    return list(range(step - 1, hf["num_hidden_layers"], step))


def layer_types(mc) -> List[str]:
    """transformers' ``layer_types`` of a megalite model: chunked where it chunks."""
    return ["chunked_attention" if mc.layer_chunk(i) is not None else "full_attention"
            for i in range(mc.num_layers)]


def layer_index(prefix: str) -> int:
    """The layer of a per-layer prefix such as ``decoder.layers.3.``."""
    return int(prefix.rstrip(".").rsplit(".", 1)[1])


def _permute_heads(w: torch.Tensor, heads: int, head_dim: int, inverse: bool) -> torch.Tensor:
    """The rows of each head (q or k projection) from interleaved rope pairs to halves."""
    perm = rope_permutation(head_dim)
    if inverse:
        perm = torch.argsort(perm)
    return w.reshape(heads, head_dim, -1)[:, perm].reshape(w.shape)


class Llama4Adapter(LlamaAdapter):
    family = "llama4"
    architectures = ("Llama4ForCausalLM",)
    model_type = "llama4_text"
    nope_layers = True
    llama4_attention = True

    # -- configs -------------------------------------------------------------------------
    def family_fields_from_hf(self, hf: dict) -> dict:
        for key, bad in (("attention_bias", bool(hf.get("attention_bias"))),
                         ("router_jitter_noise", bool(hf.get("router_jitter_noise")))):
            if bad:
                raise UnsupportedModelError(f"{key}: {hf[key]} is not supported for "
                                            "Llama4ForCausalLM")
        L = hf["num_hidden_layers"]
        chunk = hf.get("attention_chunk_size")
        out = {"no_rope_freq": no_rope_freq_from_hf(hf), "attention_chunk_size": chunk,
               "qk_l2_norm": bool(hf.get("use_qk_norm", True)),
               "ffn_hidden_size": hf.get("intermediate_size_mlp", hf["intermediate_size"])}
        probe = ModelConfig(num_layers=L, position_embedding_type="rope",
                            no_rope_freq=out["no_rope_freq"], attention_chunk_size=chunk)
        types = hf.get("layer_types")
        if types is not None and list(types) != layer_types(probe):
            raise UnsupportedModelError(
                f"layer_types {list(types)} is not supported: megalite chunks exactly the "
                f"layers with RoPE ({layer_types(probe)})")
        if out["no_rope_freq"] is not None and hf.get("attn_temperature_tuning", True):
            out.update(attn_temperature_tuning=True,
                       attn_temperature_floor_scale=int(hf.get("floor_scale", 8192)),
                       attn_temperature_scale=float(hf.get("attn_scale", 0.1)))
        experts = hf.get("num_local_experts") or 0
        moe = [int(i in hf_moe_layers(hf)) for i in range(L)] if experts else [0] * L
        if any(moe):
            k = hf.get("num_experts_per_tok", 1)
            if k != 1:
                raise UnsupportedModelError(f"num_experts_per_tok {k} is not supported for "
                                            "Llama4ForCausalLM (its experts take top-1 "
                                            "score-scaled inputs)")
            out.update(num_experts=experts, moe_router_topk=1,
                       moe_ffn_hidden_size=hf["intermediate_size"],
                       moe_shared_expert_intermediate_size=hf["intermediate_size"],
                       moe_layer_freq=1 if all(moe) else moe,
                       moe_router_score_function="sigmoid", moe_apply_probs_on_input=True,
                       moe_aux_loss_coeff=0.0)
        return out

    def export_problems(self, m: dict) -> List[str]:
        mc = ModelConfig(**m)
        body = [p for p in super().export_problems(m) if p != "no --num-experts"]
        if not mc.num_experts:
            return body
        return body + [msg for bad, msg in (
            (mc.moe_router_topk != 1, "--moe-router-topk 1"),
            (mc.moe_router_score_function != "sigmoid", "--moe-router-score-function sigmoid"),
            (not mc.moe_apply_probs_on_input, "--moe-apply-probs-on-input"),
            (mc.moe_shared_expert_intermediate_size != mc.resolved_moe_ffn_hidden_size(),
             "--moe-shared-expert-intermediate-size equal to --moe-ffn-hidden-size"),
            (mc.moe_shared_expert_gate, "no --moe-shared-expert-gate"),
            (mc.moe_router_enable_expert_bias, "no --moe-router-enable-expert-bias"),
            (mc.moe_router_topk_scaling_factor not in (None, 1.0),
             "no --moe-router-topk-scaling-factor"),
            (mc.moe_expert_capacity_factor is not None, "no --moe-expert-capacity-factor"),
        ) if bad]

    def family_export_problems(self, mc) -> List[str]:
        return [msg for bad, msg in ((mc.add_qkv_bias, "no --add-qkv-bias"),
                                     (mc.qk_layernorm, "no --qk-layernorm")) if bad]

    def family_config_to_hf(self, mc) -> dict:
        freq = mc.no_rope_freq
        moe = [i for i in range(mc.num_layers) if mc.is_moe_layer(i)]
        ffn = mc.resolved_ffn_hidden_size()
        return {
            "intermediate_size": mc.resolved_moe_ffn_hidden_size() if mc.num_experts else ffn,
            "intermediate_size_mlp": ffn, "attention_bias": False,
            "no_rope_layers": [int(mc.layer_uses_rotary(i)) for i in range(mc.num_layers)],
            "no_rope_layer_interval": freq if isinstance(freq, int) else 4,
            "attention_chunk_size": mc.attention_chunk_size, "layer_types": layer_types(mc),
            "attn_temperature_tuning": bool(mc.attn_temperature_tuning),
            "floor_scale": mc.attn_temperature_floor_scale,
            "attn_scale": mc.attn_temperature_scale, "use_qk_norm": bool(mc.qk_l2_norm),
            "num_local_experts": mc.num_experts or 0, "num_experts_per_tok": 1,
            "moe_layers": moe, "interleave_moe_layer_step": 1, "router_aux_loss_coef": 0.0,
            "router_jitter_noise": 0.0, "output_router_logits": False,
            # the special token ids are the tokenizer's: what the import recorded, else unset
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}

    def config_to_hf(self, m: dict, torch_dtype: str = "float32") -> dict:
        hf = super().config_to_hf(m, torch_dtype)
        hf.pop("rope_scaling", None)         # Llama4TextConfig is strict: rope_parameters only
        hf.pop("rope_theta", None)
        return hf

    # -- state dicts ---------------------------------------------------------------------
    def attention_from_hf(self, get, norm, hf: str, mg: str, m: dict
                          ) -> Dict[str, torch.Tensor]:
        heads, groups, d, _ = attention_shape(m)
        a = hf + "self_attn."
        rows = {a + "q_proj.weight": heads, a + "k_proj.weight": groups}
        return super().attention_from_hf(
            lambda key: _permute_heads(get(key), rows[key], d, False) if key in rows
            else get(key), norm, hf, mg, m)

    def attention_to_hf(self, get, put, norm, mg: str, hf: str, m: dict
                        ) -> Dict[str, torch.Tensor]:
        heads, groups, d, _ = attention_shape(m)
        out = super().attention_to_hf(get, put, norm, mg, hf, m)
        a = hf + "self_attn."
        for key, n in ((a + "q_proj.weight", heads), (a + "k_proj.weight", groups)):
            out[key] = put(_permute_heads(out[key], n, d, True))
        return out

    def mlp_from_hf(self, get, hf: str, mg: str, m: dict) -> Dict[str, torch.Tensor]:
        src, dst = hf + "feed_forward.", mg + "mlp."
        if not ModelConfig(**m).is_moe_layer(layer_index(mg)):
            return {dst + "linear_fc1.weight": torch.cat([get(src + "gate_proj.weight"),
                                                          get(src + "up_proj.weight")]),
                    dst + "linear_fc2.weight": get(src + "down_proj.weight")}
        shared = src + "shared_expert."
        return {
            dst + "router.weight": get(src + "router.weight"),
            dst + "experts.linear_fc1.weight": get(src + "experts.gate_up_proj").transpose(1, 2),
            dst + "experts.linear_fc2.weight": get(src + "experts.down_proj").transpose(1, 2),
            dst + "shared_experts.linear_fc1.weight": torch.cat(
                [get(shared + "gate_proj.weight"), get(shared + "up_proj.weight")]),
            dst + "shared_experts.linear_fc2.weight": get(shared + "down_proj.weight")}

    def mlp_to_hf(self, get, put, mg: str, hf: str, m: dict) -> Dict[str, torch.Tensor]:
        src, dst = mg + "mlp.", hf + "feed_forward."
        if not ModelConfig(**m).is_moe_layer(layer_index(mg)):
            gate, up = get(src + "linear_fc1.weight").chunk(2, dim=0)
            return {dst + "gate_proj.weight": put(gate), dst + "up_proj.weight": put(up),
                    dst + "down_proj.weight": put(get(src + "linear_fc2.weight"))}
        gate, up = get(src + "shared_experts.linear_fc1.weight").chunk(2, dim=0)
        shared = dst + "shared_expert."
        return {
            dst + "router.weight": put(get(src + "router.weight")),
            dst + "experts.gate_up_proj": put(get(src + "experts.linear_fc1.weight")
                                              .transpose(1, 2)),
            dst + "experts.down_proj": put(get(src + "experts.linear_fc2.weight")
                                           .transpose(1, 2)),
            shared + "gate_proj.weight": put(gate), shared + "up_proj.weight": put(up),
            shared + "down_proj.weight": put(get(src + "shared_experts.linear_fc2.weight"))}
