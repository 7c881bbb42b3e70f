"""LR schedules, AdamW parameter groups, fp32 master weights under bf16, clipping (through
the single-rank DDP strategy, which owns the gradients and the norm)."""
import math

import pytest
import torch

from megalite.optimizer.lr_schedule import StepSettings
from megalite.cli.arguments import parse_args
from megalite.distributed.data_parallel import DDPStrategy
from megalite.models.parallelize import attach_data_parallel
from megalite.optimizer import LRScheduler, MixedPrecisionOptimizer
from megalite.parallel_state import ParallelState, RankGrid


def test_warmup_then_decay_styles():
    """``lr(i)`` is the lr of update ``i``: Megatron's value at the steps consumed before it."""
    lin = LRScheduler(1.0, 0.1, warmup_steps=10, decay_steps=110, style="linear")
    assert lin.lr(6) == pytest.approx(0.5) and lin.lr(11) == pytest.approx(1.0)
    assert lin.lr(61) == pytest.approx(0.1 + 0.9 * 0.5) and lin.lr(111) == pytest.approx(0.1)
    assert lin.lr(500) == pytest.approx(0.1)
    cos = LRScheduler(1.0, 0.1, warmup_steps=10, decay_steps=110, style="cosine")
    assert cos.lr(61) == pytest.approx(0.1 + 0.9 * 0.5)
    assert cos.lr(36) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    const = LRScheduler(1.0, 0.1, warmup_steps=4, decay_steps=100, style="constant")
    assert const.lr(3) == pytest.approx(0.5) and const.lr(99) == 1.0
    wsd = LRScheduler(1.0, 0.0, warmup_steps=10, decay_steps=100, style="WSD", wsd_decay_steps=20)
    assert wsd.lr(51) == 1.0 and wsd.lr(81) == 1.0
    assert wsd.lr(91) == pytest.approx(0.5) and wsd.lr(101) == pytest.approx(0.0)


def test_warmup_fraction_from_config():
    cfg = parse_args(["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
                      "--seq-length", "8", "--mock-data", "--vocab-size", "10", "--lr", "2.0",
                      "--train-iters", "100", "--lr-warmup-fraction", "0.1",
                      "--lr-decay-style", "cosine", "--min-lr", "0.2"])
    sched = LRScheduler.from_config(cfg, 100)   # steps in samples: global batch 1 here
    assert sched.warmup_steps == 10 and sched.decay_steps == 100
    assert sched.lr(11) == pytest.approx(2.0) and sched.lr(101) == pytest.approx(0.2)


def _cfg(extra=()):
    return parse_args(["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
                       "--seq-length", "8", "--mock-data", "--vocab-size", "10", "--lr", "0.1",
                       "--train-iters", "1", "--weight-decay", "0.5", *extra])


def _state():
    return ParallelState.build(RankGrid(1), 0, create_groups=False)


def test_no_decay_on_norms_and_biases():
    lin, norm = torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)
    named = [("lin.weight", lin.weight), ("lin.bias", lin.bias), ("norm.weight", norm.weight)]
    opt = DDPStrategy(named, _cfg(), _state()).optimizer
    assert isinstance(opt, MixedPrecisionOptimizer)
    decay = {id(p) for g in opt.inner.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decay == {id(lin.weight)}


def test_bf16_master_weights_accumulate_small_updates():
    w = torch.nn.Parameter(torch.ones(4, 4, dtype=torch.bfloat16))
    ddp = DDPStrategy([("w", w)], _cfg(["--bf16", "--weight-decay", "0",
                                        "--optimizer", "sgd", "--clip-grad", "0"]), _state())
    attach_data_parallel([], ddp)           # the parallelize step installs its hooks
    opt = ddp.optimizer
    opt.inner.param_groups[0]["momentum"] = 0.0
    for _ in range(10):  # 10 updates of 1e-4 each: lost in bf16 (ulp at 1.0 is 2^-7), kept in fp32
        ddp.zero_grad()
        (w.float().sum()).backward()
        assert w.grad is None and w.main_grad.dtype == torch.float32  # hook moved it to main_grad
        ddp.step(StepSettings(1e-4))
    assert opt.masters[0].dtype == torch.float32
    assert opt.masters[0][0, 0].item() == pytest.approx(1 - 1e-3, abs=1e-6)
    assert w.dtype == torch.bfloat16


def test_clip_to_global_norm():
    w = torch.nn.Parameter(torch.zeros(2))
    ddp = DDPStrategy([("w", w)], _cfg(["--clip-grad", "1.0", "--optimizer", "sgd",
                                        "--weight-decay", "0"]), _state())
    ddp.optimizer.inner.param_groups[0]["momentum"] = 0.0
    w.grad = torch.tensor([3.0, 4.0])
    norm = ddp.step(StepSettings(1.0))
    assert norm == pytest.approx(5.0)
    assert torch.allclose(w.detach(), torch.tensor([-0.6, -0.8]), atol=1e-5)
