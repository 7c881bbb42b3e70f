"""Preemption, the wall clock and NaN checks: when a run must stop, and how every rank
learns it at the same iteration.

Why collective: SIGTERM (SLURM preemption, torchrun shutdown) may reach the ranks at
different moments; saving needs every rank.  So each rank notes the signal locally and the
loop decides at the end of an iteration with one tiny max-all-reduce over the world, as
Megatron's ``--exit-signal-handler`` does.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import time
import traceback
from typing import Optional

import torch
import torch.distributed as dist

from megalite import comm
from megalite.diagnostics import hang_dumps
from megalite.cli.boundary import exit_for_user_error, peer_user_error

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class ExitWatcher:
    """Notes SIGTERM/SIGUSR1 (with ``--exit-signal-handler``) and the elapsed minutes
    (``--exit-duration-in-mins``); ``should_exit()`` is a collective: all ranks agree."""

    def __init__(self, signal_handler: bool, duration_mins: Optional[float]):
        self.signal_handler, self.duration_mins = signal_handler, duration_mins
        self.start = time.monotonic()
        self.received: Optional[int] = None
        self.reason = ""
        self._previous = {}
        if signal_handler:
            for sig in EXIT_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)

    @property
    def active(self) -> bool:
        return self.signal_handler or self.duration_mins is not None

    def _note(self, signum, frame) -> None:
        self.received = signum

    def should_exit(self) -> bool:
        if not self.active:
            return False
        timed_out = self.duration_mins is not None and \
            (time.monotonic() - self.start) / 60.0 >= self.duration_mins
        flags = torch.tensor([float(self.received is not None), float(timed_out)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            comm.all_reduce(flags, comm.world_group(), op="max")
        if flags[0] > 0:
            name = signal.Signals(self.received).name if self.received else "a signal"
            self.reason = f"received {name}" if self.received else "a peer received a signal"
        elif flags[1] > 0:
            self.reason = f"--exit-duration-in-mins {self.duration_mins} reached"
        return bool(flags.any())

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def check_finite(loss: float, grad_norm: Optional[float], iteration: int, rank: int,
                 check_grad: bool) -> None:
    """Raise naming the iteration and rank when the loss (or, with
    ``--check-for-nan-in-loss-and-grad``, the gradient norm) is NaN/Inf."""
    if not math.isfinite(loss):
        raise FloatingPointError(f"rank {rank}: loss is {loss} at iteration {iteration}")
    if check_grad and grad_norm is not None and not math.isfinite(grad_norm):
        raise FloatingPointError(f"rank {rank}: gradient norm is {grad_norm} at iteration "
                                 f"{iteration}")


def abort_all_ranks(exc: BaseException) -> None:
    """Report ``exc`` with this rank's number and leave at once, so that no peer waits out
    the collective timeout for a rank that died with an error: our sockets close, every
    peer's pending collective or p2p fails within seconds, and torchrun tears down the
    rest.  First the flight recorder is written (``hang_dumps.on_failure``)."""
    echo = peer_user_error()
    if echo is not None:       # a peer's user error (printed there) broke our collective
        exit_for_user_error(echo, first=False)
    rank = dist.get_rank() if dist.is_initialized() else 0
    sys.stdout.flush()
    sys.stderr.write(f"[rank {rank}] error, ending every rank: {type(exc).__name__}: {exc}\n")
    traceback.print_exception(exc, file=sys.stderr)
    sys.stderr.flush()
    hang_dumps.on_failure(exc)     # this rank's flight recorder; the diagnosis after a CommError
    os._exit(1)
