"""Hugging Face DeepSeek-V3 (``DeepseekV3ForCausalLM``) <-> megalite.

Multi-Latent Attention, the first ``first_k_dense_replace`` layers dense and the rest MoE
(sigmoid router with the aux-free expert bias, group-limited top-k, ``routed_scaling_factor``,
one shared expert), and the Multi-Token Prediction modules.  Per layer i (megalite <- HF):

    self_attention.linear_q_down_proj  <- self_attn.q_a_proj     (q_proj without q_lora_rank)
    self_attention.q_layernorm         <- self_attn.q_a_layernorm
    self_attention.linear_q_up_proj    <- self_attn.q_b_proj
    self_attention.linear_kv_down_proj <- self_attn.kv_a_proj_with_mqa
    self_attention.kv_layernorm        <- self_attn.kv_a_layernorm
    self_attention.linear_kv_up_proj   <- self_attn.kv_b_proj
    self_attention.linear_proj         <- self_attn.o_proj
    mlp.linear_fc1 / linear_fc2        <- mlp.[gate_proj; up_proj] / down_proj (dense layers)
    mlp.router.weight                  <- mlp.gate.weight
    mlp.router.expert_bias (a buffer)  <- mlp.gate.e_score_correction_bias
    mlp.experts.linear_fc1 / fc2       <- mlp.experts.{e}.[gate_proj; up_proj] / down_proj
    mlp.shared_experts.linear_fc1/fc2  <- mlp.shared_experts.[gate_proj; up_proj] / down_proj

RoPE: DeepSeek stores the rope rows of q and of the shared key interleaved (pairs (0,1),
(2,3), ..., ``rope_interleave``, transformers' default); megalite rotates halves (Llama's
``rotate_half``), so those rows are permuted on import ([0, 2, 4, ..., 1, 3, 5, ...]) and
back on export -- the attention scores are identical.

Multi-Token Prediction: the released checkpoints carry MTP module k as
``model.layers.{L+k}.*`` (L = num_hidden_layers; transformers' ``MtpModel`` reads them for
speculative decoding): ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and a decoder
layer (plus copies of the embedding and head, which megalite shares).  They import as
``mtp.layers.{k}.*`` when present and export the same way; a config announcing
``num_nextn_predict_layers`` without those weights imports without MTP (a note says so).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List

import torch

from megalite.checkpointing.hf_adapters.base import HFAdapter, UnsupportedModelError
from megalite.checkpointing.hf_adapters.llama import take
from megalite.checkpointing.hf_adapters.rope import rope_fields_from_hf, rope_parameters_to_hf
from megalite.config.activations import activation_of
from megalite.config import ModelConfig

EXPERT_BIAS = "mlp.router.expert_bias"       # full state-dict key suffix of the router buffer
_LATENT_NORM_EPS = 1e-6                      # transformers' q/kv latent norms: eps fixed at 1e-6


def rope_permutation(dim: int) -> torch.Tensor:
    """Row order taking interleaved rope pairs to rotate-half layout: [0, 2, ..., 1, 3, ...]."""
    return torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])


def _permute_rope_rows(w: torch.Tensor, heads: int, head_dim: int, rope: int,
                       inverse: bool = False) -> torch.Tensor:
    """Permute the last ``rope`` rows of each of ``heads`` blocks of ``head_dim`` rows."""
    perm = rope_permutation(rope)
    if inverse:
        perm = torch.argsort(perm)
    w = w.reshape(heads, head_dim, -1).clone()
    w[:, head_dim - rope:] = w[:, head_dim - rope:][:, perm]
    return w.reshape(heads * head_dim, -1)


def mla_rope_fields(hf: dict) -> dict:
    """The rope part's fields: the shared mapping (``rope.py``), with YaRN as MLA's
    ``--rope-type yarn`` under ``--position-embedding-type rope`` (Megatron's MLA flags)."""
    out = rope_fields_from_hf(hf)
    for key, kind in (("use_rope_scaling", "llama3"),
                      ("rotary_seq_len_interpolation_factor", "linear")):
        if out.get(key):      # MLA's rope part rotates with default or YaRN tables only
            raise UnsupportedModelError(f"rope_type '{kind}' is not supported for DeepSeek-V3 "
                                        "(default or yarn)")
    out["rope_type"] = "yarn" if out["position_embedding_type"] == "yarn" else "rope"
    out["position_embedding_type"] = "rope"
    return out


def _latent_eps(mc) -> float:
    return mc.norm_epsilon if mc.mla_latent_norm_epsilon is None else mc.mla_latent_norm_epsilon


def sigmoid_moe_fields(hf: dict, experts: int, first_dense: int, family: str) -> dict:
    """The MoE fields of a DeepSeek-V3-style config (GLM-4.5's too): layers from
    ``first_dense`` on sparse, a sigmoid router with the aux-free expert bias
    (``e_score_correction_bias``), group-limited top-k, ``routed_scaling_factor``,
    ``n_shared_experts`` of ``moe_intermediate_size`` each."""
    L = hf["num_hidden_layers"]
    groups = hf.get("n_group") or 1
    k = hf["num_experts_per_tok"]
    if groups > 1 and k % (hf.get("topk_group") or 1) or \
            groups > 1 and k // hf["topk_group"] != 2:
        raise UnsupportedModelError(
            f"{family} config not supported: group-limited routing ranks groups by "
            "their top-2 scores in transformers, megalite by their top "
            "num_experts_per_tok/topk_group; they agree only when that is 2")
    shared = hf.get("n_shared_experts") or 0
    return dict(num_experts=experts, moe_router_topk=k,
                moe_ffn_hidden_size=hf["moe_intermediate_size"],
                moe_layer_freq=[0] * first_dense + [1] * (L - first_dense),
                moe_shared_expert_intermediate_size=(
                    hf["moe_intermediate_size"] * shared if shared else None),
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_num_groups=groups if groups > 1 else None,
                moe_router_group_topk=hf["topk_group"] if groups > 1 else None,
                moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
                moe_aux_loss_coeff=0.0)


def sigmoid_moe_export_problems(mc) -> List[str]:
    """What a MoE model's router and shared expert lack to be written as DeepSeek-V3's."""
    if not mc.num_experts:
        return []
    return [msg for bad, msg in (
        (mc.moe_router_score_function != "sigmoid", "--moe-router-score-function sigmoid"),
        (not mc.moe_router_enable_expert_bias, "--moe-router-enable-expert-bias"),
        (mc.moe_router_topk < 2, "--moe-router-topk >= 2"),
        (mc.moe_apply_probs_on_input, "no --moe-apply-probs-on-input"),
        (bool(mc.moe_router_num_groups) and
         mc.moe_router_topk // (mc.moe_router_group_topk or 1) != 2,
         "--moe-router-topk / --moe-router-group-topk = 2 (transformers ranks groups by "
         "their top-2 scores)"),
        (mc.moe_shared_expert_intermediate_size is not None and
         mc.moe_shared_expert_intermediate_size % mc.resolved_moe_ffn_hidden_size(),
         "--moe-shared-expert-intermediate-size a multiple of --moe-ffn-hidden-size"),
    ) if bad]


def sigmoid_moe_to_hf(mc) -> dict:
    """The router and expert keys of a DeepSeek-V3-style config.json."""
    shared = mc.moe_shared_expert_intermediate_size
    return dict(n_routed_experts=mc.num_experts, num_experts_per_tok=mc.moe_router_topk,
                moe_intermediate_size=mc.resolved_moe_ffn_hidden_size(),
                n_shared_experts=shared // mc.resolved_moe_ffn_hidden_size() if shared else 0,
                n_group=mc.moe_router_num_groups or 1,
                topk_group=mc.moe_router_group_topk or 1, norm_topk_prob=True,
                routed_scaling_factor=mc.moe_router_topk_scaling_factor or 1.0)


def moe_mlp_tensors(get, has, hf: str, mg: str, moe: bool, to_hf: bool = False) -> dict:
    """One layer's MLP tensors in either direction, DeepSeek-V3's names (GLM-4.5's too):
    ``mlp.[gate_proj; up_proj] / down_proj`` dense; ``mlp.gate.weight`` and its
    ``e_score_correction_bias``, ``mlp.experts.{e}.*`` (or transformers 5's fused
    ``experts.gate_up_proj`` / ``down_proj``) and ``mlp.shared_experts.*`` MoE.  ``get`` reads
    the source, ``has`` asks it; an absent expert bias imports as None."""
    out = {}
    if to_hf:
        def pair(fc1, fc2, prefix):
            gate, up = get(fc1).chunk(2, dim=0)
            out.update({prefix + "gate_proj.weight": gate, prefix + "up_proj.weight": up,
                        prefix + "down_proj.weight": get(fc2)})
        if not moe:
            pair(mg + "mlp.linear_fc1.weight", mg + "mlp.linear_fc2.weight", hf + "mlp.")
            return out
        out[hf + "mlp.gate.weight"] = get(mg + "mlp.router.weight")
        out[hf + "mlp.gate.e_score_correction_bias"] = get(mg + EXPERT_BIAS)
        fc1, fc2 = get(mg + "mlp.experts.linear_fc1.weight"), \
            get(mg + "mlp.experts.linear_fc2.weight")
        for e in range(fc1.shape[0]):
            gate, up = fc1[e].chunk(2, dim=0)
            p = f"{hf}mlp.experts.{e}."
            out.update({p + "gate_proj.weight": gate, p + "up_proj.weight": up,
                        p + "down_proj.weight": fc2[e]})
        if has(mg + "mlp.shared_experts.linear_fc1.weight"):
            pair(mg + "mlp.shared_experts.linear_fc1.weight",
                 mg + "mlp.shared_experts.linear_fc2.weight", hf + "mlp.shared_experts.")
        return out

    def fused(prefix):
        return torch.cat([get(prefix + "gate_proj.weight"), get(prefix + "up_proj.weight")])

    if not moe:
        return {mg + "mlp.linear_fc1.weight": fused(hf + "mlp."),
                mg + "mlp.linear_fc2.weight": get(hf + "mlp.down_proj.weight")}
    out[mg + "mlp.router.weight"] = get(hf + "mlp.gate.weight")
    out[mg + EXPERT_BIAS] = get(hf + "mlp.gate.e_score_correction_bias") \
        if has(hf + "mlp.gate.e_score_correction_bias") else None
    if has(hf + "mlp.experts.gate_up_proj"):          # transformers >= 5, in memory
        out[mg + "mlp.experts.linear_fc1.weight"] = get(hf + "mlp.experts.gate_up_proj")
        out[mg + "mlp.experts.linear_fc2.weight"] = get(hf + "mlp.experts.down_proj")
    else:
        E = 0
        while has(f"{hf}mlp.experts.{E}.down_proj.weight"):
            E += 1
        if E == 0:
            raise UnsupportedModelError(f"checkpoint has no experts under '{hf}mlp.experts.'")
        out[mg + "mlp.experts.linear_fc1.weight"] = torch.stack(
            [fused(f"{hf}mlp.experts.{e}.") for e in range(E)])
        out[mg + "mlp.experts.linear_fc2.weight"] = torch.stack(
            [get(f"{hf}mlp.experts.{e}.down_proj.weight") for e in range(E)])
    if has(hf + "mlp.shared_experts.down_proj.weight"):
        out[mg + "mlp.shared_experts.linear_fc1.weight"] = fused(hf + "mlp.shared_experts.")
        out[mg + "mlp.shared_experts.linear_fc2.weight"] = \
            get(hf + "mlp.shared_experts.down_proj.weight")
    return out


class DeepseekV3Adapter(HFAdapter):
    family = "deepseek_v3"
    architectures = ("DeepseekV3ForCausalLM",)
    model_type = "deepseek_v3"

    # -- configs -------------------------------------------------------------------------
    def config_from_hf(self, hf: dict) -> dict:
        refuse = [msg for bad, msg in (
            (hf.get("hidden_act", "silu") != "silu", f"hidden_act '{hf.get('hidden_act')}' "
             "(only silu)"),
            (bool(hf.get("attention_bias")), "attention_bias=true (MLA projections without "
             "biases only)"),
            ((hf.get("num_key_value_heads") or hf["num_attention_heads"]) !=
             hf["num_attention_heads"], "num_key_value_heads != num_attention_heads (MLA has "
             "one K/V head per query head)"),
            (hf.get("topk_method", "noaux_tc") != "noaux_tc",
             f"topk_method '{hf.get('topk_method')}' (only noaux_tc, DeepSeek-V3's)"),
            (hf.get("scoring_func", "sigmoid") != "sigmoid",
             f"scoring_func '{hf.get('scoring_func')}' (only sigmoid)"),
            (hf.get("moe_layer_freq", 1) != 1, f"moe_layer_freq {hf.get('moe_layer_freq')} "
             "(only 1: every layer after the first_k_dense_replace is MoE)"),
            (hf.get("n_routed_experts") and not hf.get("norm_topk_prob", True),
             "norm_topk_prob=false (megalite's sigmoid router normalizes the top-k)"),
            (hf.get("n_routed_experts") and (hf.get("num_experts_per_tok") or 1) < 2,
             "num_experts_per_tok < 2"),
        ) if bad]
        if refuse:
            raise UnsupportedModelError(f"DeepSeek-V3 config not supported: {refuse[0]}")
        L = hf["num_hidden_layers"]
        experts = hf.get("n_routed_experts")
        first_dense = min(hf.get("first_k_dense_replace") or 0, L)
        rope = mla_rope_fields(hf)
        max_pos = hf.get("max_position_embeddings", 4096)
        seq = rope.get("yarn_original_max_position_embeddings") or max_pos
        cfg = dataclasses.asdict(ModelConfig())
        cfg.update(
            num_layers=L, hidden_size=hf["hidden_size"], ffn_hidden_size=hf["intermediate_size"],
            num_attention_heads=hf["num_attention_heads"], seq_length=min(seq, max_pos),
            max_position_embeddings=max_pos, vocab_size=hf["vocab_size"],
            normalization="RMSNorm", norm_epsilon=hf.get("rms_norm_eps", 1e-6),
            swiglu=True, add_bias_linear=False,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
            init_method_std=hf.get("initializer_range", 0.02), hidden_dropout=0.0,
            attention_dropout=float(hf.get("attention_dropout") or 0.0),
            multi_latent_attention=True, q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"], qk_head_dim=hf["qk_nope_head_dim"],
            qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
            qk_layernorm=True, **rope)
        if cfg["norm_epsilon"] != _LATENT_NORM_EPS:     # transformers' latent norms keep 1e-6
            cfg["mla_latent_norm_epsilon"] = _LATENT_NORM_EPS
        if experts:
            cfg.update(sigmoid_moe_fields(hf, experts, first_dense, "DeepSeek-V3"))
        # what config.json announces; ``from_hf`` keeps only the MTP layers the weights hold
        cfg["mtp_num_layers"] = hf.get("num_nextn_predict_layers",
                                       hf.get("num_mtp_layers")) or None
        return cfg

    def export_problems(self, m: dict) -> List[str]:
        mc = ModelConfig(**m)
        moe = bool(mc.num_experts)
        dense_then_moe = moe and all(
            mc.is_moe_layer(i) == (i >= self._first_moe(mc)) for i in range(mc.num_layers))
        return [msg for bad, msg in (
            (not mc.multi_latent_attention, "--multi-latent-attention"),
            (mc.normalization != "RMSNorm", "--normalization RMSNorm"),
            (mc.position_embedding_type != "rope", "--position-embedding-type rope"),
            (activation_of(mc).name != "swiglu", "--swiglu"), (mc.add_bias_linear, "--disable-bias-linear"),
            (not mc.qk_layernorm, "--qk-layernorm (DeepSeek's latent norms)"),
            (_latent_eps(mc) != _LATENT_NORM_EPS, "--mla-latent-norm-epsilon 1e-6"),
            (mc.norm_placement != "pre", "--norm-placement pre"),
            (moe and not dense_then_moe, "dense layers first, then MoE (--moe-layer-freq)"),
        ) if bad] + sigmoid_moe_export_problems(mc)

    @staticmethod
    def _first_moe(mc) -> int:
        return next((i for i in range(mc.num_layers) if mc.is_moe_layer(i)), mc.num_layers)

    def config_to_hf(self, m: dict, torch_dtype: str = "float32") -> dict:
        problems = self.export_problems(m)
        if problems:
            raise UnsupportedModelError("this model does not export as DeepseekV3ForCausalLM; "
                                        "needs " + ", ".join(problems))
        mc = ModelConfig(**m)
        rope = rope_parameters_to_hf(dataclasses.replace(
            mc, position_embedding_type="yarn" if mc.uses_yarn() else "rope"))
        max_pos = mc.max_position_embeddings or mc.seq_length
        hf = {
            "architectures": list(self.architectures), "model_type": self.model_type,
            "vocab_size": mc.vocab_size, "hidden_size": mc.hidden_size,
            "intermediate_size": mc.resolved_ffn_hidden_size(),
            "num_hidden_layers": mc.num_layers, "num_attention_heads": mc.num_attention_heads,
            "num_key_value_heads": mc.num_attention_heads, "hidden_act": "silu",
            "max_position_embeddings": max_pos, "rms_norm_eps": mc.norm_epsilon,
            "rope_parameters": rope, "rope_interleave": True,
            "tie_word_embeddings": not mc.untie_embeddings_and_output_weights,
            "attention_bias": False, "attention_dropout": mc.attention_dropout,
            "initializer_range": mc.init_method_std, "q_lora_rank": mc.q_lora_rank,
            "kv_lora_rank": mc.kv_lora_rank, "qk_nope_head_dim": mc.qk_head_dim,
            "qk_rope_head_dim": mc.qk_pos_emb_head_dim, "v_head_dim": mc.v_head_dim,
            "num_nextn_predict_layers": mc.mtp_num_layers or 0,
            "torch_dtype": torch_dtype, "dtype": torch_dtype,
        }
        if mc.num_experts:
            hf.update(sigmoid_moe_to_hf(mc), first_k_dense_replace=self._first_moe(mc),
                      topk_method="noaux_tc", scoring_func="sigmoid")
        else:        # transformers builds MoE layers from first_k_dense_replace on
            hf.update(first_k_dense_replace=mc.num_layers, n_routed_experts=1,
                      num_experts_per_tok=1, moe_intermediate_size=mc.resolved_ffn_hidden_size(),
                      n_shared_experts=0, n_group=1, topk_group=1)
        return hf

    # -- state dicts ---------------------------------------------------------------------
    def _attention(self, get, hf: str, mg: str, m: dict, to_hf: bool = False):
        """One layer's attention tensors in either direction (``get`` reads the source)."""
        heads, rope = m["num_attention_heads"], m["qk_pos_emb_head_dim"]
        q_head = m["qk_head_dim"] + rope
        a, b = (mg, hf) if to_hf else (hf, mg)       # a: source prefix, b: target prefix
        names = [("self_attention.linear_kv_down_proj.weight",
                  "self_attn.kv_a_proj_with_mqa.weight"),
                 ("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
                 ("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight"),
                 ("self_attention.linear_proj.weight", "self_attn.o_proj.weight")]
        if m.get("q_lora_rank"):
            names += [("self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight"),
                      ("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight"),
                      ("self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight")]
        else:
            names += [("self_attention.linear_q_proj.weight", "self_attn.q_proj.weight")]
        out = {}
        for mg_name, hf_name in names:
            src, dst = (mg_name, hf_name) if to_hf else (hf_name, mg_name)
            w = get(a + src)
            if mg_name.endswith(("linear_q_up_proj.weight", "linear_q_proj.weight")):
                w = _permute_rope_rows(w, heads, q_head, rope, inverse=to_hf)
            elif mg_name.endswith("linear_kv_down_proj.weight"):
                w = _permute_rope_rows(w, 1, w.shape[0], rope, inverse=to_hf)
            out[b + dst] = w
        return out

    def _layer_pairs(self, m: dict):
        """(HF prefix, megalite prefix, is MoE) of every decoder and MTP transformer layer."""
        mc = ModelConfig(**m)
        L = mc.num_layers
        for i in range(L + (mc.mtp_num_layers or 0)):
            mg = f"decoder.layers.{i}." if i < L else f"mtp.layers.{i - L}.transformer_layer."
            yield f"model.layers.{i}.", mg, mc.is_moe_layer(i)

    def from_hf(self, hf_sd: Dict[str, torch.Tensor], m: dict) -> Dict[str, torch.Tensor]:
        announced = m.get("mtp_num_layers") or 0
        L = m["num_layers"]
        mtp = 0
        while any(k.startswith(f"model.layers.{L + mtp}.") for k in hf_sd):
            mtp += 1
        if mtp and announced and mtp != announced:
            raise UnsupportedModelError(f"config.json announces {announced} MTP layers but the "
                                        f"checkpoint holds {mtp} (model.layers.{L}..)")
        if mtp and m.get("num_experts") and self._first_dense(m) >= L:
            raise UnsupportedModelError("MTP layers of an all-dense DeepSeek-V3 are MoE in "
                                        "transformers; megalite builds them like the last layer")
        if announced and not mtp:
            print(f"> note: config.json announces {announced} MTP layer(s) "
                  f"(num_nextn_predict_layers) but the checkpoint has no model.layers.{L}.* "
                  "weights: imported without MTP (--mtp-num-layers trains new ones)")
        m["mtp_num_layers"] = mtp or None
        get = lambda k: take(hf_sd, k).float()  # noqa: E731
        has = lambda k: k in hf_sd  # noqa: E731
        out = {"embedding.word_embeddings.weight": get("model.embed_tokens.weight"),
               "decoder.final_layernorm.weight": get("model.norm.weight")}
        if m["untie_embeddings_and_output_weights"]:
            out["output_layer.weight"] = get("lm_head.weight")
        for hf, mg, moe in self._layer_pairs(m):
            out[mg + "input_layernorm.weight"] = get(hf + "input_layernorm.weight")
            out[mg + "pre_mlp_layernorm.weight"] = get(hf + "post_attention_layernorm.weight")
            out.update(self._attention(get, hf, mg, m))
            out.update(moe_mlp_tensors(get, has, hf, mg, moe))
        for k in range(mtp):
            hf, mg = f"model.layers.{L + k}.", f"mtp.layers.{k}."
            for mg_name, hf_name in (("enorm", "enorm"), ("hnorm", "hnorm"),
                                     ("final_layernorm", "shared_head.norm")):
                out[f"{mg}{mg_name}.weight"] = get(f"{hf}{hf_name}.weight")
            out[mg + "eh_proj.weight"] = get(hf + "eh_proj.weight")
        return {k: v for k, v in out.items() if v is not None}

    @staticmethod
    def _first_dense(m: dict) -> int:
        freq = m.get("moe_layer_freq")
        return freq.index(1) if isinstance(freq, list) and 1 in freq else 0

    def to_hf(self, sd: Dict[str, torch.Tensor], m: dict,
              dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
        mc = ModelConfig(**m)

        def put(t):  # a fresh tensor each: safetensors refuses tensors that share storage
            return t.to(dtype).clone(memory_format=torch.contiguous_format)

        def get(k):
            if k.endswith(EXPERT_BIAS) and k not in sd:     # no bias kept: transformers' zeros
                return torch.zeros(mc.num_experts)
            return take(sd, k)

        has = lambda k: k in sd  # noqa: E731
        out = {"model.embed_tokens.weight": get("embedding.word_embeddings.weight"),
               "model.norm.weight": get("decoder.final_layernorm.weight")}
        head = get("output_layer.weight") if mc.untie_embeddings_and_output_weights else None
        if head is not None:
            out["lm_head.weight"] = head
        for hf, mg, moe in self._layer_pairs(m):
            out[hf + "input_layernorm.weight"] = get(mg + "input_layernorm.weight")
            out[hf + "post_attention_layernorm.weight"] = get(mg + "pre_mlp_layernorm.weight")
            out.update(self._attention(get, hf, mg, m, to_hf=True))
            out.update(moe_mlp_tensors(get, has, hf, mg, moe, to_hf=True))
        L = mc.num_layers
        for k in range(mc.mtp_num_layers or 0):
            hf, mg = f"model.layers.{L + k}.", f"mtp.layers.{k}."
            out[hf + "enorm.weight"] = get(mg + "enorm.weight")
            out[hf + "hnorm.weight"] = get(mg + "hnorm.weight")
            out[hf + "shared_head.norm.weight"] = get(mg + "final_layernorm.weight")
            out[hf + "eh_proj.weight"] = get(mg + "eh_proj.weight")
            # DeepSeek's release repeats the shared embedding and head in each MTP layer
            out[hf + "embed_tokens.weight"] = get("embedding.word_embeddings.weight")
            out[hf + "shared_head.head.weight"] = head if head is not None else \
                get("embedding.word_embeddings.weight")
        return {k: put(v) for k, v in out.items()}
