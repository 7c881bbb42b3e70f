"""The error boundary of every entry point: a user error is one line, exit status 2, once.

``run_cli(main, argv, prog)`` wraps pretrain_gpt.py / pretrain_moe.py, tools/checkpoint/
convert.py, tools/preprocess_data.py, ``megalite plan|viz|...`` and ``python -m
megalite.generate``.  What it does with an exception:

- a ``UserError`` (megalite/errors.py): ``<prog>: error: <message>`` on stderr, exit status 2.
  Printed once: before any process group by rank 0 only (every rank computes the same
  verdict); after, by the first rank to publish it in the process group's store.  Ranks whose
  collectives then break because that rank left find the published line and exit 2 quietly.
  Under torchrun every rank also writes the line to its error file
  (``TORCHELASTIC_ERROR_FILE``, the file torch's ``errors.record`` writes), so the launcher's
  failure summary names it as the root cause instead of a worker traceback.
- Ctrl-C: ``Interrupted``, the same way.
- a closed stdout pipe (``convert.py ... | head -1``): a quiet exit, status 141 (128 +
  SIGPIPE, what a shell shows for a Unix tool ended by the pipe).
- anything else is a bug: the traceback stays (torchrun's error file gets it too).

``MEGALITE_DEBUG=1`` prints the traceback of user errors as well.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

from megalite.errors import EXIT_USER_ERROR, Interrupted, UserError


def debug() -> bool:
    return os.environ.get("MEGALITE_DEBUG", "") not in ("", "0")


def _in_process_group() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized()
                and dist.get_world_size() > 1)


def _launcher_rank() -> int:
    for var in ("RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def write_elastic_error_file(line: str) -> None:
    """torchelastic's error-file format (what ``errors.record`` writes), with our one line as
    both message and call stack: the launcher prints the call stack as the root cause."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                       "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as fh:
            json.dump(data, fh)
    except OSError:
        pass


def _record_bug(exc: BaseException) -> None:
    """A bug under torchrun: its traceback goes to the error file (``errors.record``)."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        # start-up time: the boundary also runs `megalite plan`, which never imports torch
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        try:
            get_error_handler().record_exception(exc)
        except Exception:  # noqa: BLE001  (never mask the bug itself)
            pass


def exit_for_user_error(line: str, *, first: bool) -> None:
    """Print ``line`` if ``first``, record it for the launcher, and leave with status 2.

    Inside a process group ``os._exit``: a clean interpreter exit would wait for peers in
    the process group's destructor, and the peers learn of the failure from the closed
    sockets (then ``published_user_error``)."""
    if first:
        sys.stdout.flush()
        print(line, file=sys.stderr, flush=True)
    write_elastic_error_file(line)
    if _in_process_group():
        sys.stdout.flush()
        sys.stderr.flush()
        if first:
            _linger_for_peers()
        os._exit(EXIT_USER_ERROR)
    sys.exit(EXIT_USER_ERROR)


PEER_LINGER_SECONDS = 10.0


def _linger_for_peers() -> None:
    """The rank that published the error may host the store its peers read it from
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, srun without torchrun): it stays until their
    watchers have seen the line and left -- the launcher then stops it, quietly with status
    2 -- or for ``PEER_LINGER_SECONDS`` at most."""
    def _quiet(signum, frame):
        os._exit(EXIT_USER_ERROR)
    try:
        signal.signal(signal.SIGTERM, _quiet)
    except ValueError:
        return
    time.sleep(PEER_LINGER_SECONDS)


def leave_for_peer_error(line: str) -> None:
    """Another rank published a user error (it printed it): record it and leave quietly,
    wherever this rank's main thread is blocked.  Called by the store watcher."""
    write_elastic_error_file(line)
    sys.stdout.flush()
    sys.stderr.flush()
    if _hosts_the_store():
        time.sleep(STORE_HOST_GRACE_SECONDS)
    os._exit(EXIT_USER_ERROR)


STORE_HOST_GRACE_SECONDS = 1.0


def _hosts_the_store() -> bool:
    """Rank 0 hosts the store itself when the launcher does not share its own
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: megalite.elastic.launch, the sbatch script).
    Leaving on a peer's error, it waits a moment so that the peer's watcher, which has just
    seen the line, reads it before the store vanishes (c10d prints a C++ stack otherwise)."""
    return _launcher_rank() == 0 and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1"


def report_user_error(exc: BaseException, prog: str) -> None:
    """The boundary's handling of one user error (module docstring); never returns."""
    line = f"{prog}: error: {exc}"
    if debug():
        traceback.print_exception(exc, file=sys.stderr)
    if _in_process_group():
        # start-up time: the boundary also runs `megalite plan`, which never imports torch
        from megalite import comm

        if _launcher_rank() != 0:   # several ranks failing alike: let rank 0's words be printed
            time.sleep(0.3)
        first = comm.publish_user_error(line)
    elif _launcher_rank() != 0:
        _wait_for_rank0(line)
        first = True       # rank 0 did not end this job: its verdict differs, say ours
    else:
        first = True
    exit_for_user_error(line, first=first)


RANK0_GRACE_SECONDS = 5.0


def _wait_for_rank0(line: str) -> None:
    """Before any process group, every rank reaches the same verdict and rank 0 prints it.
    The others wait, so that they do not end the job (torchrun stops every worker when one
    exits) before rank 0 has said it; the launcher's SIGTERM then ends them quietly with
    status 2.  A rank whose verdict rank 0 does not share speaks for itself after the grace."""
    write_elastic_error_file(line)

    def _quiet(signum, frame):
        os._exit(EXIT_USER_ERROR)
    try:
        signal.signal(signal.SIGTERM, _quiet)
    except ValueError:          # not the main thread: nothing to wait for
        return
    time.sleep(RANK0_GRACE_SECONDS)


def peer_user_error():
    """The user error another rank published (a failing collective here is its echo)."""
    if not _in_process_group():
        return None
    # start-up time: the boundary also runs `megalite plan`, which never imports torch
    from megalite import comm

    return comm.published_user_error()


EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE     # what a shell reports for a tool SIGPIPE ended


def leave_for_closed_pipe() -> int:
    """The reader of our stdout went away (``| head -1``): stop quietly, as Unix tools do.
    stdout is pointed at /dev/null first, so the interpreter's final flush has nowhere to
    fail (Python's documented way; SIGPIPE's default action would also end the process on
    a peer's closed socket)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_BROKEN_PIPE


def run_cli(main, argv=None, prog: str = "megalite"):
    """Run ``main(argv)`` behind the boundary; returns its exit status."""
    try:
        status = main(argv)
        sys.stdout.flush()       # a closed pipe shows here, inside the boundary
        return status
    except BrokenPipeError:
        return leave_for_closed_pipe()
    except UserError as exc:
        report_user_error(exc, prog)
    except KeyboardInterrupt:
        report_user_error(Interrupted("interrupted by Ctrl-C"), prog)
    except SystemExit:
        raise
    except BaseException as exc:
        echo = peer_user_error()
        if echo is not None:           # another rank's user error broke our collective
            exit_for_user_error(echo, first=False)
        _record_bug(exc)
        raise
