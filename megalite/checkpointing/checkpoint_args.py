"""The model a checkpoint holds, against the model the command line asks for.

Why: loading weights into a model of another shape fails deep inside a rank (or, for a
value no tensor shape shows, such as ``--rotary-base``, does not fail at all and trains
the wrong model).  So before any process group exists:

* ``--use-checkpoint-args`` copies the model flags from the checkpoint ``--load`` will
  read (Megatron's ``load_args_from_checkpoint``: shape flags only where the command line
  left them unset, architecture switches always) and how the model was trained (dropout,
  MoE balancing and capacity: the checkpoint's unless the command line gives the flag);
* otherwise a model flag that disagrees with the checkpoint is one ``ConfigError`` naming
  the flag, both values and the fix.

Layout flags (TP, PP, DP, VPP, ...) may differ: checkpoints reshard on load.
``model_flags`` renders a checkpoint's model as ``pretrain_gpt.py`` flags (the converter
prints them).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Iterable, List, Optional, Tuple

from megalite.checkpointing.manifest import iteration_dir, read_marker, saved_iterations
from megalite.config import ConfigError, MegaliteConfig, ModelConfig, field_flag
from megalite.transformer.activations import SWITCHES, activation_of

# Copied only where the command line left them unset (Megatron's non-forced _set_arg).
SHAPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "kv_channels", "seq_length", "max_position_embeddings", "vocab_size")
# Architecture switches: the checkpoint's value always wins (Megatron's force=True).
ARCH_FIELDS = ("group_query_attention", "num_query_groups", "normalization", "norm_epsilon",
               "position_embedding_type", "rotary_base", "rotary_percent", "apply_layernorm_1p",
               *SWITCHES, "activation", "untie_embeddings_and_output_weights", "add_bias_linear",
               "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
               "moe_router_score_function", "moe_router_pre_softmax",
               "moe_router_enable_expert_bias", "moe_shared_expert_intermediate_size",
               "add_qkv_bias", "qk_layernorm", "use_rope_scaling", "rope_scaling_factor",
               "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
               "rope_scaling_original_max_position_embeddings", "rotary_scaling_factor",
               "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
               "yarn_correction_range_round_to_int", "mscale", "mscale_all_dim",
               "moe_shared_expert_gate", "moe_router_topk_scaling_factor",
               "moe_router_num_groups", "moe_router_group_topk",
               # Multi-Latent Attention and its rope part; Multi-Token Prediction
               "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
               "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "mtp_num_layers",
               "attn_logit_softcapping", "final_logit_softcapping")
# Fields that mean something only under one position embedding / switch (``_applies``).
LLAMA3_ROPE_FIELDS = ("rope_scaling_factor", "rope_scaling_low_freq_factor",
                      "rope_scaling_high_freq_factor",
                      "rope_scaling_original_max_position_embeddings")
YARN_FIELDS = ("rotary_scaling_factor", "yarn_original_max_position_embeddings",
               "yarn_beta_fast", "yarn_beta_slow", "yarn_correction_range_round_to_int",
               "mscale", "mscale_all_dim")
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
              "v_head_dim", "rope_type")
# How the model was trained (regularisation, MoE balancing and token dropping): the
# checkpoint's value unless the command line (or --config) gives the flag.  Without this a
# fine-tune of an imported Llama would train with the default dropout of 0.1.
TRAINED_FIELDS = ("init_method_std", "hidden_dropout", "attention_dropout",
                  "moe_aux_loss_coeff", "moe_router_load_balancing_type", "moe_z_loss_coeff",
                  "moe_router_bias_update_rate", "moe_expert_capacity_factor",
                  "moe_token_drop_policy", "mtp_loss_scaling_factor",
                  "qk_clip", "qk_clip_threshold", "qk_clip_alpha")
TOKENIZER_FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file",
                    "tiktoken_pattern", "tiktoken_num_special_tokens", "tiktoken_special_tokens")
# Run-time choices, not part of what the weights mean: never copied, never printed by
# model_flags.  Every ModelConfig field is in exactly one of these four tuples (a test
# holds every new field to it).
NOT_MODEL = ("transformer_impl",)
RUNTIME_FIELDS = ("make_vocab_size_divisible_by", "attention_backend",
                  "moe_token_dispatcher_type", "transformer_impl", "fp8_format",
                  "fp8_amax_history_len", "fp8_amax_compute_algo", "cross_entropy_loss_fusion",
                  "cross_entropy_chunk_tokens")

_FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig)}


def flag_of(name: str) -> str:
    return field_flag(_FIELDS[name])


def read_checkpoint_meta(load_dir: str) -> Optional[Tuple[str, dict]]:
    """(metadata.json path, its contents) of the iteration ``--load`` reads: the marker's,
    else the newest with a metadata.json; None when ``load_dir`` holds no checkpoint."""
    if not load_dir or not os.path.isdir(load_dir):
        return None
    marked, _ = read_marker(load_dir)
    candidates = ([marked] if marked is not None else []) + saved_iterations(load_dir)
    for it in candidates:
        path = os.path.join(iteration_dir(load_dir, it), "metadata.json")
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    meta = json.load(f)
            except (OSError, ValueError):
                continue
            if isinstance(meta.get("model"), dict):
                return path, meta
    return None


def _resolved(name: str) -> Callable[[ModelConfig], Any]:
    """How a field is compared: derived values are compared as the model builds them."""
    special = {
        "ffn_hidden_size": ModelConfig.resolved_ffn_hidden_size,
        "kv_channels": ModelConfig.resolved_kv_channels,
        "num_query_groups": ModelConfig.resolved_query_groups,
        "max_position_embeddings": lambda m: m.max_position_embeddings or m.seq_length,
        "moe_ffn_hidden_size": ModelConfig.resolved_moe_ffn_hidden_size,
        "moe_layer_freq": lambda m: [m.is_moe_layer(i) for i in range(m.num_layers)],
        "activation": lambda m: activation_of(m).name,
    }
    return special.get(name, lambda m: getattr(m, name))


def _applies(name: str, m: ModelConfig) -> bool:
    """Whether a field means anything for this model (e.g. rotary flags only with RoPE)."""
    if name in ("rotary_base", "rotary_percent"):
        return m.uses_rotary()
    if name == "use_rope_scaling":
        return m.position_embedding_type == "rope"
    if name in LLAMA3_ROPE_FIELDS:
        return m.position_embedding_type == "rope" and m.use_rope_scaling
    if name in YARN_FIELDS:
        return m.uses_yarn()
    if name == "max_position_embeddings":
        return m.position_embedding_type == "learned_absolute"
    if name.startswith("moe_"):
        return bool(m.num_experts)
    if name in MLA_FIELDS:
        return m.multi_latent_attention
    if name in SWITCHES:                    # with --activation on either side: compared as
        return m.activation is None         # the activation they select (next)
    return name not in ("group_query_attention", "seq_length")   # compared as query groups


def _model_from(saved: dict) -> ModelConfig:
    known = {k: v for k, v in saved.items() if k in _FIELDS}
    return ModelConfig(**known)


def _render(name: str, value) -> str:
    """``value`` of field ``name`` as command-line text (ints stay ints, lists as Megatron's)."""
    if isinstance(value, list):
        return "[" + ",".join(str(int(v)) for v in value) + "]"
    if isinstance(value, float) and value.is_integer() and "int" in str(_FIELDS[name].type) \
            and "float" not in str(_FIELDS[name].type):
        return str(int(value))
    return str(value)


def _as_flags(name: str, value) -> List[str]:
    """Flags that set field ``name`` to ``value`` ([] when the default already does)."""
    f = _FIELDS[name]
    action = f.metadata.get("action")
    if action in ("store_true", "store_false"):
        on = value if action == "store_true" else not value
        return [field_flag(f)] if on else []
    if value is None:
        return []
    return [field_flag(f), _render(name, value)]


def _describe(name: str, value) -> str:
    action = _FIELDS[name].metadata.get("action")
    if action == "store_true":
        return "on" if value else "off"
    if action == "store_false":
        return "off" if value else "on"
    return _render(name, value) if not isinstance(value, bool) else str(value)


def _fix(name: str, saved: ModelConfig) -> str:
    """The flags that make this run agree with the checkpoint on ``name``."""
    if name == "num_query_groups":
        groups = saved.resolved_query_groups()
        if groups == saved.num_attention_heads:
            return "no --group-query-attention"
        return f"--group-query-attention --num-query-groups {groups}"
    if name in ("ffn_hidden_size", "kv_channels", "max_position_embeddings",
                "moe_ffn_hidden_size", "activation"):
        value = _resolved(name)(saved)
    else:
        value = getattr(saved, name)
    flags = _as_flags(name, value)
    return " ".join(flags) if flags else f"no {flag_of(name)}"


def check_model_matches_checkpoint(cfg: MegaliteConfig) -> None:
    """One ``ConfigError`` for the first model flag that disagrees with the checkpoint
    ``--load`` reads; nothing when there is no checkpoint (yet)."""
    found = read_checkpoint_meta(cfg.checkpoint.load)
    if found is None:
        return
    path, meta = found
    where = os.path.dirname(os.path.dirname(path))
    try:
        saved = _model_from(meta["model"])
    except (TypeError, ValueError):
        return                              # an unreadable model section: the load reports it
    ours = cfg.model
    for name in SHAPE_FIELDS + ARCH_FIELDS:
        if name not in _FIELDS or (name not in meta["model"] and name != "activation"):
            continue                        # (an old checkpoint's activation: its switches)
        if name == "vocab_size" and (saved.vocab_size is None or
                                     (ours.vocab_size is None and cfg.data.tokenizer_type)):
            continue                        # from the tokenizer; the load's shape check sees it
        if not (_applies(name, ours) and _applies(name, saved)):
            continue
        try:
            a, b = _resolved(name)(ours), _resolved(name)(saved)
        except (TypeError, ValueError, ZeroDivisionError):
            continue
        if a != b:
            shown = {"num_query_groups": lambda m: m.resolved_query_groups(),
                     "moe_layer_freq": lambda m: m.moe_layer_freq}.get(
                         name, lambda m: _resolved(name)(m))
            raise ConfigError(
                f"{flag_of(name)}: this run has {_describe(name, shown(ours))}, the checkpoint "
                f"in {where} has {_describe(name, shown(saved))}; pass "
                f"{_fix(name, saved)} (or --use-checkpoint-args)")


def apply_checkpoint_args(cfg: MegaliteConfig, given: Iterable[str] = ()
                          ) -> Tuple[MegaliteConfig, List[str]]:
    """``--use-checkpoint-args``: ``cfg`` with the checkpoint's model (and, if none is
    given, tokenizer) settings, and the notes to print; ``cfg`` itself when ``--load``
    holds no checkpoint yet (a run that will resume into it starts from its own flags).
    ``given``: the field names the command line or --config set (those win for
    ``TRAINED_FIELDS``; a replaced architecture flag is noted only when given)."""
    load = cfg.checkpoint.load
    if not load:
        raise ConfigError("--use-checkpoint-args reads the model flags from a checkpoint: "
                          "give --load DIR")
    found = read_checkpoint_meta(load)
    if found is None:
        return cfg, [f"> --use-checkpoint-args: no checkpoint in {load} yet; using the "
                     "command-line model flags"]
    path, meta = found
    saved, model = meta["model"], dataclasses.asdict(cfg.model)
    given = set(given)
    notes = []
    for name in SHAPE_FIELDS + ARCH_FIELDS + TRAINED_FIELDS:
        if name not in _FIELDS or name not in saved:
            continue
        if name in SHAPE_FIELDS and model[name] is not None:
            continue                        # the command line wins for unforced shape flags
        if name in TRAINED_FIELDS and name in given:
            continue                        # e.g. --hidden-dropout for this fine-tune
        if model[name] != saved[name]:
            if name in given and model[name] is not None:
                notes.append(f"> {flag_of(name)} {_describe(name, model[name])} replaced by "
                             f"the checkpoint's {_describe(name, saved[name])}")
            model[name] = saved[name]
    if "activation" not in saved:
        model["activation"] = None          # a checkpoint from before --activation: its switches
    data = dataclasses.asdict(cfg.data)
    saved_data = (meta.get("args") or {}).get("data") or {}
    tok = (meta.get("extra") or {}).get("tokenizer") or {}
    if not data["tokenizer_type"] and not data["mock_data"] and \
            (saved_data.get("tokenizer_type") or tok.get("tokenizer_type")):
        for name in TOKENIZER_FIELDS:
            if name in saved_data:
                data[name] = saved_data[name]
        if tok.get("tokenizer_model"):
            data["tokenizer_model"] = tok["tokenizer_model"]      # absolute at save time
    notes.append(f"> model flags from the checkpoint {path}")
    new = dataclasses.replace(cfg, model=type(cfg.model)(**model),
                              data=type(cfg.data)(**data))
    return new, notes


def model_flags(model: dict) -> List[str]:
    """``pretrain_gpt.py`` flags that build ``model`` (a ``ModelConfig`` dict): every field
    whose value differs from the default, run-time choices left out."""
    default = dataclasses.asdict(ModelConfig())
    out: List[str] = []
    for name in _FIELDS:                    # the --help order, whatever the dict's order
        if name not in model or name in NOT_MODEL or model[name] == default[name]:
            continue
        out += _as_flags(name, model[name])
    return out
