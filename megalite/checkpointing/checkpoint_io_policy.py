"""What a save or load says and cleans up: one line per checkpoint written or read (time and
size, as Megatron's "saving checkpoint at iteration ..." / "successfully saved"), and one
user-error line when the filesystem or the user stops a save (full disk, quota, Ctrl-C,
SIGTERM): the partial ``iter_*`` folder removed, the marker untouched, and the newest
complete checkpoint named.  The checkpointer's I/O policy, apart from what it writes.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import threading
import time
from typing import Optional

from megalite.checkpointing import manifest as mf
from megalite.errors import Interrupted, StorageError

# errno values that mean "the filesystem refused the write", not a bug
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES,
                   errno.EPERM, errno.EIO}
# what torch's C++ writer says when the disk fills under it (the errno is lost there)
_STORAGE_WORDS = ("No space left on device", "unexpected pos", "Disk quota exceeded",
                  "file write failed")


_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\] ([^\n'\"]+)")


def storage_cause(exc: BaseException) -> Optional[str]:
    """The filesystem's refusal behind ``exc`` as a short phrase, searching its cause chain
    and the tracebacks DCP gathered from other ranks (pickled across ranks, their exceptions
    lose the OSError behind torch's "unexpected pos"); None when it is not one (a bug)."""
    seen, todo, texts = set(), [exc], []
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS:
            return f"{e.strerror or os.strerror(e.errno)} (errno {e.errno})"
        texts.append(str(e))
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)       # DCP's CheckpointException
        if isinstance(failures, dict):
            for wrapped in failures.values():
                if isinstance(wrapped, tuple) and wrapped:
                    todo.append(wrapped[0])
                    texts += [str(part) for part in wrapped[1:]]
    for text in texts:
        for number, words in _ERRNO_TEXT.findall(text):
            if int(number) in _STORAGE_ERRNOS:
                return f"{words.strip()} (errno {number})"
    for text in texts:
        if any(w in text for w in _STORAGE_WORDS):
            return "No space left on device" if "No space" in text or "unexpected pos" in text \
                else text.strip().splitlines()[0][:120]
    return None


def newest_complete(root: Optional[str]) -> str:
    """'<dir>' of the newest complete checkpoint (the marker moves only after one is
    whole), or a phrase saying there is none."""
    if not root:
        return "none (no --save)"
    it, _ = mf.read_marker(root)
    if it is not None and os.path.isfile(os.path.join(mf.iteration_dir(root, it), mf.MANIFEST)):
        return mf.iteration_dir(root, it)
    return f"none in {root}"


def remove_partial(root: str, iteration: int) -> bool:
    """Delete ``iter_<iteration>`` unless it is complete and marked (rank 0 only)."""
    it_dir = mf.iteration_dir(root, iteration)
    marked = mf.read_marker(root)[0] == iteration
    if not os.path.isdir(it_dir) or (marked and os.path.isfile(os.path.join(it_dir, mf.MANIFEST))):
        return False
    shutil.rmtree(it_dir, ignore_errors=True)
    return not os.path.exists(it_dir)


def cleanup_phrase(root: str, iteration: int, rank: int) -> str:
    """Rank 0 removes the partial folder and says so; the others say who does."""
    if rank != 0:
        return "the partial folder is removed by rank 0"
    removed = remove_partial(root, iteration)
    return ("removed the partial folder " if removed else "could not remove the partial folder ") \
        + mf.iteration_dir(root, iteration)


def save_failed(root: str, iteration: int, cause: str, where: str, detail: str = ""
                ) -> StorageError:
    """``detail``: the failure's own text, where DCP names the rank(s) that failed (a
    node-local disk)."""
    ranks = re.search(r"failed on rank\(s\) (\[[^\]]*\])", detail)
    on = f" on rank(s) {ranks.group(1)}" if ranks else ""
    return StorageError(f"--save: writing the checkpoint of iteration {iteration} to {root} "
                        f"failed{on}: {cause}; {where}; newest complete checkpoint: "
                        f"{newest_complete(root)}; free space or point --save elsewhere")


def save_interrupted(root: str, iteration: int, rank: int, what: str) -> Interrupted:
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # a second Ctrl-C must not cut cleanup
    where = cleanup_phrase(root, iteration, rank)
    return Interrupted(f"interrupted by {what} while saving iteration {iteration}: {where}; "
                       f"newest complete checkpoint: {newest_complete(root)}")


class _Terminated(KeyboardInterrupt):
    """SIGTERM during a save, raised where the save is so that its cleanup runs."""


@contextlib.contextmanager
def interruptible_save():
    """During a synchronous save on the main thread, SIGTERM (torchrun tearing down, SLURM
    cancelling without --exit-signal-handler) interrupts like Ctrl-C instead of killing the
    process in the middle of a file; a handler someone installed is left alone."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    if previous is not signal.SIG_DFL:
        yield
        return

    def _raise(signum, frame):
        raise _Terminated()
    signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def interruption_name(exc: KeyboardInterrupt) -> str:
    return "SIGTERM" if isinstance(exc, _Terminated) else "Ctrl-C"


def checkpoint_bytes(it_dir: str) -> int:
    """Size on disk of a complete checkpoint, from its manifest (no directory walk)."""
    try:
        with open(os.path.join(it_dir, mf.MANIFEST)) as f:
            files = json.load(f)["files"]
        return sum(int(size) for size, _ in files.values())
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def describe_size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def saved_line(iteration: int, it_dir: str, started: float) -> str:
    return (f"> saved checkpoint at iteration {iteration} to {it_dir} in "
            f"{time.perf_counter() - started:.2f} s ({describe_size(checkpoint_bytes(it_dir))})")


def loaded_line(iteration: int, it_dir: str, started: float) -> str:
    return (f"> loaded checkpoint {it_dir} (iteration {iteration}) in "
            f"{time.perf_counter() - started:.2f} s ({describe_size(checkpoint_bytes(it_dir))})")
