"""Single-process checks of three Megatron flags: the fp16 loss scaler's pieces and flag
checks, the batch-size ramp's flag checks and sampler, and ``--apply-layernorm-1p``
(a model with zero-centred norm weights ``w - 1`` equals a plain model with ``w``)."""
import dataclasses

import pytest
import torch

from megalite.cli.arguments import parse_args
from megalite.checkpointing import hf
from megalite.config import ConfigError
from megalite.data.samplers import PretrainingSampler
from megalite.config.microbatches import BatchSizeSchedule
from megalite.models.gpt import build_model, single_rank_state
from megalite.optimizer.grad_scaler import (ConstantGradScaler, DynamicGradScaler,
                                            build_grad_scaler, unscale_and_find_inf)
from megalite.optimizer.optimizer import uses_weight_decay
from megalite.transformer.norms import LayerNorm, RMSNorm

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--mock-data", "--vocab-size", "64", "--lr", "1e-3",
        "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0"]


def args(*extra, world=1):
    return parse_args(["--world-size", str(world), *TINY, *extra])


# -- fp16 loss scaler ---------------------------------------------------------------------
def test_unscale_divides_and_flags_non_finite():
    a, b = torch.full((3,), 8.0), torch.full((2, 2), -4.0)
    found = unscale_and_find_inf([a, b], 0.25)
    assert found.item() == 0 and torch.equal(a, torch.full((3,), 2.0)) and \
        torch.equal(b, torch.full((2, 2), -1.0))
    for bad in (float("inf"), float("-inf"), float("nan")):
        c = torch.tensor([1.0, bad])
        assert unscale_and_find_inf([a, c, torch.empty(0)], 1.0).item() == 1


def test_grad_scaler_choice_follows_the_flags():
    assert build_grad_scaler(args("--train-iters", "1").optimizer) is None
    assert build_grad_scaler(args("--train-iters", "1", "--bf16").optimizer) is None
    assert build_grad_scaler(args("--train-iters", "1", "--loss-scale", "8").optimizer) is None
    bf16_static = build_grad_scaler(args("--train-iters", "1", "--bf16", "--loss-scale",
                                         "8").optimizer)       # Megatron: bf16 may scale too
    assert type(bf16_static) is ConstantGradScaler and bf16_static.scale == 8
    static = build_grad_scaler(args("--train-iters", "1", "--fp16", "--loss-scale", "128").optimizer)
    assert type(static) is ConstantGradScaler and static.scale == 128
    static.update(True)
    assert static.scale == 128 and static.state_dict() == {}
    dyn = build_grad_scaler(args("--train-iters", "1", "--fp16", "--initial-loss-scale", "64",
                                 "--min-loss-scale", "2", "--loss-scale-window", "3",
                                 "--hysteresis", "1").optimizer)
    assert isinstance(dyn, DynamicGradScaler)
    assert (dyn.scale, dyn.min_scale, dyn.window, dyn.hysteresis) == (64, 2, 3, 1)
    for found in (True, True, True, True, True, True):    # 32 16 8 4 2 2 (the floor)
        dyn.update(found)
    assert dyn.scale == 2
    for _ in range(3):
        dyn.update(False)
    assert dyn.scale == 4
    restored = DynamicGradScaler(64, 2, 3, 1)
    restored.load_state_dict(dyn.state_dict())
    assert restored.state_dict() == dyn.state_dict()


def test_fp16_runs_and_its_flags_are_checked():
    cfg = args("--train-iters", "1", "--fp16")       # no longer refused
    assert cfg.optimizer.fp16
    for extra, match in [
            (["--fp16", "--bf16"], "only one of --fp16 and --bf16"),
            (["--fp16", "--loss-scale", "0"], "--loss-scale must be a positive number"),
            (["--fp16", "--min-loss-scale", "8", "--initial-loss-scale", "4"],
             r"--min-loss-scale must be <= --initial-loss-scale \(4.0\), got 8.0"),
            (["--fp16", "--loss-scale-window", "0"], "--loss-scale-window must be"),
            (["--fp16", "--hysteresis", "0"], "--hysteresis must be >= 1")]:
        with pytest.raises(ConfigError, match=match):
            args("--train-iters", "1", *extra)


# -- --rampup-batch-size -------------------------------------------------------------------
def test_rampup_flag_checks_are_megatrons():
    cfg = args("--train-samples", "100", "--global-batch-size", "8", "--micro-batch-size", "2",
               "--rampup-batch-size", "4", "4", "20", world=2)
    assert cfg.training.rampup_batch_size
    args("--train-iters", "5", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "8")
    base = ["--train-samples", "100", "--global-batch-size", "8", "--micro-batch-size", "2"]
    for ramp, match in [
            (["3", "1", "20"], r"START \(3\) is not divisible by --micro-batch-size \(2\) x "
                               r"data-parallel size \(2\)"),
            (["4", "2", "20"], r"INCREMENT \(2\) is not divisible"),
            (["4", "8", "20"], r"--global-batch-size - START \(4\) is not divisible by "
                               r"INCREMENT \(8\)"),
            (["12", "4", "20"], r"START \(12\) is larger than --global-batch-size \(8\)"),
            (["4", "0", "20"], "START and INCREMENT must be >= 1")]:
        with pytest.raises(ConfigError, match=match):
            args(*base, "--rampup-batch-size", *ramp, world=2)
    with pytest.raises(ConfigError, match="interleaved schedule .* global batch 5"):
        args("--train-samples", "100", "--global-batch-size", "8", "--micro-batch-size", "1",
             "--rampup-batch-size", "4", "1", "20", "--pipeline-model-parallel-size", "2",
             "--num-layers-per-virtual-pipeline-stage", "1", "--num-layers", "4", world=2)


