"""The lr and weight-decay sequences equal Megatron-Core's ``OptimizerParamScheduler``,
step by step, for every decay style, warmup in iterations and in samples, across a resume
(the oracle is megatron-core itself: ``pip install --no-deps megatron-core einops``)."""
import warnings

import pytest
import torch

from megalite.cli.arguments import parse_args
from megalite.optimizer import LRScheduler

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    mcore = pytest.importorskip("megatron.core.optimizer_param_scheduler")

BASE = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
        "--seq-length", "8", "--mock-data", "--vocab-size", "10", "--lr", "1e-3",
        "--min-lr", "1e-5", "--global-batch-size", "4", "--micro-batch-size", "4"]


def megatron_scheduler(cfg, opt):
    """Megatron-LM's ``get_optimizer_param_scheduler`` on ``cfg`` (its training.py logic)."""
    o, t = cfg.optimizer, cfg.training
    if t.train_iters:
        decay = (o.lr_decay_iters or t.train_iters) * t.global_batch_size
        wd_steps = t.train_iters * t.global_batch_size
        wsd = o.lr_wsd_decay_iters * t.global_batch_size if o.lr_wsd_decay_iters else None
        warmup = o.lr_warmup_iters * t.global_batch_size
    else:
        decay = o.lr_decay_samples or t.train_samples
        wd_steps = t.train_samples
        wsd = o.lr_wsd_decay_samples
        warmup = o.lr_warmup_samples
    if o.lr_warmup_fraction is not None:
        warmup = o.lr_warmup_fraction * decay
    wd0 = o.weight_decay if o.start_weight_decay is None else o.start_weight_decay
    wd1 = o.weight_decay if o.end_weight_decay is None else o.end_weight_decay
    return mcore.OptimizerParamScheduler(
        opt, init_lr=o.lr_warmup_init, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=decay, lr_decay_style=o.lr_decay_style, start_wd=wd0, end_wd=wd1,
        wd_incr_steps=wd_steps, wd_incr_style=o.weight_decay_incr_style,
        wsd_decay_steps=wsd, lr_wsd_decay_style=o.lr_wsd_decay_style)


CASES = [
    ["--train-iters", "4", "--lr-decay-style", "linear", "--min-lr", "0"],
    ["--train-iters", "40", "--lr-decay-style", "linear", "--lr-warmup-iters", "5"],
    ["--train-iters", "40", "--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.1",
     "--lr-decay-iters", "30"],
    ["--train-iters", "40", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "10",
     "--lr-warmup-iters", "3"],
    ["--train-iters", "40", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "8",
     "--lr-wsd-decay-style", "exponential"],
    ["--train-iters", "40", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "8",
     "--lr-wsd-decay-style", "minus_sqrt"],
    ["--train-iters", "40", "--lr-decay-style", "inverse-square-root", "--lr-warmup-iters", "4"],
    ["--train-iters", "40", "--lr-decay-style", "constant", "--lr-warmup-iters", "6",
     "--lr-warmup-init", "1e-4"],
    ["--train-samples", "160", "--lr-decay-style", "cosine", "--lr-warmup-samples", "18",
     "--lr-decay-samples", "130"],
    ["--train-samples", "160", "--lr-decay-style", "linear", "--lr-warmup-samples", "10",
     "--weight-decay-incr-style", "linear", "--start-weight-decay", "0.01",
     "--end-weight-decay", "0.1"],
    ["--train-samples", "160", "--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "40",
     "--weight-decay-incr-style", "cosine", "--start-weight-decay", "0.0",
     "--end-weight-decay", "0.2", "--lr-wsd-decay-style", "cosine"],
]


@pytest.mark.parametrize("extra", CASES, ids=lambda c: "-".join(c[2:4] + c[4:6]))
def test_lr_and_wd_equal_optimizer_param_scheduler(extra):
    cfg = parse_args(BASE + extra)
    gbs, iters = cfg.training.global_batch_size, None
    iters = cfg.training.train_iters or cfg.training.train_samples // gbs
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))]}], lr=0.0)
    ref = megatron_scheduler(cfg, opt)
    ours = LRScheduler.from_config(cfg, iters)
    resumed = None
    for it in range(1, iters + 4):          # a few steps past the end: min lr / end wd
        consumed = (it - 1) * gbs
        if it == iters // 2:                 # resume: a fresh scheduler from consumed samples
            resumed = LRScheduler.from_config(cfg, iters)
        sched = resumed or ours
        settings = sched.settings_at(consumed)
        lr = settings.lr
        assert lr == opt.param_groups[0]["lr"], (it, lr, opt.param_groups[0]["lr"])
        assert settings.weight_decay == opt.param_groups[0]["weight_decay"], it
        if cfg.training.train_iters:
            assert sched.lr(it) == lr
        ref.step(increment=gbs)


def test_issue_example_first_update_uses_peak_lr():
    cfg = parse_args(BASE + ["--train-iters", "4", "--min-lr", "0"])
    sched = LRScheduler.from_config(cfg, 4)
    assert [sched.lr(i) for i in range(1, 5)] == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])


def test_decoupled_lr_follows_its_own_peak_and_floor():
    cfg = parse_args(BASE + ["--train-iters", "10", "--decoupled-lr", "5e-3",
                             "--decoupled-min-lr", "5e-4", "--lr-warmup-iters", "2"])
    sched = LRScheduler.from_config(cfg, 10)
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))]},
                           {"params": [torch.nn.Parameter(torch.zeros(1))],
                            "max_lr": 5e-3, "min_lr": 5e-4}], lr=0.0)
    ref = megatron_scheduler(cfg, opt)
    for it in range(1, 13):
        settings = sched.settings_at((it - 1) * 4)
        assert [settings.lr, settings.decoupled_lr] == [g["lr"] for g in opt.param_groups]
        ref.step(increment=4)


def test_trainer_gives_embedding_and_output_the_decoupled_lr():
    from megalite.parallel_state import ParallelState, RankGrid
    from megalite.training.loop import Trainer

    cfg = parse_args(BASE + ["--train-iters", "3", "--decoupled-lr", "5e-3",
                             "--decoupled-min-lr", "5e-4", "--untie-embeddings-and-output-weights",
                             "--eval-iters", "0"])
    trainer = Trainer(cfg, ParallelState.build(RankGrid(1), 0, create_groups=False), "cpu")
    trainer.setup()
    it = trainer.data_iterator(trainer.train_ds, 0)
    for step in range(2):
        out = trainer.train_step(it)
        groups = trainer.optimizer.inner.param_groups
        dec = [g["lr"] for g in groups if g.get("decoupled_lr")]
        rest = [g["lr"] for g in groups if not g.get("decoupled_lr")]
        assert dec and set(dec) == {trainer.scheduler.lr_at(step * 4, decoupled=True)}
        assert set(rest) == {out["lr"]} and out["lr"] == trainer.scheduler.lr_at(step * 4)
        n_dec = sum(len(g["params"]) for g in groups if g.get("decoupled_lr"))
        assert n_dec == 2        # word embedding and output layer
