"""The global batch size of each iteration: constant, Megatron's ``--rampup-batch-size`` or
its ``--step-batch-size-schedule``.

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

``--step-batch-size-schedule "0:16 2.4B:320 4.8B:624"`` (Megatron-LM's replacement for the
ramp, its ``StepBatchsizeNumMicroBatchesCalculator``): THRESHOLD:BATCH pairs, either number
with a K/M/B/T suffix (10^3 .. 10^12, ``int(float(x) * suffix)``), separated by spaces or
commas (one quoted word or several, as a bash array expands it).  Megatron's training passes
the sequence length, so a threshold counts *tokens* and becomes ``tokens // seq_length``
samples (``seq_length=None``: samples, as its calculator also allows).  The batch of an
iteration is the one of the last threshold <= the samples consumed before it; the first
threshold must be 0 and they must grow strictly.  The last batch is the run's
``--global-batch-size`` (Megatron refuses that flag beside the schedule, yet its GPT-3
example passes both: megalite accepts it when it equals the last batch), so the lr schedule
of a ``--train-iters`` run counts ``iterations x`` that batch, as Megatron's does.  With
``--train-samples`` the iterations follow Megatron's ``update_train_iters``: batches are
counted while fewer than ``--train-samples`` samples are consumed (the last one may end
past it).
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Tuple

SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}
STEP_FLAG = "--step-batch-size-schedule"


class BatchSizeSchedule:
    """``global_batch_size_at(consumed_samples)`` and the micro-batches it takes
    (``steps``: the parsed step schedule, (threshold in samples, batch) pairs)."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, dp_size: int,
                 rampup: Optional[Tuple[int, int, int]] = None,
                 steps: Optional[Sequence[Tuple[int, int]]] = None):
        self.global_batch_size = int(global_batch_size)
        self.micro_times_dp = int(micro_batch_size) * int(dp_size)
        self.rampup = None
        self.steps = [(int(t), int(b)) for t, b in steps] if steps else None
        if rampup:
            start, increment, samples = (int(v) for v in rampup)
            n = (self.global_batch_size - start) // increment
            # START == --global-batch-size: nothing to ramp (Megatron divides by zero)
            self.rampup = (start, increment, samples, samples / n if n else None)

    @classmethod
    def of_run(cls, training, dp_size: int, seq_length: Optional[int]) -> "BatchSizeSchedule":
        """The schedule a run's ``TrainingConfig`` gives (the one place that reads its
        batch-size flags)."""
        t = training
        steps = parse_step_schedule(t.step_batch_size_schedule, seq_length) \
            if t.step_batch_size_schedule else None
        gbs = t.global_batch_size or (steps[-1][1] if steps else t.micro_batch_size)
        return cls(gbs, t.micro_batch_size, dp_size, t.rampup_batch_size, steps)

    @property
    def varies(self) -> bool:
        """Whether the batch changes during the run (then the metrics file logs it)."""
        return self.rampup is not None or self.steps is not None

    def global_batch_size_at(self, consumed_samples: int) -> int:
        if self.steps is not None:
            batch = self.steps[0][1]
            for threshold, size in self.steps:
                if consumed_samples < threshold:
                    break
                batch = size
            return batch
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
        dropped.  A step schedule: Megatron counts batches while fewer than
        ``train_samples`` are consumed."""
        if self.steps is not None:
            iterations = consumed = 0
            while consumed < train_samples:
                consumed += self.global_batch_size_at(consumed)
                iterations += 1
            return iterations
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


    def samples_in(self, iterations: int) -> int:
        """The samples the first ``iterations`` iterations consume."""
        batches = self.batch_sizes()
        return sum(next(batches) for _ in range(iterations))


def parse_count(text: str) -> int:
    """A number with an optional K/M/B/T suffix, as Megatron parses it (``2.4B``)."""
    text = str(text).strip().upper()
    multiplier = SUFFIXES.get(text[-1:], 1)
    if multiplier > 1:
        text = text[:-1]
    return int(float(text) * multiplier)


def _entries(schedule) -> List[str]:
    """The THRESHOLD:BATCH words of the flag's values (spaces or commas between them)."""
    return " ".join(str(v) for v in schedule).replace(",", " ").split()


def parse_step_schedule(schedule, seq_length: Optional[int]) -> List[Tuple[int, int]]:
    """(threshold in samples, batch) pairs sorted by threshold; thresholds count tokens when
    ``seq_length`` is given.  Raises ValueError (one line) on a malformed entry."""
    steps = []
    for entry in _entries(schedule):
        threshold, sep, batch = entry.partition(":")
        try:
            if not sep:
                raise ValueError(entry)
            pair = (parse_count(threshold), parse_count(batch))
        except (ValueError, OverflowError):
            raise ValueError(f"{STEP_FLAG}: {entry!r} is not THRESHOLD:BATCH (numbers, "
                             "optionally with a K/M/B/T suffix: 2.4B:320)") from None
        steps.append((pair[0] // seq_length if seq_length else pair[0], pair[1]))
    return sorted(steps)


def step_schedule_problem(schedule, seq_length: Optional[int]) -> Optional[str]:
    """The flag's own domain, Megatron's checks: entries parse, the first threshold is 0,
    thresholds grow strictly (after tokens become samples), every batch is >= 1."""
    if not schedule:
        return None
    try:
        steps = parse_step_schedule(schedule, seq_length)
    except ValueError as exc:
        return str(exc)
    if not steps:
        return f"{STEP_FLAG}: give at least one THRESHOLD:BATCH pair (0:16 2.4B:320)"
    unit = f"samples (tokens // --seq-length {seq_length})" if seq_length else "samples"
    if steps[0][0] != 0:
        return f"{STEP_FLAG}: the first threshold must be 0 (the batch the run starts with)"
    for (before, _), (after, _) in zip(steps, steps[1:]):
        if after <= before:
            return f"{STEP_FLAG}: thresholds must grow strictly; two of them are both " \
                   f"{after} {unit}"
    small = next((b for _, b in steps if b < 1), None)
    if small is not None:
        return f"{STEP_FLAG}: every batch must be >= 1, got {small}"
    return None


def step_schedule_batch_problem(schedule, seq_length: Optional[int],
                                global_batch_size: Optional[int], micro_batch_size: int,
                                dp: int) -> Optional[str]:
    """The schedule against the run: its last batch is the run's global batch, and every
    batch splits into micro-batches over the DP ranks (Megatron checks the current one)."""
    if not schedule:
        return None
    problem = step_schedule_problem(schedule, seq_length)
    if problem:
        return problem
    steps = parse_step_schedule(schedule, seq_length)
    last = steps[-1][1]
    if global_batch_size is not None and global_batch_size != last:
        return f"--global-batch-size ({global_batch_size}) differs from the last batch of " \
               f"{STEP_FLAG} ({last}); drop --global-batch-size (the schedule sets it)"
    unit = micro_batch_size * dp
    for _, batch in steps:
        if batch % unit:
            return f"{STEP_FLAG}: batch {batch} is not divisible by --micro-batch-size " \
                   f"({micro_batch_size}) x data-parallel size ({dp}); every batch of the " \
                   "schedule must be"
    return None


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
