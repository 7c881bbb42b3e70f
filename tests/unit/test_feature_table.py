"""The feature table (megalite/cli/features.py): every pair of features is either excluded with a
reason or run together by a named equivalence test that exists; every exclusion is what
validation refuses, with that reason; docs/compatibility.md is the table's current
rendering; "not supported with" appears nowhere else in megalite/."""
import ast
import dataclasses
import os
import re

import pytest

from megalite.cli import features as F
from megalite.cli.arguments import parse_args
from megalite.cli.compatibility_doc import PAGE, counts, render
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
    for rule in F.RULES:
        names = [getattr(rule, k, None) for k in ("feature", "needs", "also", "a", "b")]
        assert {n for n in names if n} <= set(F.FEATURES), rule
        if isinstance(rule.reason, str):
            assert "--" in rule.reason and "\n" not in rule.reason, rule


@pytest.mark.parametrize("rule", [r for r in F.RULES if isinstance(r, F.Excludes)],
                         ids=lambda r: f"{r.a}-x-{r.b}")
def test_validation_refuses_each_exclusion_with_its_reason(rule):
    cfg = config_with(rule.a, rule.b, validate=False)
    assert F.refusal(cfg) == rule.reason
    if rule.dry_run and not {"te", "fp8"} & {rule.a, rule.b}:
        with pytest.raises(ConfigError, match=re.escape(rule.reason)):
            parse_args(BASE + TURN_ON[rule.a] + TURN_ON[rule.b])
    else:                            # hardware rules: --dry-run describes the layout only
        assert F.refusal(cfg, dry_run=True) is None


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


def test_not_supported_with_appears_only_in_the_table():
    hits = []
    for folder, _, files in os.walk(os.path.join(ROOT, "megalite")):
        for f in files:
            if f.endswith(".py") and f != "features.py":
                path = os.path.join(folder, f)
                if "not supported with" in open(path, encoding="utf-8").read().lower():
                    hits.append(os.path.relpath(path, ROOT))
    assert not hits, hits
