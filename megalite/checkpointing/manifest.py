"""Which checkpoint is complete: manifest (sizes + SHA-256 of every file), the latest
marker written last and atomically, and the fallback to the newest complete iteration.

Why: a kill, a full disk or bit rot must never leave ``--load`` resuming from half a
checkpoint.  An iteration counts only when its ``manifest.json`` exists (written after every
rank finished and a barrier) and every file it lists has the recorded size and checksum;
the marker only ever points at such an iteration.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, List, Optional, Tuple

from megalite.config.checkpoint_folders import ITERATION, MARKER, iteration_name

MANIFEST = "manifest.json"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, iteration_name(iteration))


def file_digest(path: str) -> Tuple[int, str]:
    """(size in bytes, SHA-256 hex) of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return os.path.getsize(path), h.hexdigest()


def digest_files(directory: str, names) -> Dict[str, list]:
    return {n: list(file_digest(os.path.join(directory, n))) for n in sorted(names)}


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str, text: str) -> None:
    """Write-then-rename (fsynced), so readers see the old or the new file, never half."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:             # a full disk: leave no half-written temporary behind
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(os.path.dirname(path) or ".")


def write_manifest(iter_dir: str, files: Dict[str, list], info: Optional[dict] = None) -> None:
    atomic_write(os.path.join(iter_dir, MANIFEST),
                 json.dumps({"files": files, **(info or {})}, indent=1, sort_keys=True))


def write_marker(root: str, iteration: int) -> None:
    atomic_write(os.path.join(root, MARKER), str(iteration))


def read_marker(root: str) -> Tuple[Optional[int], Optional[str]]:
    """(iteration, None) or (None, one-line problem); (None, None) when there is no marker."""
    path = os.path.join(root, MARKER)
    if not os.path.isfile(path):
        return None, None
    with open(path, "rb") as f:
        raw = f.read(64)
    try:
        return int(raw.decode().strip()), None
    except (UnicodeDecodeError, ValueError):
        return None, f"{path}: bad marker {raw[:20]!r} (not an iteration number)"


def verify_iteration(iter_dir: str) -> Optional[str]:
    """None when every file of the manifest is present and intact; else one line naming
    the first bad file."""
    path = os.path.join(iter_dir, MANIFEST)
    if not os.path.isdir(iter_dir):
        return f"{iter_dir}: missing checkpoint directory"
    if not os.path.isfile(path):
        return f"{path}: missing (the save did not complete)"
    try:
        with open(path) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{path}: unreadable manifest ({exc})"
    for name, (size, sha) in sorted(files.items()):
        fpath = os.path.join(iter_dir, name)
        if not os.path.isfile(fpath):
            return f"{fpath}: missing shard file"
        actual = os.path.getsize(fpath)
        if actual != size:
            return f"{fpath}: {actual} bytes, the manifest records {size} (truncated or extended)"
        if file_digest(fpath)[1] != sha:
            return f"{fpath}: checksum mismatch (corrupted bytes)"
    return None


def saved_iterations(root: str) -> List[int]:
    """Every ``iter_NNNNNNN`` under ``root``, newest first."""
    if not os.path.isdir(root):
        return []
    its = [int(m.group(1)) for m in map(ITERATION.match, os.listdir(root)) if m]
    return sorted(its, reverse=True)


def find_loadable(root: str) -> Tuple[Optional[int], List[str]]:
    """(newest complete iteration or None, problems found on the way, one line each).

    The marker's iteration is tried first; then every other iteration, newest first
    (a marker that is bad or points at a broken checkpoint is not trusted further)."""
    problems = []
    marked, bad = read_marker(root)
    if bad:
        problems.append(bad)
    order = ([marked] if marked is not None else []) + \
        [i for i in saved_iterations(root) if i != marked]
    for it in order:
        err = verify_iteration(iteration_dir(root, it))
        if err is None:
            return it, problems
        problems.append(err)
    return None, problems
