"""Validation checks the parsed config without changing it; effective SP is derived."""
import copy

import pytest

from megalite.cli import validation
from megalite.cli.arguments import parse_args
from megalite.config import ConfigError, MegaliteConfig, ModelConfig
from megalite.planner.layout import layout_from_config

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--mock-data", "--vocab-size", "1000", "--train-iters", "2",
        "--lr", "1e-3", "--global-batch-size", "8"]


@pytest.mark.parametrize("tp,active", [(1, False), (2, True)])
def test_sequence_parallel_flag_kept_as_given_and_effective_value_derived(tp, active):
    cfg = parse_args(["--world-size", "2", *BASE, "--sequence-parallel",
                      "--tensor-model-parallel-size", str(tp)])
    assert cfg.parallel.sequence_parallel is True          # not switched off after parsing
    assert cfg.parallel.sequence_parallel_active is active
    assert layout_from_config(cfg).sp is active
    plain = parse_args(["--world-size", "2", *BASE, "--tensor-model-parallel-size", str(tp)])
    assert plain.parallel.sequence_parallel_active is False


def test_validate_layout_does_not_change_a_complete_config():
    cfg = parse_args(["--world-size", "8", *BASE, "--sequence-parallel",
                      "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2"],
                     validate_config=False)
    before = copy.deepcopy(cfg.to_dict())
    validation.validate_layout(cfg)
    validation.validate(cfg)
    assert cfg.to_dict() == before


def test_sp_seq_check_only_when_sp_is_active():
    # 30 tokens do not split over TP 4, but without TP there is nothing to split.
    args = [a if a != "32" else "30" for a in BASE]
    parse_args(["--world-size", "1", *args, "--sequence-parallel"])
    with pytest.raises(ConfigError, match="--sequence-parallel needs --seq-length"):
        parse_args(["--world-size", "4", *args, "--num-attention-heads", "4",
                    "--tensor-model-parallel-size", "4", "--sequence-parallel",
                    "--global-batch-size", "1"])


def layout_cfg(**parallel):
    cfg = MegaliteConfig(world_size=parallel.pop("world", 8), model=ModelConfig(
        num_layers=8, hidden_size=64, num_attention_heads=8, seq_length=64, vocab_size=100))
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


@pytest.mark.parametrize("check,parallel,words", [
    (validation.check_rank_grids, dict(tensor_model_parallel_size=3), "world size 8"),
    (validation.check_virtual_stages, dict(num_virtual_stages_per_pipeline_rank=2),
     "virtual pipeline stages need"),
    (validation.check_stage_split, dict(pipeline_model_parallel_size=8,
                                        decoder_first_pipeline_num_layers=3), "must split evenly"),
    (validation.check_layout_features, dict(tensor_model_parallel_size=16, world=16),
     "--num-attention-heads"),          # the rule engine's "heads split over TP"
    (validation.check_layout_features, dict(context_parallel_size=64, world=64),
     "load-balanced CP"),
    (validation.check_layout_features, dict(expert_model_parallel_size=2), "needs --num-experts"),
    (validation.check_layout_features, dict(pipeline_model_parallel_size=2,
                                            decoder_first_pipeline_num_layers=2,
                                            num_virtual_stages_per_pipeline_rank=2),
     "do not combine with virtual pipeline stages"),
])
def test_each_named_check_owns_its_topic(check, parallel, words):
    with pytest.raises(ConfigError, match=words):
        check(layout_cfg(**parallel))
    with pytest.raises(ConfigError, match=words):        # and validate_layout reaches it
        validation.validate_layout(layout_cfg(**parallel))
    check(layout_cfg())                                   # a good config passes


def test_checks_run_in_order_first_fault_reported():
    # TP 3 breaks both the rank grid and the head split; the grid is checked first.
    with pytest.raises(ConfigError, match="world size 8 is not divisible"):
        validation.validate_layout(layout_cfg(tensor_model_parallel_size=3))
