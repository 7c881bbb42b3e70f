"""Sampler: the global batch is the same samples whatever the DP size, and runs resume exactly."""

import itertools

import pytest
import torch

from megalite.data.gpt_dataset import MockGPTDataset
from megalite.data.samplers import PretrainingSampler, build_data_iterator


def rank_batches(total, consumed, mbs, gbs, dp):
    """Per global batch, the concatenation over DP ranks (in rank order) of their micro-batches."""
    per_rank = [list(PretrainingSampler(total, consumed, mbs, gbs, r, dp)) for r in range(dp)]
    n_micro = gbs // (mbs * dp)
    out = []
    for g in range(len(per_rank[0]) // n_micro):
        batch = []
        for r in range(dp):
            for mb in per_rank[r][g * n_micro : (g + 1) * n_micro]:
                assert len(mb) == mbs
                batch += mb
        out.append(batch)
    return out


@pytest.mark.parametrize("mbs", [1, 2, 4])
def test_global_batch_does_not_depend_on_dp(mbs):
    gbs, total = 16, 100
    expected = [list(range(g * gbs, (g + 1) * gbs)) for g in range(total // gbs)]
    for dp in (1, 2, 4):
        assert rank_batches(total, 0, mbs, gbs, dp) == expected


def test_documented_rank_slices():
    # G=16, dp=4, mbs=2, c=32: rank r gets 32 + 4r .. 32 + 4r + 3 as two micro-batches
    for r in range(4):
        mbs = list(itertools.islice(PretrainingSampler(100, 32, 2, 16, r, 4), 2))
        base = 32 + 4 * r
        assert mbs == [[base, base + 1], [base + 2, base + 3]]


def test_resume_from_consumed_samples():
    full = list(PretrainingSampler(200, 0, 2, 8, 1, 2))  # rank 1 of 2: 2 micro-batches per step
    for steps_done in (1, 3, 7):
        resumed = list(PretrainingSampler(200, steps_done * 8, 2, 8, 1, 2))
        assert resumed == full[steps_done * 2 :]


def test_stops_before_a_partial_global_batch_and_len():
    s = PretrainingSampler(50, 0, 2, 16, 0, 2)  # 3 full global batches of 16 in 50 samples
    batches = list(s)
    assert len(batches) == len(s) == 3 * 4
    assert max(i for b in batches for i in b) < 48
    assert len(PretrainingSampler(50, 16, 2, 16, 0, 2)) == 2 * 4


def test_cyclic_wraps_around():
    it = iter(PretrainingSampler(10, 8, 2, 4, 0, 1, cyclic=True))
    assert [next(it) for _ in range(4)] == [[8, 9], [0, 1], [2, 3], [4, 5]]


def test_bad_configurations():
    with pytest.raises(ValueError, match="not divisible"):
        PretrainingSampler(100, 0, 3, 16, 0, 2)
    with pytest.raises(ValueError, match="dp_rank"):
        PretrainingSampler(100, 0, 2, 16, 2, 2)
    with pytest.raises(ValueError, match="consumed_samples"):
        PretrainingSampler(100, 100, 2, 16, 0, 2)


def test_data_iterator_batches_are_the_same_global_batch_for_every_dp():
    ds = MockGPTDataset(64, 8, 100, seed=0)
    gbs = 8

    def global_batch_tokens(dp, mbs, consumed):
        parts = []
        for r in range(dp):
            it = build_data_iterator(ds, consumed, mbs, gbs, r, dp)
            for _ in range(gbs // (mbs * dp)):
                b = next(it)
                assert b["tokens"].shape == (mbs, 8) and b["tokens"].dtype == torch.int64
                assert b["labels"].shape == (mbs, 8) and b["loss_mask"].dtype == torch.float32
                assert b["position_ids"].shape == (mbs, 8)
                parts.append(b["tokens"])
        return torch.cat(parts)

    reference = torch.stack([ds[i]["tokens"] for i in range(16, 24)])
    for dp, mbs in [(1, 1), (1, 8), (2, 2), (4, 1), (4, 2), (8, 1)]:
        assert torch.equal(global_batch_tokens(dp, mbs, 16), reference), (dp, mbs)
    assert build_data_iterator(None, 0, 1, 8, 0, 1) is None
