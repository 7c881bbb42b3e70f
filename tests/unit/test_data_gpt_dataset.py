"""GPT dataset: packing, shuffling, caching, split rules, mock data and blending."""

import os

import numpy as np
import pytest
import torch

from megalite.data.gpt_dataset import (
    BlendedDataset,
    GPTDataset,
    MockGPTDataset,
    Segments,
    blending_indices,
    build_train_valid_test_datasets,
    parse_data_path,
    parse_split,
    split_boundaries,
    split_segments,
)
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, write_documents

EOD = 999
LENGTHS = [5, 1, 12, 3, 8, 2, 9, 4, 6, 7]


def make_docs(lengths, base=0):
    """Document i holds tokens base + 100*i + k, ending with EOD: every token says where it is from."""
    return [list(base + 100 * i + np.arange(n - 1)) + [EOD] for i, n in enumerate(lengths)]


@pytest.fixture
def corpus(tmp_path):
    docs = make_docs(LENGTHS)
    return write_documents(str(tmp_path / "corpus"), docs, np.int32), docs


def all_segments(ds):
    return Segments(np.arange(len(ds)), np.zeros(len(ds)), ds.sequence_lengths.astype(np.int64))


def test_packing_concatenates_documents(corpus, tmp_path):
    prefix, docs = corpus
    ds = IndexedDataset(prefix)
    seq, n = 7, 40  # 40 samples * 7 tokens = 280 > 57 tokens per epoch: several epochs
    gpt = GPTDataset(ds, all_segments(ds), seq, n, seed=3, cache_dir=str(tmp_path / "c"))
    epochs = -(-(n * seq + 1) // sum(LENGTHS))
    total = (epochs * sum(LENGTHS) - 1) // seq   # Megatron keeps every sample of its epochs
    assert len(gpt) == total >= n and gpt.num_epochs == epochs
    # every document appears once per epoch; the epochs are shuffled together (Megatron)
    assert sorted(gpt.document_index.tolist()) == sorted(list(range(len(docs))) * epochs)
    stream = np.concatenate([docs[k] for k in gpt.document_index])
    assert sorted(gpt.shuffle_index.tolist()) == list(range(total))
    seen = set()
    for i in range(total):
        j = int(gpt.shuffle_index[i])
        seen.add(j)
        expect = stream[j * seq : j * seq + seq + 1]
        s = gpt[i]
        assert s["tokens"].dtype == torch.int64 and s["tokens"].shape == (seq,)
        assert s["tokens"].tolist() == expect[:-1].tolist()
        assert s["labels"].tolist() == expect[1:].tolist()
        assert s["position_ids"].tolist() == list(range(seq))
        assert s["loss_mask"].tolist() == [1.0] * seq
    assert seen == set(range(total))


def test_eod_mask_loss(corpus):
    prefix, _ = corpus
    ds = IndexedDataset(prefix)
    gpt = GPTDataset(ds, all_segments(ds), 16, 10, seed=0, eod_token=EOD, eod_mask_loss=True, cache_dir=None)
    masked = 0
    for i in range(len(gpt)):
        s = gpt[i]
        assert torch.equal(s["loss_mask"] == 0, s["tokens"] == EOD)
        masked += int((s["loss_mask"] == 0).sum())
    assert masked > 0


def test_cache_is_reused(corpus, tmp_path, monkeypatch):
    prefix, _ = corpus
    ds = IndexedDataset(prefix)
    cache = str(tmp_path / "cache")
    first = GPTDataset(ds, all_segments(ds), 8, 20, seed=5, cache_dir=cache)
    assert not first.loaded_from_cache
    files = sorted(os.listdir(cache))
    assert len([f for f in files if f.endswith(".npy")]) == 3
    monkeypatch.setattr(GPTDataset, "_build", lambda self: pytest.fail("rebuilt instead of loading the cache"))
    second = GPTDataset(ds, all_segments(ds), 8, 20, seed=5, cache_dir=cache)
    assert second.loaded_from_cache and sorted(os.listdir(cache)) == files
    for i in range(20):
        assert torch.equal(first[i]["tokens"], second[i]["tokens"])
    monkeypatch.undo()
    other = GPTDataset(ds, all_segments(ds), 8, 20, seed=6, cache_dir=cache)  # new key: new files
    assert not other.loaded_from_cache and len(os.listdir(cache)) == len(files) + 4
    assert any(not torch.equal(first[i]["tokens"], other[i]["tokens"]) for i in range(20))
    # default location: next to the data
    GPTDataset(ds, all_segments(ds), 8, 20, seed=5)
    assert any(f.endswith("shuffle_idx.npy") for f in os.listdir(os.path.dirname(prefix)))


def test_parse_split_and_boundaries():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("90,10,0") == pytest.approx([0.9, 0.1, 0.0])
    assert parse_split("98/2") == pytest.approx([0.98, 0.02, 0.0])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    assert parse_split("969, 30, 1") == pytest.approx([0.969, 0.03, 0.001])  # the config default
    assert parse_split("'99,1,0'") == pytest.approx([0.99, 0.01, 0.0])  # quotes: Megatron parses
    for bad in ("a,b", "1,2,3,4", "0,0,0", "-1,2", "abc"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)
    assert split_boundaries(1000, parse_split("969,30,1")) == [0, 969, 999, 1000]
    assert split_boundaries(10, parse_split("90,10,0")) == [0, 9, 10, 10]
    assert split_boundaries(3, [1 / 3] * 3) == [0, 1, 2, 3]


def test_document_split(corpus):
    prefix, _ = corpus
    ds = IndexedDataset(prefix)
    (tr, va, te), rule = split_segments(ds, parse_split("80,10,10"))
    assert rule == "document"
    assert tr.seq.tolist() == list(range(8)) and va.seq.tolist() == [8] and te.seq.tolist() == [9]
    assert tr.num_tokens == sum(LENGTHS[:8]) and tr.start.tolist() == [0] * 8


def test_document_split_keeps_multi_sequence_documents_whole(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "m.bin"), np.uint16)
    for d in range(4):  # each document has two sequences
        b.add_item([d, d])
        b.add_item([d])
        b.end_document()
    b.finalize(str(tmp_path / "m.idx"))
    (tr, va, _), rule = split_segments(IndexedDataset(str(tmp_path / "m")), parse_split("3,1,0"))
    assert rule == "document" and tr.seq.tolist() == list(range(6)) and va.seq.tolist() == [6, 7]


