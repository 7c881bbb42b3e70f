"""The run's first user error, shared through the job's store.

When one rank stops on a user error, exactly one rank must print it and every other rank
must leave at once, even one blocked in a collective with the failed rank.  This goes
through the job's TCP store rather than a process group (a collective cannot reach a rank
that is stuck in another one), so it needs none of the collectives' wrapping in
``megalite.comm`` and lives apart from them; ``megalite.comm`` re-exports it
(``comm.publish_user_error`` and the rest).
"""
from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

FIRST_USER_ERROR_KEY = "first_user_error"
RUN_ENDED = "\x00run ended normally"    # the key's value when no user error ended the run
WATCHERS_DONE_KEY = "user_error_watchers_done"
_published_here = False
_control = None
_watcher: Optional[threading.Thread] = None


def _control_store():
    """A client of the job's store (torchrun's, or rank 0's under
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) for megalite's own keys, one namespace per
    restart attempt; None outside a multi-process job."""
    global _control
    if _control is None and dist.is_initialized() and dist.get_world_size() > 1 and \
            "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
        client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                               is_master=False, timeout=timedelta(seconds=30),
                               wait_for_workers=False)
        _control = dist.PrefixStore(f"megalite/control/attempt_{attempt}", client)
    return _control


def publish_user_error(line: str) -> bool:
    """Record ``line`` as the run's first user error; True when it was first, so exactly one
    rank prints it.  The other ranks' watchers (``watch_user_errors``) see it and leave."""
    global _published_here
    _published_here = True
    try:
        store = _control_store()
        if store is None:
            return True
        stored = store.compare_set(FIRST_USER_ERROR_KEY, "", line)
    except (RuntimeError, dist.DistError, OSError):  # store unreachable: say it here
        return True
    return (stored.decode() if isinstance(stored, bytes) else stored) == line


def published_user_error() -> Optional[str]:
    """The user error some rank published, if any (None when the store is gone)."""
    try:
        store = _control_store()
        if store is None or not store.check([FIRST_USER_ERROR_KEY]):
            return None
        value = store.get(FIRST_USER_ERROR_KEY)
    except (RuntimeError, dist.DistError, OSError):
        return None
    return value.decode() if isinstance(value, bytes) else value


def watch_user_errors(on_error) -> None:
    """A daemon thread that waits (server-side, no polling) for another rank's published
    user error and calls ``on_error(line)``: a rank stuck in any collective or p2p op with
    the failed rank leaves at once, whoever hosts the store."""
    if _control_store() is None:
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    waiter = dist.PrefixStore(f"megalite/control/attempt_{attempt}", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timedelta(days=365), wait_for_workers=False))

    def _wait() -> None:
        try:
            waiter.wait([FIRST_USER_ERROR_KEY])
            value = waiter.get(FIRST_USER_ERROR_KEY)
            line = value.decode() if isinstance(value, bytes) else value
            if line == RUN_ENDED:
                waiter.add(WATCHERS_DONE_KEY, 1)
                return
        except (RuntimeError, dist.DistError, OSError):
            return                     # the store went away: the job is ending anyway
        if not _published_here:
            on_error(line)
    global _watcher
    _watcher = threading.Thread(target=_wait, daemon=True, name="megalite-user-error-watch")
    _watcher.start()


def stop_watching_user_errors(timeout_s: float = 10.0) -> None:
    """At the normal end of a run (after the final barrier): wake every rank's watcher with
    ``RUN_ENDED`` and let it return; rank 0, which may host the store, leaves only when all
    have.  A watcher still blocked in the store when its process exits would see the store
    vanish during interpreter shutdown, and the process would abort ("terminate called
    without an active exception", status -6): a finished run reported as a failure."""
    global _watcher
    store = _control_store()
    if _watcher is None or store is None:
        return
    try:
        store.compare_set(FIRST_USER_ERROR_KEY, "", RUN_ENDED)   # a user error stays first
        _watcher.join(timeout_s)
        if dist.get_rank() == 0:
            deadline = time.monotonic() + timeout_s
            while store.add(WATCHERS_DONE_KEY, 0) < dist.get_world_size() and \
                    time.monotonic() < deadline:
                time.sleep(0.02)
    except (RuntimeError, dist.DistError, OSError):
        pass
    _watcher = None
