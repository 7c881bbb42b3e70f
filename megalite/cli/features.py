"""Which features combine, declared once.

Every feature says how to tell from a ``MegaliteConfig`` that it is on (``on``) and which
flags turn it on; ``RULES`` says what a feature needs (``Needs``), which pairs do not
combine (``Excludes``, each with its reason) and which settings a feature refuses
(``Refuses``).  Pairs inside one ``group`` are alternatives of one choice (one pipeline
schedule per run).  Everything else combines, and ``COVERAGE`` names the equivalence tests
that run the combinations (tests/unit/test_feature_table.py walks every pair: excluded
or covered, never neither).

Readers: validation (``check_features``: every rule, first broken one reported), the
planner's search (``validate_layout`` applies the rules between layout features, so the
search enumerates only layouts the table allows), backend selection (``--transformer-impl
auto`` is resolved before the rules are read, so TE's rules hold for it too) and
docs/compatibility.md (``tools/compatibility_matrix.py`` writes it from this table).

Importing this module does not import torch (the planner reads it).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from megalite.pipeline_parallel.simulator import SCHEDULES, resolve_schedule

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
def _vpp(cfg) -> int:
    return cfg.parallel.virtual_stages(cfg.model.num_layers)


def _schedule_is(name: str) -> Callable:
    def on(cfg) -> bool:
        p = cfg.parallel
        return p.pp > 1 and resolve_schedule(p.pipeline_schedule, _vpp(cfg)).name == name
    return on


def _moe(cfg) -> bool:
    return bool(cfg.model.num_experts)


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
    Feature("moe", "mixture-of-experts layers", "--num-experts E", _moe),
    Feature("ep", "expert parallelism", "--expert-model-parallel-size N (> 1)",
            lambda c: c.parallel.ep > 1),
    Feature("expert-tp", "tensor parallelism inside the experts",
            "--expert-tensor-parallel-size N (> 1; default: TP)",
            lambda c: _moe(c) and c.parallel.etp > 1),
    Feature("moe-alltoall", "MoE token dispatch by all-to-all",
            "--num-experts with --moe-token-dispatcher-type alltoall (the default)",
            lambda c: _moe(c) and c.model.moe_token_dispatcher_type == "alltoall",
            kind=IMPLEMENTATION, group="moe dispatcher"),
    Feature("moe-allgather", "MoE token dispatch by all-gather",
            "--moe-token-dispatcher-type allgather",
            lambda c: _moe(c) and c.model.moe_token_dispatcher_type == "allgather",
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


# ---- the rules -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Needs:
    """``feature`` (when ``also`` is on too, if given) needs ``needs`` on."""
    feature: str
    needs: str
    reason: Union[str, Callable]   # text, or cfg -> text (the run's environment)
    also: Optional[str] = None
    dry_run: bool = True           # False: only a run is refused (hardware, kernels)


@dataclass(frozen=True)
class Excludes:
    a: str
    b: str
    reason: str
    dry_run: bool = True


@dataclass(frozen=True)
class Refuses:
    """``feature`` refuses a setting (``when(cfg)``), e.g. CP with attention dropout."""
    feature: str
    setting: str
    when: Callable
    reason: str
    dry_run: bool = True


def _fp8_without_te(cfg) -> str:
    from megalite.backends.selection import fp8_environment

    return (f"--fp8-format {cfg.model.fp8_format}: FP8 training needs Transformer Engine on a "
            f"CUDA GPU with FP8 support; this run has {fp8_environment(cfg)}. Drop the "
            "--fp8-* flags")


CP_DROPOUT = ("--context-parallel-size > 1 has no attention dropout (ring and all-to-all "
              "attention draw none): set --attention-dropout 0")
ZB_MOE_RECOMPUTE = ("--pipeline-schedule zero-bubble with a recomputed MoE layer "
                    "(--recompute-granularity full, or selective with --recompute-modules mlp): "
                    "under the B/W split its recomputation saves other tensors than its forward "
                    "(torch.utils.checkpoint refuses); use 1f1b, or recompute core_attn only")


def _recomputes_moe_layers(cfg) -> bool:
    t = cfg.training
    return _moe(cfg) and (t.recompute_granularity == "full" or (
        t.recompute_granularity == "selective" and "mlp" in (t.recompute_modules or ())))


MOE_COMPILE = ("--compile with --num-experts: the MoE layers' routing gives every step other "
               "token counts (data-dependent shapes, host-side all-to-all splits), and a "
               "compiled MoE run did not finish two tiny steps in 150 s on CPU; drop --compile")
CP_A2A_COMPILE = ("--compile with --cp-comm-type a2a: a compiled all-to-all (Ulysses) "
                  "attention run did not finish two tiny steps in 150 s on CPU; use "
                  "--cp-comm-type p2p or drop --compile")
FP8_RECOMPUTE = ("--fp8-format with --recompute-granularity: a recomputed forward would run "
                 "outside the FP8 autocast; drop one of them")

RULES = (
    Needs("ep", "moe", "--expert-model-parallel-size > 1 needs --num-experts"),
    Needs("overlap-param-gather", "distopt", "--overlap-param-gather needs "
          "--use-distributed-optimizer (and --overlap-grad-reduce), as in Megatron"),
    Needs("overlap-param-gather", "overlap-grad-reduce", "--overlap-param-gather needs "
          "--overlap-grad-reduce (its buckets are the gather's), as in Megatron"),
    Needs("moe", "sp", "--num-experts with --tensor-model-parallel-size > 1 needs "
          "--sequence-parallel (each token must live on one rank for the expert dispatch, as "
          "in Megatron)", also="tp"),
    Needs("fp8", "te", _fp8_without_te, dry_run=False),
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
    Excludes("te", "pp-zero-bubble", "--pipeline-schedule zero-bubble splits each linear's "
             "backward into B and W passes, which TE's fused linears do not; use 1f1b / "
             "interleaved or --transformer-impl local", dry_run=False),
    *(Excludes(moe, "compile", MOE_COMPILE, dry_run=False)
      for moe in ("moe", "ep", "expert-tp", "moe-alltoall", "moe-allgather")),
    Excludes("cp-a2a", "compile", CP_A2A_COMPILE, dry_run=False),
    Excludes("fp8", "recompute-full", FP8_RECOMPUTE, dry_run=False),
    Excludes("fp8", "recompute-selective", FP8_RECOMPUTE, dry_run=False),
    Refuses("pp-zero-bubble", "a recomputed MoE layer", _recomputes_moe_layers,
            ZB_MOE_RECOMPUTE),
    Refuses("cp-p2p", "--attention-dropout > 0", lambda c: c.model.attention_dropout > 0,
            CP_DROPOUT, dry_run=False),
    Refuses("cp-a2a", "--attention-dropout > 0", lambda c: c.model.attention_dropout > 0,
            CP_DROPOUT, dry_run=False),
    # Gemma 2's soft-caps: only the local unfused core attention caps scores, only the
    # unfused output layer caps logits
    *(Refuses(f, "--attn-logit-softcapping", lambda c: c.model.attn_logit_softcapping is not None,
              f"--attn-logit-softcapping with {how}: its attention kernel cannot cap the scores "
              "before the softmax; drop it or use the local unfused core attention")
      for f, how in (("te", "Transformer Engine layers"), ("cp-p2p", "ring attention (CP)"),
                     ("cp-a2a", "all-to-all attention (CP)"))),
    Refuses("fused-loss", "--final-logit-softcapping",
            lambda c: c.model.final_logit_softcapping is not None,
            "--final-logit-softcapping with --cross-entropy-loss-fusion: the fused chunks never "
            "hold the logits to cap; drop one of them"),
)


# ---- reading the table ------------------------------------------------------------------------
def active(cfg) -> List[str]:
    """The features ``cfg`` turns on, in table order."""
    return [n for n, f in FEATURES.items() if f.on(cfg)]


def _layout_rule(rule) -> bool:
    names = [rule.feature, rule.needs, rule.also] if isinstance(rule, Needs) else \
        [rule.a, rule.b] if isinstance(rule, Excludes) else [rule.feature]
    return all(FEATURES[n].kind == LAYOUT for n in names if n)


def _text(reason, cfg) -> str:
    return reason(cfg) if callable(reason) else reason


def broken_rules(cfg, *, dry_run: bool = False, layout_only: bool = False) -> Iterator[str]:
    """One line per rule ``cfg`` breaks, in table order (``dry_run``: only the rules that
    also refuse a --dry-run; ``layout_only``: only rules between layout features)."""
    on = set(active(cfg))
    for rule in RULES:
        if (dry_run and not rule.dry_run) or (layout_only and not _layout_rule(rule)):
            continue
        if isinstance(rule, Needs):
            if rule.feature in on and (rule.also is None or rule.also in on) and \
                    rule.needs not in on:
                yield _text(rule.reason, cfg)
        elif isinstance(rule, Excludes):
            if rule.a in on and rule.b in on:
                yield rule.reason
        elif rule.feature in on and rule.when(cfg):
            yield rule.reason


def refusal(cfg, **kwargs) -> Optional[str]:
    """The first rule ``cfg`` breaks (one line), or None."""
    return next(broken_rules(cfg, **kwargs), None)


def _declared_exclusion(a: str, b: str) -> Optional[str]:
    for rule in RULES:
        if isinstance(rule, Excludes) and {rule.a, rule.b} == {a, b}:
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
            if isinstance(rule, Needs) and rule.feature == x and rule.also is None:
                via = _declared_exclusion(rule.needs, y)
                if via:
                    return f"{x} needs {rule.needs}, which {y} excludes: {via}"
    return None


def pairs() -> Iterator[Tuple[str, str]]:
    return itertools.combinations(FEATURES, 2)


# ---- which equivalence test runs which combination ----------------------------------------------
# "file::function[case]" (case: its name in that file's cases): the features that run
# together there, each checked against the
# single-process run (or, for TE/FP8 on CPU, against the local layers through tests/te_fake).
# A covered pair is any two features of one entry.
_PE = "tests/distributed/test_pipeline_equivalence.py::test_pipeline_matches_single_process"
_CP = "tests/distributed/test_context_parallel_dist.py::test_training_loop_matches_single_process"
_MOE = "tests/distributed/test_moe_dist.py::test_moe_matches_one_process"
_DP2 = "tests/distributed/test_dp_overlap_fsdp2_dist.py::test_overlap_zero2_fsdp2_world2"
_DP4 = "tests/distributed/test_dp_overlap_fsdp2_dist.py::test_overlap_zero2_fsdp2_world4"
_FC = "tests/distributed/test_fsdp2_compose_dist.py::test_fsdp2_composes"
PAIRS_TEST = "tests/distributed/test_feature_pairs_dist.py::test_combination_matches_single_process"
COVERAGE: Dict[str, Sequence[str]] = {
    f"{_PE}[tp2-pp2-sp-full-uniform1]": ("tp", "sp", "pp-1f1b", "recompute-full"),
    f"{_PE}[tp2-pp2-sp-selective-attn]": ("tp", "sp", "pp-1f1b", "recompute-selective"),
    f"{_PE}[tp2-pp2-vpp2-sp-m4]": ("tp", "sp", "pp-interleaved"),
    f"{_PE}[account-loss-tp2-pp2-vpp2-sp-full-llama]":
        ("tp", "sp", "pp-interleaved", "pp-account", "recompute-full"),
    f"{_PE}[vpp2-pp2-selective-mlp]": ("pp-interleaved", "recompute-selective"),
    f"{_PE}[tp2-pp2-zb-sp-full-uniform1-llama]": ("tp", "sp", "pp-zero-bubble",
                                                  "recompute-full"),
    f"{_PE}[account-both-zb-pp4-empty-ends]": ("pp-zero-bubble", "pp-account"),
    f"{_PE}[pp2-uneven-1+3]": ("pp-1f1b", "pp-uneven"),
    f"{_PE}[pp2-selective-all]": ("pp-1f1b", "recompute-selective"),
    f"{_CP}[cp2-tp2-sp-p2p-core-attn-recompute]": ("cp-p2p", "tp", "sp",
                                                    "recompute-selective"),
    f"{_CP}[cp2-dp2-a2a-full-recompute]": ("cp-a2a", "recompute-full"),
    f"{_CP}[cp2-tp2-sp-a2a]": ("cp-a2a", "tp", "sp"),
    f"{_CP}[cp2-pp2-1f1b-p2p]": ("cp-p2p", "pp-1f1b"),
    f"{_CP}[cp2-pp2-interleaved-a2a]": ("cp-a2a", "pp-interleaved"),
    f"{_CP}[cp2-pp2-zero-bubble-p2p]": ("cp-p2p", "pp-zero-bubble"),
    f"{_CP}[cp2-dp2-p2p-distopt]": ("cp-p2p", "distopt"),
    f"{_MOE}[ep2-tp2-sp-etp1]": ("moe", "ep", "tp", "sp", "moe-alltoall"),
    f"{_MOE}[ep2-etp2]": ("moe", "ep", "expert-tp", "moe-alltoall"),
    f"{_MOE}[ep2-pp2]": ("moe", "ep", "pp-1f1b", "moe-alltoall"),
    f"{_MOE}[ep2-pp2-zero-bubble]": ("moe", "ep", "pp-zero-bubble", "moe-alltoall"),
    f"{_MOE}[ep2-dp-distopt]": ("moe", "ep", "distopt", "moe-alltoall"),
    f"{_MOE}[ep2-pp2-full-recompute]": ("moe", "ep", "pp-1f1b", "recompute-full",
                                        "moe-alltoall"),
    f"{_MOE}[ep4-recompute-mlp]": ("moe", "ep", "recompute-selective", "moe-alltoall"),
    f"{_MOE}[ep2-etp2-allgather]": ("moe", "ep", "expert-tp", "moe-allgather"),
    f"{_DP2}[do_ov_pg]": ("distopt", "overlap-grad-reduce", "overlap-param-gather"),
    f"{_DP4}[fsdp2_tp2]": ("fsdp2", "tp", "sp"),
    f"{_FC}[fsdp2_pp2_1f1b]": ("fsdp2", "pp-1f1b"),
    f"{_FC}[fsdp2_pp2_interleaved]": ("fsdp2", "pp-interleaved"),
    f"{_FC}[fsdp2_pp2_zero_bubble]": ("fsdp2", "pp-zero-bubble"),
    f"{_FC}[fsdp2_cp2]": ("fsdp2", "cp-p2p"),
    f"{_FC}[fsdp2_ep2]": ("fsdp2", "moe", "ep", "moe-alltoall"),
    f"{_FC}[hsdp_2x2]": ("fsdp2", "hsdp"),
    f"{_FC}[distopt_2x2]": ("distopt", "overlap-grad-reduce", "hsdp"),
    f"{_FC}[fsdp2_tp2_pp2]": ("fsdp2", "tp", "sp", "pp-1f1b"),
    f"{_DP4}[do_ov_tp2_pp2]": ("distopt", "overlap-grad-reduce", "tp", "pp-1f1b"),
    "tests/distributed/test_fused_cross_entropy_dist.py"
    "::test_fused_tp_matches_unfused_single_process": ("fused-loss", "tp", "sp"),
    "tests/distributed/test_te_backend_dist.py"
    "::test_te_spec_at_tp2_matches_single_process_local": ("te", "tp", "sp"),
    "tests/gpu/test_te_gpu.py::test_te_matches_local_training_tp2": ("te", "tp", "sp"),
    "tests/gpu/test_te_gpu.py::test_context_parallel_through_te[p2p]": ("te", "cp-p2p"),
    "tests/gpu/test_te_gpu.py::test_context_parallel_through_te[a2a]": ("te", "cp-a2a"),
    "tests/distributed/test_distributed_optimizer_dist.py::test_distributed_optimizer_world4"
    "[tp2_dp2_sp]": ("distopt", "tp", "sp"),
    "tests/distributed/test_distributed_optimizer_dist.py::test_distributed_optimizer_world4"
    "[pp2_dp2_gpt2]": ("distopt", "pp-1f1b"),
    f"{PAIRS_TEST}[moe-te-fp8-tp2-cp2-ep2-distopt-fused]":
        ("tp", "sp", "cp-p2p", "moe", "ep", "expert-tp", "moe-alltoall", "distopt",
         "overlap-grad-reduce", "overlap-param-gather", "te", "fp8", "fused-loss"),
    f"{PAIRS_TEST}[moe-te-cp2-a2a-pp2-account-etp2-allgather-distopt-selective-fused]":
        ("pp-1f1b", "pp-account", "cp-a2a", "moe", "expert-tp", "moe-allgather", "distopt",
         "overlap-grad-reduce", "overlap-param-gather", "te", "recompute-selective",
         "fused-loss"),
    f"{PAIRS_TEST}[moe-cp2-a2a-zb-uneven-ep2-distopt-attn-fused]":
        ("pp-zero-bubble", "pp-uneven", "cp-a2a", "moe", "ep", "moe-alltoall", "distopt",
         "overlap-grad-reduce", "overlap-param-gather", "recompute-selective", "fused-loss"),
    f"{PAIRS_TEST}[moe-te-fp8-tp2-pp2-uneven-etp2-allgather-distopt]":
        ("tp", "sp", "pp-1f1b", "pp-uneven", "moe", "expert-tp", "moe-allgather", "distopt",
         "overlap-grad-reduce", "overlap-param-gather", "te", "fp8"),
    f"{PAIRS_TEST}[moe-cp2-vpp2-etp2-allgather-distopt-full-fused]":
        ("pp-interleaved", "cp-p2p", "moe", "expert-tp", "moe-allgather", "distopt",
         "overlap-grad-reduce", "overlap-param-gather", "recompute-full", "fused-loss"),
    f"{PAIRS_TEST}[moe-cp2-zb-account-etp2-ddp-overlap-attn-fused]":
        ("pp-zero-bubble", "pp-account", "cp-p2p", "moe", "expert-tp", "moe-alltoall",
         "overlap-grad-reduce", "recompute-selective", "fused-loss"),
    f"{PAIRS_TEST}[moe-te-cp2-a2a-vpp2-ep2-ddp-overlap-full]":
        ("pp-interleaved", "cp-a2a", "moe", "ep", "moe-alltoall", "overlap-grad-reduce", "te",
         "recompute-full"),
    f"{PAIRS_TEST}[moe-zb-account-ep2-allgather-distopt]":
        ("pp-zero-bubble", "pp-account", "moe", "ep", "moe-allgather", "distopt",
         "overlap-grad-reduce", "overlap-param-gather"),
    f"{PAIRS_TEST}[moe-cp2-pp2-uneven-selective-fused]":
        ("pp-1f1b", "pp-uneven", "cp-p2p", "moe", "moe-alltoall", "recompute-selective",
         "fused-loss"),
    f"{PAIRS_TEST}[fsdp2-tp2-overlap-full-fused]":
        ("tp", "sp", "overlap-grad-reduce", "fsdp2", "recompute-full", "fused-loss"),
    f"{PAIRS_TEST}[moe-fsdp2-cp2-a2a-pp2-uneven-etp2-allgather]":
        ("pp-1f1b", "pp-uneven", "cp-a2a", "moe", "expert-tp", "moe-allgather", "fsdp2"),
    f"{PAIRS_TEST}[moe-fsdp2-hsdp-zb-account-attn]":
        ("pp-zero-bubble", "pp-account", "moe", "moe-alltoall", "fsdp2", "hsdp",
         "recompute-selective"),
    f"{PAIRS_TEST}[hsdp-te-fp8-tp2-distopt-fused]":
        ("tp", "sp", "distopt", "overlap-grad-reduce", "overlap-param-gather", "hsdp", "te",
         "fp8", "fused-loss"),
    f"{PAIRS_TEST}[moe-hsdp-cp2-a2a-ep2-allgather-distopt-full]":
        ("cp-a2a", "moe", "ep", "moe-allgather", "distopt", "overlap-grad-reduce",
         "overlap-param-gather", "hsdp", "recompute-full"),
    f"{PAIRS_TEST}[moe-hsdp-cp2-etp2-distopt]":
        ("cp-p2p", "moe", "expert-tp", "moe-alltoall", "distopt", "overlap-grad-reduce",
         "overlap-param-gather", "hsdp"),
    f"{PAIRS_TEST}[hsdp-fsdp2-vpp2]":
        ("pp-interleaved", "fsdp2", "hsdp"),
    f"{PAIRS_TEST}[hsdp-pp2-uneven-distopt-full]":
        ("pp-1f1b", "pp-uneven", "distopt", "overlap-grad-reduce", "overlap-param-gather",
         "hsdp", "recompute-full"),
    f"{PAIRS_TEST}[te-fp8-tp2-pp2-account-distopt-fused-compile]":
        ("tp", "sp", "pp-1f1b", "pp-account", "distopt", "overlap-grad-reduce",
         "overlap-param-gather", "te", "fp8", "compile", "fused-loss"),
    f"{PAIRS_TEST}[fsdp2-hsdp-overlap-selective-fused-compile]":
        ("overlap-grad-reduce", "fsdp2", "hsdp", "recompute-selective", "compile", "fused-loss"),
    f"{PAIRS_TEST}[cp2-zb-uneven-full-compile]":
        ("pp-zero-bubble", "pp-uneven", "cp-p2p", "recompute-full", "compile"),
    f"{PAIRS_TEST}[te-fp8-cp2-a2a-pp2-fused]":
        ("pp-1f1b", "cp-a2a", "te", "fp8", "fused-loss"),
    f"{PAIRS_TEST}[te-fp8-vpp2-compile]": ("pp-interleaved", "te", "fp8", "compile"),
}


def covering_tests(a: str, b: str) -> List[str]:
    """The equivalence tests that run features ``a`` and ``b`` together."""
    return [t for t, feats in COVERAGE.items() if a in feats and b in feats]
