"""The .bin/.idx writer and reader against Megatron's byte layout, and corrupt-file handling."""

import os
import pickle
import struct

import numpy as np
import pytest

from megalite.data.indexed_dataset import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetBuilder,
    best_dtype,
    write_documents,
)

# two documents: doc 0 = sequences [5, 6, 7] and [8]; doc 1 = sequence [9, 10]
SEQS = [[5, 6, 7], [8], [9, 10]]
DOC_BOUNDS = [0, 2, 3]


def hand_built(dtype, code):
    """Megatron's layout written out field by field, independently of the writer."""
    item = np.dtype(dtype).itemsize
    lengths = [len(s) for s in SEQS]
    pointers = [0, 3 * item, 4 * item]
    idx = b"MMIDIDX\x00\x00"
    idx += struct.pack("<Q", 1) + struct.pack("<B", code)
    idx += struct.pack("<Q", len(SEQS)) + struct.pack("<Q", len(DOC_BOUNDS))
    idx += struct.pack(f"<{len(lengths)}i", *lengths)
    idx += struct.pack(f"<{len(pointers)}q", *pointers)
    idx += struct.pack(f"<{len(DOC_BOUNDS)}q", *DOC_BOUNDS)
    bin_ = np.array([t for s in SEQS for t in s], dtype=dtype).tobytes()
    return idx, bin_


def write_with_builder(prefix, dtype):
    b = IndexedDatasetBuilder(prefix + ".bin", dtype)
    b.add_item([5, 6, 7])
    b.add_item(np.array([8]))
    b.end_document()
    b.add_document([9, 10], [2])
    b.finalize(prefix + ".idx")


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4), (np.int64, 5), (np.uint8, 1)])
def test_writer_bytes_match_megatron_layout(tmp_path, dtype, code):
    prefix = str(tmp_path / "ds")
    write_with_builder(prefix, dtype)
    idx, bin_ = hand_built(dtype, code)
    assert open(prefix + ".idx", "rb").read() == idx
    assert open(prefix + ".bin", "rb").read() == bin_
    assert len(idx) == 34 + 3 * 4 + 3 * 8 + 3 * 8


def test_reader_reads_hand_built_file(tmp_path):
    prefix = str(tmp_path / "hand")
    idx, bin_ = hand_built(np.uint16, 8)
    open(prefix + ".idx", "wb").write(idx)
    open(prefix + ".bin", "wb").write(bin_)
    ds = IndexedDataset(prefix)
    assert len(ds) == 3 and ds.num_documents == 2 and ds.num_tokens == 6
    assert ds.dtype == np.uint16
    assert [ds[i].tolist() for i in range(3)] == SEQS
    assert ds.sequence_lengths.tolist() == [3, 1, 2]
    assert ds.sequence_pointers.tolist() == [0, 6, 8]
    assert ds.document_indices.tolist() == DOC_BOUNDS
    assert ds.get(0, 1).tolist() == [6, 7]
    assert ds.get(0, 1, 1).tolist() == [6]
    assert ds.get(2, 2).tolist() == []
    assert [s.tolist() for s in ds[1:3]] == SEQS[1:]
    assert ds[-1].tolist() == [9, 10]
    with pytest.raises(IndexError):
        ds.get(0, 2, 5)
    with pytest.raises(IndexError):
        ds[3]
    clone = pickle.loads(pickle.dumps(ds))
    assert clone[2].tolist() == [9, 10]


def test_dtype_choice_and_codes():
    assert best_dtype(50257) is np.uint16
    assert best_dtype(65499) is np.uint16
    assert best_dtype(65500) is np.int32
    assert best_dtype(128256) is np.int32
    assert best_dtype(None) is np.int32
    assert DTYPE_CODES == {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                           6: np.float64, 7: np.float32, 8: np.uint16}


def test_writer_rejects_ids_that_do_not_fit(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.uint16)
    with pytest.raises(ValueError, match="do not fit"):
        b.add_item([1, 70000])
    with pytest.raises(ValueError, match="do not fit"):
        b.add_item([-1])


def test_empty_and_torch_input(tmp_path):
    import torch

    prefix = write_documents(str(tmp_path / "t"), [torch.tensor([1, 2, 3]), [4]], np.int32)
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(2)] == [[1, 2, 3], [4]]
    empty = write_documents(str(tmp_path / "e"), [], np.uint16)
    ds = IndexedDataset(empty)
    assert len(ds) == 0 and ds.num_documents == 0 and ds.num_tokens == 0


@pytest.fixture
def good(tmp_path):
    prefix = str(tmp_path / "good")
    write_with_builder(prefix, np.uint16)
    return prefix


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_truncated_bin_is_value_error(good):
    with open(good + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(good + ".bin") - 2)
    with pytest.raises(ValueError, match=r"good\.bin is truncated"):
        IndexedDataset(good)


def test_longer_bin_is_value_error(good):
    with open(good + ".bin", "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(ValueError, match="good.bin is longer"):
        IndexedDataset(good)


def test_bad_magic_is_value_error(good):
    _patch(good + ".idx", 0, b"XXIDIDX")
    with pytest.raises(ValueError, match=r"good\.idx.*bad magic"):
        IndexedDataset(good)


def test_bad_version_dtype_and_size(good, tmp_path):
    raw = open(good + ".idx", "rb").read()
    cases = [
        (raw[:9] + struct.pack("<Q", 2) + raw[17:], "unsupported version 2"),
        (raw[:17] + b"\x09" + raw[18:], "unknown dtype code 9"),
        (raw[:-8], "size is 86 bytes but its header .* implies 94"),  # truncated index
        # header sequence count disagrees with the file size
        (raw[:18] + struct.pack("<Q", 4) + raw[26:], r"size is 94 bytes but its header \(4 sequences"),
        (raw[:20], "truncated header"),
    ]
    for data, msg in cases:
        open(good + ".idx", "wb").write(data)
        with pytest.raises(ValueError, match="corrupt index file .*good.idx: " + msg):
            IndexedDataset(good)


def test_inconsistent_pointers_and_doc_index(good):
    # sequence pointer of sequence 1 says byte 4 instead of 6
    _patch(good + ".idx", 34 + 12 + 8, struct.pack("<q", 4))
    with pytest.raises(ValueError, match="pointers"):
        IndexedDataset(good)
    write_with_builder(good, np.uint16)
    _patch(good + ".idx", 34 + 12 + 24 + 16, struct.pack("<q", 7))  # last doc bound past the end
    with pytest.raises(ValueError, match="document index"):
        IndexedDataset(good)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere"):
        IndexedDataset(str(tmp_path / "nothere"))