def test_single_document_splits_by_tokens(tmp_path):
    doc = list(range(1000))
    prefix = write_documents(str(tmp_path / "one"), [doc], np.uint16)
    ds = IndexedDataset(prefix)
    (tr, va, te), rule = split_segments(ds, parse_split("90,10,0"))
    assert rule == "token"
    assert (tr.start.tolist(), tr.length.tolist()) == ([0], [900])
    assert (va.start.tolist(), va.length.tolist()) == ([900], [100])
    assert len(te) == 0
    train, valid, test = build_train_valid_test_datasets(
        [prefix], "90,10,0", 16, 1, (50, 5, 5), False, None, cache_dir=str(tmp_path / "c"), contiguous=True)
    assert test is None
    for i in range(len(train)):  # contiguous stream: sample j is doc[16j : 16j+17], wrapping epochs
        j = int(train.shuffle_index[i])
        expect = [doc[p % 900] for p in range(16 * j, 16 * j + 17)]
        assert train[i]["tokens"].tolist() == expect[:-1] and train[i]["labels"].tolist() == expect[1:]
    assert all(900 <= t < 1000 for i in range(len(valid)) for t in valid[i]["tokens"].tolist())


def test_fallback_to_tokens_when_a_split_gets_no_document(tmp_path):
    prefix = write_documents(str(tmp_path / "two"), [list(range(50)), list(range(100, 150))], np.uint16)
    (tr, va, te), rule = split_segments(IndexedDataset(prefix), parse_split("90,5,5"))
    assert rule == "token"
    assert (tr.num_tokens, va.num_tokens, te.num_tokens) == (90, 5, 5)
    assert tr.seq.tolist() == [0, 1] and tr.length.tolist() == [50, 40]
    assert (va.seq.tolist(), va.start.tolist()) == ([1], [40])


