"""The rule engine (megalite/cli/features.py): every pair of features is either excluded with a
reason or run together by a named equivalence test that exists; every rule has a case that
breaks it, refused by validation with that rule's message, and one that keeps it, accepted;
docs/compatibility.md is the table's current rendering; user errors are raised only by the
engine, the field domains, the boundary and the listed places that find faults at run time."""
import ast
import dataclasses
import os
import re

import pytest

from megalite.cli import features as F
from megalite.cli.arguments import parse_args
from megalite.cli.compatibility_doc import PAGE, counts, render
from megalite.backends.selection import fp8_environment
from megalite.cli.validation import validate
from megalite.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "8",
        "--seq-length", "32", "--mock-data", "--vocab-size", "100", "--train-iters", "2",
        "--lr", "1e-3", "--attention-dropout", "0", "--global-batch-size", "16",
        "--world-size", "16"]
# flags that turn each feature on (with what it needs) in BASE's model
TURN_ON = {
    "tp": ["--tp", "2"], "sp": ["--tp", "2", "--sequence-parallel"], "pp-1f1b": ["--pp", "2"],
    "pp-interleaved": ["--pp", "2", "--num-virtual-stages-per-pipeline-rank", "2"],
    "pp-zero-bubble": ["--pp", "2", "--pipeline-schedule", "zero-bubble"],
    "pp-dualpipev": ["--pp", "2", "--pipeline-schedule", "dualpipev", "--global-batch-size",
                     "64"],
    "pp-zbv": ["--pp", "2", "--pipeline-schedule", "zbv", "--global-batch-size", "64"],
    "pp-uneven": ["--pp", "2", "--decoder-first-pipeline-num-layers", "2"],
    "pp-account": ["--pp", "2", "--account-for-loss-in-pipeline-split",
                   "--account-for-embedding-in-pipeline-split"],
    "cp-p2p": ["--cp", "2"], "cp-a2a": ["--cp", "2", "--cp-comm-type", "a2a"],
    "moe": ["--num-experts", "4"], "ep": ["--num-experts", "4", "--ep", "2"],
    "expert-tp": ["--num-experts", "4", "--expert-tensor-parallel-size", "2"],
    "moe-alltoall": ["--num-experts", "4"],
    "moe-allgather": ["--num-experts", "4", "--moe-token-dispatcher-type", "allgather"],
    "distopt": ["--use-distributed-optimizer"], "overlap-grad-reduce": ["--overlap-grad-reduce"],
    "overlap-param-gather": ["--use-distributed-optimizer", "--overlap-grad-reduce",
                             "--overlap-param-gather"],
    "fsdp2": ["--use-torch-fsdp2"],
    "hsdp": ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"],
    "te": [], "fp8": [],          # set after parsing (CPU)
    "recompute-full": ["--recompute-granularity", "full", "--recompute-method", "uniform"],
    "recompute-selective": ["--recompute-granularity", "selective"],
    "compile": ["--compile"], "fused-loss": ["--cross-entropy-loss-fusion"],
}


def config_with(*names, validate=True):
    """A config turning ``names`` on; TE and FP8 are set after parsing (a CPU run refuses
    them), and validation is left to the caller when ``validate`` is False."""
    argv = [a for n in names for a in TURN_ON[n]]
    cfg = parse_args(BASE + argv, validate_config=validate and not {"te", "fp8"} & set(names))
    if {"te", "fp8"} & set(names):
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, transformer_impl="transformer_engine",
            fp8_format="hybrid" if "fp8" in names else None))
    return cfg


def test_turn_on_flags_turn_on_exactly_their_feature():
    implied = {"sp": {"tp"}, "ep": {"moe", "moe-alltoall"}, "expert-tp": {"moe", "moe-alltoall"},
               "moe": {"moe-alltoall"}, "moe-alltoall": {"moe"}, "moe-allgather": {"moe"},
               "pp-uneven": {"pp-1f1b"}, "pp-account": {"pp-1f1b"}, "fp8": {"te"},
               "overlap-param-gather": {"distopt", "overlap-grad-reduce"}, "hsdp": {"distopt"}}
    assert set(TURN_ON) == set(F.FEATURES)
    for name in F.FEATURES:
        got = set(F.active(config_with(name, validate=False)))
        assert got == {name} | implied.get(name, set()), (name, got)


def test_every_pair_is_excluded_with_a_reason_or_covered_by_a_named_test(capsys):
    excluded, covered = [], []
    for a, b in F.pairs():
        why, tests = F.exclusion(a, b), F.covering_tests(a, b)
        assert why or tests, f"{a} x {b}: neither excluded (with its reason) nor covered"
        assert not (why and tests), f"{a} x {b}: excluded ({why}) yet run by {tests}"
        (excluded if why else covered).append((a, b))
    n = counts()
    assert (n["excluded"], n["covered"]) == (len(excluded), len(covered))
    with capsys.disabled():
        print(f"\nfeature pairs: {len(excluded) + len(covered)} = {len(excluded)} excluded "
              f"({n['alternatives']} alternatives, {n['implied']} implied) + {len(covered)} "
              f"covered by {len(F.COVERAGE)} named equivalence tests")


