"""Where a run stands in its data: a DCP ``Stateful`` part of the training state.

Why per split: the training sampler resumes at the consumed training samples (each DP rank
takes its slice of the next global batch, whatever the DP size), and the evaluations count
the samples they read of the validation and test sets, as Megatron's
``consumed_train_samples`` / ``consumed_valid_samples`` do, so a resumed run carries on
the counts of the run it continues.  (Every evaluation reads the same first batches of its
split, ``Trainer.evaluate``: the count does not move where an evaluation starts.)
"""
from __future__ import annotations

from typing import Dict

SPLITS = ("train", "valid", "test")


class DataPosition:
    """``iteration``: training iterations done; ``consumed[split]``: samples read."""

    def __init__(self):
        self.iteration = 0
        self.consumed: Dict[str, int] = {s: 0 for s in SPLITS}

    def state_dict(self) -> dict:
        return {"iteration": self.iteration,
                **{f"consumed_{s}_samples": n for s, n in self.consumed.items()}}

    def load_state_dict(self, sd: dict) -> None:
        """Splits a checkpoint lacks (older, converted ones hold train only) start at 0."""
        self.iteration = int(sd["iteration"])
        self.consumed = {s: int(sd.get(f"consumed_{s}_samples") or 0) for s in SPLITS}
