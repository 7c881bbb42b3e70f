"""Every config field declares its domain, and a value outside it is one line before any
process group: the walk over all fields that issue 24 asks for.

The invalid values come from the declarations themselves (``domains.invalid_examples``),
so a new field without a domain fails here, and a declared domain that the checker does not
enforce fails here too.  Values go in through a ``--config`` YAML file, the way a typo in a
recipe arrives (YAML carries any type; argparse never sees defaults' types).
"""
import os

import pytest
import yaml

from megalite.cli.arguments import parse_args
from megalite.config import ConfigError, all_fields, field_flag, has_domain
from megalite.config.domains import invalid_examples

SETTINGS = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
            "mock_data": True, "vocab_size": 100, "lr": 1e-3, "train_iters": 2,
            "global_batch_size": 4, "micro_batch_size": 1, "num_experts": 4,
            "moe_router_topk": 2}
BASE = ["--world-size", "1"] + [x for k, v in SETTINGS.items() for x in
                                (["--" + k.replace("_", "-")] if v is True else
                                 ["--" + k.replace("_", "-"), str(v)])]


def _yaml_key(f) -> str:
    return field_flag(f).lstrip("-").replace("-", "_")


def _flags(f) -> list:
    return [field_flag(f), *f.metadata.get("aliases", ())]


def test_every_field_declares_a_domain():
    missing = [f"{s}.{f.name}" for s, f in all_fields() if not has_domain(f)]
    assert not missing, f"fields without a declared domain (opt(gt=..., choices=...)): {missing}"


def test_every_value_outside_a_domain_is_one_line_naming_the_flag(tmp_path):
    base = parse_args(BASE)
    covered, cases, wrong = 0, 0, []
    for section, f in all_fields():
        examples = invalid_examples(base, section, f)
        assert examples, f"{section}.{f.name}: its domain yields no value outside it"
        for i, value in enumerate(examples):
            path = tmp_path / f"{f.name}_{i}.yaml"
            path.write_text(yaml.safe_dump({**SETTINGS, _yaml_key(f): value}))
            try:
                parse_args(["--world-size", "1", "--config", str(path)])
                wrong.append(f"{section}.{f.name} = {value!r}: accepted")
            except ConfigError as err:
                msg = str(err)
                if "\n" in msg or not any(flag in msg for flag in _flags(f)):
                    wrong.append(f"{section}.{f.name} = {value!r}: {msg!r}")
            cases += 1
        covered += 1
    assert not wrong, "\n".join(wrong)
    print(f"\nfield domains walked: {covered} fields, {cases} values outside their domains, "
          "each refused in one line naming its flag")
    assert covered == sum(1 for _ in all_fields()) and covered >= 150


@pytest.mark.parametrize("flags,words", [
    (["--eval-interval", "0"], "--eval-interval must be a positive integer, got 0"),
    (["--log-interval", "0"], "--log-interval must be a positive integer, got 0"),
    (["--lr=-1e-3"], "--lr must be a non-negative number, got -0.001"),
    (["--min-lr", "1e-2"], "--min-lr must be <= --lr (0.001), got 0.01"),
    (["--hidden-dropout", "1.5"], "--hidden-dropout must be < 1, got 1.5"),
    (["--recompute-method", "uniform"], "--recompute-method needs --recompute-granularity full"),
    (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer"),
    (["--skip-train"], "--skip-train needs --load"),
    (["--ckpt-step", "3"], "--ckpt-step needs --load"),
])
def test_user_facing_domain_messages(flags, words):
    with pytest.raises(ConfigError) as err:
        parse_args(BASE + flags)
    assert str(err.value) == words or str(err.value).startswith(words), str(err.value)


def test_yaml_booleans_are_strict(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("bf16: maybe\n")
    with pytest.raises(ConfigError, match=r"--bf16: expected true or false, got 'maybe'"):
        parse_args(BASE + ["--config", str(path)])
    path.write_text("bf16: yes\n")
    assert parse_args(BASE + ["--config", str(path)]).optimizer.bf16


def test_load_of_an_iteration_folder_names_the_parent(tmp_path):
    it = tmp_path / "ckpt" / "iter_0000020"
    it.mkdir(parents=True)
    with pytest.raises(ConfigError) as err:
        parse_args(BASE + ["--load", str(it)])
    parent = os.path.dirname(str(it))
    assert str(err.value) == (f"--load: '{it}' is one checkpoint of a run; pass its parent "
                              f"folder: --load {parent} --ckpt-step 20")


def test_flag_domains_page_is_current():
    """docs/flag_domains.md is generated from the declarations; regenerate it with
    ``python -m megalite.config.domain_doc > docs/flag_domains.md``."""
    from megalite.config.domain_doc import render

    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "flag_domains.md")
    with open(path) as fh:
        assert fh.read() == render(), "docs/flag_domains.md is stale: regenerate it"
