"""Which samples each data-parallel rank reads, so a global batch never depends on DP size.

Rule: a global batch of ``G`` samples starting at ``consumed_samples = c`` is samples
``c .. c+G-1``. With ``dp`` ranks each rank owns ``G/dp`` of them, contiguously:
DP rank ``r`` gets ``c + r*G/dp .. c + (r+1)*G/dp - 1``, read as ``G/(mbs*dp)`` micro-batches
of ``mbs`` consecutive samples in order. Concatenating the ranks' samples in rank order gives
``c .. c+G-1`` for every ``dp``, and the next global batch starts at ``c + G``, so a run resumes
exactly by passing the checkpointed ``consumed_samples``.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch

__all__ = ["PretrainingSampler", "build_data_iterator", "collate_samples"]


class PretrainingSampler:
    """Batch sampler yielding this DP rank's micro-batches (lists of sample indices) in order.

    Stops before a global batch that would run past ``total_samples``; with ``cyclic=True``
    it instead wraps sample indices around modulo ``total_samples`` forever (for evaluation).
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        cyclic: bool = False,
        batch_size_at: Optional[Callable[[int], int]] = None,
    ) -> None:
        """``batch_size_at(consumed_samples)``: the global batch starting there (a batch-size
        ramp, ``megalite/config/microbatches.py``); default ``global_batch_size`` throughout."""
        if micro_batch_size < 1 or dp_size < 1:
            raise ValueError(f"micro_batch_size ({micro_batch_size}) and dp_size ({dp_size}) must be >= 1")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(
                f"global batch size {global_batch_size} is not divisible by "
                f"micro batch size {micro_batch_size} x data-parallel size {dp_size}"
            )
        if total_samples < 1:
            raise ValueError("the dataset is empty")
        if consumed_samples < 0 or (not cyclic and consumed_samples >= total_samples):
            raise ValueError(
                f"consumed_samples {consumed_samples} leaves nothing to read from {total_samples} samples"
            )
        self.total_samples = int(total_samples)
        self.consumed_samples = int(consumed_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.global_batch_size = int(global_batch_size)
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.cyclic = cyclic
        self.batch_size_at = batch_size_at or (lambda consumed: self.global_batch_size)
        self.per_rank = self.global_batch_size // self.dp_size
        self.num_micro_batches = self.per_rank // self.micro_batch_size

    def rank_samples(self, consumed_samples: int, global_batch_size: Optional[int] = None
                     ) -> list[int]:
        """This rank's sample indices of the global batch starting at ``consumed_samples``."""
        per_rank = (global_batch_size or self.global_batch_size) // self.dp_size
        start = consumed_samples + self.dp_rank * per_rank
        idx = list(range(start, start + per_rank))
        return [i % self.total_samples for i in idx] if self.cyclic else idx

    def __len__(self) -> int:
        """Micro-batches left for this rank (cyclic samplers report one pass)."""
        left = self.total_samples - (0 if self.cyclic else self.consumed_samples)
        return (left // self.global_batch_size) * self.num_micro_batches

    def __iter__(self) -> Iterator[list[int]]:
        c = self.consumed_samples
        while True:
            g = self.batch_size_at(c)
            if not self.cyclic and c + g > self.total_samples:
                return
            mine = self.rank_samples(c, g)
            for m in range(len(mine) // self.micro_batch_size):
                yield mine[m * self.micro_batch_size : (m + 1) * self.micro_batch_size]
            c += g


def collate_samples(samples: list[dict]) -> dict:
    """Stack a list of sample dicts into one dict of batched tensors."""
    return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in samples[0]}


def build_data_iterator(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    global_batch_size: int,
    dp_rank: int,
    dp_size: int,
    cyclic: bool = False,
    batch_size_at: Optional[Callable[[int], int]] = None,
):
    """Iterator over this DP rank's micro-batches (dicts of ``[mbs, seq]`` tensors), or ``None``.

    Returns ``None`` for a ``None`` dataset so callers can pass missing valid/test splits through.
    """
    if dataset is None:
        return None
    sampler = PretrainingSampler(
        len(dataset), consumed_samples, micro_batch_size, global_batch_size, dp_rank, dp_size, cyclic,
        batch_size_at,
    )
    # its own generator: making an iterator must not draw from the global RNG, or a resumed
    # run (which builds its iterator after restoring that RNG) would drop out differently
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=0, collate_fn=collate_samples,
        generator=torch.Generator(),
    )
    return iter(loader)
