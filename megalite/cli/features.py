"""Which features and values combine, declared once: the rule engine.

Every feature says how to tell from a ``MegaliteConfig`` that it is on (``on``) and which
flags turn it on; ``RULES`` says what a feature needs (``Needs``, any of several), which
features do not combine (``Excludes``, each with its reason), which settings a feature
refuses (``Refuses``) and which relations between values must hold (``Relation``: heads over
TP, MLA's head layout, precision and data flags).  Rules name features by property where
one exists (``SPLIT_BACKWARD``: the schedules that split backward), so a new schedule
inherits them.  Pairs inside one ``group`` are alternatives of one choice (one pipeline
schedule per run).  Everything else combines, and ``COVERAGE``
(``megalite/cli/feature_coverage.py``) names the equivalence tests that run the
combinations (tests/unit/test_feature_table.py walks every pair: excluded or covered, never
neither, and breaks every rule once).

Readers: validation (``check_features``: every rule, first broken one reported), the
planner's search (``validate_layout`` applies the layout rules, and its pruning calls the
size functions below, so the search enumerates only layouts the table allows), backend
selection (``--transformer-impl auto`` is resolved before the rules are read, so TE's rules
hold for it too; selection itself reports only what the machine lacks) and
docs/compatibility.md (``tools/compatibility_matrix.py`` writes it from this table).
A flag's own domain (type, range, choices) is declared beside its field
(``megalite/config/domains.py``); so is a flag that needs another (``requires=``), and each
such declaration is a rule of this table (``REQUIREMENTS``), checked with the others.  Model constructors assert what a rule here guarantees,
naming the rule.

The kinds of rule and the layout-size relations are in ``megalite/cli/rule_kinds.py``.
Importing this module does not import torch (the planner reads it).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from megalite.cli.rule_kinds import (  # noqa: F401 -- the table's names, read as F.X too
    Excludes, Needs, QuotesEnvironment, Refuses, Relation, Rule, a2a_heads_split, any_of,
    cp_sequence_split, heads_split, hsdp_splits, schedule_fits)
from megalite.cli.feature_coverage import (COVERAGE, PAIRS_TEST,  # noqa: F401 -- read here
                                           covering_tests)
from megalite.config import all_fields, field_flag, find_field
from megalite.config.domains import requirement_problem, requirements
from megalite.config.pipeline_schedules import SCHEDULES, resolve_schedule
from megalite.config.score_mods import SCORE_MODS, refusal_reason
from megalite.config.attention_variants import VARIANTS
from megalite.cli.feature_reasons import (  # noqa: F401 -- the rules' reasons, read as F.X too
    CP_A2A_COMPILE, CP_DROPOUT, FP8_RECOMPUTE, MOE_COMPILE, MOE_FEATURES, SPLIT_BACKWARD,
    TE_SPLIT_BACKWARD, VSHAPE, VSHAPE_MTP, VSHAPE_UNEVEN, a2a_reason, flags_environment,
    fp8_without_te, heads_reason, hsdp_group_sizes, hsdp_reason, mla_extra,
    mla_position_reason, moe, precision_conflict, precision_reason, recomputes_moe_layers,
    schedule_misfit, schedule_reason, split_moe_recompute_reason, unwired_fp8, vpp)

LAYOUT, STRATEGY, IMPLEMENTATION = "layout", "strategy", "implementation"


@dataclass(frozen=True)
class Feature:
    name: str
    summary: str
    flags: str                     # how a user turns it on
    on: Callable                   # MegaliteConfig -> bool
    kind: str = LAYOUT             # layout (how the model is cut) | strategy | implementation
    group: Optional[str] = None    # alternatives of one choice


# ---- the features ------------------------------------------------------------------------

def _schedule_is(name: str) -> Callable:
    def on(cfg) -> bool:
        p = cfg.parallel
        return p.pp > 1 and resolve_schedule(p.pipeline_schedule, vpp(cfg)).name == name
    return on


_SCHEDULE_FLAGS = {"1f1b": "--pipeline-model-parallel-size N (> 1)",
                   "interleaved": "PP > 1 and --num-virtual-stages-per-pipeline-rank V (> 1) "
                                  "(or --num-layers-per-virtual-pipeline-stage)",
                   "zero-bubble": "PP > 1 and --pipeline-schedule zero-bubble"}

FEATURES: Dict[str, Feature] = {f.name: f for f in (
    Feature("tp", "tensor parallelism", "--tensor-model-parallel-size N (> 1)",
            lambda c: c.parallel.tp > 1),
    Feature("sp", "sequence parallelism (norms, dropout and boundaries split over TP)",
            "--sequence-parallel with TP > 1", lambda c: c.parallel.sequence_parallel_active),
    *(Feature(f"pp-{name}", f"pipeline, {s.summary}",
              _SCHEDULE_FLAGS.get(name, f"PP > 1 and --pipeline-schedule {name}"),
              _schedule_is(name), group="pipeline schedule")
      for name, s in SCHEDULES.items()),
    Feature("pp-uneven", "uneven pipeline split (lighter first / last stage)",
            "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers",
            lambda c: c.parallel.decoder_first_pipeline_num_layers is not None or
            c.parallel.decoder_last_pipeline_num_layers is not None),
    Feature("pp-account", "embedding / loss counted as pipeline layers",
            "--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split",
            lambda c: c.parallel.account_for_embedding_in_pipeline_split or
            c.parallel.account_for_loss_in_pipeline_split),
    Feature("cp-p2p", "context parallelism, ring attention",
            "--context-parallel-size N (> 1), --cp-comm-type p2p",
            lambda c: c.parallel.cp > 1 and c.parallel.cp_comm_type == "p2p", group="cp"),
    Feature("cp-a2a", "context parallelism, all-to-all (Ulysses) attention",
            "--context-parallel-size N (> 1) --cp-comm-type a2a",
            lambda c: c.parallel.cp > 1 and c.parallel.cp_comm_type == "a2a", group="cp"),
    Feature("moe", "mixture-of-experts layers", "--num-experts E", moe),
    Feature("ep", "expert parallelism", "--expert-model-parallel-size N (> 1)",
            lambda c: c.parallel.ep > 1),
    Feature("expert-tp", "tensor parallelism inside the experts",
            "--expert-tensor-parallel-size N (> 1; default: TP)",
            lambda c: moe(c) and c.parallel.etp > 1),
    Feature("moe-alltoall", "MoE token dispatch by all-to-all",
            "--num-experts with --moe-token-dispatcher-type alltoall (the default)",
            lambda c: moe(c) and c.model.moe_token_dispatcher_type == "alltoall",
            kind=IMPLEMENTATION, group="moe dispatcher"),
    Feature("moe-allgather", "MoE token dispatch by all-gather",
            "--moe-token-dispatcher-type allgather",
            lambda c: moe(c) and c.model.moe_token_dispatcher_type == "allgather",
            kind=IMPLEMENTATION, group="moe dispatcher"),
    Feature("distopt", "distributed optimizer (ZeRO-1; ZeRO-2 with --overlap-grad-reduce)",
            "--use-distributed-optimizer", lambda c: c.parallel.use_distributed_optimizer,
            kind=STRATEGY),
    Feature("overlap-grad-reduce", "gradient reduction in buckets overlapping backward",
            "--overlap-grad-reduce", lambda c: c.parallel.overlap_grad_reduce, kind=STRATEGY),
    Feature("overlap-param-gather", "parameter all-gather overlapping the next forward",
            "--overlap-param-gather", lambda c: c.parallel.overlap_param_gather, kind=STRATEGY),
    Feature("fsdp2", "ZeRO-3 through torch FSDP2 (fully_shard)", "--use-torch-fsdp2 (or "
            "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params)",
            lambda c: c.parallel.use_torch_fsdp2, kind=STRATEGY),
    Feature("hsdp", "hybrid sharding: the sharded strategy replicated over R instances of "
            "neighbouring ranks (HSDP for FSDP2), so its all-gathers stay inside an instance",
            "--num-distributed-optimizer-instances R (> 1) with --use-distributed-optimizer "
            "or --use-torch-fsdp2", lambda c: c.parallel.num_distributed_optimizer_instances > 1,
            kind=STRATEGY),
    Feature("te", "Transformer Engine layers", "--transformer-impl transformer_engine (or "
            "auto on a CUDA machine with TE)",
            lambda c: c.model.transformer_impl == "transformer_engine", kind=IMPLEMENTATION),
    Feature("fp8", "FP8 GEMMs (TE, delayed scaling)", "--fp8-format e4m3|hybrid",
            lambda c: c.model.fp8_format is not None, kind=IMPLEMENTATION),
    Feature("recompute-full", "full activation recomputation",
            "--recompute-granularity full",
            lambda c: c.training.recompute_granularity == "full", group="recompute"),
    Feature("recompute-selective", "selective activation recomputation",
            "--recompute-granularity selective [--recompute-modules ...]",
            lambda c: c.training.recompute_granularity == "selective", group="recompute"),
    Feature("compile", "torch.compile of each transformer layer", "--compile",
            lambda c: bool(c.training.compile), kind=IMPLEMENTATION),
    Feature("fused-loss", "output layer and cross entropy fused, in chunks",
            "--cross-entropy-loss-fusion", lambda c: bool(c.model.cross_entropy_loss_fusion),
            kind=IMPLEMENTATION),
)}
PIPELINE = tuple(n for n, f in FEATURES.items() if f.group == "pipeline schedule")


def _score_mod_on(mod) -> Callable:
    def on(cfg) -> bool:
        return getattr(cfg.model, mod.field) is not None
    return on


# ---- the rules (their reasons' texts: megalite/cli/feature_reasons.py) -----------------------
RULES: Tuple[Rule, ...] = (
    Needs("ep", "moe", "--expert-model-parallel-size > 1 needs --num-experts"),
    Needs("overlap-param-gather", "distopt", "--overlap-param-gather needs "
          "--use-distributed-optimizer (and --overlap-grad-reduce), as in Megatron"),
    Needs("overlap-param-gather", "overlap-grad-reduce", "--overlap-param-gather needs "
          "--overlap-grad-reduce (its buckets are the gather's), as in Megatron"),
    Needs("moe", "sp", "--num-experts with --tensor-model-parallel-size > 1 needs "
          "--sequence-parallel (each token must live on one rank for the expert dispatch, as "
          "in Megatron)", also="tp"),
    Needs("fp8", "te", QuotesEnvironment(fp8_without_te), dry_run=False),
    Needs("hsdp", ("distopt", "fsdp2"), "--num-distributed-optimizer-instances > 1 splits the "
          "sharded data-parallel group: add --use-distributed-optimizer or --use-torch-fsdp2"),
    Excludes("pp-uneven", "pp-interleaved", "--decoder-first/last-pipeline-num-layers do not "
             "combine with virtual pipeline stages; balance the ends with "
             "--account-for-embedding/loss-in-pipeline-split instead"),
    Excludes("pp-uneven", "pp-account", "--account-for-embedding-in-pipeline-split / "
             "--account-for-loss-in-pipeline-split and --decoder-first/last-pipeline-num-layers "
             "both balance the first and last stages; use one of them"),
    Excludes("distopt", "fsdp2", "--use-torch-fsdp2 and --use-distributed-optimizer both "
             "shard the optimizer; pick one"),
    Excludes("te", "fsdp2", "--use-torch-fsdp2 with Transformer Engine layers: TE's modules "
             "are not wrapped in FSDP2 units here (TE keeps FP8 metadata beside its weights); "
             "use --use-distributed-optimizer or --transformer-impl local", dry_run=False),
    Excludes("te", SPLIT_BACKWARD, TE_SPLIT_BACKWARD, dry_run=False),
    Excludes(MOE_FEATURES, "compile", MOE_COMPILE, dry_run=False),
    Excludes("cp-a2a", "compile", CP_A2A_COMPILE, dry_run=False),
    Excludes("fp8", ("recompute-full", "recompute-selective"), FP8_RECOMPUTE, dry_run=False),
    Refuses(SPLIT_BACKWARD, "a recomputed MoE layer", recomputes_moe_layers,
            split_moe_recompute_reason),
    Excludes("pp-uneven", VSHAPE, VSHAPE_UNEVEN),
    Refuses(VSHAPE, "--mtp-num-layers", lambda c: bool(c.model.mtp_num_layers), VSHAPE_MTP),
    Refuses(("cp-p2p", "cp-a2a"), "--attention-dropout > 0",
            lambda c: c.model.attention_dropout > 0, CP_DROPOUT, dry_run=False),
    Refuses("hsdp", "--optimizer muon", lambda c: c.optimizer.optimizer == "muon",
            "--optimizer muon with --num-distributed-optimizer-instances > 1: Muon gathers each "
            "matrix over one sharded group (optimizer/muon_layout.py), not across instances; "
            "use --num-distributed-optimizer-instances 1"),
    Relation("Megatron FP8 flags megalite does not wire", unwired_fp8, lambda c: (
        f"{unwired_fp8(c)[0]}: only --fp8-format, --fp8-amax-history-len and "
        "--fp8-amax-compute-algo of Megatron's FP8 flags are wired (delayed scaling, Transformer "
        "Engine on a CUDA GPU); drop this flag"), dry_run=False),
    # layout sizes (the planner's search enumerates only layouts that keep them)
    Relation("schedule matches virtual stages", schedule_misfit, schedule_reason, layout=True),
    Relation("heads split over TP", lambda c: not heads_split(
        c.model.num_attention_heads, c.model.resolved_query_groups(), c.parallel.tp),
        heads_reason, layout=True),
    Relation("sequence splits over 2 x CP", lambda c: not cp_sequence_split(
        c.model.seq_length, c.parallel.cp), lambda c: (
        f"--seq-length ({c.model.seq_length}) must be divisible by 2 x --context-parallel-size "
        f"({2 * c.parallel.cp}) for load-balanced CP"), layout=True),
    Relation("sequence-parallel splits the CP chunk over TP", lambda c: (
        c.parallel.sequence_parallel_active and
        (c.model.seq_length // c.parallel.cp) % c.parallel.tp), lambda c: (
        f"--sequence-parallel needs --seq-length ({c.model.seq_length}) / CP to be divisible "
        f"by --tensor-model-parallel-size ({c.parallel.tp})"), layout=True),
    Relation("all-to-all CP splits heads over TP x CP", lambda c: (
        c.parallel.cp > 1 and c.parallel.cp_comm_type == "a2a" and not a2a_heads_split(
            c.model.num_attention_heads, c.model.resolved_query_groups(), c.parallel.tp,
            c.parallel.cp)), a2a_reason, layout=True),
    Relation("multi-token prediction excludes CP", lambda c: (
        c.model.mtp_num_layers and c.parallel.cp > 1),
        "--mtp-num-layers with --context-parallel-size > 1: shifting the tokens across CP "
        "ranks is not implemented; use CP 1", layout=True),
    Relation("hsdp instances split the data-parallel groups", lambda c: (
        c.parallel.num_distributed_optimizer_instances > 1 and not hsdp_splits(
            c.parallel.num_distributed_optimizer_instances, hsdp_group_sizes(c))),
        hsdp_reason),
    Relation("--check-collectives excludes --use-torch-fsdp2", lambda c: (
        c.training.check_collectives and c.parallel.use_torch_fsdp2),
        "--check-collectives does not cover --use-torch-fsdp2: the check runs each rank's step "
        "on meta tensors without process groups, and FSDP2 (torch's fully_shard) needs a "
        "device mesh of real process groups and refuses meta parameters in a step; at run "
        "time its all-gathers and reduce-scatters are recorded (the flight recorder and "
        "MEGALITE_FAULT_INJECT see them) -- check the layout without --use-torch-fsdp2"),
    # the model
    Relation("multi-latent attention needs rope", lambda c: (
        c.model.multi_latent_attention and c.model.position_embedding_type != "rope"),
        mla_position_reason),
    Relation("multi-latent attention excludes GQA, qkv bias and rope scaling", mla_extra,
             lambda c: f"{mla_extra(c)} does not apply to --multi-latent-attention (one K/V "
             "head per query head, no fused qkv projection, YaRN or plain rope part); drop it"),
    Relation("--no-rope-freq needs rotary attention without MLA", lambda c: (
        c.model.no_rope_freq is not None and (not c.model.uses_rotary() or
                                              c.model.multi_latent_attention)),
        "--no-rope-freq skips RoPE in some layers: it needs --position-embedding-type rope "
        "(or yarn) and no --multi-latent-attention (whose rope part carries the positions)"),
    Relation("--qk-layernorm-scope projection needs RMSNorm without MLA", lambda c: (
        c.model.qk_layernorm and c.model.qk_layernorm_scope == "projection" and
        (c.model.normalization != "RMSNorm" or c.model.multi_latent_attention)),
        "--qk-layernorm-scope projection is an RMSNorm over the whole q and k projections "
        "(OLMo 2): it needs --normalization RMSNorm and no --multi-latent-attention"),
    # precision
    Relation("--precision excludes --fp16/--bf16", precision_conflict, precision_reason),
    Relation("--fp16 excludes --bf16", lambda c: c.optimizer.fp16 and c.optimizer.bf16,
             "give only one of --fp16 and --bf16"),
    # data
    Relation("per-split data excludes --data-path and --mock-data", lambda c: (
        c.data.per_split_data_path() and (c.data.mock_data or c.data.data_path)),
        "--train/valid/test-data-path give each split its own data: not with --data-path or "
        "--mock-data (one data source, as Megatron)"),
    Relation("--mock-data excludes --sample-windows random", lambda c: (
        c.data.mock_data and c.data.sample_windows != "packed"),
        "--sample-windows random cuts windows from --data-path; mock data is random already: "
        "drop --sample-windows or --mock-data"),
    # the score modifications (config/score_mods.py: Gemma 2's soft-cap, ...) each
    # implementation that cannot run them refuses, with the entry's reason
    *(Refuses(impl, mod.flag, _score_mod_on(mod), refusal_reason(mod, impl))
      for mod in SCORE_MODS.values() for impl in mod.refused_by),
    Relation("documents need a tokenizer", lambda c: (
        (c.data.reset_position_ids or c.data.reset_attention_mask) and not c.data.tokenizer_type),
        "--reset-position-ids / --reset-attention-mask find the documents by the tokenizer's "
        "end-of-document token: give --tokenizer-type (NullTokenizer's is vocab size - 1)"),
    # the attention variants' own rules (config/attention_variants.py, one entry each),
    # each with the entry's reason
    *(Refuses(r.refused_by, r.name, r.when, r.reason) if r.refused_by else
      Relation(r.name, r.when, r.reason)
      for variant in VARIANTS.values() for r in variant.rules),
    # OLMo 2's post-norm: TE fuses the input norms into the next linears (LayerNormLinear)
    Refuses("te", "--norm-placement post", lambda c: c.model.norm_placement == "post",
            "--norm-placement post with Transformer Engine layers: TE fuses each norm into "
            "the linear after it, so it cannot normalize the attention / MLP outputs; use "
            "--transformer-impl local"),
    # QK-clip: megalite's core attentions record the logits (local, ring and all-to-all:
    # transformer/qk_logits.py, context_parallel/max_logits.py); TE's kernels hand none out
    Refuses("te", "--qk-clip", lambda c: c.model.qk_clip,
            "--qk-clip with Transformer Engine layers: its attention kernel does not record the "
            "largest logit per head; drop --qk-clip or use the local core attention"),
    Relation("--qk-clip excludes --multi-latent-attention", lambda c: (
        c.model.qk_clip and c.model.multi_latent_attention),
        "--qk-clip scales linear_qkv's Q and K rows; Multi-Latent Attention has no linear_qkv: "
        "drop --qk-clip or --multi-latent-attention"),
    # gpt-oss: one fc2 bias per expert
    Refuses("expert-tp", "--moe-expert-bias", lambda c: c.model.moe_expert_bias,
            "--moe-expert-bias with --expert-tensor-parallel-size > 1: each shard's fc2 output "
            "is a partial sum, so the expert's bias would be added once per shard; use "
            "--expert-tensor-parallel-size 1"),
    # Qwen3-Next: Gated DeltaNet layers (transformer/gated_delta_net.py) and gated attention
    Relation("Gated DeltaNet heads split over TP", lambda c: (
        c.model.experimental_attention_variant is not None and (
            c.model.linear_num_key_heads % c.parallel.tp
            or c.model.linear_num_value_heads % c.model.linear_num_key_heads)),
        lambda c: f"--linear-num-key-heads {c.model.linear_num_key_heads} must be a multiple "
        f"of --tensor-model-parallel-size {c.parallel.tp} (each rank holds whole q/k heads) "
        f"and divide --linear-num-value-heads {c.model.linear_num_value_heads}", layout=True),
    Refuses("te", "--experimental-attention-variant or --attention-output-gate", lambda c: (
        c.model.experimental_attention_variant is not None or c.model.attention_output_gate),
            "--experimental-attention-variant / --attention-output-gate with Transformer Engine "
            "layers: TE's layer has no Gated DeltaNet and no output gate; use "
            "--transformer-impl local"),
    Relation("Qwen3-Next's layers exclude MLA, Muon and --qk-clip", lambda c: (
        (c.model.attention_output_gate or c.model.experimental_attention_variant is not None)
        and (c.model.multi_latent_attention or c.model.qk_clip
             or (c.model.attention_output_gate and c.optimizer.optimizer == "muon"))),
        "--attention-output-gate adds gate rows to linear_qkv, which Multi-Latent Attention "
        "lacks and --optimizer muon / --qk-clip split as [q, k, v] only, and Gated DeltaNet "
        "layers (--experimental-attention-variant) have no MLA form and no attention logits "
        "to clip: drop one of them"),
    # Llama 4's attention (its chunk rules: config/attention_variants.py)
    Relation("--qk-l2-norm excludes --multi-latent-attention",
             lambda c: c.model.multi_latent_attention and c.model.qk_l2_norm,
             "--qk-l2-norm acts on linear_qkv's heads and the layers that rotate; Multi-Latent "
             "Attention has neither: drop it or --multi-latent-attention"),
    Relation("--qk-l2-norm excludes --qk-layernorm", lambda c: (
        c.model.qk_l2_norm and c.model.qk_layernorm),
        "--qk-l2-norm normalizes q and k without a weight, --qk-layernorm with one: give one"),
    Relation("--moe-apply-probs-on-input needs --moe-router-topk 1", lambda c: (
        c.model.moe_apply_probs_on_input and c.model.num_experts and
        c.model.moe_router_topk != 1),
        "--moe-apply-probs-on-input scales each token by its one expert's score before the "
        "expert: give --moe-router-topk 1"),
)


# A flag that means something only with another one set (``--kv-lora-rank`` without
# ``--multi-latent-attention``) declares it beside its field (``requires=``); each such
# declaration is a rule of this table, checked with the others.
def _condition_words(section: str, condition: str) -> str:
    ref, _, want = condition.partition("=")
    flag = field_flag(find_field(ref, section)[1])
    return f"{flag} {want}" if want else flag


def _requirement_rule(section: str, f) -> Relation:
    def problem(cfg) -> Optional[str]:
        return requirement_problem(cfg, section, f)
    needs = " and ".join(_condition_words(section, c) for c in requirements(f))
    return Relation(f"{field_flag(f)} needs {needs}", problem, problem)


# the overlapped F&B execution (pipeline_parallel/schedules.py, comm/overlap.py); layout
# rules: the planner's search, predicting a run with the overlap, applies them per layout
def _overlap_without_pairs(cfg) -> bool:
    """PP = 1 pairs consecutive micro-batches, which only the EP all-to-all gains from."""
    p = cfg.parallel
    if not p.overlap_moe_expert_parallel_comm:
        return False
    if p.pp == 1:
        return p.ep == 1
    return not resolve_schedule(p.pipeline_schedule, vpp(cfg)).pairs_f_and_b


PAIRED_SCHEDULES = " or ".join(n for n, s in SCHEDULES.items() if s.pairs_f_and_b)
RULES += (
    Relation("--overlap-moe-expert-parallel-comm needs F&B pairs", _overlap_without_pairs,
             "--overlap-moe-expert-parallel-comm overlaps the paired forward and backward of "
             "two micro-batches: it needs --expert-model-parallel-size > 1 (PP 1), or "
             f"--pipeline-model-parallel-size > 1 with --pipeline-schedule {PAIRED_SCHEDULES} "
             "(or auto without virtual stages)", layout=True),
    Relation("--overlap-moe-expert-parallel-comm without PP excludes --use-torch-fsdp2",
             lambda c: (c.parallel.overlap_moe_expert_parallel_comm and c.parallel.pp == 1 and
                        c.parallel.use_torch_fsdp2),
             "--overlap-moe-expert-parallel-comm with --use-torch-fsdp2 and PP 1: FSDP2 "
             "reshards a layer after each backward while the paired forward may be using its "
             "gathered parameters (under PP it keeps them gathered); use PP > 1 or drop one",
             layout=True),
    Relation("--delay-wgrad-compute excludes a recomputed MoE layer", lambda c: (
        c.parallel.overlap_moe_expert_parallel_comm and c.parallel.delay_wgrad_compute and
        recomputes_moe_layers(c)),
        "--delay-wgrad-compute splits the paired backwards into B and W, and a recomputed "
        "MoE layer (--recompute-granularity full, or selective with --recompute-modules mlp) "
        "saves other tensors in its recomputation under that split (torch.utils.checkpoint "
        "refuses); drop --delay-wgrad-compute or recompute core_attn only", layout=True),
)


REQUIREMENTS: Tuple[Relation, ...] = tuple(
    _requirement_rule(section, f) for section, f in all_fields() if requirements(f))
RULES += REQUIREMENTS


def requirement_refusal(cfg) -> Optional[str]:
    """The first flag set without the one it needs, or None: validation asks this right
    after the domains, since its other checks read a feature's parameters only where the
    feature is on."""
    return next((r.when(cfg) for r in REQUIREMENTS if r.when(cfg)), None)


# ---- reading the table ------------------------------------------------------------------------
def active(cfg) -> List[str]:
    """The features ``cfg`` turns on, in table order."""
    return [n for n, f in FEATURES.items() if f.on(cfg)]


def rule_features(rule: Rule) -> List[str]:
    """The features a rule names (none for a ``Relation``)."""
    if isinstance(rule, Needs):
        return [rule.feature, *any_of(rule.needs), *([rule.also] if rule.also else [])]
    if isinstance(rule, Excludes):
        return [*any_of(rule.a), *any_of(rule.b)]
    if isinstance(rule, Refuses):
        return list(any_of(rule.feature))
    return []


def _layout_rule(rule: Rule) -> bool:
    if isinstance(rule, Relation):
        return rule.layout
    return all(FEATURES[n].kind == LAYOUT for n in rule_features(rule))


def _text(reason, cfg, environment: Callable = flags_environment) -> str:
    if isinstance(reason, QuotesEnvironment):
        return reason.text(cfg, environment(cfg))
    return reason(cfg) if callable(reason) else reason


def broken(cfg, *, dry_run: bool = False, layout_only: bool = False) -> Iterator[Rule]:
    """Every rule ``cfg`` breaks, in table order (``dry_run``: only the rules that also
    refuse a --dry-run; ``layout_only``: only rules between layout features and sizes)."""
    on = set(active(cfg))
    for rule in RULES:
        if (dry_run and not rule.dry_run) or (layout_only and not _layout_rule(rule)):
            continue
        if rule.broken(cfg, on):
            yield rule


def broken_rules(cfg, environment: Callable = flags_environment, **kwargs) -> Iterator[str]:
    """One line per rule ``cfg`` breaks, in table order (``broken``'s arguments;
    ``environment(cfg)``: the machine, in words, for the reasons that quote it)."""
    return (_text(rule.reason, cfg, environment) for rule in broken(cfg, **kwargs))


def refusal(cfg, **kwargs) -> Optional[str]:
    """The first rule ``cfg`` breaks (one line), or None."""
    return next(broken_rules(cfg, **kwargs), None)


def _declared_exclusion(a: str, b: str) -> Optional[str]:
    for rule in RULES:
        if isinstance(rule, Excludes) and any(
                x in any_of(rule.a) and y in any_of(rule.b) for x, y in ((a, b), (b, a))):
            return rule.reason
    fa, fb = FEATURES[a], FEATURES[b]
    if fa.group is not None and fa.group == fb.group:
        return f"alternatives: one {fa.group} per run"
    return None


def exclusion(a: str, b: str) -> Optional[str]:
    """Why features ``a`` and ``b`` do not combine (None: they do): a declared exclusion,
    alternatives of one group, or implied -- one needs a feature the other excludes."""
    why = _declared_exclusion(a, b)
    if why:
        return why
    for x, y in ((a, b), (b, a)):
        for rule in RULES:
            if isinstance(rule, Needs) and rule.feature == x and rule.also is None and \
                    isinstance(rule.needs, str):
                via = _declared_exclusion(rule.needs, y)
                if via:
                    return f"{x} needs {rule.needs}, which {y} excludes: {via}"
    return None


def pairs() -> Iterator[Tuple[str, str]]:
    return itertools.combinations(FEATURES, 2)

