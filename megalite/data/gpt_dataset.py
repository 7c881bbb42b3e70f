"""GPT pretraining datasets: packed samples from an indexed dataset, mock data, and blends.

Packing (as in Megatron): the selected documents are concatenated, epoch after epoch, each
epoch in a fresh shuffled order, into one token stream. Sample ``j`` (before shuffling) is the
``seq_length + 1`` tokens starting at stream position ``j * seq_length``; consecutive samples
share one boundary token. ``tokens = sample[:-1]``, ``labels = sample[1:]``. The sample order
is then shuffled. The three index arrays (document order, sample starts, sample shuffle) are
cached as ``.npy`` files keyed by a hash of everything they depend on.

Split rule (``--split 969,30,1``): weights are normalized and turned into contiguous document
ranges with Megatron's rounding. If that leaves a split with nonzero weight without any
document (e.g. a single-document corpus with ``90,10,0``), the corpus is instead split by
tokens: the concatenated token stream is cut at the same fractions, cutting inside documents.
``contiguous=True`` always splits by tokens and keeps documents in corpus order (a
nanoGPT-style contiguous stream); samples are still drawn in shuffled order.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import warnings
from typing import Sequence

import numpy as np
import torch

from megalite.data.indexed_dataset import IndexedDataset, bin_path
from megalite.data.samples import make_sample

__all__ = [
    "BlendedDataset",
    "GPTDataset",
    "MockGPTDataset",
    "Segments",
    "blending_indices",
    "build_train_valid_test_datasets",
    "parse_data_path",
    "parse_split",
    "split_boundaries",
    "split_segments",
]

logger = logging.getLogger(__name__)
SPLIT_NAMES = ("train", "valid", "test")
_INDEX_VERSION = 1


# ---------------------------------------------------------------------------------------
# argument parsing
# ---------------------------------------------------------------------------------------
def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` (or ``"969/30/1"``, or fewer than 3 numbers) -> 3 normalized weights."""
    try:
        parts = [float(s) for s in split.replace("/", ",").split(",") if s.strip() != ""]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected up to 3 comma-separated numbers like 969,30,1") from None
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"--split {split!r}: expected 1-3 non-negative numbers with a positive sum")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def split_boundaries(size: int, weights: Sequence[float]) -> list[int]:
    """Megatron's rounding of fractions to boundaries ``[0, b1, b2, size]`` over ``size`` units."""
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * float(size))))
    diff = bounds[-1] - size
    bounds = [0] + [b - diff for b in bounds[1:]]
    return [min(max(b, 0), size) for b in bounds]


def parse_data_path(data_path: Sequence[str]) -> tuple[list[float], list[str]]:
    """``["0.3", "a", "0.7", "b"]`` -> weights and prefixes; bare prefixes get equal weights."""
    items = list(data_path)
    if not items:
        raise ValueError("--data-path is empty")

    def is_number(s: str) -> bool:
        try:
            float(s)
            return True
        except ValueError:
            return False

    if len(items) % 2 == 0 and all(is_number(items[i]) for i in range(0, len(items), 2)):
        weights = [float(items[i]) for i in range(0, len(items), 2)]
        prefixes = [items[i] for i in range(1, len(items), 2)]
    elif not any(is_number(s) for s in items):
        weights, prefixes = [1.0] * len(items), items
    else:
        raise ValueError(
            f"--data-path {' '.join(items)!r}: give either prefixes only, or weight/prefix pairs "
            "like '0.3 prefA 0.7 prefB'"
        )
    if not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--data-path weights {weights} must be finite and non-negative with "
                         f"a positive sum")
    total = sum(weights)
    return [w / total for w in weights], prefixes


# ---------------------------------------------------------------------------------------
# segments: the token ranges a split owns
# ---------------------------------------------------------------------------------------
class Segments:
    """Token ranges ``(sequence id, start token, length)`` that make up one split, in order."""

    def __init__(self, seq: np.ndarray, start: np.ndarray, length: np.ndarray) -> None:
        keep = length > 0
        self.seq = np.asarray(seq, dtype=np.int64)[keep]
        self.start = np.asarray(start, dtype=np.int64)[keep]
        self.length = np.asarray(length, dtype=np.int64)[keep]

    def __len__(self) -> int:
        return len(self.seq)

    @property
    def num_tokens(self) -> int:
        return int(self.length.sum())

    def digest(self) -> str:
        h = hashlib.md5()
        for a in (self.seq, self.start, self.length):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()


