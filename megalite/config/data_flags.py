"""The grammar of the data flags, parsed once for their domain checks (before any process
group) and for the dataset builder: ``--data-path`` blends (weight/prefix pairs or bare
prefixes, normalized as Megatron-LM normalizes them) and ``--split`` (Megatron's
``parse_and_normalize_split``).  The index rules built on them are in
``data/megatron_indices.py``.
"""
from __future__ import annotations

import math
import re
from typing import List, Optional, Sequence, Tuple

import numpy as np

from megalite.errors import ConfigError


def normalize(weights: Sequence[float]) -> List[float]:
    """Megatron's ``utils.normalize`` (numpy sum, so the last bit matches too)."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def parse_split_numbers(split: str) -> List[float]:
    """Megatron's ``parse_and_normalize_split``: every number in the string, up to three,
    padded with zeros and normalized.  Quotes and spaces around the numbers are ignored."""
    if re.search(r"-\s*[.0-9]", str(split)):
        raise ConfigError(f"--split {split!r}: weights must be non-negative")
    numbers = [float(x) for x in re.findall(r"[.0-9]+", str(split)) if x.strip(".")]
    if not numbers or len(numbers) > 3 or sum(numbers) <= 0:
        raise ConfigError(f"--split {split!r}: expected 1-3 non-negative numbers with a positive "
                         "sum, like 969,30,1")
    return normalize(numbers + [0.0] * (3 - len(numbers)))


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def parse_data_path(data_path: Sequence[str], flag: str = "--data-path"
                    ) -> Tuple[List[float], List[str]]:
    """``["0.3", "a", "0.7", "b"]`` -> normalized weights and prefixes; bare prefixes get
    equal weights.  The one parser of a blend list: the flag's domain check (before any
    process group) and the dataset builder both call it; ValueError is one line naming
    ``flag``."""
    items = [str(i) for i in data_path]
    if not items:
        raise ConfigError(f"{flag} is empty")
    numbers = [_is_number(s) for s in items]
    if len(items) % 2 == 0 and all(numbers[0::2]) and not any(numbers[1::2]):
        weights = [float(w) for w in items[0::2]]
        prefixes = items[1::2]
    elif not any(numbers):
        weights, prefixes = [1.0] * len(items), items
    else:
        raise ConfigError(
            f"{flag} {' '.join(items)!r}: {len(items)} items, neither prefixes only nor "
            "weight/prefix pairs; give 'prefA prefB' or '0.3 prefA 0.7 prefB'")
    if not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"{flag} weights {weights} must be finite and non-negative with "
                         "a positive sum")
    total = sum(weights)
    return [w / total for w in weights], prefixes


def blend_weight_note(data_path: Sequence[str], flag: str = "--data-path") -> Optional[str]:
    """The line saying that weights which do not sum to 1 were normalized (as Megatron
    normalizes them, silently), or None."""
    if not data_path or len(data_path) < 2 or not _is_number(str(data_path[0])):
        return None
    raw = [float(w) for w in data_path[0::2]]
    if abs(sum(raw) - 1.0) <= 1e-6:
        return None
    shares = " ".join(f"{w:.4g}" for w in normalize(raw))
    return f"{flag} weights sum to {sum(raw):.4g}, not 1: normalized to {shares} " \
           "(as Megatron-LM does)"
