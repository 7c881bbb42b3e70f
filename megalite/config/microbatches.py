"""The global batch size of each iteration: constant, or Megatron's ``--rampup-batch-size``.

Why: GPT-3-style runs start with a small global batch and grow it while the loss falls
fastest.  ``--rampup-batch-size START INCREMENT SAMPLES`` grows the batch from START to
``--global-batch-size`` in steps of INCREMENT, spread evenly over SAMPLES consumed
samples; the number of micro-batches per iteration follows.  Semantics, step for step
Megatron-Core's ``RampupBatchsizeNumMicroBatchesCalculator``: the batch of an iteration is
a function of the samples consumed before it,

    consumed > SAMPLES:  --global-batch-size
    otherwise:           START + int(consumed / (SAMPLES / n_increments)) * INCREMENT

so a resume needs nothing but the consumed-sample count.  With ``--train-samples`` the
iteration count follows Megatron's ``update_train_iters``.  Megatron-LM refuses a ramp
with ``--train-iters``, yet its GPT-3 175B example script passes both; megalite accepts
it: ``--train-iters`` iterations, each with the ramp's batch, and the lr schedule counted
in samples as for any ``--train-iters`` run.
"""
from __future__ import annotations

from typing import Iterator, Optional, Tuple


class BatchSizeSchedule:
    """``global_batch_size_at(consumed_samples)`` and the micro-batches it takes."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, dp_size: int,
                 rampup: Optional[Tuple[int, int, int]] = None):
        self.global_batch_size = int(global_batch_size)
        self.micro_times_dp = int(micro_batch_size) * int(dp_size)
        self.rampup = None
        if rampup:
            start, increment, samples = (int(v) for v in rampup)
            n = (self.global_batch_size - start) // increment
            # START == --global-batch-size: nothing to ramp (Megatron divides by zero)
            self.rampup = (start, increment, samples, samples / n if n else None)

    def global_batch_size_at(self, consumed_samples: int) -> int:
        if self.rampup is None:
            return self.global_batch_size
        start, increment, samples, per_increment = self.rampup
        if consumed_samples > samples or per_increment is None:
            return self.global_batch_size
        return start + int(consumed_samples / per_increment) * increment

    def num_micro_batches_at(self, consumed_samples: int) -> int:
        return self.global_batch_size_at(consumed_samples) // self.micro_times_dp

    def batch_sizes(self, consumed_samples: int = 0) -> Iterator[int]:
        """The global batch of each iteration from ``consumed_samples`` on (endless)."""
        c = consumed_samples
        while True:
            g = self.global_batch_size_at(c)
            yield g
            c += g

    def train_iters(self, train_samples: int) -> int:
        """Megatron's ``update_train_iters``: the ramp's iterations while consumed <= SAMPLES
        (and <= ``train_samples``), then whole constant batches; a partial last batch is
        dropped."""
        if self.rampup is None:
            return train_samples // self.global_batch_size
        samples = self.rampup[2]
        iterations = consumed = 0
        while consumed <= samples and consumed <= train_samples:
            consumed += self.global_batch_size_at(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.global_batch_size
        return iterations


def rampup_values_problem(rampup) -> Optional[str]:
    """The three values of ``--rampup-batch-size`` on their own (the field's domain)."""
    if not rampup:
        return None
    try:
        start, increment, samples = (int(v) for v in rampup)
    except (TypeError, ValueError):
        return f"--rampup-batch-size {' '.join(map(str, rampup))}: give three integers " \
               "START INCREMENT SAMPLES"
    if start < 1 or increment < 1 or samples < 0:
        return "--rampup-batch-size: START and INCREMENT must be >= 1 and SAMPLES >= 0"
    return None


def rampup_problem(rampup, global_batch_size: int, micro_batch_size: int, dp: int
                   ) -> Optional[str]:
    """Megatron's checks on ``--rampup-batch-size``, as one line (None when it is fine):
    every batch of the ramp must split into micro-batches over the DP ranks."""
    if not rampup:
        return None
    problem = rampup_values_problem(rampup)
    if problem:
        return problem
    start, increment, samples = (int(v) for v in rampup)
    if start > global_batch_size:
        return f"--rampup-batch-size START ({start}) is larger than --global-batch-size " \
               f"({global_batch_size})"
    if (global_batch_size - start) % increment:
        return f"--rampup-batch-size: --global-batch-size - START ({global_batch_size - start}) " \
               f"is not divisible by INCREMENT ({increment})"
    unit = micro_batch_size * dp
    checks = (("START", start), ("INCREMENT", increment)) if start < global_batch_size \
        else (("START", start),)
    for name, value in checks:
        if value % unit:
            return f"--rampup-batch-size {name} ({value}) is not divisible by " \
                   f"--micro-batch-size ({micro_batch_size}) x data-parallel size ({dp}); " \
                   "every batch of the ramp must be"
    return None