def split_segments(
    indexed: IndexedDataset, weights: Sequence[float], contiguous: bool = False
) -> tuple[list[Segments], str]:
    """Segments of train/valid/test for ``indexed`` and the rule used (``"document"``/``"token"``)."""
    lengths = indexed.sequence_lengths.astype(np.int64)
    docs = indexed.document_indices
    n_docs = len(docs) - 1
    if not contiguous:
        bounds = split_boundaries(n_docs, weights)
        counts = [bounds[i + 1] - bounds[i] for i in range(3)]
        if all(c > 0 for c, w in zip(counts, weights) if w > 0):
            out = []
            for i in range(3):
                s0, s1 = int(docs[bounds[i]]), int(docs[bounds[i + 1]])
                out.append(Segments(np.arange(s0, s1), np.zeros(s1 - s0), lengths[s0:s1]))
            return out, "document"
    # token-level split over the concatenated stream of all sequences
    ends = np.cumsum(lengths)
    starts = ends - lengths
    bounds = split_boundaries(int(ends[-1]) if len(ends) else 0, weights)
    out = []
    for i in range(3):
        t0, t1 = bounds[i], bounds[i + 1]
        lo = np.maximum(starts, t0)
        hi = np.minimum(ends, t1)
        sel = np.nonzero(hi > lo)[0]
        out.append(Segments(sel, lo[sel] - starts[sel], hi[sel] - lo[sel]))
    return out, "token"


# ---------------------------------------------------------------------------------------
# samples
# ---------------------------------------------------------------------------------------
def _save_npy(path: str, arr: np.ndarray) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, arr)
    os.replace(tmp, path)  # atomic: concurrent ranks building the same cache never see half a file


class GPTDataset(torch.utils.data.Dataset):
    """``num_samples`` packed samples of ``seq_length`` tokens from the given segments.

    Sample ``i`` is a dict of ``tokens``, ``labels`` (tokens shifted by one), ``loss_mask`` and
    ``position_ids``. The same arguments always give the same samples in the same order.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        segments: Segments,
        seq_length: int,
        num_samples: int | None,
        seed: int,
        *,
        name: str = "train",
        shuffle_documents: bool = True,
        eod_token: int | None = None,
        eod_mask_loss: bool = False,
        cache_dir: str | None = None,
    ) -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        self.indexed, self.segments = indexed, segments
        self.seq_length, self.seed, self.name = int(seq_length), int(seed), name
        self.eod_token, self.eod_mask_loss = eod_token, eod_mask_loss
        tokens = segments.num_tokens
        if tokens < 2:
            raise ValueError(
                f"{name} split of {indexed.path_prefix!r} has {tokens} tokens; need at least 2 "
                "(check --split and the data)"
            )
        if num_samples is None:  # one pass over the split
            num_samples = max((tokens - 1) // self.seq_length, 1)
        self.num_samples = int(num_samples)
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        # smallest number of epochs whose stream holds every sample's seq_length + 1 tokens
        self.num_epochs = max(1, -(-(self.num_samples * self.seq_length + 1) // tokens))
        self.shuffle_documents = shuffle_documents

        description = {
            "class": "GPTDataset",
            "version": _INDEX_VERSION,
            "data": os.path.basename(indexed.path_prefix),
            "bin_bytes": os.path.getsize(bin_path(indexed.path_prefix)),
            "split": name,
            "segments": segments.digest(),
            "seq_length": self.seq_length,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle_documents": shuffle_documents,
        }
        self.description = description
        self.cache_key = hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()
        if cache_dir is None:
            cache_dir = os.path.dirname(os.path.abspath(indexed.path_prefix))
        self.cache_prefix = os.path.join(
            cache_dir, f"{os.path.basename(indexed.path_prefix)}_{name}_{self.cache_key}"
        )
        self.loaded_from_cache = False
        self.document_index, self.sample_index, self.shuffle_index = self._load_or_build()

    # -- index construction ----------------------------------------------------------------
    def _cache_paths(self) -> list[str]:
        return [f"{self.cache_prefix}_{n}.npy" for n in ("doc_idx", "sample_idx", "shuffle_idx")]

    def _load_or_build(self):
        paths = self._cache_paths()
        if all(os.path.isfile(p) for p in paths):
            try:
                arrays = tuple(np.load(p, mmap_mode="r") for p in paths)
                if len(arrays[1]) == self.num_samples + 1 and len(arrays[2]) == self.num_samples:
                    self.loaded_from_cache = True
                    return arrays
            except (OSError, ValueError):
                pass  # unreadable cache: rebuild it below
        arrays = self._build()
        try:
            os.makedirs(os.path.dirname(self.cache_prefix), exist_ok=True)
            for p, a in zip(paths, arrays):
                _save_npy(p, a)
            with open(f"{self.cache_prefix}_description.json", "w") as f:
                json.dump(self.description, f, indent=1)
        except OSError as e:
            warnings.warn(f"could not cache dataset indices at {self.cache_prefix}: {e}; kept in memory")
        return arrays

    def _build(self):
        rng = np.random.default_rng(self.seed)
        n_seg = len(self.segments)
        if self.shuffle_documents:
            document_index = np.concatenate([rng.permutation(n_seg) for _ in range(self.num_epochs)])
        else:
            document_index = np.tile(np.arange(n_seg, dtype=np.int64), self.num_epochs)
        lengths = self.segments.length[document_index]
        ends = np.cumsum(lengths)
        # sample j starts at stream position j * seq_length; row num_samples closes the last one
        positions = np.arange(self.num_samples + 1, dtype=np.int64) * self.seq_length
        rows = np.searchsorted(ends, positions, side="right")
        offsets = positions - (ends[rows] - lengths[rows])
        sample_index = np.stack([rows, offsets], axis=1).astype(np.int64)
        shuffle_index = rng.permutation(self.num_samples).astype(np.int64)
        return document_index.astype(np.int64), sample_index, shuffle_index

    # -- access ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_samples

    def _segment_tokens(self, row: int, offset: int, end: int | None) -> np.ndarray:
        k = int(self.document_index[row])
        seg = self.segments
        stop = int(seg.length[k]) if end is None else end
        return self.indexed.get(int(seg.seq[k]), int(seg.start[k]) + offset, stop - offset)

    def raw_tokens(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` stream tokens behind sample ``idx`` (after shuffling)."""
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for {self.num_samples} samples")
        j = int(self.shuffle_index[idx])
        r0, o0 = (int(x) for x in self.sample_index[j])
        r1, o1 = (int(x) for x in self.sample_index[j + 1])
        if r0 == r1:
            parts = [self._segment_tokens(r0, o0, o1 + 1)]
        else:
            parts = [self._segment_tokens(r0, o0, None)]
            parts += [self._segment_tokens(r, 0, None) for r in range(r0 + 1, r1)]
            parts.append(self._segment_tokens(r1, 0, o1 + 1))
        out = np.concatenate(parts).astype(np.int64)
        assert len(out) == self.seq_length + 1, (len(out), self.seq_length)
        return out

    def __getitem__(self, idx: int) -> dict:
        return make_sample(self.raw_tokens(int(idx)), self.eod_token, self.eod_mask_loss)


