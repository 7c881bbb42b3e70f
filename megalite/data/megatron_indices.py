"""Megatron-Core's ``GPTDataset`` / ``BlendedMegatronDatasetBuilder`` index rules, in numpy.

The same seed, split, sequence length and sample counts give the same documents, the same
sample boundaries and the same sample order as Megatron-Core (its ``helpers_cpp`` is
replaced by the vectorised equivalent here; tests compare against megatron-core itself):

* split: ``re.findall(r"[.0-9]+")`` numbers (so ``'99,1,0'`` with literal quotes parses),
  normalized, turned into book-ends ``(lo, hi)`` by cumulative sums; split ``i`` owns
  sequences ``round(lo * n) .. round(hi * n)``.
* document index: the split's documents tiled once per epoch and shuffled *across* epochs
  with ``numpy.random.RandomState(seed)``; the last epoch is shuffled on its own when it
  supplies fewer than 80% of an epoch's samples.
* sample index: sample ``j`` starts at stream token ``j * seq_length`` (``seq_length + 1``
  tokens each, neighbours sharing one), as (document-index row, offset) pairs.
* shuffle index: a permutation of *all* samples of all epochs (so a dataset holds at least
  the samples asked for, usually more), the separated last epoch again on its own.
* blends: per-dataset sample counts ``ceil(n * w)`` (plus a 0.5% surplus built), the greedy
  blending index of ``helpers.build_blending_indices``.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import numpy as np

from megalite.config.data_flags import normalize

MID_LEVEL_DATASET_SURPLUS = 0.005   # BlendedMegatronDatasetConfig.mid_level_dataset_surplus
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def split_matrix(weights: Sequence[float]) -> List[Optional[Tuple[float, float]]]:
    """Book-ends of each split (``convert_split_vector_to_split_matrix``), None if empty."""
    expansion = [0]
    for w in weights:
        expansion.append(expansion[-1] + w)
    return [None if hi <= lo else (lo, hi) for lo, hi in zip(expansion[:-1], expansion[1:])]


def split_ranges(num_elements: int, weights: Sequence[float]):
    """``[(begin, end) or None] * 3``: the sequences each split owns."""
    return [None if b is None else (int(round(b[0] * float(num_elements))),
                                    int(round(b[1] * float(num_elements))))
            for b in split_matrix(weights)]


def num_epochs_for(num_samples: Optional[int], tokens_per_epoch: int, seq_length: int) -> int:
    """Epochs whose token stream holds ``num_samples`` samples plus the extra token."""
    if num_samples is None:
        return 1
    requested = num_samples * seq_length + 1
    return max(1, -(-requested // tokens_per_epoch)) if tokens_per_epoch > 0 else 1


def separate_final_epoch(num_samples: Optional[int], num_epochs: int, tokens_per_epoch: int,
                         seq_length: int) -> Tuple[bool, int]:
    """(whether the last epoch is shuffled apart, samples of the epochs before it)."""
    if num_epochs == 1:
        return False, 0
    before = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    from_final = num_samples - before
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch), before


def build_document_index(num_documents: int, num_epochs: int, rng: np.random.RandomState,
                         separate_final: bool) -> np.ndarray:
    """Positions ``0..num_documents-1`` per epoch, shuffled as Megatron shuffles its ids (a
    shuffle's permutation does not depend on the values, so positions map to ids 1:1)."""
    if not separate_final or num_epochs == 1:
        index = np.tile(np.arange(num_documents, dtype=np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(num_documents, num_epochs - 1, rng, False)
    last = build_document_index(num_documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(lengths: np.ndarray, document_index: np.ndarray, seq_length: int,
                       num_epochs: int, tokens_per_epoch: int) -> np.ndarray:
    """``helpers.build_sample_idx`` (drop the last partial sample, one extra token): row ``j``
    is the document-index row holding stream token ``j * seq_length`` and its offset."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    doc_lengths = np.asarray(lengths, dtype=np.int64)[document_index]
    ends = np.cumsum(doc_lengths)
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    rows = np.searchsorted(ends, positions, side="right")   # skips empty documents
    offsets = positions - (ends[rows] - doc_lengths[rows])
    rows[0], offsets[0] = 0, 0
    return np.stack([rows, offsets], axis=1)


def build_shuffle_index(num_samples: int, total_size: int,
                        rng: np.random.RandomState) -> np.ndarray:
    """``_build_shuffle_index``: ``[0, num_samples)`` shuffled, then the rest on its own."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(0, num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_indices(lengths: np.ndarray, seq_length: int, num_samples: Optional[int], seed: int,
                  shuffle_documents: bool = True):
    """(document index, sample index, shuffle index) of one split, as Megatron builds them;
    ``lengths`` are the split's document lengths in corpus order."""
    tokens_per_epoch = int(np.asarray(lengths, dtype=np.int64).sum())
    epochs = num_epochs_for(num_samples, tokens_per_epoch, seq_length)
    separate, before = separate_final_epoch(num_samples, epochs, tokens_per_epoch, seq_length)
    rng = np.random.RandomState(seed)
    if shuffle_documents:
        document_index = build_document_index(len(lengths), epochs, rng, separate)
    else:   # contiguous (nanoGPT-style) stream: corpus order, samples still shuffled
        document_index = np.tile(np.arange(len(lengths), dtype=np.int32), epochs)
    sample_index = build_sample_index(lengths, document_index, seq_length, epochs,
                                      tokens_per_epoch)
    total = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(before if separate else total, total, rng)
    return document_index, sample_index, shuffle_index


def blend_sizes(weights: Sequence[float], target: int, surplus: float = 0.0) -> List[int]:
    """``_get_size_per_split_per_dataset`` for one split: samples per dataset."""
    return [int(math.ceil(math.ceil(target * w) * (1 + surplus))) for w in weights]


def blending_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """``helpers.build_blending_indices``: sample ``i`` goes to the dataset furthest below its
    share (ties to the lowest id).  Returns (dataset index, sample index within it)."""
    w = [float(x) for x in weights]
    taken = [0] * len(w)
    dataset_index = np.empty(size, dtype=np.int16 if len(w) < 2**15 else np.int64)
    sample_index = np.empty(size, dtype=np.int64)
    datasets = range(1, len(w))
    for i in range(size):
        n = float(max(i, 1))
        best, best_err = 0, w[0] * n - taken[0]
        for d in datasets:
            err = w[d] * n - taken[d]
            if err > best_err:
                best, best_err = d, err
        dataset_index[i] = best
        sample_index[i] = taken[best]
        taken[best] += 1
    return dataset_index, sample_index
