"""GPT pretraining datasets: packed samples from an indexed dataset, mock data, and blends.

Packing is Megatron-Core's ``GPTDataset`` (rules in ``megatron_indices``): the split's
documents, tiled once per epoch and shuffled across epochs, form one token stream. Sample
``j`` (before shuffling) is the ``seq_length + 1`` tokens starting at stream position
``j * seq_length``; consecutive samples share one boundary token. ``tokens = sample[:-1]``,
``labels = sample[1:]``. The order of all samples of all epochs is then shuffled, so a
dataset holds at least the samples asked for. Same seed, split, sequence length and sample
counts: the same samples in the same order as Megatron-LM. The three index arrays are cached
as ``.npy`` files keyed by a hash of everything they depend on.

Split rule (``--split 969,30,1``): Megatron's, over the sequences of the ``.idx`` file. If
that leaves a split with nonzero weight without any sequence (e.g. a single-document corpus
with ``90,10,0``, where Megatron-LM stops), the corpus is instead split by tokens: the
concatenated token stream is cut at the same fractions, cutting inside documents.
``contiguous=True`` always splits by tokens and keeps documents in corpus order (a
nanoGPT-style contiguous stream); samples are still drawn in shuffled order.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from typing import Sequence

import numpy as np
import torch

from megalite.data.indexed_dataset import IndexedDataset, bin_path
from megalite.config.data_flags import normalize, parse_data_path, parse_split_numbers
from megalite.data.megatron_indices import (MID_LEVEL_DATASET_SURPLUS, blend_sizes,
                                            blending_indices, build_indices, split_ranges)
from megalite.data.samples import make_sample
from megalite.data.random_windows import RandomWindowDataset
from megalite.errors import ConfigError

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
_INDEX_VERSION = 2   # 2: Megatron-Core's index rules


# ---------------------------------------------------------------------------------------
# argument parsing
# ---------------------------------------------------------------------------------------
def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` (or ``"969/30/1"``, ``"'99,1,0'"`` with quotes, or fewer than 3 numbers)
    -> 3 normalized weights, as Megatron parses it."""
    return parse_split_numbers(split)


def split_boundaries(size: int, weights: Sequence[float]) -> list[int]:
    """Megatron's rounding of fractions to boundaries ``[0, b1, b2, size]`` over ``size`` units."""
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * float(size))))
    diff = bounds[-1] - size
    bounds = [0] + [b - diff for b in bounds[1:]]
    return [min(max(b, 0), size) for b in bounds]


