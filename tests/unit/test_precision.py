"""--precision auto|fp32|bf16: the matmul-rate probe, the choice, the warning and the log.

The choice is tested with an injected probe (no timing); one real probe checks that the
rates are measured on the model's shapes within the budget; one real run checks that the
record reaches the log and the metrics file.
"""
import json
import time

import pytest

from megalite.cli.arguments import parse_args
from megalite.config import ConfigError
from megalite.training.precision import (MAX_PROBE_FLOPS, SLOW_BF16_RATIO, MatmulRates,
                                         choose_precision, format_precision, log_precision,
                                         measure_matmul_rates, probe_shapes, resolve_precision)

FLAGS = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--vocab-size", "100", "--mock-data", "--lr", "1e-3",
         "--train-iters", "2", "--eval-iters", "0", "--global-batch-size", "2",
         "--micro-batch-size", "2", "--no-progress-bar"]


def cfg_of(*extra):
    return parse_args(["--world-size", "1", *FLAGS, *extra])


class FakeProbe:
    def __init__(self, fp32, bf16):
        self.rates, self.calls = (fp32, bf16), []

    def __call__(self, shapes, device="cpu"):
        self.calls.append(list(shapes))
        return MatmulRates(*self.rates, tuple(shapes))


@pytest.mark.parametrize("fp32,bf16,want", [(130e9, 410e9, "bf16"), (121e9, 2.4e9, "fp32"),
                                            (300e9, 290e9, "fp32")])
def test_auto_picks_the_faster_on_a_fake_probe(fp32, bf16, want):
    probe = FakeProbe(fp32, bf16)
    cfg, record = resolve_precision(cfg_of("--precision", "auto"), probe=probe)
    assert cfg.optimizer.bf16 is (want == "bf16") and record["chosen"] == want
    assert record["requested"] == "auto" and record["warning"] is None
    assert record["fp32_flops_per_s"] == fp32 and record["bf16_flops_per_s"] == bf16
    assert len(probe.calls) == 1 and record["probe_shapes"] == [list(s) for s in probe.calls[0]]


def test_fp32_does_not_probe():
    probe = FakeProbe(1.0, 2.0)
    for flags in ((), ("--precision", "fp32")):
        cfg, record = resolve_precision(cfg_of(*flags), probe=probe)
        assert record is None and not cfg.optimizer.bf16
    assert probe.calls == []


@pytest.mark.parametrize("flags", [("--bf16",), ("--precision", "bf16"),
                                   ("--bf16", "--precision", "bf16")])
def test_bf16_warns_with_both_figures_when_much_slower(flags):
    cfg, record = resolve_precision(cfg_of(*flags), probe=FakeProbe(121e9, 2.4e9))
    assert cfg.optimizer.bf16 and record["chosen"] == "bf16"
    assert "2.4 GFLOP/s" in record["warning"] and "121.0 GFLOP/s" in record["warning"]
    _, fast = resolve_precision(cfg_of(*flags), probe=FakeProbe(130e9, 410e9))
    assert fast["warning"] is None
    _, edge = resolve_precision(cfg_of(*flags), probe=FakeProbe(100e9, SLOW_BF16_RATIO * 100e9))
    assert edge["warning"] is None                         # "much slower" is below the ratio


def test_choose_precision_rules():
    slow = MatmulRates(100e9, 1e9)
    assert choose_precision("fp32", None) == ("fp32", None)
    assert choose_precision("auto", slow) == ("fp32", None)
    assert choose_precision("bf16", slow)[0] == "bf16" and choose_precision("bf16", slow)[1]


@pytest.mark.parametrize("flags,msg", [
    (("--precision", "fp32", "--bf16"), "--precision fp32 conflicts with --bf16"),
    (("--precision", "auto", "--bf16"), "--precision auto conflicts with --bf16"),
    (("--precision", "bf16", "--fp16"), "--precision bf16 conflicts with --fp16")])
def test_conflicting_flags_are_one_line_errors(flags, msg):
    with pytest.raises(ConfigError) as err:
        cfg_of(*flags)
    assert msg in str(err.value) and "\n" not in str(err.value)


def test_probe_shapes_follow_the_model_and_stay_small():
    cfg = cfg_of("--hidden-size", "256", "--ffn-hidden-size", "688", "--swiglu",
                 "--vocab-size", "32000", "--seq-length", "256", "--micro-batch-size", "8",
                 "--global-batch-size", "8")
    shapes = probe_shapes(cfg.model, 2048)
    assert shapes == [(512, 256, 1376), (512, 256, 1525)]   # output features cut to the cap
    assert all(2 * m * k * n <= MAX_PROBE_FLOPS for m, k, n in shapes)
    huge = cfg_of("--hidden-size", "8192", "--num-attention-heads", "64",
                  "--vocab-size", "128000").model
    assert all(2 * m * k * n <= 2 * MAX_PROBE_FLOPS for m, k, n in probe_shapes(huge, 8192, 8))


def test_real_probe_is_fast_and_positive():
    t0 = time.perf_counter()
    rates = measure_matmul_rates([(64, 32, 48), (32, 32, 100)], seconds=0.1)
    assert time.perf_counter() - t0 < 5.0
    assert rates.fp32 > 0 and rates.bf16 > 0 and len(rates.shapes) == 2


class FakeLogger:
    def __init__(self, tmp_path):
        self.is_writer, self.lines = True, []
        self.metrics = open(tmp_path / "m.jsonl", "w")

    def info(self, line):
        self.lines.append(line)


def test_log_precision_writes_the_record_and_the_warning(tmp_path):
    _, record = resolve_precision(cfg_of("--bf16"), probe=FakeProbe(121e9, 2.4e9))
    logger = FakeLogger(tmp_path)
    log_precision(logger, record)
    logger.metrics.close()
    assert json.loads((tmp_path / "m.jsonl").read_text()) == record
    assert logger.lines == [format_precision(record), record["warning"]]
    assert logger.lines[0].startswith("> precision: bf16 (requested bf16); matmul rates")


def test_a_run_with_precision_auto_logs_its_choice(tmp_path, capsys):
    from megalite.training.loop import pretrain

    metrics = tmp_path / "m.jsonl"
    assert pretrain(cfg_of("--precision", "auto", "--metrics-file", str(metrics))) == 0
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    prec = [r for r in recs if r.get("split") == "precision"]
    assert len(prec) == 1 and prec[0]["chosen"] in ("fp32", "bf16")
    assert prec[0]["fp32_flops_per_s"] > 0 and prec[0]["bf16_flops_per_s"] > 0
    assert len([r for r in recs if "split" not in r]) == 2          # the training lines
    assert "> precision: " in capsys.readouterr().out