def test_mock_dataset_is_deterministic():
    a = MockGPTDataset(10, 32, 50, seed=7)
    b = MockGPTDataset(10, 32, 50, seed=7)
    c = MockGPTDataset(10, 32, 50, seed=8)
    assert len(a) == 10
    assert torch.equal(a[3]["tokens"], b[3]["tokens"]) and torch.equal(a[3]["labels"][:-1], a[3]["tokens"][1:])
    assert not torch.equal(a[3]["tokens"], a[4]["tokens"])
    assert not torch.equal(a[3]["tokens"], c[3]["tokens"])
    assert all(0 <= int(t) < 50 for i in range(10) for t in a[i]["tokens"])
    tr, va, te = build_train_valid_test_datasets(None, "1,0,0", 32, 7, (10, 4, 0), True, 50)
    assert len(tr) == 10 and len(va) == 4 and te is None
    assert torch.equal(tr[3]["tokens"], a[3]["tokens"])
    with pytest.raises(ValueError, match="vocab size"):
        MockGPTDataset(10, 32, None, seed=1)


def test_blending_indices_track_the_weights():
    weights = [0.2, 0.5, 0.3]
    idx, sample = blending_indices(weights, 1000)
    counts = np.zeros(3, dtype=int)
    for n, d in enumerate(idx, 1):
        assert sample[n - 1] == counts[d]  # each dataset is read in order 0, 1, 2, ...
        counts[d] += 1
        assert np.all(np.abs(counts - np.array(weights) * n) <= 1.0 + 1e-9)
    assert counts.tolist() == [200, 500, 300]
    assert np.array_equal(blending_indices(weights, 1000)[0], idx)
    # Megatron's exact order: ties go to the lower dataset index; sample 0 counts as n = 1
    assert blending_indices([0.5, 0.5], 6)[0].tolist() == [0, 1, 0, 1, 0, 1]
    assert blending_indices([0.3, 0.7], 5)[0].tolist() == [1, 0, 1, 1, 0]


def test_parse_data_path():
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (pytest.approx([0.3, 0.7]), ["a", "b"])
    assert parse_data_path(["3", "a", "1", "b"]) == (pytest.approx([0.75, 0.25]), ["a", "b"])
    assert parse_data_path(["a", "b"]) == ([0.5, 0.5], ["a", "b"])
    with pytest.raises(ValueError, match="--data-path"):
        parse_data_path(["0.3", "a", "b"])


def test_blended_train_valid_test(tmp_path):
    a = write_documents(str(tmp_path / "a"), make_docs([20] * 30), np.int32)  # tokens < 3000
    b = write_documents(str(tmp_path / "b"), make_docs([20] * 30, base=10000), np.int32)
    tr, va, te = build_train_valid_test_datasets(["0.3", a, "0.7", b], "80,20,0", 8, 1, (200, 50, 0), False, None)
    # Megatron's sizes: ceil(n * w) per dataset, summed
    assert isinstance(tr, BlendedDataset) and len(tr) == 60 + 140 and len(va) == 50 and te is None
    from_b = []
    for i in range(len(tr)):
        s = tr[i]
        toks = s["tokens"][s["tokens"] != EOD]
        is_b = bool((toks >= 10000).all())
        assert is_b or bool((toks < 10000).all())
        assert int(s["dataset_id"]) == int(is_b)
        from_b.append(is_b)
    assert sum(from_b) == 140  # 0.7 * 200
    assert [d.requested_samples for d in tr.datasets] == [61, 141]   # +0.5% built (Megatron)
    # valid draws only from the last 20% of each corpus' documents (documents 24..29)
    for i in range(len(va)):
        doc_ids = (va[i]["tokens"][va[i]["tokens"] != EOD] % 10000) // 100
        assert bool((doc_ids >= 24).all())
    # bare prefixes: one epoch of each, blended by size (equal here)
    tr2, _, _ = build_train_valid_test_datasets([a, b], "80,20,0", 8, 1, (100, 0, 0), False, None)
    assert np.bincount(tr2.dataset_index).tolist() == [50, 50]


def test_build_errors(tmp_path):
    with pytest.raises(ValueError, match="--data-path"):
        build_train_valid_test_datasets([], "1", 8, 1, (1, 0, 0), False, None)
    with pytest.raises(FileNotFoundError, match="nothere"):
        build_train_valid_test_datasets([str(tmp_path / "nothere")], "1", 8, 1, (1, 0, 0), False, None)
