"""The model the planner sizes: recipes, Hugging Face configs, pretrain_gpt.py flags, and
exact parameter counts per pipeline stage and rank.

The counts mirror megalite's GPTModel tensor by tensor (see docs/planner.md, "Parameters"),
so ``stage_params`` is what ``sum(p.numel() for p in model.parameters())`` returns on a rank.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from typing import List, Optional

from megalite.cli.arguments import build_parser
from megalite.config import ConfigError, ModelConfig
from megalite.cli.presets import MODEL_PRESETS, preset_model
from megalite.pipeline_parallel.split import PipelineSplit, split_layers
from megalite.config.activations import DEFAULT as DEFAULT_ACTIVATION
from megalite.config.activations import activation_for_hf, activation_of, switches
from megalite.config.attention_variants import attention_params

# Model presets live in one place (megalite/cli/presets.py): the planner's --recipe and the
# launch recipes (launch/recipes/*.yaml, ``recipe: {model: NAME}``) read the same shapes.
RECIPES = MODEL_PRESETS


def recipe(name: str) -> ModelConfig:
    if name.lower() not in RECIPES:
        raise ConfigError(f"--recipe: unknown model '{name}'; choose from {', '.join(RECIPES)}")
    return preset_model(name)


def from_hf_config(path: str) -> ModelConfig:
    """A Hugging Face config.json -> ModelConfig: through the family's adapter where one is
    registered (the same mapping convert.py uses: RoPE scaling, q/k norms, biases, head
    dim), else read generically as a Llama-like model (shapes only)."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"--hf-config: file '{path}' does not exist")
    try:
        with open(path) as fh:
            hf = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--hf-config: cannot read '{path}': {exc}") from None
    hf = hf.get("text_config", hf)
    adapted = _from_adapter(hf, path)
    if adapted is not None:
        return adapted
    need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [k for k in need if k not in hf]
    if missing:
        raise ConfigError(f"--hf-config: '{path}' lacks {', '.join(missing)}; is it a "
                          "Llama/Mistral/Mixtral/Qwen config.json?")
    if hf.get("shared_expert_intermediate_size"):
        raise ConfigError("--hf-config: shared experts (Qwen2-MoE) are not supported by megalite")
    heads = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or heads
    act = str(hf.get("hidden_act", "silu")).lower()
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    moe_ffn = hf.get("moe_intermediate_size") or (hf.get("intermediate_size") if experts else None)
    kv = hf.get("head_dim")
    m = ModelConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=heads, group_query_attention=groups != heads,
        num_query_groups=groups if groups != heads else None,
        kv_channels=kv if kv and kv != hf["hidden_size"] // heads else None,
        ffn_hidden_size=hf.get("intermediate_size"), vocab_size=hf["vocab_size"],
        seq_length=min(hf.get("max_position_embeddings", 4096), 8192),
        normalization="RMSNorm", norm_epsilon=hf.get("rms_norm_eps", 1e-5),
        position_embedding_type="rope", rotary_base=int(hf.get(
            "rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000))),
        **switches(activation_for_hf(act) or DEFAULT_ACTIVATION),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        add_bias_linear=bool(hf.get("attention_bias", False) and hf.get("mlp_bias", False)),
        hidden_dropout=0.0, attention_dropout=0.0,
        num_experts=experts or None, moe_ffn_hidden_size=moe_ffn,
        moe_router_topk=hf.get("num_experts_per_tok", 2),
        moe_layer_freq=hf.get("decoder_sparse_step", 1) or 1)
    return m


def _from_adapter(hf: dict, path: str) -> Optional[ModelConfig]:
    """The registered adapter's mapping (None when no adapter knows the architecture);
    the sequence is capped at 8192 as the generic reader does.  Imports torch: only a
    --hf-config run pays for it."""
    # start-up time: the HF adapters import torch; a plan imports it only for --hf-config
    from megalite.checkpointing.hf_adapters import UnsupportedModelError, adapter_for_hf

    try:
        adapter = adapter_for_hf(hf)
    except UnsupportedModelError:
        return None
    try:
        d = adapter.config_from_hf(hf)
    except UnsupportedModelError as exc:
        raise ConfigError(f"--hf-config {path}: {exc}") from None
    except KeyError as exc:
        raise ConfigError(f"--hf-config: '{path}' lacks {exc.args[0]}") from None
    d["seq_length"] = min(d["seq_length"], 8192)
    return ModelConfig(**d)


def from_flags(argv: List[str]) -> ModelConfig:
    """pretrain_gpt.py model flags (--num-layers ...) -> ModelConfig, via megalite's parser."""
    parser = build_parser("megalite plan")
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    by_flag = {s: a for a in parser._actions for s in a.option_strings}
    for tok in argv:
        if tok.startswith("--"):
            act = by_flag.get(tok.split("=", 1)[0])
            if act is None:
                raise ConfigError(f"unrecognized argument {tok} (see megalite plan --help)")
            if act.dest not in model_fields:
                raise ConfigError(f"{tok} is not a model flag; the planner chooses the layout "
                                  "(pin dimensions with --tp/--pp/--cp/--ep/--vpp)")
    ns = vars(parser.parse_args(argv))
    return ModelConfig(**{k: ns[k] for k in model_fields})


# ---- architecture arithmetic -----------------------------------------------------------

def is_moe_layer(m: ModelConfig, layer: int) -> bool:
    return m.is_moe_layer(layer)


def moe_ffn(m: ModelConfig) -> int:
    return m.moe_ffn_hidden_size or m.resolved_ffn_hidden_size()


def max_positions(m: ModelConfig) -> int:
    return m.max_position_embeddings or m.seq_length


def layers_per_stage(m: ModelConfig, pp: int, first: Optional[int] = None,
                     last: Optional[int] = None) -> List[int]:
    """Layer count on each pipeline rank (all its virtual chunks together)."""
    return split_layers(m.num_layers, pp, 1, first, last).counts()


@functools.lru_cache(maxsize=4096)
def pipeline_split(num_layers: int, pp: int, vpp: int = 1, first: Optional[int] = None,
                   last: Optional[int] = None, accounts: tuple = (False, False),
                   mtp_layers: int = 0, layout: Optional[str] = None,
                   vshape: bool = False) -> PipelineSplit:
    """megalite's split rule (pipeline_parallel/split.py): ``accounts`` = (embedding, loss)
    counted as pipeline layers, or ``layout`` (``--pipeline-model-parallel-layout``, which
    can also give the MTP depths a slot, as Bridge's DeepSeek-V3 ``Et|(tt|)*30mL``);
    ``vshape``: DualPipeV's placement (chunk 1 runs back up the ranks)."""
    emb, loss = tuple(accounts)[:2]
    return split_layers(num_layers, pp, vpp, first, last, emb, loss, vshape=vshape,
                        layout=layout, mtp_layers=mtp_layers)


def output_rank(pp: int, vpp: int = 1, vshape: bool = False) -> int:
    """The pipeline rank holding the final norm, output layer, loss and MTP modules: the
    last, or rank 0 in the V shape (the split's own ``output_stage``)."""
    return 0 if vshape and pp > 1 else pp - 1


def stage_layer_ids(m: ModelConfig, pp: int, pp_rank: int, vpp: int = 1,
                    first: Optional[int] = None, last: Optional[int] = None,
                    accounts: tuple = (False, False),
                    layout: Optional[str] = None, vshape: bool = False) -> List[int]:
    """Global indices of the layers pipeline rank ``pp_rank`` holds (``accounts``,
    ``layout``, ``vshape``: ``pipeline_split``'s)."""
    return pipeline_split(m.num_layers, pp, vpp, first, last, tuple(accounts),
                          m.mtp_num_layers or 0, layout, vshape).rank_layers(pp_rank)


@dataclass
class ParamCount:
    """Parameters on one rank, split by the data-parallel group that reduces them."""
    dense: int = 0    # reduced over DP x CP (everything but routed experts)
    expert: int = 0   # reduced over expert-DP

    @property
    def total(self) -> int:
        return self.dense + self.expert

    def __iadd__(self, other: "ParamCount"):
        self.dense += other.dense
        self.expert += other.expert
        return self


def _norm(m: ModelConfig, h: int) -> int:
    return 2 * h if m.normalization == "LayerNorm" else h


def norm_params(m: ModelConfig, h: int) -> int:
    """Parameters of one norm over ``h`` (LayerNorm: weight and bias)."""
    return _norm(m, h)


def stage_layer_kinds(m: ModelConfig, pp: int, pp_rank: int, vpp: int = 1,
                      first: Optional[int] = None, last: Optional[int] = None,
                      accounts: tuple = (False, False), layout: Optional[str] = None,
                      vshape: bool = False) -> tuple:
    """(dense layers, MoE layers) on a pipeline rank: layers differ only in their MLP."""
    ids = stage_layer_ids(m, pp, pp_rank, vpp, first, last, accounts, layout, vshape)
    n_moe = sum(is_moe_layer(m, i) for i in ids) if m.num_experts else 0
    return len(ids) - n_moe, n_moe


def with_mtp_layers(m: ModelConfig, kinds: tuple, last: bool) -> tuple:
    """(dense, MoE) transformer layers a stage runs: ``kinds`` plus, on the last stage, one
    per MTP depth, dense or MoE like the model's last layer (transformer/mtp.py)."""
    if not last or not m.mtp_num_layers:
        return kinds
    moe = is_moe_layer(m, m.num_layers)
    return kinds[0] + (0 if moe else m.mtp_num_layers), kinds[1] + (m.mtp_num_layers if moe
                                                                    else 0)


def layer_params(m: ModelConfig, layer: int, tp: int = 1, etp: int = 1, ep: int = 1) -> ParamCount:
    """One transformer layer's parameters on one rank (TP shards split, the rest replicated)."""
    return kind_params(m, is_moe_layer(m, layer), tp, etp, ep,
                       linear=m.is_linear_attention_layer(layer))


def attention_head_dims(m: ModelConfig) -> tuple:
    """(query heads, K/V heads, q/k head dim, v head dim) that core attention sees: MLA's
    expanded heads (qk + rope, v) or standard attention's."""
    if m.multi_latent_attention:
        return (m.num_attention_heads, m.num_attention_heads,
                m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim)
    d = m.resolved_kv_channels()
    return m.num_attention_heads, m.resolved_query_groups(), d, d


def mla_projections(m: ModelConfig) -> List[tuple]:
    """MLA's linears (transformer/mla.py) as (name, in, out, TP split): the down projections
    are "duplicated" on every TP rank, the up projections "column"-parallel (the ones
    Megatron's ``mla_up_proj`` recomputes), the output projection "row"-parallel.  The one
    table of MLA's shapes: parameters, FLOPs and the GEMMs the cost model times read it."""
    h, a = m.hidden_size, m.num_attention_heads
    qh = m.qk_head_dim + m.qk_pos_emb_head_dim
    if m.q_lora_rank:
        q = [("q_down", h, m.q_lora_rank, "duplicated"),
             ("q_up", m.q_lora_rank, a * qh, "column")]
    else:
        q = [("q", h, a * qh, "column")]
    return q + [("kv_down", h, m.kv_lora_rank + m.qk_pos_emb_head_dim, "duplicated"),
                ("kv_up", m.kv_lora_rank, a * (m.qk_head_dim + m.v_head_dim), "column"),
                ("proj", a * m.v_head_dim, h, "row")]


def mla_attention_params(m: ModelConfig, tp: int = 1) -> int:
    """MLA's projections and latent norms on one rank (transformer/mla.py): duplicated down
    projections and latent norms, column-parallel up projections, row-parallel output."""
    n = sum(i * o // (1 if split == "duplicated" else tp)
            for _, i, o, split in mla_projections(m))
    return n + mla_latent_norm_params(m) + (m.hidden_size if m.add_bias_linear else 0)


def mla_latent_norm_params(m: ModelConfig) -> int:
    """MLA's latent norms (with --qk-layernorm), replicated over TP."""
    if not m.qk_layernorm:
        return 0
    return _norm(m, m.kv_lora_rank) + (_norm(m, m.q_lora_rank) if m.q_lora_rank else 0)


def mla_latent_cache_elements(m: ModelConfig) -> int:
    """Per token and layer, what MLA must keep for later tokens at inference: the
    compressed latent and the shared rope key (DeepSeek-V2 section 2.1.2), against
    2 x heads x (qk + rope or v) for the expanded K/V."""
    return m.kv_lora_rank + m.qk_pos_emb_head_dim


def gated_delta_net_params(m: ModelConfig, tp: int = 1) -> int:
    """A Gated DeltaNet token mixer on one rank (transformer/gated_delta_net.py): the two
    column-parallel input projections, conv channels, A_log and dt_bias split with the
    heads, the gated norm replicated, the row-parallel output projection."""
    h, hk, hv = m.hidden_size, m.linear_num_key_heads, m.linear_num_value_heads
    dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
    channels = 2 * hk * dk + hv * dv                        # q, k, v through the conv
    n = (channels + hv * dv) * h // tp + 2 * hv * h // tp     # in_proj_qkvz, in_proj_ba
    n += channels * m.linear_conv_kernel_dim // tp + 2 * hv // tp     # conv, A_log, dt_bias
    return n + dv + hv * dv * h // tp                         # gated norm, out_proj


def kind_params(m: ModelConfig, moe: bool, tp: int = 1, etp: int = 1, ep: int = 1,
                linear: bool = False) -> ParamCount:
    """One layer of a kind: dense or MoE MLP, attention or (``linear``) Gated DeltaNet."""
    h, a, g = m.hidden_size, m.num_attention_heads, m.resolved_query_groups()
    d, bias = m.resolved_kv_channels(), m.add_bias_linear
    qkv_rows = (a + 2 * g) * d + (a * d if m.attention_output_gate else 0)
    n = _norm(m, h) * 2                                  # input norm + pre-MLP norm
    n += _norm(m, h) * 2 if m.norm_placement == "sandwich" else 0   # Gemma's post norms
    if linear:
        n += gated_delta_net_params(m, tp)
    elif m.multi_latent_attention:
        n += mla_attention_params(m, tp)
    else:
        n += qkv_rows * h // tp + (qkv_rows // tp if bias or m.add_qkv_bias else 0)   # QKV
        if m.qk_layernorm and m.qk_layernorm_scope == "projection":  # split over TP
            n += (a + g) * d // tp
        elif m.qk_layernorm:
            n += 2 * _norm(m, d)                        # q/k norms: replicated over TP
        n += h * a * d // tp + (h if bias else 0)                   # row-parallel projection
    n += attention_params(m, tp)               # the variants' own (config/attention_variants.py)
    gate = activation_of(m).fc1_blocks
    if not moe:
        f = m.resolved_ffn_hidden_size()
        n += gate * f * h // tp + (gate * f // tp if bias else 0)   # fc1
        n += h * f // tp + (h if bias else 0)                       # fc2
        return ParamCount(dense=n)
    fe, local = moe_ffn(m), m.num_experts // ep
    n += m.num_experts * (h + (1 if m.moe_expert_bias else 0))      # router (+ its bias)
    shared = m.moe_shared_expert_intermediate_size                  # a dense MLP (TP)
    if shared:
        n += gate * shared * h // tp + (gate * shared // tp if bias else 0)
        n += h * shared // tp + (h if bias else 0)
        n += h if m.moe_shared_expert_gate else 0                   # its [1, h] sigmoid gate
    per_expert = gate * fe * h // etp + h * fe // etp                # grouped
    if m.moe_expert_bias:                                           # gpt-oss (expert-TP 1)
        per_expert += gate * fe // etp + h
    return ParamCount(dense=n, expert=local * per_expert)


def embedding_params(m: ModelConfig, tp: int) -> int:
    n = m.padded_vocab_size(tp) * m.hidden_size // tp
    if m.position_embedding_type == "learned_absolute":
        n += max_positions(m) * m.hidden_size
    return n


def head_params(m: ModelConfig, tp: int, pp: int) -> int:
    """Final norm plus the output layer (or the tied embedding's copy when PP > 1; with MTP
    that copy is the last stage's embedding, counted in ``mtp_params``)."""
    n = _norm(m, m.hidden_size)
    if m.untie_embeddings_and_output_weights or (pp > 1 and not m.mtp_num_layers):
        n += m.padded_vocab_size(tp) * m.hidden_size // tp
    return n


def mtp_params(m: ModelConfig, tp: int = 1, pp: int = 1, etp: int = 1, ep: int = 1
               ) -> ParamCount:
    """The MTP modules on the last stage (transformer/mtp.py): per depth two input norms, the
    column-parallel eh_proj [h, 2h], a layer like the model's last and the final norm; plus,
    off the first stage, the embedding's tied copy."""
    out = ParamCount()
    if not m.mtp_num_layers:
        return out
    h = m.hidden_size
    one = layer_params(m, m.num_layers, tp, etp, ep)
    per_depth = 3 * _norm(m, h) + 2 * h * h // tp
    out += ParamCount(m.mtp_num_layers * (one.dense + per_depth), m.mtp_num_layers * one.expert)
    if pp > 1:
        out.dense += embedding_params(m, tp)
    return out


def stage_params(m: ModelConfig, pp_rank: int, tp: int = 1, pp: int = 1, vpp: int = 1,
                 etp: int = 1, ep: int = 1, first: Optional[int] = None,
                 last: Optional[int] = None, accounts: tuple = (False, False),
                 layout: Optional[str] = None, vshape: bool = False) -> ParamCount:
    """Exact parameter count on a rank of pipeline stage ``pp_rank``."""
    out = ParamCount()
    for layer in stage_layer_ids(m, pp, pp_rank, vpp, first, last, accounts, layout, vshape):
        out += layer_params(m, layer, tp, etp, ep)
    if pp_rank == 0:
        out.dense += embedding_params(m, tp)
    out_rank = output_rank(pp, vpp, vshape)
    if pp_rank == out_rank:          # on rank 0 (the V) the output reads the embedding itself
        out.dense += head_params(m, tp, pp if out_rank else 1)
        out += mtp_params(m, tp, pp, etp, ep)
    return out


def total_params(m: ModelConfig) -> int:
    """Unsharded parameter count of the whole model (tied weights counted once)."""
    return stage_params(m, 0, tp=1, pp=1).total


def active_params(m: ModelConfig) -> int:
    """Parameters a token passes through (MoE: top-k experts instead of all)."""
    total = total_params(m)
    if not m.num_experts:
        return total
    gate = activation_of(m).fc1_blocks
    fe, bias = moe_ffn(m), m.moe_expert_bias       # the experts' biases (moe/experts.py)
    per_expert = gate * fe * m.hidden_size + m.hidden_size * fe + \
        ((gate * fe + m.hidden_size) if bias else 0)
    moe_layers = sum(is_moe_layer(m, i) for i in range(m.num_transformer_layers()))  # + MTP
    return total - moe_layers * (m.num_experts - m.moe_router_topk) * per_expert


def describe(m: ModelConfig) -> str:
    moe = f", {m.num_experts} experts top-{m.moe_router_topk}" if m.num_experts else ""
    if m.multi_latent_attention:
        moe += (f", MLA (q rank {m.q_lora_rank}, kv rank {m.kv_lora_rank}, heads "
                f"{m.qk_head_dim}+{m.qk_pos_emb_head_dim}/{m.v_head_dim})")
    if m.mtp_num_layers:
        moe += f", MTP {m.mtp_num_layers}"
    gqa = f"/{m.resolved_query_groups()} kv" if m.resolved_query_groups() != m.num_attention_heads \
        else ""
    n = total_params(m)
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    return (f"{size} params: {m.num_layers} layers, hidden "
            f"{m.hidden_size}, {m.num_attention_heads}{gqa} heads, ffn "
            f"{m.resolved_ffn_hidden_size()}{'' if activation_of(m).flag is None else ' ' + activation_of(m).name}, vocab "
            f"{m.vocab_size}{moe}")


# Qwen3-Next hybrids: what a Gated DeltaNet layer carries along the sequence
def gated_delta_net_state_elements(m: ModelConfig) -> int:
    """Per sequence and DeltaNet layer, the recurrent state (value heads x dk x dv, fp32)
    plus the convolution's tail ((K - 1) tokens of q, k and v channels): what context
    parallelism hands from rank to rank and generation keeps instead of a KV cache (which
    grows with the sequence; this does not)."""
    hv, hk = m.linear_num_value_heads, m.linear_num_key_heads
    dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
    return hv * dk * dv + (m.linear_conv_kernel_dim - 1) * (2 * hk * dk + hv * dv)
