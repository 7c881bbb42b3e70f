"""Sample order equals Megatron-Core's ``GPTDataset`` / ``BlendedDataset`` for the same seed,
split, sequence length and sample counts: the index arrays, the first 500 training samples
and every validation sample (oracle: megatron-core with its compiled ``helpers_cpp``)."""
import warnings

import numpy as np
import pytest

from megalite.data.gpt_dataset import build_train_valid_test_datasets
from megalite.data.indexed_dataset import write_documents

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    builder_mod = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
    from megatron.core.datasets.gpt_dataset import GPTDataset as McoreGPTDataset
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig


class _Tok:
    """What GPTDatasetConfig reads from a tokenizer (no pad token in these corpora)."""
    eod, pad, vocab_size = 0, -1, 30000
    unique_identifiers = {"class": "test"}


def corpus(path, n_docs, seed, base=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 60, size=n_docs)
    lengths[1] = 0   # one empty document (kept: it takes part in the shuffle)
    docs = [list(base + 1 + rng.integers(0, 5000, size=int(n))) for n in lengths]
    return write_documents(str(path), docs, np.int32)


def megatron(blend, split, seq, seed, sizes, cache):
    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq, blend=blend, split=split,
                              path_to_cache=cache and str(cache), tokenizer=_Tok(),
                              reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, mmap_bin_files=True)
    return builder_mod.BlendedMegatronDatasetBuilder(McoreGPTDataset, list(sizes), lambda: True,
                                                     config).build()


CASES = [  # (documents, split, seq_length, seed, (train, valid, test) samples)
    (1000, "949,50,1", 16, 1234, (600, 40, 8)),
    (250, "'99,1,0'", 8, 7, (520, 16, 0)),
    (60, "80,15,5", 32, 42, (500, 64, 12)),
]


@pytest.mark.parametrize("n_docs,split,seq,seed,sizes", CASES)
def test_single_corpus_matches_gpt_dataset(tmp_path, n_docs, split, seq, seed, sizes):
    prefix = corpus(tmp_path / "c", n_docs, seed)
    theirs = megatron(([prefix], None), split.strip("'"), seq, seed, sizes, tmp_path / "m")
    ours = build_train_valid_test_datasets([prefix], split, seq, seed, sizes, False, None,
                                           cache_dir=str(tmp_path / "o"))
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if b is None or sizes[i] == 0:
            assert a is None or sizes[i] == 0
            continue
        assert len(a) == len(b)
        assert np.array_equal(a.segments.seq[a.document_index], b.document_index)
        assert np.array_equal(a.sample_index, b.sample_index)
        assert np.array_equal(a.shuffle_index, b.shuffle_index)
        count = min(500, len(b)) if i == 0 else len(b)
        for k in range(count):
            assert a[k]["tokens"].tolist() == b[k]["tokens"].tolist(), (i, k)
            assert a[k]["labels"].tolist() == b[k]["labels"].tolist(), (i, k)


def test_split_rounding_matches_megatron(tmp_path):
    """5 documents, --split 1,1,1: Megatron gives [0,1] [2] [3,4]."""
    prefix = write_documents(str(tmp_path / "five"), [[d + 1] * 30 for d in range(5)], np.int32)
    ours = build_train_valid_test_datasets([prefix], "1,1,1", 8, 1, (10, 10, 10), False, None,
                                           cache_dir=str(tmp_path / "o"))
    assert [d.segments.seq.tolist() for d in ours] == [[0, 1], [2], [3, 4]]


def test_blend_matches_blended_dataset(tmp_path):
    a = corpus(tmp_path / "a", 300, 3)
    b = corpus(tmp_path / "b", 450, 4, base=10000)
    c = corpus(tmp_path / "c", 200, 5, base=20000)
    sizes, seq, seed = (500, 48, 16), 16, 99
    # no cache: megatron's BlendedDataset caches only under torch.distributed
    theirs = megatron(([a, b, c], [0.2, 0.5, 0.3]), "90,8,2", seq, seed, sizes, None)
    ours = build_train_valid_test_datasets(["0.2", a, "0.5", b, "0.3", c], "90,8,2", seq, seed,
                                           sizes, False, None, cache_dir=str(tmp_path / "o"))
    for x, y in zip(ours, theirs):
        assert len(x) == len(y)
        assert np.array_equal(x.dataset_index, y.dataset_index)
        assert np.array_equal(x.dataset_sample_index, y.dataset_sample_index)
        assert [len(d) for d in x.datasets] == [len(d) for d in y.datasets]
        for k in range(len(y)):
            assert x[k]["tokens"].tolist() == y[k]["tokens"].tolist(), k
            assert int(x[k]["dataset_id"]) == int(y[k]["dataset_id"])
