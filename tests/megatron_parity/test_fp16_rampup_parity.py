"""``--fp16`` loss scaling and ``--rampup-batch-size`` against megatron-core itself:
the loss-scale sequence of ``DynamicGradScaler`` for given overflow flags, and the batch
sizes of ``RampupBatchsizeNumMicroBatchesCalculator`` (``pip install --no-deps
megatron-core einops``)."""
import contextlib
import random
from unittest import mock

import pytest
import torch

from megalite.config.microbatches import BatchSizeSchedule
from megalite.optimizer.grad_scaler import DynamicGradScaler


@contextlib.contextmanager
def cpu_tensors():
    """megatron-core's scalers put their scalars on 'cuda': build them on the CPU."""
    real = torch.tensor

    def tensor(*args, **kwargs):
        kwargs.pop("device", None)
        return real(*args, **kwargs)
    with mock.patch.object(torch, "tensor", tensor):
        yield


@pytest.mark.parametrize("initial,min_scale,window,hysteresis,p_inf,seed", [
    (2.0 ** 32, 1.0, 1000, 2, 0.5, 0),       # Megatron's defaults, an overflow-heavy start
    (2.0 ** 16, 1.0, 3, 2, 0.3, 1),          # short window: growth and hysteresis refills
    (1024.0, 256.0, 2, 1, 0.6, 2),           # hits the floor
    (65536.0, 1.0, 5, 3, 0.2, 3),
])
def test_dynamic_scaler_sequence_equals_megatron_core(initial, min_scale, window, hysteresis,
                                                      p_inf, seed):
    mcore = pytest.importorskip("megatron.core.optimizer.grad_scaler")
    with cpu_tensors():
        ref = mcore.DynamicGradScaler(initial_scale=initial, min_scale=min_scale,
                                      growth_factor=2.0, backoff_factor=0.5,
                                      growth_interval=window, hysteresis=hysteresis)
    ours = DynamicGradScaler(initial, min_scale, window, hysteresis)
    rng = random.Random(seed)
    flags = [rng.random() < p_inf for _ in range(300)]
    flags[:8] = [True] * 8                      # a run of overflows (the 2^32 start)
    seen = set()
    for i, found_inf in enumerate(flags):
        with cpu_tensors():
            ref.update(found_inf)
        ours.update(found_inf)
        assert ours.scale == float(ref.scale.item()), (i, ours.scale, ref.scale.item())
        assert ours.inv_scale == pytest.approx(float(ref.inv_scale.item()), rel=1e-7)
        assert (ours.growth_tracker, ours.hysteresis_tracker) == (
            ref._growth_tracker, ref._hysteresis_tracker), i
        seen.add(ours.scale)
    assert len(seen) > 3                        # the sequence moved both ways
    sd = ref.state_dict()
    assert ours.state_dict() == {"scale": float(sd["scale"].item()),
                                 "growth_tracker": sd["growth_tracker"],
                                 "hysteresis_tracker": sd["hysteresis_tracker"]}


def megatron_train_iters(calc, train_samples: int, rampup_samples: int, gbs: int) -> int:
    """Megatron-LM's ``update_train_iters`` (training.py), driving megatron-core's
    calculator."""
    iterations = consumed = 0
    while consumed <= rampup_samples and consumed <= train_samples:
        calc.update(consumed, consistency_check=False)
        consumed += calc.get_current_global_batch_size()
        iterations += 1
    calc.update(0, consistency_check=False)
    if train_samples > consumed:
        iterations += (train_samples - consumed) // gbs
    return iterations


@pytest.mark.parametrize("gbs,mbs,dp,rampup,train_samples", [
    (1536, 1, 1, (16, 16, 5859375), 10_000_000),   # the GPT-3 175B script's ramp
    (64, 2, 2, (8, 4, 100), 1000),
    (32, 1, 4, (4, 4, 37), 300),                   # SAMPLES not a multiple of the steps
    (16, 2, 1, (16, 2, 50), 100),                  # START == --global-batch-size: constant
])
def test_rampup_batch_sizes_equal_megatron_core(gbs, mbs, dp, rampup, train_samples):
    nmc = pytest.importorskip("megatron.core.num_microbatches_calculator")
    ours = BatchSizeSchedule(gbs, mbs, dp, rampup)
    if rampup[0] == gbs:     # megatron-core divides by zero increments here
        assert [ours.global_batch_size_at(c) for c in (0, 10, 10 ** 6)] == [gbs] * 3
        return
    calc = nmc.RampupBatchsizeNumMicroBatchesCalculator(
        gbs, mbs, dp, False, 0, rampup[0], rampup[1], rampup[2])
    consumed, sizes = 0, []
    for step, g in zip(range(20000), ours.batch_sizes()):
        calc.update(consumed, consistency_check=True)
        assert g == calc.get_current_global_batch_size(), (step, consumed)
        assert ours.num_micro_batches_at(consumed) == calc.get() == g // (mbs * dp)
        sizes.append(g)
        consumed += g
        if consumed > rampup[2] + 3 * gbs:
            break
    assert sizes[0] == rampup[0] and sizes[-1] == gbs and sizes == sorted(sizes)
    # spot checks far into the ramp (the GPT-3 ramp takes ~7.6k iterations)
    for c in (0, 1, rampup[2] // 3, rampup[2] // 2 + 7, rampup[2], rampup[2] + 1):
        calc.update(c, consistency_check=False)
        assert ours.global_batch_size_at(c) == calc.get_current_global_batch_size(), c
    calc = nmc.RampupBatchsizeNumMicroBatchesCalculator(
        gbs, mbs, dp, False, 0, rampup[0], rampup[1], rampup[2])
    assert ours.train_iters(train_samples) == megatron_train_iters(
        calc, train_samples, rampup[2], gbs)