def _functions(path):
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


def test_coverage_names_tests_that_exist_and_known_features():
    for test_id, names in F.COVERAGE.items():
        path, _, rest = test_id.partition("::")
        function, _, case = rest.partition("[")
        assert os.path.exists(os.path.join(ROOT, path)), test_id
        assert function in _functions(path), f"{test_id}: no function {function}"
        assert function.startswith("test_"), test_id
        if case:     # the case's name appears in that file (a CASES key or a parameter)
            text = open(os.path.join(ROOT, path), encoding="utf-8").read()
            assert re.search(r"[\"']" + re.escape(case[:-1]) + r"[\"']", text), test_id
        assert set(names) <= set(F.FEATURES) and len(names) >= 2, test_id


def test_rules_name_known_features_and_say_which_flag():
    names = [r.name for r in F.RULES]
    assert len(set(names)) == len(names), "two rules share a name"
    for rule in F.RULES:
        assert set(F.rule_features(rule)) <= set(F.FEATURES), rule
        if isinstance(rule.reason, str):
            assert "--" in rule.reason and "\n" not in rule.reason, rule


def test_rules_keyed_on_split_backward_cover_every_schedule_that_splits_it():
    """A schedule with ``split_backward`` inherits zero bubble's rules (TE, recomputed MoE)
    because the rules name the property, not the schedule."""
    from megalite.config.pipeline_schedules import SCHEDULES

    splits = {f"pp-{n}" for n, s in SCHEDULES.items() if s.split_backward}
    assert splits and set(F.SPLIT_BACKWARD) == splits
    assert any(isinstance(r, F.Excludes) and r.a == "te" and set(F.any_of(r.b)) == splits
               for r in F.RULES)
    assert any(isinstance(r, F.Refuses) and set(F.any_of(r.feature)) == splits and
               r.when is F.recomputes_moe_layers for r in F.RULES)


def _exclusion_pairs():
    return [pytest.param(rule, a, b, id=f"{a}-x-{b}") for rule in F.RULES
            if isinstance(rule, F.Excludes) for a in F.any_of(rule.a) for b in F.any_of(rule.b)]


@pytest.mark.parametrize("rule,a,b", _exclusion_pairs())
def test_validation_refuses_each_exclusion_with_its_reason(rule, a, b):
    cfg = config_with(a, b, validate=False)
    assert F.refusal(cfg) == rule.reason
    if rule.dry_run and not {"te", "fp8"} & {a, b}:
        with pytest.raises(ConfigError, match=re.escape(rule.reason)):
            parse_args(BASE + TURN_ON[a] + TURN_ON[b])
    else:                            # hardware rules: --dry-run describes the layout only
        assert F.refusal(cfg, dry_run=True) is None
    for alone in (a, b):             # each side alone does not break it
        assert rule not in set(F.broken(config_with(alone, validate=False))), (rule.name, alone)


# Every rule that is not a pair exclusion (those are walked above): argv (added to BASE)
# that break it, and argv that keep it; a dict {"model": {...}, ...} sets those sections' fields
# after parsing (Transformer Engine and FP8, which a CPU run refuses).  A new rule without
# a case here fails test_every_rule_has_a_refusal_case.
_ZB_MOE = ["--pp", "2", "--pipeline-schedule", "zero-bubble", "--num-experts", "4"]
_DV = ["--pp", "2", "--pipeline-schedule", "dualpipev", "--global-batch-size", "64"]
_ZBV = ["--pp", "2", "--pipeline-schedule", "zbv", "--global-batch-size", "64"]
_MLA = ["--multi-latent-attention", "--position-embedding-type", "rope"]
_TE = {"transformer_impl": "transformer_engine"}
_DOCS = ["--reset-attention-mask", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]
_GDN = ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "4",
        "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
        "--linear-key-head-dim", "8", "--linear-value-head-dim", "8"]   # Qwen3-Next
