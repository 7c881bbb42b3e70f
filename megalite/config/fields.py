"""``opt()``: a config field that knows its flag, its help and its valid domain.

The domain is declared beside the field, as keyword arguments of ``opt``, and read by one
checker (``megalite.config.domains``) before any process group exists, so a value outside it
is one line naming the flag instead of a ZeroDivisionError an hour into the job.  A test
(tests/unit/test_field_domains.py) walks every field and fails when a new one has no domain.

Domain keywords (all optional, combined with AND):

- ``gt`` / ``ge`` / ``lt`` / ``le``: numeric bounds.  A number, or the name of another field
  (``"lr"`` in the same section, ``"model.num_layers"`` in another), so relations such as
  ``--min-lr <= --lr`` are declarations too.  ``None`` passes unless ``required``.
- ``choices``: allowed values (also checked for values from ``--config`` YAML files, which
  argparse does not see); for list fields, allowed values of each element.
- ``requires``: ``"field"`` (must be set / true) or ``"field=value"``, checked only when this
  field is set (not None, not False, not its default).  "Only with X" rules.
- ``path``: ``"in"`` (an existing file or folder), ``"in-file"``, ``"in-dir"`` (existing),
  ``"out"`` (a file we may create: its nearest existing ancestor is a writable folder),
  ``"out-dir"`` (a folder we may create or write into).
- ``check``: a function ``(value, cfg) -> problem or None`` for a domain that is not a range
  (a blend list of weights and prefixes); the problem is one line naming the flag.
- ``free``: the reason a value has no domain beyond its type (a run name); explicit, so that
  "no domain" is never an accident.
- ``length``: the exact number of elements of a list field (``--rampup-batch-size``).

Booleans (``action="store_true"/"store_false"``) have the domain {true, false}; their YAML
values are parsed strictly.  Types come from the annotation (int, float, str, bool, list).
"""
from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Callable, Optional

DOMAIN_KEYS = ("gt", "ge", "lt", "le", "choices", "requires", "path", "check", "free", "length")
PATH_KINDS = ("in", "in-file", "in-dir", "out", "out-dir")
# What a ModelConfig field is to a checkpoint (``--use-checkpoint-args`` and the mismatch
# check, megalite/checkpointing/checkpoint_args.py): a shape flag (copied where the command
# line left it unset), an architecture switch (the checkpoint's value always wins), how the
# model was trained (the checkpoint's unless the command line gives the flag), or a run-time
# choice (never copied).  A new model field is an architecture switch unless it says so.
CHECKPOINT_ROLES = ("arch", "shape", "trained", "runtime")


def opt(default: Any = None, help: str = "", *, flag: Optional[str] = None,
        choices: Optional[list] = None, action: Optional[str] = None,
        nargs: Optional[str] = None, aliases: tuple = (), type: Optional[Callable] = None,
        gt=None, ge=None, lt=None, le=None, requires: Optional[str] = None,
        path: Optional[str] = None, check: Optional[Callable] = None,
        free: Optional[str] = None, length: Optional[int] = None,
        negation: Optional[str] = None, checkpoint: str = "arch",
        shorthand: Optional[tuple] = None):
    """A dataclass field that knows how to present itself on the command line
    (``type``: the flag's parser when the annotation alone does not say it; ``negation``: a
    boolean's ``--no-...`` flag, as Megatron spells some; ``shorthand``: (flag, value), a
    switch of Megatron's that sets this field to ``value``) and its domain (module
    docstring).  ``checkpoint``: what a model field is to a checkpoint (``CHECKPOINT_ROLES``;
    the other sections ignore it)."""
    if checkpoint not in CHECKPOINT_ROLES:
        raise ValueError(f"opt(checkpoint={checkpoint!r}): choose from {CHECKPOINT_ROLES}")
    if path is not None and path not in PATH_KINDS:
        raise ValueError(f"opt(path={path!r}): choose from {PATH_KINDS}")
    domain = {k: v for k, v in (("gt", gt), ("ge", ge), ("lt", lt), ("le", le),
                                ("choices", choices), ("requires", requires), ("path", path),
                                ("check", check), ("free", free), ("length", length))
              if v is not None}
    # argparse enforces choices on scalar command-line values; a list field's choices are
    # per element, which argparse cannot express, so they live in the domain only.
    cli_choices = choices if nargs is None else None
    meta = {"help": help, "flag": flag, "choices": cli_choices, "action": action,
            "nargs": nargs, "aliases": aliases, "type": type, "domain": domain,
            "negation": negation, "checkpoint": checkpoint, "shorthand": shorthand}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: list(default) if isinstance(default, list)
                     else dict(default), metadata=meta)
    return field(default=default, metadata=meta)


def field_flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def field_domain(f: dataclasses.Field) -> dict:
    return f.metadata.get("domain", {})


def is_bool_flag(f: dataclasses.Field) -> bool:
    return f.metadata.get("action") in ("store_true", "store_false")


def has_domain(f: dataclasses.Field) -> bool:
    """Whether the field declares what values it accepts (booleans always do)."""
    return is_bool_flag(f) or bool(field_domain(f))