# ---------------------------------------------------------------------------------------
# segments: the token ranges a split owns
# ---------------------------------------------------------------------------------------
class Segments:
    """Token ranges ``(sequence id, start token, length)`` that make up one split, in order."""

    def __init__(self, seq: np.ndarray, start: np.ndarray, length: np.ndarray,
                 keep_empty: bool = False) -> None:
        keep = np.ones(len(length), dtype=bool) if keep_empty else np.asarray(length) > 0
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
    if not contiguous:   # Megatron: split the sequences (empty ones included)
        ranges = split_ranges(len(lengths), weights)
        if all(r is not None and r[1] > r[0] and lengths[r[0]:r[1]].sum() > 1
               for r, w in zip(ranges, weights) if w > 0):
            out = []
            for r in ranges:
                s0, s1 = r if r is not None else (0, 0)
                out.append(Segments(np.arange(s0, s1), np.zeros(s1 - s0), lengths[s0:s1],
                                    keep_empty=True))
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
    """At least ``num_samples`` packed samples of ``seq_length`` tokens from the segments.

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
            raise ConfigError(
                f"{name} split of {indexed.path_prefix!r} has {tokens} tokens; need at least 2 "
                "(check --split and the data)"
            )
        if num_samples is not None and int(num_samples) < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        # None: one epoch (Megatron's rule); the dataset then holds every sample of it
        self.requested_samples = None if num_samples is None else int(num_samples)
        self.shuffle_documents = shuffle_documents

        description = {
            "class": "GPTDataset",
            "version": _INDEX_VERSION,
            "data": os.path.basename(indexed.path_prefix),
            "bin_bytes": os.path.getsize(bin_path(indexed.path_prefix)),
            "split": name,
            "segments": segments.digest(),
            "seq_length": self.seq_length,
            "num_samples": self.requested_samples,
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
                if len(arrays[1]) == len(arrays[2]) + 1:
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
        return build_indices(self.segments.length, self.seq_length, self.requested_samples,
                             self.seed, self.shuffle_documents)

    @property
    def num_samples(self) -> int:
        """Samples this dataset holds: every sample of its epochs (>= the number asked)."""
        return len(self.shuffle_index)

    @property
    def num_epochs(self) -> int:
        return max(1, len(self.document_index) // max(len(self.segments), 1))

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
            raise ConfigError("mock data needs a vocab size (--vocab-size or a tokenizer)")
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
class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights`` (see blending_indices).

    Each sample dict gets a ``dataset_id`` entry saying which dataset it came from.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int, indices=None) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("BlendedDataset needs one weight per dataset")
        self.datasets, self.size = list(datasets), int(size)
        self.weights = normalize(weights)
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
    per_split_data_path: Sequence[Sequence[str]] | None = None,
):
    """Train, valid and test datasets (``None`` where 0 samples are asked or the split is empty).

    ``num_samples[i]`` is how many samples split ``i`` must provide (e.g. ``train_iters *
    global_batch_size``); datasets wrap around epochs as needed. ``data_path`` is Megatron's
    ``--data-path`` list; ``mock=True`` ignores it and returns :class:`MockGPTDataset` s.
    ``sample_windows="random"`` cuts the *training* samples at random offsets
    (:class:`~megalite.data.random_windows.RandomWindowDataset`); valid/test stay packed so
    every evaluation covers its split evenly and the same way.  ``per_split_data_path``
    (Megatron's ``--train/valid/test-data-path``): three blend lists, each split all of its
    own (``data_path`` and ``split`` unused; an empty list gives no dataset).
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
    common = dict(seq_length=seq_length, seed=seed, vocab_size=vocab_size, cache_dir=cache_dir,
                  eod_token=eod_token, eod_mask_loss=eod_mask_loss, contiguous=contiguous,
                  sample_windows=sample_windows)
    if per_split_data_path is not None:
        # Megatron's --train/valid/test-data-path: each split is all of its own blend
        # (--split ignored); a split without a path has no dataset
        if len(per_split_data_path) != 3:
            raise ValueError("per_split_data_path must be (train, valid, test) lists")
        out = []
        for i, (paths, n) in enumerate(zip(per_split_data_path, num_samples)):
            only = [0.0] * 3
            only[i] = 1.0
            sizes = tuple(n if j == i else 0 for j in range(3))
            out.append(_build_splits(paths, only, sizes, single_prefix_direct=True,
                                     **common)[i] if paths and n > 0 else None)
        return tuple(out)
    if not data_path:
        raise ConfigError("no --data-path given (pass --mock-data for synthetic data)")
    return _build_splits(data_path, parse_split(split), num_samples, **common)


def _build_splits(data_path, split_weights, num_samples, *, seq_length, seed, vocab_size,
                  cache_dir, eod_token, eod_mask_loss, contiguous, sample_windows,
                  single_prefix_direct=False):
    """The three datasets of one ``--data-path`` blend cut by ``split_weights``
    (``single_prefix_direct``: one prefix is its own dataset even when weighted, as
    Megatron builds a per-split blend)."""
    _, prefixes = parse_data_path(data_path)
    raw_weights = megatron_blend_weights(data_path)
    if single_prefix_direct and len(prefixes) == 1:
        raw_weights = None
    indexed = [IndexedDataset(p) for p in prefixes]
    if vocab_size:
        for ds in indexed:
            ds.check_token_range(vocab_size)
    segments = []
    for ds in indexed:
        segs, rule = split_segments(ds, split_weights, contiguous)
        logger.info("%s: split %s by %s -> %s tokens", ds.path_prefix, split_weights, rule,
                    [s.num_tokens for s in segs])
        segments.append(segs)

    def one(d: int, i: int, n: int | None, want: int):
        if i == 0 and sample_windows == "random":
            return RandomWindowDataset(indexed[d], segments[d][i], seq_length, n or want, seed,
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
        elif raw_weights is None and len(indexed) == 1:
            out.append(one(0, i, n, n))
        elif raw_weights is not None:
            # Megatron's blend: ceil(n * w) samples per dataset (+0.5% built), greedy order
            weights = normalize(raw_weights)
            target = blend_sizes(weights, n)
            built = blend_sizes(weights, n, MID_LEVEL_DATASET_SURPLUS)
            parts = [one(d, i, built[d], built[d]) for d in range(len(indexed))]
            out.append(BlendedDataset(parts, weights, sum(target)))
        else:
            # prefixes without weights: one epoch of each, blended by their sizes
            parts = [one(d, i, None, n) for d in range(len(indexed))]
            sizes = [len(p) for p in parts]
            out.append(BlendedDataset(parts, sizes, min(n, sum(sizes))))
    return tuple(out)


def megatron_blend_weights(data_path: Sequence[str]) -> list[float] | None:
    """The raw weights of a ``--data-path`` weight/prefix list, None for bare prefixes
    (Megatron then blends one epoch of each dataset by size)."""
    weights, _ = parse_data_path(data_path)
    items = list(data_path)
    if len(items) % 2 == 0 and len(items) >= 2:
        try:
            return [float(items[k]) for k in range(0, len(items), 2)]
        except ValueError:
            pass
    return None