RULE_CASES = {
    "ep needs moe": ([["--ep", "2"]], [["--ep", "2", "--num-experts", "4"]]),
    "overlap-param-gather needs distopt": (
        [["--overlap-grad-reduce", "--overlap-param-gather"]],
        [["--overlap-grad-reduce", "--overlap-param-gather", "--use-distributed-optimizer"]]),
    "overlap-param-gather needs overlap-grad-reduce": (
        [["--use-distributed-optimizer", "--overlap-param-gather"]],
        [["--use-distributed-optimizer", "--overlap-param-gather", "--overlap-grad-reduce"]]),
    "moe needs sp with tp": ([["--tp", "2", "--num-experts", "4"]],
                             [["--tp", "2", "--num-experts", "4", "--sequence-parallel"],
                              ["--num-experts", "4"]]),
    "fp8 needs te": ([["--device", "cpu", "--transformer-impl", "local",
                       {"model": {"fp8_format": "hybrid"}}]],
                     [[{"model": dict(_TE, fp8_format="hybrid")}]]),
    "hsdp needs distopt|fsdp2": (
        [["--num-distributed-optimizer-instances", "2"]],
        [["--num-distributed-optimizer-instances", "2", "--use-distributed-optimizer"],
         ["--num-distributed-optimizer-instances", "2", "--use-torch-fsdp2"]]),
    "pp-dualpipev|pp-zbv refuses --mtp-num-layers": (
        [_DV + ["--mtp-num-layers", "1"], _ZBV + ["--mtp-num-layers", "1"]], [_DV, _ZBV]),
    "pp-zero-bubble|pp-dualpipev|pp-zbv refuses a recomputed MoE layer": (
        [_ZB_MOE + ["--recompute-granularity", "full", "--recompute-method", "uniform"],
         _ZB_MOE + ["--recompute-granularity", "selective", "--recompute-modules", "mlp"],
         _ZBV + ["--num-experts", "4", "--recompute-granularity", "full",
                 "--recompute-method", "uniform"]],
        [_ZB_MOE + ["--recompute-granularity", "selective"],
         ["--pp", "2", "--num-experts", "4", "--recompute-granularity", "full",
          "--recompute-method", "uniform"]]),
    "hsdp refuses --optimizer muon": (
        [["--optimizer", "muon", "--use-distributed-optimizer",
          "--num-distributed-optimizer-instances", "2"]],
        [["--optimizer", "muon", "--use-distributed-optimizer"],
         ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]]),
    "cp-p2p|cp-a2a refuses --attention-dropout > 0": (
        [["--cp", "2", "--attention-dropout", "0.1"],
         ["--cp", "2", "--cp-comm-type", "a2a", "--attention-dropout", "0.1"]],
        [["--cp", "2"], ["--attention-dropout", "0.1"]]),
    "Megatron FP8 flags megalite does not wire": ([["--fp8-recipe", "tensorwise"]], [[]]),
    "te refuses --attn-logit-softcapping": (
        [[{"model": dict(_TE, attn_logit_softcapping=30.0)}]],
        [[{"model": dict(_TE)}], ["--attn-logit-softcapping", "30"]]),
    # the overlapped F&B execution
    "--overlap-moe-expert-parallel-comm needs F&B pairs": (
        [["--overlap-moe-expert-parallel-comm"],
         ["--pp", "2", "--pipeline-schedule", "zero-bubble",
          "--overlap-moe-expert-parallel-comm"]],
        [["--pp", "2", "--overlap-moe-expert-parallel-comm"],
         _DV + ["--overlap-moe-expert-parallel-comm"],
         ["--ep", "2", "--num-experts", "4", "--overlap-moe-expert-parallel-comm"]]),
    "--overlap-moe-expert-parallel-comm without PP excludes --use-torch-fsdp2": (
        [["--ep", "2", "--num-experts", "4", "--overlap-moe-expert-parallel-comm",
          "--use-torch-fsdp2"]],
        [["--pp", "2", "--overlap-moe-expert-parallel-comm", "--use-torch-fsdp2"]]),
    "--delay-wgrad-compute excludes a recomputed MoE layer": (
        [["--pp", "2", "--num-experts", "4", "--overlap-moe-expert-parallel-comm",
          "--delay-wgrad-compute", "--recompute-granularity", "full",
          "--recompute-method", "uniform", "--recompute-num-layers", "1"]],
        [["--pp", "2", "--num-experts", "4", "--overlap-moe-expert-parallel-comm",
          "--delay-wgrad-compute"]]),
    "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm": (
        [["--pp", "2", "--delay-wgrad-compute"]],
        [["--pp", "2", "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]]),
    # the flags declared beside their fields to need another (requires=)
    "--use-rope-scaling needs --position-embedding-type rope": (
        [["--use-rope-scaling", "--position-embedding-type", "learned_absolute"]],
        [["--use-rope-scaling", "--position-embedding-type", "rope"]]),
    "--q-lora-rank needs --multi-latent-attention": (
        [["--q-lora-rank", "8"]], [_MLA + ["--q-lora-rank", "8"]]),
    "--moe-router-topk-scaling-factor needs --num-experts": (
        [["--moe-router-topk-scaling-factor", "2"]],
        [["--moe-router-topk-scaling-factor", "2", "--num-experts", "4"]]),
    "--moe-router-num-groups needs --moe-router-group-topk": (
        [["--num-experts", "4", "--moe-router-num-groups", "2"]],
        [["--num-experts", "4", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1"]]),
    "--moe-router-group-topk needs --moe-router-num-groups": (
        [["--num-experts", "4", "--moe-router-group-topk", "1"]], []),
    "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size": (
        [["--num-experts", "4", "--moe-shared-expert-gate"]],
        [["--num-experts", "4", "--moe-shared-expert-gate",
          "--moe-shared-expert-intermediate-size", "32"]]),
    "--data-parallel-sharding-strategy needs --use-megatron-fsdp": (
        [["--data-parallel-sharding-strategy", "optim"]],
        [["--data-parallel-sharding-strategy", "optim", "--use-megatron-fsdp"]]),
    "--elastic needs --global-batch-size": (
        [["--elastic", {"training": {"global_batch_size": None}}]], [["--elastic"]]),
    "--decoupled-min-lr needs --decoupled-lr": (
        [["--decoupled-min-lr", "1e-5"]], [["--decoupled-min-lr", "1e-5", "--decoupled-lr", "1e-4"]]),
    "--skip-train needs --load": ([["--skip-train"]], [["--skip-train", "--load", "."]]),
    "--recompute-method needs --recompute-granularity full": (
        [["--recompute-method", "uniform"]],
        [["--recompute-method", "uniform", "--recompute-granularity", "full"]]),
    "--check-collectives needs --dry-run": (
        [["--check-collectives"]], [["--check-collectives", "--dry-run"]]),
    "--loss-plot needs --metrics-file": (
        [["--loss-plot", "loss.png"]], [["--loss-plot", "loss.png", "--metrics-file", "m.jsonl"]]),
    "--ckpt-step needs --load": ([["--ckpt-step", "3"]], [["--ckpt-step", "3", "--load", "."]]),
    "--mla-latent-norm-epsilon needs --multi-latent-attention": (
        [["--mla-latent-norm-epsilon", "1e-6"]], [_MLA + ["--mla-latent-norm-epsilon", "1e-6"]]),
    "--qk-layernorm-scope needs --qk-layernorm": (
        [["--qk-layernorm-scope", "projection", "--normalization", "RMSNorm"]],
        [["--qk-layernorm-scope", "projection", "--normalization", "RMSNorm", "--qk-layernorm"]]),
    "documents need a tokenizer": (
        [["--reset-attention-mask"], ["--reset-position-ids"]],
        [_DOCS]),
    "te refuses --reset-attention-mask or --window-size with CP": (
        [["--cp", "2", *_DOCS, {"model": dict(_TE)}],
         ["--cp", "2", {"model": dict(_TE, window_size=(8, 0))}]],
        [["--cp", "2", *_DOCS], [*_DOCS, {"model": dict(_TE)}]]),
    "te refuses --norm-placement post": (
        [[{"model": dict(_TE, norm_placement="post")}]],
        [[{"model": dict(_TE)}], ["--norm-placement", "post"]]),
    "te refuses --qk-clip": ([[{"model": dict(_TE, qk_clip=True)}]],
                             [[{"model": dict(_TE)}], ["--qk-clip"]]),
    "--qk-clip excludes --multi-latent-attention": (
        [_MLA + ["--qk-clip"]], [_MLA, ["--qk-clip"]]),
    "--qk-clip excludes --reset-attention-mask and --window-size": (
        [[*_DOCS, "--qk-clip"], ["--window-size", "4,0", "--qk-clip"]],
        [[*_DOCS], ["--qk-clip"]]),
    # Qwen3-Next: Gated DeltaNet and gated attention
    "Gated DeltaNet heads split over TP": (
        [_GDN + ["--tp", "2", "--sequence-parallel", "--linear-num-key-heads", "3",
                 "--linear-num-value-heads", "6"],
         _GDN + ["--linear-num-key-heads", "4", "--linear-num-value-heads", "6"]],
        [_GDN + ["--tp", "2", "--sequence-parallel"], _GDN]),
    "te refuses --experimental-attention-variant or --attention-output-gate": (
        [[{"model": dict(_TE, experimental_attention_variant="gated_delta_net")}],
         [{"model": dict(_TE, attention_output_gate=True)}]],
        [[{"model": dict(_TE)}], _GDN + ["--attention-output-gate"]]),
    "--linear-attention-freq needs --experimental-attention-variant": (
        [["--linear-attention-freq", "4"]], [_GDN]),
    "Qwen3-Next's layers exclude MLA, Muon and --qk-clip": (
        [_MLA + ["--attention-output-gate"], ["--attention-output-gate", "--qk-clip"],
         ["--attention-output-gate", "--optimizer", "muon"], _GDN + _MLA, _GDN + ["--qk-clip"]],
        [["--attention-output-gate"], _MLA, ["--qk-clip"], _GDN + ["--optimizer", "muon"]]),
    # Llama 4's attention
    "te refuses --attention-chunk-size with CP": (
        [["--cp", "2", {"model": dict(_TE, attention_chunk_size=8)}]],
        [["--cp", "2", "--attention-chunk-size", "8"],
         [{"model": dict(_TE, attention_chunk_size=8)}]]),
    "--attention-chunk-size excludes --multi-latent-attention": (
        [_MLA + ["--attention-chunk-size", "8"]],
        [_MLA, ["--attention-chunk-size", "8", "--position-embedding-type", "rope"]]),
    "--qk-l2-norm excludes --multi-latent-attention": (
        [_MLA + ["--qk-l2-norm"]],
        [_MLA, ["--qk-l2-norm", "--position-embedding-type", "rope"]]),
    "--qk-l2-norm excludes --qk-layernorm": (
        [["--qk-l2-norm", "--qk-layernorm"]], [["--qk-l2-norm"], ["--qk-layernorm"]]),
    "--qk-clip excludes --attention-chunk-size": (
        [["--attention-chunk-size", "8", "--qk-clip"]],
        [["--attention-chunk-size", "8"], ["--qk-clip"]]),
    "--attn-temperature-tuning needs --no-rope-freq": (
        [["--attn-temperature-tuning", "--position-embedding-type", "rope"]],
        [["--attn-temperature-tuning", "--position-embedding-type", "rope",
          "--no-rope-freq", "2"]]),
    "--attn-temperature-floor-scale needs --attn-temperature-tuning": (
        [["--attn-temperature-floor-scale", "16"]],
        [["--attn-temperature-floor-scale", "16", "--attn-temperature-tuning",
          "--position-embedding-type", "rope", "--no-rope-freq", "2"]]),
    "--moe-apply-probs-on-input needs --moe-router-topk 1": (
        [["--num-experts", "4", "--moe-router-topk", "2", "--moe-apply-probs-on-input"]],
        [["--num-experts", "4", "--moe-router-topk", "1", "--moe-apply-probs-on-input"],
         ["--num-experts", "4", "--moe-router-topk", "2"]]),
    "--moe-apply-probs-on-input needs --num-experts": (
        [["--moe-apply-probs-on-input"]], [["--num-experts", "4", "--moe-router-topk", "1"]]),
    "--attn-temperature-scale needs --attn-temperature-tuning": (
        [["--attn-temperature-scale", "0.2"]],
        [["--attn-temperature-scale", "0.2", "--attn-temperature-tuning",
          "--position-embedding-type", "rope", "--no-rope-freq", "2"]]),
    "schedule matches virtual stages": (
        [["--pp", "2", "--pipeline-schedule", "interleaved"],
         ["--pp", "2", "--pipeline-schedule", "1f1b",
          "--num-virtual-stages-per-pipeline-rank", "2"],
         _DV + ["--num-virtual-stages-per-pipeline-rank", "4"]],
        [["--pp", "2", "--pipeline-schedule", "interleaved",
          "--num-virtual-stages-per-pipeline-rank", "2"], ["--pp", "2"],
         _DV + ["--num-virtual-stages-per-pipeline-rank", "2"]]),
    "heads split over TP": (
        [["--tp", "16"], ["--tp", "4", "--group-query-attention", "--num-query-groups", "2"]],
        [["--tp", "8"], ["--tp", "4", "--group-query-attention", "--num-query-groups", "4"]]),
    "sequence splits over 2 x CP": ([["--cp", "4", "--seq-length", "36"]], [["--cp", "4"]]),
    "sequence-parallel splits the CP chunk over TP": (
        [["--tp", "4", "--sequence-parallel", "--seq-length", "34"]],
        [["--tp", "4", "--sequence-parallel"], ["--tp", "4", "--seq-length", "34"]]),
    "all-to-all CP splits heads over TP x CP": (
        [["--cp", "4", "--cp-comm-type", "a2a", "--tp", "4"]],
        [["--cp", "2", "--cp-comm-type", "a2a", "--tp", "4"], ["--cp", "4", "--tp", "4"]]),
    "--check-collectives excludes --use-torch-fsdp2": (
        [["--dry-run", "--check-collectives", "--use-torch-fsdp2"]],
        [["--dry-run", "--check-collectives"], ["--use-torch-fsdp2"]]),
    "multi-token prediction excludes CP": ([["--mtp-num-layers", "1", "--cp", "2"]],
                                           [["--mtp-num-layers", "1"]]),
    "hsdp instances split the data-parallel groups": (
        [["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "3"]],
        [["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "4"]]),
    "multi-latent attention needs rope": (
        [["--multi-latent-attention"],
         ["--multi-latent-attention", "--position-embedding-type", "yarn"]], [_MLA]),
    "multi-latent attention excludes GQA, qkv bias and rope scaling": (
        [_MLA + ["--group-query-attention", "--num-query-groups", "2"],
         _MLA + ["--add-qkv-bias"], _MLA + ["--use-rope-scaling"]],
        [_MLA, ["--add-qkv-bias"]]),
    "--no-rope-freq needs rotary attention without MLA": (
        [["--no-rope-freq", "4"], _MLA + ["--no-rope-freq", "4"]],
        [["--position-embedding-type", "rope", "--no-rope-freq", "4"],
         ["--position-embedding-type", "yarn", "--no-rope-freq", "([0]*3+[1])*2"]]),
    "--qk-layernorm-scope projection needs RMSNorm without MLA": (
        [["--qk-layernorm", "--qk-layernorm-scope", "projection"],
         _MLA + ["--normalization", "RMSNorm", "--qk-layernorm", "--qk-layernorm-scope",
                 "projection"]],
        [["--normalization", "RMSNorm", "--qk-layernorm", "--qk-layernorm-scope",
          "projection"], ["--qk-layernorm"]]),
    "--precision excludes --fp16/--bf16": (
        [["--precision", "fp32", "--bf16"], ["--precision", "bf16", "--fp16"]],
        [["--bf16"], ["--precision", "bf16", "--bf16"]]),
    "--fp16 excludes --bf16": ([["--fp16", "--bf16"]], [["--fp16"]]),
    "per-split data excludes --data-path and --mock-data": (
        [["--train-data-path", "train"]], [[]]),      # train.bin/.idx: made in the test
    "--mock-data excludes --sample-windows random": ([["--sample-windows", "random"]], [[]]),
    # Gemma 3's RoPE flags
    "--rotary-base-local needs --window-size": (
        [["--position-embedding-type", "rope", "--rotary-base-local", "10000"]],
        [["--position-embedding-type", "rope", "--window-size", "3,0",
          "--rotary-base-local", "10000"]]),
    "--rotary-seq-len-interpolation-factor needs --position-embedding-type rope": (
        [["--rotary-seq-len-interpolation-factor", "8"]],
        [["--position-embedding-type", "rope", "--rotary-seq-len-interpolation-factor", "8"]]),
    # gpt-oss: sinks with TE and CP, expert biases with expert-TP
    "te refuses --softmax-type with CP": (
        [["--cp", "2", {"model": dict(_TE, softmax_type="learnable")}]],
        [[{"model": dict(_TE, softmax_type="learnable")}],
         ["--cp", "2", "--softmax-type", "learnable"]]),
    "expert-tp refuses --moe-expert-bias": (
        [["--num-experts", "4", "--moe-expert-bias", "--tp", "2", "--sequence-parallel"]],
        [["--num-experts", "4", "--moe-expert-bias", "--tp", "2", "--sequence-parallel",
          "--expert-tensor-parallel-size", "1"]]),
    "--moe-expert-bias needs --num-experts": (
        [["--moe-expert-bias"]], [["--num-experts", "4", "--moe-expert-bias"]]),
    "--moe-router-dtype needs --num-experts": (
        [["--moe-router-dtype", "fp32"]], [["--num-experts", "4", "--moe-router-dtype", "fp32"]]),
}


def _build(case, validate):
    argv = [a for a in case if isinstance(a, str)]
    sections = next((a for a in case if isinstance(a, dict)), {})
    cfg = parse_args(BASE + argv, validate_config=validate and not sections)
    for section, fields in sections.items():
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section),
                                                                      **fields)})
    return cfg


def test_every_rule_has_a_refusal_case():
    named = {r.name for r in F.RULES if not isinstance(r, F.Excludes)}
    assert set(RULE_CASES) == named, named ^ set(RULE_CASES)


@pytest.mark.parametrize("name", sorted(RULE_CASES))
def test_validation_refuses_each_rule_with_its_message_and_accepts_it_kept(
        name, tmp_path, monkeypatch):
    """Each case breaks its rule first; the whole validation refuses it with the rule's
    message, and each kept variant passes validation (TE variants: the rules only)."""
    monkeypatch.chdir(tmp_path)
    for ext in (".bin", ".idx"):
        (tmp_path / f"train{ext}").write_bytes(b"")
    rule = next(r for r in F.RULES if r.name == name)
    bad, good = RULE_CASES[name]
    for case in bad:
        cfg = _build(case, validate=False)
        assert next(F.broken(cfg), None) is rule, (case, [r.name for r in F.broken(cfg)])
        message = F._text(rule.reason, cfg, fp8_environment)
        assert "--" in message and "\n" not in message, message
        with pytest.raises(ConfigError) as err:
            validate(cfg)
        assert str(err.value) == message
        if not rule.dry_run:        # hardware and kernels: --dry-run describes the layout
            assert rule not in set(F.broken(cfg, dry_run=True))
    for case in good:
        cfg = _build(case, validate=True)
        assert rule not in set(F.broken(cfg)), case
        if any(isinstance(a, dict) for a in case):   # TE on CPU: only the rules are read
            assert F.refusal(cfg) is None, case


def test_needs_and_refused_settings():
    with pytest.raises(ConfigError, match="--expert-model-parallel-size > 1 needs --num-experts"):
        parse_args(BASE + ["--ep", "2"])
    with pytest.raises(ConfigError, match="needs --sequence-parallel"):
        parse_args(BASE + ["--tp", "2", "--num-experts", "4"])
    with pytest.raises(ConfigError, match="--overlap-param-gather needs --use-distributed"):
        parse_args(BASE + ["--overlap-grad-reduce", "--overlap-param-gather"])
    with pytest.raises(ConfigError, match="--overlap-param-gather needs --overlap-grad-reduce"):
        parse_args(BASE + ["--use-distributed-optimizer", "--overlap-param-gather"])
    cp = BASE + ["--cp", "2"]
    cp[cp.index("--attention-dropout") + 1] = "0.1"
    with pytest.raises(ConfigError, match=re.escape(F.CP_DROPOUT)):
        parse_args(cp)
    assert parse_args(cp + ["--dry-run"])       # a layout check: the run refuses it
    with pytest.raises(ConfigError, match="FP8 training needs Transformer Engine"):
        parse_args(BASE + ["--fp8-format", "hybrid", "--device", "cpu"])


def test_the_compatibility_page_is_current():
    page = open(os.path.join(ROOT, PAGE), encoding="utf-8").read()
    assert page == render(), "run python tools/compatibility_matrix.py"


# Where a user error may be raised.  Rules about which features and values combine live in
# the rule engine (cli/features.py, read by cli/validation.py); a flag's own domain beside its
# field (config/domains.py raises what domain_checks.py finds); the boundary prints them.
# Everything else here finds its fault in something only known while running, each for the
# reason given.  A new file raising a user error must be one of these, or its rule belongs in
# the engine.
USER_ERROR_PLACES = {
    "megalite/cli/features.py": "the rule engine",
    "megalite/cli/validation.py": "the engine's reader: value checks before any process group",
    "megalite/config/domains.py": "field domains",
    "megalite/cli/boundary.py": "the boundary",
    "megalite/cli/arguments.py": "parsing: a --config file's contents, unknown flags",
    "megalite/cli/presets.py": "a --model-preset name or file",
    "megalite/cli/recipes.py": "a recipe file's contents (--config)",
    "megalite/config/megatron_fsdp.py": "translating --use-megatron-fsdp to the strategy "
                                        "fields, before the fields exist to write a rule on",
    "megalite/checkpointing/checkpoint_args.py": "checkpoint contents vs the flags",
    "megalite/checkpointing/resume_schedule.py": "checkpoint contents vs the schedule flags",
    "megalite/checkpointing/hf.py": "a Hugging Face folder's files (index, safetensors)",
    "megalite/checkpointing/hf_adapters/base.py": "a Hugging Face checkpoint's contents",
    "megalite/checkpointing/hf_adapters/deepseek_v3.py": "a Hugging Face checkpoint's contents",
    "megalite/checkpointing/hf_adapters/llama.py": "a Hugging Face checkpoint's contents",
    "megalite/checkpointing/hf_adapters/mixtral.py": "a Hugging Face checkpoint's contents",
    "megalite/checkpointing/hf_adapters/qwen3.py": "a Hugging Face checkpoint's contents",
    "megalite/checkpointing/hf_adapters/qwen_moe.py": "a Hugging Face checkpoint's contents",
    "megalite/checkpointing/hf_adapters/rope.py": "a Hugging Face checkpoint's rope settings",
    "megalite/checkpointing/hf_adapters/sliding_window.py":
        "a Hugging Face checkpoint's sliding windows",
    "megalite/checkpointing/hf_adapters/smollm3.py": "a Hugging Face checkpoint's contents",
    "megalite/checkpointing/hf_adapters/gpt_oss.py": "a Hugging Face checkpoint's contents",
    "megalite/checkpointing/hf_adapters/qwen3_next.py": "a Hugging Face checkpoint's contents",
    "megalite/optimizer/optimizer_state.py": "checkpoint contents (optimizer state)",
    "megalite/checkpointing/checkpoint.py": "checkpoint contents and the filesystem under --save",
    "megalite/checkpointing/train_state.py": "checkpoint contents (training state)",
    "megalite/generate/__init__.py": "the checkpoint a generation loads",
    "megalite/data/gpt_dataset.py": "data files and the --data-path/--split they are read with",
    "megalite/data/indexed_dataset.py": "data file contents (token ids, .bin/.idx)",
    "megalite/config/data_flags.py": "--data-path and --split, parsed for their domain checks and the dataset builder",
    "megalite/data/random_windows.py": "a data split too short for its windows",
    "megalite/data/tokenizers.py": "tokenizer files (their constructors' errors, one line)",
    "megalite/pipeline_parallel/timeline_records.py": "a timeline file's contents",
    "megalite/viz/timeline.py": "a timeline file's contents",
    "megalite/cli/elastic_fit.py": "the launched world: no smaller world fits the layout",
    "megalite/training/dry_run.py": "what a --dry-run finds: the planner's memory verdict, the "
                                    "collective check's verdict, a tokenizer's vocabulary",
    "megalite/commands/plan.py": "the planner's own command line",
    "megalite/planner/goodput.py": "the planner's own flags (failure rates, checkpoint sizes)",
    "megalite/planner/hardware.py": "the planner's hardware files and names",
    "megalite/planner/model_spec.py": "the planner's model files and names",
    "megalite/planner/moe_cost.py": "the planner's MoE routing-statistics file",
    "megalite/planner/optimizer_precision.py": "the planner's Megatron optimizer-precision "
                                               "flags (--exp-avg-dtype ...)",
    "megalite/planner/host_offload.py": "the planner's Megatron offload flags "
                                        "(--cpu-offloading, --optimizer-cpu-offload)",
    "megalite/planner/search.py": "re-raises validation's reason for a layout asked for",
    "megalite/commands/validate_run.py": "the plan-validation command's own flags",
    "megalite/elastic/etcd_rdzv.py": "the etcd rendezvous' endpoints and client (found when "
                                     "the launcher reaches them)",
    "megalite/elastic/launch.py": "the launcher's own flags (--warm-spares)",
    "megalite/config/pipeline_layout.py": "the --pipeline-model-parallel-layout string (its "
                                          "one reader, for the runtime split and the planner)",
    "megalite/checkpointing/hf_adapters/gemma.py": "a Hugging Face checkpoint's contents",
    # Llama 4 and GLM-4.5
    "megalite/checkpointing/hf_adapters/llama4.py": "a Hugging Face checkpoint's contents",
    "megalite/checkpointing/hf_adapters/glm4_moe.py": "a Hugging Face checkpoint's contents",
}


def _user_error_names():
    """UserError and every class that derives from it anywhere in megalite/ (by name)."""
    bases = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "megalite")):
        for f in files:
            if f.endswith(".py"):
                tree = ast.parse(open(os.path.join(folder, f), encoding="utf-8").read())
                for n in ast.walk(tree):
                    if isinstance(n, ast.ClassDef):
                        bases[n.name] = {getattr(b, "id", getattr(b, "attr", None))
                                         for b in n.bases}
    names, grew = {"UserError"}, True
    while grew:
        new = {c for c, bs in bases.items() if bs & names} - names
        names, grew = names | new, bool(new)
    return names


def test_user_errors_are_raised_only_by_the_engine_domains_boundary_and_listed_places():
    names, places = _user_error_names(), set()
    assert {"ConfigError", "DataError", "CheckpointError", "UnsupportedModelError"} <= names
    for folder, _, files in os.walk(os.path.join(ROOT, "megalite")):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(folder, f)
            rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
            for n in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                if isinstance(n, ast.Raise) and n.exc is not None:
                    e = n.exc.func if isinstance(n.exc, ast.Call) else n.exc
                    if getattr(e, "id", getattr(e, "attr", None)) in names:
                        places.add(rel)
                        assert rel in USER_ERROR_PLACES, \
                            f"{rel}:{n.lineno} raises a user error: put the rule in " \
                            "megalite/cli/features.py, or list the file here with its reason"
    stale = set(USER_ERROR_PLACES) - places - {"megalite/cli/features.py",
                                               "megalite/cli/boundary.py"}
    assert not stale, f"listed but raising no user error: {sorted(stale)}"


def test_no_builtin_raise_tells_the_user_a_flag():
    """A builtin exception prints as a bug; one whose text names a flag (``--x``) is a user
    error in disguise, unless the flag's domain or a rule refuses it first (listed)."""
    guarded = {   # reachable only past validation: the internal invariant names the flag
        "megalite/backends/__init__.py", "megalite/backends/selection.py",
        "megalite/config/model.py", "megalite/context_parallel/__init__.py",
        "megalite/moe/token_dispatcher.py", "megalite/optimizer/lr_schedule.py",
        "megalite/transformer/recompute.py",    # choices / ranges: the fields' domains
        "megalite/data/tokenizers.py", "megalite/data/tiktoken_models.py",  # tokenizer_for
        # turns each into one DataError line
        "megalite/distributed/data_parallel.py", "megalite/distributed/grad_buckets.py",
        "megalite/models/gpt.py", "megalite/transformer/attention.py",
        "megalite/transformer/spec.py",   # a layer spec or strategy built wrong: a bug
    }
    hits = []
    for folder, _, files in os.walk(os.path.join(ROOT, "megalite")):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(folder, f)
            rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
            text = open(path, encoding="utf-8").read()
            for n in ast.walk(ast.parse(text)):
                if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call) and \
                        getattr(n.exc.func, "id", None) in ("ValueError", "RuntimeError",
                                                            "TypeError", "NotImplementedError") \
                        and "--" in ast.get_source_segment(text, n.exc) and rel not in guarded:
                    hits.append(f"{rel}:{n.lineno}")
    assert not hits, hits
