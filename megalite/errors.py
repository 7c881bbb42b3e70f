"""User errors: one hierarchy, one line each, exit status 2.

Anything the user gave us can be wrong: flags, config files, data, checkpoints, the filesystem
under ``--save``, a signal.  Those raise a ``UserError`` subclass whose message names the flag
or file and the fix; every entry point's boundary (``megalite.cli.boundary``) prints it once and
exits 2.  Every other exception is a bug and keeps its traceback.
"""
from __future__ import annotations

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A mistake in the user's input; the message is one line naming the flag or file and
    the fix."""


class ConfigError(UserError, ValueError):
    """Flags and config files (``--config``), including layouts that do not fit the world."""


class DataError(UserError):
    """Data files and their contents (token ids, missing .bin/.idx, tokenizer files)."""


class CheckpointError(UserError):
    """A checkpoint that is missing, damaged, incomplete or does not match the run."""


class StorageError(UserError):
    """The filesystem refused a write (disk full, permissions, quota) under --save or a log
    path; what was kept is part of the message."""


class Interrupted(UserError):
    """Ctrl-C or a termination signal outside ``--exit-signal-handler``; the message says
    what was kept."""
