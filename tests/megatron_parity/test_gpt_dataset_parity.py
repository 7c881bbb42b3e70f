"""Sample order equals Megatron-Core's ``GPTDataset`` / ``BlendedDataset`` for the same seed,
split, sequence length and sample counts: the index arrays, the first 500 training samples
and every validation sample (oracle: megatron-core with its compiled ``helpers_cpp``)."""
import glob
import json
import os
import subprocess
import sys
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


def corpus(path, n_docs, seed, base=0, high=5000):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 60, size=n_docs)
    lengths[1] = 0   # one empty document (kept: it takes part in the shuffle)
    docs = [list(base + 1 + rng.integers(0, high, size=int(n))) for n in lengths]
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


# -- what pretrain_gpt.py builds (the entry point as a subprocess, its dataset cache read) ---

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "16", "--lr", "1e-3", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "128", "--device", "cpu", "--log-interval", "100"]   # small: cheap


def _pretrain(tmp_path, *flags):
    metrics = tmp_path / "metrics.jsonl"
    p = subprocess.run([sys.executable, "pretrain_gpt.py", *TINY, *flags, "--data-cache-path",
                        str(tmp_path / "cache"), "--metrics-file", str(metrics)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(x) for x in metrics.read_text().splitlines()]


def _cached(tmp_path):
    """{(data file, split): (description, (doc_idx, sample_idx, shuffle_idx))} of the run."""
    out = {}
    for path in glob.glob(str(tmp_path / "cache" / "*_description.json")):
        desc = json.load(open(path))
        stem = path[:-len("_description.json")]
        out[(desc["data"], desc["split"])] = (desc, tuple(
            np.load(f"{stem}_{n}.npy") for n in ("doc_idx", "sample_idx", "shuffle_idx")))
    return out


def _same_indices(ours, theirs):
    doc, sample, shuffle = ours
    assert np.array_equal(doc, theirs.document_index)
    assert np.array_equal(sample, theirs.sample_index)
    assert np.array_equal(shuffle, theirs.shuffle_index)


def test_train_samples_as_given_across_an_epoch_boundary(tmp_path):
    """--train-samples 418 at global batch 16 on a corpus of 417 samples per epoch:
    Megatron builds the training set for 418 samples (two epochs) and runs 418 // 16 = 26
    iterations; building for the 416 samples those consume would be one epoch and change
    every sample.  The run's indices are megatron-core's GPTDataset for 418."""
    rng = np.random.default_rng(0)
    docs = [list(1 + rng.integers(0, 120, size=48)) for _ in range(139)] + [[7]]
    prefix = write_documents(str(tmp_path / "c"), docs, np.int32)     # 417 x 16 + 1 tokens
    recs = _pretrain(tmp_path, "--data-path", prefix, "--split", "1,0,0", "--micro-batch-size",
                     "8", "--global-batch-size", "16", "--train-samples", "418",
                     "--eval-iters", "0")
    train = [r for r in recs if "split" not in r]
    assert [r["iteration"] for r in train] == list(range(1, 27))
    assert train[-1]["consumed_samples"] == 416
    (desc, ours), = _cached(tmp_path).values()
    assert desc["num_samples"] == 418
    theirs = megatron(([prefix], None), "1,0,0", 16, 1234, (418, 0, 0), tmp_path / "m")[0]
    assert len(theirs) == 834         # two epochs of 417
    _same_indices(ours, theirs)


def test_per_split_data_paths_match_megatron(tmp_path):
    """--train-data-path (a weighted blend) / --valid-data-path / --test-data-path: each split
    is all of its own files, --split ignored; every dataset the run built is megatron-core's
    for the same blend_per_split and sample counts."""
    a, b, c = (corpus(tmp_path / name, docs, seed, high=120)
               for name, docs, seed in (("a", 120, 1), ("b", 90, 2), ("c", 60, 3)))
    recs = _pretrain(tmp_path, "--train-data-path", "0.6", a, "0.4", b, "--valid-data-path", c,
                     "--test-data-path", c, "--split", "1,0,0", "--micro-batch-size", "4",
                     "--global-batch-size", "8", "--train-iters", "3", "--eval-interval", "2",
                     "--eval-iters", "2")
    assert [r["iteration"] for r in recs if r.get("split") == "valid"] == [2, 3]
    cached = _cached(tmp_path)
    assert set(cached) == {("a", "train"), ("b", "train"), ("c", "valid"), ("c", "test")}
    # Megatron's sizes: train 3 x 8; valid (3 // 2 + 1) x 2 x 8; test 2 x 8
    config = GPTDatasetConfig(
        random_seed=1234, sequence_length=16, blend_per_split=[([a, b], [0.6, 0.4]),
                                                               ([c], None), ([c], None)],
        path_to_cache=None, tokenizer=_Tok(), reset_position_ids=False,   # (as above)
        reset_attention_mask=False, eod_mask_loss=False, mmap_bin_files=True)
    train, valid, test = builder_mod.BlendedMegatronDatasetBuilder(
        McoreGPTDataset, [24, 32, 16], lambda: True, config).build()
    for (name, split), ds in ((("a", "train"), train.datasets[0]),
                              (("b", "train"), train.datasets[1]),
                              (("c", "valid"), valid), (("c", "test"), test)):
        _same_indices(cached[(name, split)][1], ds)
