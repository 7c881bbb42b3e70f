"""Random-window training samples (--sample-windows random): exact substrings of the split's
stream, seeded per sample index, uniform over offsets, wired into the dataset builder."""

import numpy as np
import pytest

from megalite.data.gpt_dataset import (
    BlendedDataset,
    GPTDataset,
    build_train_valid_test_datasets,
    split_segments,
)
from megalite.data.indexed_dataset import IndexedDataset, write_documents
from megalite.data.random_windows import RandomWindowDataset
from test_data_gpt_dataset import EOD, LENGTHS, make_docs


@pytest.fixture
def corpus(tmp_path):
    docs = make_docs(LENGTHS)
    return write_documents(str(tmp_path / "corpus"), docs, np.int32), docs


def train_dataset(prefix, seq=7, n=300, seed=5, split=(0.8, 0.2, 0.0)):
    ds = IndexedDataset(prefix)
    segs, _ = split_segments(ds, split)
    return RandomWindowDataset(ds, segs[0], seq, n, seed, eod_token=EOD), segs[0]


def test_windows_are_substrings_of_the_split_stream(corpus):
    prefix, docs = corpus
    rw, segs = train_dataset(prefix)
    stream = np.concatenate([docs[int(k)] for k in segs.seq])  # train docs in corpus order
    assert rw.num_tokens == len(stream) == sum(LENGTHS[:8])
    crossing = 0
    for i in range(len(rw)):
        start = rw.window_start(i)
        assert 0 <= start <= len(stream) - 8
        sample = rw[i]
        want = stream[start:start + 8]
        assert sample["tokens"].tolist() == want[:-1].tolist()
        assert sample["labels"].tolist() == want[1:].tolist()
        assert sample["position_ids"].tolist() == list(range(7))
        crossing += int((want[:-1] == EOD).any())
    assert crossing > len(rw) // 2  # most windows span a document boundary


def test_samples_depend_only_on_seed_and_index(corpus):
    prefix, _ = corpus
    a, _ = train_dataset(prefix, n=300)
    b, _ = train_dataset(prefix, n=50)  # a shorter run (or a resumed one) sees the same samples
    assert all((a[i]["tokens"] == b[i]["tokens"]).all() for i in range(50))
    c, _ = train_dataset(prefix, n=50, seed=6)
    assert [a.window_start(i) for i in range(50)] != [c.window_start(i) for i in range(50)]
    with pytest.raises(IndexError):
        b[50]


def test_offsets_are_uniform(tmp_path):
    prefix = write_documents(str(tmp_path / "one"), [list(range(101))], np.int32)
    rw, _ = train_dataset(prefix, seq=10, n=18_000, split=(1.0, 0.0, 0.0))
    starts = np.array([rw.window_start(i) for i in range(len(rw))])
    counts = np.bincount(starts, minlength=91)
    assert len(counts) == 91 and counts.min() > 0  # every start 0..90 is drawn, none beyond
    expected = len(starts) / 91
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 150  # 90 degrees of freedom: p < 1e-4 above this


def test_builder_cuts_only_training_samples_at_random(corpus):
    prefix, _ = corpus
    tr, va, te = build_train_valid_test_datasets([prefix], "80,20,0", 7, 3, (40, 10, 0), False, None,
                                                 sample_windows="random")
    assert isinstance(tr, RandomWindowDataset) and len(tr) == 40
    assert isinstance(va, GPTDataset) and te is None
    for i in range(len(tr)):  # train windows come from the first 8 documents only
        toks = tr[i]["tokens"]
        assert bool(((toks[toks != EOD] // 100) < 8).all())
    packed, _, _ = build_train_valid_test_datasets([prefix], "80,20,0", 7, 3, (40, 10, 0), False, None)
    assert isinstance(packed, GPTDataset)


def test_blended_random_windows(tmp_path):
    a = write_documents(str(tmp_path / "a"), make_docs([20] * 30), np.int32)
    b = write_documents(str(tmp_path / "b"), make_docs([20] * 30, base=10000), np.int32)
    tr, va, _ = build_train_valid_test_datasets(["0.3", a, "0.7", b], "80,20,0", 8, 1, (200, 50, 0),
                                                False, None, sample_windows="random")
    assert isinstance(tr, BlendedDataset)
    assert all(isinstance(d, RandomWindowDataset) for d in tr.datasets)
    assert [len(d) for d in tr.datasets] == [61, 141]   # Megatron's blend sizes, +0.5%
    for i in range(len(tr)):
        s = tr[i]
        toks = s["tokens"][s["tokens"] != EOD]
        assert bool((toks >= 10000).all()) == bool(int(s["dataset_id"]))
        assert bool(((toks % 10000) // 100 < 24).all())  # training documents only


def test_errors(corpus):
    prefix, _ = corpus
    with pytest.raises(ValueError, match="random windows need at least"):
        train_dataset(prefix, seq=60)
    with pytest.raises(ValueError, match="sample_windows"):
        build_train_valid_test_datasets([prefix], "80,20,0", 7, 3, (4, 0, 0), False, None,
                                        sample_windows="sliding")