class MockGPTDataset(torch.utils.data.Dataset):
    """Random tokens for ``--mock-data``: sample ``i`` depends only on (seed, i)."""

    def __init__(
        self,
        num_samples: int,
        seq_length: int,
        vocab_size: int | None,
        seed: int,
        *,
        eod_token: int | None = None,
        eod_mask_loss: bool = False,
    ) -> None:
        if vocab_size is None or vocab_size < 1:
            raise ValueError("mock data needs a vocab size (--vocab-size or a tokenizer)")
        self.num_samples, self.seq_length = int(num_samples), int(seq_length)
        self.vocab_size, self.seed = int(vocab_size), int(seed)
        self.eod_token, self.eod_mask_loss = eod_token, eod_mask_loss

    def __len__(self) -> int:
        return self.num_samples

    def raw_tokens(self, idx: int) -> np.ndarray:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for {self.num_samples} samples")
        rng = np.random.default_rng([self.seed, int(idx)])
        return rng.integers(0, self.vocab_size, size=self.seq_length + 1, dtype=np.int64)

    def __getitem__(self, idx: int) -> dict:
        return make_sample(self.raw_tokens(int(idx)), self.eod_token, self.eod_mask_loss)


# ---------------------------------------------------------------------------------------
# blending
# ---------------------------------------------------------------------------------------
def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blend: sample ``i`` goes to the dataset furthest below its target.

    Returns ``(dataset_index, dataset_sample_index)``: sample ``i`` is sample
    ``dataset_sample_index[i]`` of dataset ``dataset_index[i]``. Deterministic, no RNG; after
    any prefix of ``n`` samples each dataset's count is within one of ``weight * n``.
    """
    w = [float(x) for x in weights]
    total = sum(w)
    w = [x / total for x in w]
    taken = [0] * len(w)
    dataset_index = np.empty(size, dtype=np.int16 if len(w) < 2**15 else np.int64)
    sample_index = np.empty(size, dtype=np.int64)
    nd = range(len(w))
    for i in range(size):
        n = max(i, 1)
        best, best_err = 0, w[0] * n - taken[0]
        for d in nd:
            err = w[d] * n - taken[d]
            if err > best_err:
                best, best_err = d, err
        dataset_index[i] = best
        sample_index[i] = taken[best]
        taken[best] += 1
    return dataset_index, sample_index


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights`` (see blending_indices).

    Each sample dict gets a ``dataset_id`` entry saying which dataset it came from.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int, indices=None) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("BlendedDataset needs one weight per dataset")
        self.datasets, self.size = list(datasets), int(size)
        self.weights = [float(w) / sum(weights) for w in weights]
        if indices is None:  # callers that already ran blending_indices pass its result
            indices = blending_indices(self.weights, self.size)
        self.dataset_index, self.dataset_sample_index = indices
        counts = np.bincount(self.dataset_index.astype(np.int64), minlength=len(datasets))
        for d, (ds, c) in enumerate(zip(self.datasets, counts)):
            if c and (ds is None or len(ds) < c):
                raise ValueError(f"blended dataset {d} has {0 if ds is None else len(ds)} samples, needs {c}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict:
        d = int(self.dataset_index[idx])
        sample = self.datasets[d][int(self.dataset_sample_index[idx])]
        sample["dataset_id"] = torch.tensor(d, dtype=torch.int64)
        return sample


# ---------------------------------------------------------------------------------------
# entry point for the training loop
# ---------------------------------------------------------------------------------------
def build_train_valid_test_datasets(
    data_path: Sequence[str] | None,
    split: str,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    mock: bool,
    vocab_size: int | None,
    cache_dir: str | None = None,
    *,
    eod_token: int | None = None,
    eod_mask_loss: bool = False,
    contiguous: bool = False,
    sample_windows: str = "packed",
):
    """Train, valid and test datasets (``None`` where 0 samples are asked or the split is empty).

    ``num_samples[i]`` is how many samples split ``i`` must provide (e.g. ``train_iters *
    global_batch_size``); datasets wrap around epochs as needed. ``data_path`` is Megatron's
    ``--data-path`` list; ``mock=True`` ignores it and returns :class:`MockGPTDataset` s.
    ``sample_windows="random"`` cuts the *training* samples at random offsets
    (:class:`~megalite.data.random_windows.RandomWindowDataset`); valid/test stay packed so
    every evaluation covers its split evenly and the same way.
    """
    if sample_windows not in ("packed", "random"):
        raise ValueError(f"sample_windows must be 'packed' or 'random', got {sample_windows!r}")
    if len(num_samples) != 3:
        raise ValueError("num_samples must be (train, valid, test)")
    if mock:
        return tuple(
            MockGPTDataset(n, seq_length, vocab_size, seed + 1000 * i,
                           eod_token=eod_token, eod_mask_loss=eod_mask_loss)
            if n > 0
            else None
            for i, n in enumerate(num_samples)
        )
    if not data_path:
        raise ValueError("no --data-path given (pass --mock-data for synthetic data)")
    split_weights = parse_split(split)
    blend_weights, prefixes = parse_data_path(data_path)
    indexed = [IndexedDataset(p) for p in prefixes]
    if vocab_size:
        for ds in indexed:
            ds.check_token_range(vocab_size)
    segments = []
    for ds in indexed:
        segs, rule = split_segments(ds, split_weights, contiguous)
        logger.info("%s: split %s by %s -> %s tokens", ds.path_prefix, split, rule, [s.num_tokens for s in segs])
        segments.append(segs)

    def one(d: int, i: int, n: int):
        if i == 0 and sample_windows == "random":
            from megalite.data.random_windows import RandomWindowDataset

            return RandomWindowDataset(indexed[d], segments[d][i], seq_length, n, seed,
                                       name=SPLIT_NAMES[i], eod_token=eod_token,
                                       eod_mask_loss=eod_mask_loss)
        return GPTDataset(
            indexed[d], segments[d][i], seq_length, n, seed,
            name=SPLIT_NAMES[i], shuffle_documents=not contiguous,
            eod_token=eod_token, eod_mask_loss=eod_mask_loss, cache_dir=cache_dir,
        )

    out = []
    for i, n in enumerate(num_samples):
        if n <= 0 or split_weights[i] == 0:
            out.append(None)
            continue
        if len(indexed) == 1:
            out.append(one(0, i, n))
            continue
        # blend: count exactly how many samples each dataset must supply, then build those
        indices = blending_indices(blend_weights, n)
        counts = np.bincount(indices[0].astype(np.int64), minlength=len(indexed))
        parts = [one(d, i, int(c)) if c > 0 else None for d, c in enumerate(counts)]
        out.append(BlendedDataset(parts, blend_weights, n, indices))
    return tuple(out)
