"""The one checker of field domains: reads what ``opt(...)`` declared beside each field.

``check_domains(cfg)`` runs first in validation, before any process group, and raises one
``ConfigError`` line naming the flag.  ``invalid_examples`` turns a declaration into values
outside it, so the test that walks every field needs no second list of ranges.  The
``*_problem`` functions are the domains that are not ranges; each carries ``invalid``
examples for that walk.  Pure Python (no torch); arguments and validation call it.
"""
from __future__ import annotations

import math
import os
import re
from typing import Any, List, Optional

from megalite.config import all_fields, find_field
from megalite.config.fields import field_domain, field_flag, is_bool_flag
from megalite.errors import ConfigError

_OPS = {"gt": (">", lambda v, b: v > b), "ge": (">=", lambda v, b: v >= b),
        "lt": ("<", lambda v, b: v < b), "le": ("<=", lambda v, b: v <= b)}
_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "list": "a list",
               "bool": "true or false"}


# ---- the checker ----------------------------------------------------------------------
def base_type(f) -> Optional[str]:
    """'int' | 'float' | 'str' | 'bool' | 'list' from the annotation, None for unions."""
    t = str(f.type).replace("typing.", "")
    if "Union" in t:
        return None
    for name in ("bool", "int", "float", "str", "list"):
        if re.search(rf"\b{name}\b", t):
            return name
    return None


def _type_problem(kind: Optional[str], value) -> bool:
    if kind is None:
        return False
    if kind == "bool":
        return not isinstance(value, bool)
    if kind == "int":
        return isinstance(value, bool) or not isinstance(value, int)
    if kind == "float":
        return isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value)
    if kind == "str":
        return not isinstance(value, str)
    return not isinstance(value, list)


def _show(value) -> str:
    if isinstance(value, list):
        return " ".join(map(str, value))
    return repr(value) if isinstance(value, str) else str(value)


def _bound_words(key: str, shown: str, kind: Optional[str]) -> str:
    noun = " integer" if kind == "int" else " number"
    if shown == "0" and key in ("gt", "ge"):
        return ("a positive" if key == "gt" else "a non-negative") + noun
    return f"{_OPS[key][0]} {shown}"


def _lookup(cfg, ref: str, section: str):
    """(flag, value) of the field ``ref`` names, relative to ``section``."""
    sec, f = find_field(ref, section)
    return field_flag(f), getattr(getattr(cfg, sec), f.name)


def _is_set(value, default) -> bool:
    return value is not None and value is not False and value != [] and value != default


def _requirement_problem(cfg, section: str, flag: str, condition: str) -> Optional[str]:
    ref, _, want = condition.partition("=")
    other_flag, other = _lookup(cfg, ref, section)
    if want:
        if str(other) != want:
            return f"{flag} needs {other_flag} {want} (got {_show(other)})"
    elif other in (None, False, [], ""):
        return f"{flag} needs {other_flag}"
    return None


def _path_problem(flag: str, kind: str, value: str) -> Optional[str]:
    if kind.startswith("in"):
        if not os.path.exists(value):
            return f"{flag}: '{value}' does not exist"
        if kind == "in-file" and not os.path.isfile(value):
            return f"{flag}: '{value}' is not a file"
        if kind == "in-dir" and not os.path.isdir(value):
            return f"{flag}: '{value}' is not a folder"
        return None
    if kind == "out-dir" and os.path.exists(value) and not os.path.isdir(value):
        return f"{flag}: '{value}' exists and is not a folder; choose a folder path"
    if kind == "out" and os.path.isdir(value):
        return f"{flag}: '{value}' is a folder; give a file path"
    ancestor = os.path.dirname(os.path.abspath(value)) if kind == "out" else \
        os.path.abspath(value)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor) or not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{flag}: cannot create '{value}': '{ancestor}' is not a writable folder; " \
               "choose another path"
    return None


