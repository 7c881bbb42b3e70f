"""``--step-batch-size-schedule``: Megatron-LM's step schedule (its
``StepBatchsizeNumMicroBatchesCalculator`` and ``update_train_iters``), parsed, checked and
stepped; every mistake is one line naming the flag."""
import pytest

from megalite.cli.arguments import parse_args
from megalite.config import ConfigError
from megalite.config.microbatches import (BatchSizeSchedule, parse_count, parse_step_schedule,
                                          step_schedule_problem)

BASE = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
        "--seq-length", "16", "--mock-data", "--vocab-size", "32", "--lr", "1e-3",
        "--micro-batch-size", "2"]


def test_suffixes_as_megatron_parses_them():
    assert [parse_count(v) for v in ("0", "16", "2.4B", "4.8b", "250K", "1.5M", "12B", "1T")] \
        == [0, 16, 2_400_000_000, 4_800_000_000, 250_000, 1_500_000, 12 * 10 ** 9, 10 ** 12]


def test_thresholds_count_tokens_and_become_samples():
    # the GPT-3 example: tokens // seq_length 2048, one word or several, commas too
    gpt3 = ["0:16", "2.4B:320", "4.8B:624"]
    steps = parse_step_schedule(gpt3, 2048)
    assert steps == [(0, 16), (1171875, 320), (2343750, 624)]
    assert parse_step_schedule(["0:16 2.4B:320,4.8B:624"], 2048) == steps
    assert parse_step_schedule(["100:32", "0:16"], None) == [(0, 16), (100, 32)]   # sorted


def test_batch_of_each_iteration_and_train_iters():
    s = BatchSizeSchedule(8, 2, 1, steps=[(0, 2), (5, 4), (13, 8)])
    assert [s.global_batch_size_at(c) for c in (0, 4, 5, 12, 13, 10 ** 6)] == [2, 2, 4, 4, 8, 8]
    batches = s.batch_sizes()
    assert [next(batches) for _ in range(6)] == [2, 2, 2, 4, 4, 8]     # consumed 0,2,4,6,10,14
    assert s.varies and s.samples_in(6) == 22
    # Megatron's update_train_iters: batches while consumed < train_samples (the last may
    # end past it): 0,2,4,6,10 -> 14 >= 13 after 5 iterations
    assert s.train_iters(13) == 5 and s.train_iters(14) == 5 and s.train_iters(15) == 6
    assert s.num_micro_batches_at(10) == 2
    assert not BatchSizeSchedule(8, 2, 1).varies


@pytest.mark.parametrize("schedule,match", [
    (["100-16"], "is not THRESHOLD:BATCH"),
    (["0:16", "2.4X:32"], "is not THRESHOLD:BATCH"),
    (["1K:16"], "the first threshold must be 0"),
    (["0:16", "10:32"], "thresholds must grow strictly"),      # 10 tokens: 0 samples
    (["0:0"], "every batch must be >= 1"),
])
def test_domain_problems(schedule, match):
    assert match in step_schedule_problem(schedule, 16)


def _cfg(*extra):
    return parse_args(BASE + list(extra))


def test_run_config_takes_the_last_batch_as_global_batch():
    cfg = _cfg("--train-iters", "4", "--step-batch-size-schedule", "0:2", "64:4")
    assert cfg.training.global_batch_size == 4
    s = BatchSizeSchedule.of_run(cfg.training, 1, cfg.model.seq_length)
    assert s.steps == [(0, 2), (4, 4)]
    # Megatron's GPT-3 example passes --global-batch-size too: fine when it is the last batch
    assert _cfg("--train-iters", "4", "--global-batch-size", "4",
                "--step-batch-size-schedule", "0:2 64:4").training.global_batch_size == 4


@pytest.mark.parametrize("extra,match", [
    (["--global-batch-size", "8", "--step-batch-size-schedule", "0:2", "64:4"],
     r"--global-batch-size \(8\) differs from the last batch of --step-batch-size-schedule"),
    (["--step-batch-size-schedule", "0:3", "64:4"],
     r"--step-batch-size-schedule: batch 3 is not divisible by --micro-batch-size \(2\)"),
    (["--global-batch-size", "4", "--rampup-batch-size", "2", "2", "8",
      "--step-batch-size-schedule", "0:2", "64:4"], "give only one of them"),
    (["--step-batch-size-schedule", "0:2", "2.4Q:4"], "is not THRESHOLD:BATCH"),
])
def test_mistakes_are_one_line(extra, match):
    with pytest.raises(ConfigError, match=match):
        _cfg("--train-iters", "4", *extra)