def test_ramp_sampler_reads_each_global_batch_once_whatever_dp():
    sched = BatchSizeSchedule(8, 1, 2, (2, 2, 12))
    sizes = [g for g, _ in zip(sched.batch_sizes(), range(8))]
    assert sizes == [2, 2, 4, 6, 8, 8, 8, 8]       # START + int(consumed / 4) x 2, then 8
    for dp in (1, 2):
        ranks = [list(PretrainingSampler(200, 0, 1, 8, r, dp,
                                         batch_size_at=sched.global_batch_size_at))
                 for r in range(dp)]
        c, pos = 0, [0] * dp
        for g in sizes:
            got = []
            for r in range(dp):
                n = g // dp
                got += [i for mb in ranks[r][pos[r]:pos[r] + n] for i in mb]
                pos[r] += n
            assert got == list(range(c, c + g)), (dp, g)
            c += g
    resumed = PretrainingSampler(200, 8, 1, 8, 0, 1, batch_size_at=sched.global_batch_size_at)
    assert [mb[0] for mb in resumed][:4] == [8, 9, 10, 11]    # the 6-batch at consumed 8


# -- --apply-layernorm-1p ------------------------------------------------------------------
@pytest.mark.parametrize("klass", [LayerNorm, RMSNorm])
def test_zero_centred_norm_equals_plain_norm_with_w_plus_1(klass):
    torch.manual_seed(0)
    x = torch.randn(5, 3, 16)
    plain, zc = klass(16, 1e-5), klass(16, 1e-5, zero_centered_gamma=True)
    # multiples of 1/8: w and w - 1 exact in bf16 too (init is checked on whole models below)
    w = torch.randint(-8, 24, (16,)) / 8
    with torch.no_grad():
        plain.weight.copy_(w)
        zc.weight.copy_(w - 1)
        if klass is LayerNorm:
            zc.bias.copy_(plain.bias.normal_())
    for dtype in (torch.float32, torch.bfloat16):
        torch.testing.assert_close(zc.to(dtype)(x.to(dtype)), plain.to(dtype)(x.to(dtype)))


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_layernorm_1p_model_equals_plain_model(norm):
    extra = ["--train-iters", "1", "--normalization", norm, "--position-embedding-type", "rope",
             "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
    plain_cfg, zc_cfg = args(*extra), args(*extra, "--apply-layernorm-1p")
    torch.manual_seed(1)
    plain = build_model(plain_cfg, single_rank_state())
    zc = build_model(zc_cfg, single_rank_state())
    tokens = torch.randint(0, 64, (2, 16))
    norms = [n for n, p in zc.named_parameters() if "norm" in n and n.endswith("weight")]
    assert len(norms) == 5
    zsd = zc.state_dict()
    assert all(torch.equal(zsd[n], torch.zeros_like(zsd[n])) for n in norms)
    torch.testing.assert_close(zc(tokens), plain(tokens), rtol=0, atol=0)   # same init
    g = torch.Generator().manual_seed(2)
    psd = plain.state_dict()
    for n in norms:
        psd[n] = 1 + 0.3 * torch.randn(psd[n].shape, generator=g)
        zsd[n] = psd[n] - 1
    plain.load_state_dict(psd)
    zc.load_state_dict(zsd)
    torch.testing.assert_close(zc(tokens), plain(tokens), rtol=1e-6, atol=1e-6)
    # weight decay: norm weights are 1-D, so no decay either way (Megatron's rule)
    assert not any(uses_weight_decay(n, p) for n, p in zc.named_parameters() if n in norms)
    if norm == "RMSNorm":    # HF export writes the scale (w + 1); import subtracts it again
        m = dataclasses.asdict(zc_cfg.model)
        m_plain = dataclasses.asdict(plain_cfg.model)
        out_zc = hf.megalite_to_hf_state_dict(dict(zsd), m)
        out_plain = hf.megalite_to_hf_state_dict(dict(psd), m_plain)
        assert set(out_zc) == set(out_plain)
        for k in out_plain:
            torch.testing.assert_close(out_zc[k], out_plain[k], rtol=0, atol=1e-7)
        back = hf.hf_to_megalite_state_dict(out_zc, m)
        for n in norms:
            torch.testing.assert_close(back[n], zsd[n], rtol=0, atol=1e-7)
