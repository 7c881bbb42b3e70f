"""Training samples cut at uniformly random offsets of a split's token stream (nanoGPT's sampler).

Why this exists next to Megatron's packing (:class:`~megalite.data.gpt_dataset.GPTDataset`):
packing cuts every epoch into consecutive ``seq_length`` windows, so within an epoch a token
is predicted from one fixed context. That is the right choice for large corpora seen for
about one epoch, but on a small corpus trained for several epochs the model keeps meeting the
same grid of windows. Random offsets (``--sample-windows random``) give each epoch new windows and
new contexts for every token; on nanoGPT's baby-GPT recipe (tiny Shakespeare, 1.5 epochs)
this was worth 0.019 nats of validation loss (docs/training.md, "Convergence").

Rule: the split's segments are read in corpus order as one stream of ``T`` tokens; sample
``i`` is the ``seq_length + 1`` tokens starting at an offset drawn uniformly from
``[0, T - seq_length - 1]`` by a generator seeded with ``(seed, i)``. Windows may cross
document boundaries, as packed samples do. A sample depends only on ``(seed, i)``: no index
files, the same global batch at any DP size, and an exact resume from ``consumed_samples``.
"""

from __future__ import annotations

import numpy as np
import torch

from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.samples import make_sample
from megalite.errors import ConfigError

__all__ = ["RandomWindowDataset"]


class RandomWindowDataset(torch.utils.data.Dataset):
    """``num_samples`` windows of ``seq_length + 1`` tokens at seeded random offsets."""

    def __init__(
        self,
        indexed: IndexedDataset,
        segments,
        seq_length: int,
        num_samples: int,
        seed: int,
        *,
        name: str = "train",
        eod_token: int | None = None,
        eod_mask_loss: bool = False,
    ) -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        self.indexed, self.segments, self.name = indexed, segments, name
        self.seq_length, self.num_samples, self.seed = int(seq_length), int(num_samples), int(seed)
        self.eod_token, self.eod_mask_loss = eod_token, eod_mask_loss
        self.num_tokens = segments.num_tokens
        if self.num_tokens < self.seq_length + 1:
            raise ConfigError(
                f"{name} split of {indexed.path_prefix!r} has {self.num_tokens} tokens; random "
                f"windows need at least seq_length + 1 = {self.seq_length + 1} (check --split, "
                "--seq-length and the data)"
            )
        self._ends = np.cumsum(segments.length)  # stream position where each segment ends
        self.num_offsets = self.num_tokens - self.seq_length  # valid window starts

    def __len__(self) -> int:
        return self.num_samples

    def window_start(self, idx: int) -> int:
        """Stream position where sample ``idx`` begins."""
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for {self.num_samples} samples")
        return int(np.random.default_rng([self.seed, int(idx)]).integers(self.num_offsets))

    def stream_tokens(self, start: int, count: int) -> np.ndarray:
        """Tokens ``[start, start + count)`` of the split's stream, across segment boundaries."""
        seg, parts = self.segments, []
        k = int(np.searchsorted(self._ends, start, side="right"))
        pos = start - (int(self._ends[k]) - int(seg.length[k]))
        while count > 0:
            take = min(count, int(seg.length[k]) - pos)
            parts.append(self.indexed.get(int(seg.seq[k]), int(seg.start[k]) + pos, take))
            count -= take
            k, pos = k + 1, 0
        return np.concatenate(parts).astype(np.int64)

    def raw_tokens(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens behind sample ``idx``."""
        return self.stream_tokens(self.window_start(idx), self.seq_length + 1)

    def __getitem__(self, idx: int) -> dict:
        return make_sample(self.raw_tokens(int(idx)), self.eod_token, self.eod_mask_loss)