def field_problem(cfg, section: str, f, value) -> Optional[str]:
    """The one line saying why ``value`` is outside field ``f``'s domain (None if inside)."""
    flag, dom = field_flag(f), field_domain(f)
    kind = "bool" if is_bool_flag(f) else base_type(f)
    if value is None:
        return None        # unset: requiredness is a relation checked where it matters
    if _type_problem(kind, value):
        return f"{flag} must be {_TYPE_WORDS[kind]}, got {_show(value)}"
    choices = dom.get("choices")
    if choices is not None:
        bad = [v for v in (value if kind == "list" else [value]) if v not in choices]
        if bad:
            return f"{flag}: {_show(bad[0])} is not one of {', '.join(map(str, choices))}"
    if "length" in dom and len(value) != dom["length"]:
        return f"{flag} takes {dom['length']} values, got {len(value)} ({_show(value)})"
    for key, (_, holds) in _OPS.items():
        if key not in dom:
            continue
        bound, shown = dom[key], str(dom[key])
        if isinstance(bound, str):
            other_flag, bound = _lookup(cfg, bound, section)
            if bound is None:
                continue
            shown = f"{other_flag} ({bound})"
        if not holds(value, bound):
            return f"{flag} must be {_bound_words(key, shown, kind)}, got {_show(value)}"
    if "path" in dom:
        problem = _path_problem(flag, dom["path"], value)
        if problem:
            return problem
    if "check" in dom:
        return dom["check"](value, cfg)
    return None


def requirements(f) -> List[str]:
    """The conditions field ``f`` is declared to need (``requires=``): ``"field"`` or
    ``"field=value"``."""
    requires = field_domain(f).get("requires")
    return [] if not requires else [requires] if isinstance(requires, str) else list(requires)


def requirement_problem(cfg, section: str, f, value=None) -> Optional[str]:
    """The one line saying that field ``f``, set (to ``value``, default its value in
    ``cfg``), lacks a flag it is declared to need, or None.  The declaration sits beside the
    field; the rule engine (megalite/cli/features.py) checks it with its other rules."""
    value = getattr(getattr(cfg, section), f.name) if value is None else value
    if not _is_set(value, f.default):
        return None
    for condition in requirements(f):
        problem = _requirement_problem(cfg, section, field_flag(f), condition)
        if problem:
            return problem
    return None


def check_domains(cfg) -> None:
    """Every field of ``cfg`` against its declared domain; the first violation is one line."""
    for section, f in all_fields():
        problem = field_problem(cfg, section, f, getattr(getattr(cfg, section), f.name))
        if problem:
            raise ConfigError(problem)


# ---- values outside a domain (for the walk) ---------------------------------------------
def invalid_examples(cfg, section: str, f) -> List[Any]:
    """Values outside field ``f``'s domain, given the other fields of ``cfg``."""
    dom, kind = field_domain(f), ("bool" if is_bool_flag(f) else base_type(f))
    out: List[Any] = []
    wrong_type = {"bool": "maybe", "int": 2.5, "float": "many", "str": 7, "list": 7}
    if kind in wrong_type:
        out.append(wrong_type[kind])
    if dom.get("choices") is not None:
        out.append(["no-such-choice"] if kind == "list" else "no-such-choice")
    if "length" in dom:
        out.append(["1"] * (dom["length"] + 1))
    for key in ("gt", "ge", "lt", "le"):
        if key not in dom:
            continue
        bound = dom[key]
        if isinstance(bound, str):
            bound = _lookup(cfg, bound, section)[1]
            if bound is None:
                continue
        step = 1 if kind == "int" else max(abs(bound) * 0.5, 0.5)
        out.append(bound if key in ("gt", "lt") else
                   (bound - step if key == "ge" else bound + step))
    if "path" in dom:
        out.append("/nonexistent-megalite-walk/x" if dom["path"].startswith("in")
                   else "/proc/version/megalite-walk")
    if "check" in dom:
        out.extend(getattr(dom["check"], "invalid", []))
    return out
