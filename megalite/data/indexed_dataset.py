"""Megatron's memory-mapped indexed dataset (``.bin`` tokens + ``.idx`` index), byte-compatible.

``.idx`` layout (little-endian)::

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    <Q        version, always 1
    <B        dtype code of the tokens (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
              6 float64, 7 float32, 8 uint16)
    <Q        S = number of sequences
    <Q        D = number of entries in the document index (= documents + 1)
    int32[S]  sequence lengths, in tokens
    int64[S]  sequence pointers, byte offsets into the .bin
    int64[D]  document index: sequence number where each document starts; begins at 0,
              ends at S

``.bin`` is the tokens of all sequences back to back in that dtype. Files written by Megatron's
``tools/preprocess_data.py`` load here and vice versa. The reader checks every field against the
file sizes, so a corrupt or truncated pair fails with ``ValueError`` instead of returning garbage.
"""

from __future__ import annotations

import os
import struct
from typing import Iterable, Sequence

import numpy as np

from megalite.errors import DataError

__all__ = [
    "DTYPE_CODES",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "best_dtype",
    "bin_path",
    "idx_path",
    "write_documents",
]

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER_BYTES = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, S, D

DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def best_dtype(vocab_size: int | None) -> type:
    """Megatron's choice: 2-byte tokens when the vocab fits comfortably, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def _dtype_code(dtype) -> int:
    try:
        return _CODE_OF[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise ValueError(f"unsupported token dtype {dtype!r}; use one of {list(_CODE_OF)}") from None


class IndexedDatasetBuilder:
    """Streams token sequences into a ``.bin`` and writes the matching ``.idx`` on finalize.

    Usage: ``add_item(tokens)`` per sequence, ``end_document()`` after each document (or
    ``add_document(tokens, lengths)``), then ``finalize(idx_path)``.
    """

    def __init__(self, bin_path: str, dtype=np.int32) -> None:
        self.dtype = np.dtype(dtype)
        self._code = _dtype_code(self.dtype)
        if self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            self._range = (int(info.min), int(info.max))
        else:
            self._range = None
        self.bin_path = bin_path
        self._file = open(bin_path, "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def _to_array(self, tokens) -> np.ndarray:
        if hasattr(tokens, "detach"):  # torch tensor, without importing torch here
            tokens = tokens.detach().cpu().numpy()
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        if self._range is not None and arr.size:
            if arr.dtype.kind == "f":
                raise ValueError(f"float tokens given to an integer ({self.dtype}) dataset")
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._range[0] or hi > self._range[1]:
                raise ValueError(
                    f"token ids [{lo}, {hi}] do not fit the dataset dtype {self.dtype} "
                    f"(range {self._range[0]}..{self._range[1]})"
                )
        return arr.astype(self.dtype, copy=False)

    def add_item(self, tokens) -> None:
        """Append one sequence (list, numpy array or torch tensor of token ids)."""
        arr = self._to_array(tokens)
        self._file.write(arr.tobytes(order="C"))
        self.sequence_lengths.append(int(arr.size))

    def end_document(self) -> None:
        """Close the current document: the sequences added since the last call form it."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens, lengths: Sequence[int]) -> None:
        """Append a whole document made of sequences of the given lengths."""
        arr = self._to_array(tokens)
        if sum(int(n) for n in lengths) != arr.size:
            raise ValueError(f"lengths sum to {sum(lengths)} but the document has {arr.size} tokens")
        self._file.write(arr.tobytes(order="C"))
        self.sequence_lengths.extend(int(n) for n in lengths)
        self.end_document()

    def finalize(self, idx_path: str) -> None:
        """Close the ``.bin`` and write the ``.idx``."""
        self._file.close()
        lengths = np.asarray(self.sequence_lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        docs = np.asarray(self.document_indices, dtype=np.int64)
        with open(idx_path, "wb") as f:
            f.write(_MAGIC)
            f.write(struct.pack("<Q", _VERSION))
            f.write(struct.pack("<B", self._code))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(docs)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(docs.tobytes(order="C"))


def write_documents(prefix: str, documents: Iterable[Sequence[int]], dtype=np.int32) -> str:
    """Write each document as a single sequence to ``prefix.bin/.idx``; returns ``prefix``."""
    builder = IndexedDatasetBuilder(bin_path(prefix), dtype)
    for doc in documents:
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(idx_path(prefix))
    return prefix


class IndexedDataset:
    """Read-only, memory-mapped view of a ``prefix.bin/.idx`` pair.

    ``ds[i]`` is sequence ``i`` as a numpy array (a view into the mapping: do not write to it);
    ``ds.get(i, offset, length)`` reads part of one. Pickles by path, so DataLoader workers
    re-open the mapping instead of copying it.
    """

    def __init__(self, path_prefix: str) -> None:
        self.path_prefix = path_prefix
        self._open()

    # -- loading and validation ----------------------------------------------------------
    def _open(self) -> None:
        ip, bp = idx_path(self.path_prefix), bin_path(self.path_prefix)
        missing = [p for p in (ip, bp) if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(
                f"indexed dataset {self.path_prefix!r}: missing {', '.join(missing)} "
                "(make it with tools/preprocess_data.py; --data-path takes the prefix without .bin/.idx)"
            )
        idx_size = os.path.getsize(ip)

        def bad(msg: str):
            return ValueError(f"corrupt index file {ip}: {msg}")

        with open(ip, "rb") as f:
            header = f.read(_HEADER_BYTES)
        if len(header) < 9 or header[:9] != _MAGIC:
            raise bad(f"bad magic {header[:9]!r}, expected {_MAGIC!r} (not a Megatron mmap .idx file)")
        if len(header) < _HEADER_BYTES:
            raise bad(f"truncated header ({idx_size} bytes)")
        (version,) = struct.unpack_from("<Q", header, 9)
        if version != _VERSION:
            raise bad(f"unsupported version {version}, expected {_VERSION}")
        (code,) = struct.unpack_from("<B", header, 17)
        if code not in DTYPE_CODES:
            raise bad(f"unknown dtype code {code}")
        n_seq, n_doc = struct.unpack_from("<QQ", header, 18)
        expected = _HEADER_BYTES + n_seq * (4 + 8) + n_doc * 8
        if idx_size != expected:
            raise bad(
                f"size is {idx_size} bytes but its header ({n_seq} sequences, {n_doc} document "
                f"entries) implies {expected}"
                + (" (multimodal index files are not supported)" if idx_size == expected + n_seq else "")
            )
        self.dtype = np.dtype(DTYPE_CODES[code])
        self.dtype_code = code

        raw = np.fromfile(ip, dtype=np.uint8, offset=_HEADER_BYTES)
        off = 0
        self._sequence_lengths = raw[off : off + 4 * n_seq].view(np.int32)
        off += 4 * n_seq
        self._sequence_pointers = raw[off : off + 8 * n_seq].view(np.int64)
        off += 8 * n_seq
        self._document_indices = raw[off : off + 8 * n_doc].view(np.int64)
        for a in (self._sequence_lengths, self._sequence_pointers, self._document_indices):
            a.flags.writeable = False

        lengths, pointers, docs = self._sequence_lengths, self._sequence_pointers, self._document_indices
        if n_doc < 1 or docs[0] != 0 or docs[-1] != n_seq or np.any(np.diff(docs) < 0):
            raise bad("document index must start at 0, end at the sequence count and never decrease")
        if n_seq and lengths.min() < 0:
            raise bad("negative sequence length")
        itemsize = self.dtype.itemsize
        ends = np.cumsum(lengths.astype(np.int64) * itemsize)
        if n_seq and (pointers[0] != 0 or np.any(pointers[1:] != ends[:-1])):
            raise bad("sequence pointers do not match the sequence lengths")
        data_bytes = int(ends[-1]) if n_seq else 0

        bsize = os.path.getsize(bp)
        if bsize != data_bytes:
            kind = "truncated" if bsize < data_bytes else "longer than its index says"
            raise ValueError(
                f"data file {bp} is {kind}: {bsize} bytes, but {ip} describes {data_bytes} bytes "
                f"({data_bytes // itemsize} {self.dtype} tokens)"
            )
        self.num_tokens = data_bytes // itemsize
        if bsize == 0:  # an empty file cannot be memory-mapped
            self._tokens = np.zeros(0, dtype=self.dtype)
        else:
            self._tokens = np.memmap(bp, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        self._starts = (pointers // itemsize) if n_seq else np.zeros(0, dtype=np.int64)

    def __getstate__(self):
        return {"path_prefix": self.path_prefix}

    def __setstate__(self, state) -> None:
        self.path_prefix = state["path_prefix"]
        self._open()

    # -- access ------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._sequence_lengths)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("slices of an IndexedDataset must be contiguous")
            return [self[i] for i in range(start, stop)]
        return self.get(idx)

    def check_token_range(self, vocab_size: int, block: int = 1 << 24) -> None:
        """Raise, naming the file, if any token id is outside ``[0, vocab_size)``: at TP>1
        the vocab-parallel embedding would otherwise silently map it to a zero vector."""
        for lo in range(0, self.num_tokens, block):
            part = np.asarray(self._tokens[lo:lo + block])
            hi, low = int(part.max()), int(part.min())
            if hi >= vocab_size or low < 0:
                bad = hi if hi >= vocab_size else low
                pos = lo + int(np.argmax(part == bad))

                raise DataError(f"{bin_path(self.path_prefix)}: token id {bad} at position "
                                f"{pos} is outside the vocabulary (size {vocab_size}); "
                                "tokenize it with this run's tokenizer, or give the "
                                "tokenizer (or --vocab-size) it was made with")

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset .. offset+length`` of sequence ``idx`` (to its end when length is None)."""
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sequence {idx} out of range for {n} sequences in {self.path_prefix}")
        idx = int(idx) % n
        seq_len = int(self._sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"tokens [{offset}, {offset + length}) outside sequence {idx} of length {seq_len}")
        start = int(self._starts[idx]) + offset
        return self._tokens[start : start + length]

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self._sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        return self._sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        return self._document_indices

    @property
    def num_documents(self) -> int:
        return len(self._document_indices) - 1

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return os.path.isfile(idx_path(path_prefix)) and os.path.isfile(bin_path(path_prefix))

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.path_prefix!r}: {self.num_documents} documents, {len(self)} sequences, "
            f"{self.num_tokens} {self.dtype} tokens)"
        )
