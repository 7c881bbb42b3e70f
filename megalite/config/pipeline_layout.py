"""Megatron-LM's ``--pipeline-model-parallel-layout``: a string that says which layers each
pipeline stage holds, e.g. ``"Et|(tt|)*3,m|L"``.

``E`` is the embedding, ``t`` a transformer layer, ``m`` a multi-token-prediction depth and
``L`` the output layer and loss; ``|`` ends a stage; ``(...)*n`` and ``x*n`` repeat; commas
are cosmetic.  The stages are listed in the order a micro-batch visits them (virtual stage v
of pipeline rank r is stage ``v * PP + r``, or its place along the V for DualPipeV), so the
stage count is PP x VPP and fixes VPP.

megalite places the embedding on the first stage, the output layer, loss and MTP modules on
the last, so those letters must sit there; what the string adds over the even split is the
transformer-layer count of every stage (an empty stage is allowed).  This module is the one
reader of the string: the runtime split (pipeline_parallel/split.py), the flag checks and
the planner all take the per-stage counts from ``parse_layout``.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Optional, Tuple

from megalite.errors import ConfigError

FLAG = "--pipeline-model-parallel-layout"
LETTERS = {"E": "embedding", "t": "transformer layer", "m": "MTP depth", "L": "loss"}
_GROUP = re.compile(r"\(([^()]*)\)\*(\d+)")
_SINGLE = re.compile(r"(.)\*(\d+)")


@dataclass(frozen=True)
class PipelineLayout:
    """The parsed string: the letters of every stage, in visiting order."""
    text: str
    stages: Tuple[str, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def layer_counts(self) -> Tuple[int, ...]:
        """Transformer layers per stage, in visiting order."""
        return tuple(s.count("t") for s in self.stages)

    def count(self, letter: str) -> int:
        return sum(s.count(letter) for s in self.stages)


def _expand(text: str) -> str:
    s = text.replace(",", "").replace(" ", "")
    while True:                       # innermost groups first, so groups may nest
        expanded = _GROUP.sub(lambda g: g.group(1) * int(g.group(2)), s)
        if expanded == s:
            break
        s = expanded
    return _SINGLE.sub(lambda g: g.group(1) * int(g.group(2)), s)


@functools.lru_cache(maxsize=256)
def parse_layout(text: str, pp: int, num_layers: int,
                 mtp_layers: int = 0) -> PipelineLayout:
    """Parse and check ``text`` for ``pp`` pipeline ranks and ``num_layers`` transformer
    layers; every mistake is a ``ConfigError`` naming the flag and what to change."""
    s = _expand(text)
    bad = sorted(set(s) - set(LETTERS) - {"|"})
    if bad:
        raise ConfigError(f"{FLAG} {text!r}: unknown character(s) {''.join(bad)!r}; use E "
                          "(embedding), t (transformer layer), m (MTP), L (loss), '|' between "
                          "stages and (...)*N to repeat")
    layout = PipelineLayout(text, tuple(s.split("|")))
    n = layout.num_stages
    if n % pp:
        raise ConfigError(f"{FLAG} {text!r} has {n} stages, not a multiple of "
                          f"--pipeline-model-parallel-size ({pp}); give PP x VPP stages")
    if layout.count("t") != num_layers:
        raise ConfigError(f"{FLAG} {text!r} places {layout.count('t')} transformer layers "
                          f"('t'), but --num-layers is {num_layers}")
    for letter, stage, where in (("E", 0, "first"), ("L", n - 1, "last")):
        if layout.count(letter) != 1 or letter not in layout.stages[stage]:
            raise ConfigError(f"{FLAG} {text!r}: '{letter}' ({LETTERS[letter]}) must appear "
                              f"once, in the {where} stage (megalite places it there)")
    if not layout.stages[0].startswith("E") or not layout.stages[-1].endswith("L"):
        raise ConfigError(f"{FLAG} {text!r}: the first stage must begin with 'E' and the last "
                          "end with 'L'")
    if layout.count("m") not in (0, mtp_layers):
        raise ConfigError(f"{FLAG} {text!r} has {layout.count('m')} MTP depths ('m'), but "
                          f"--mtp-num-layers is {mtp_layers}; give all of them or none")
    if layout.count("m") and layout.stages[-1].count("m") != layout.count("m"):
        raise ConfigError(f"{FLAG} {text!r}: the MTP depths ('m') must all be in the last "
                          "stage, beside the loss (megalite runs them there)")
    if any("m" in st and "t" in st[st.index("m"):] for st in layout.stages):
        raise ConfigError(f"{FLAG} {text!r}: transformer layers must come before the MTP "
                          "depths")
    return layout


def layout_problem(text: str, pp: int, num_layers: Optional[int],
                   mtp_layers: int = 0) -> Optional[str]:
    """``parse_layout``'s refusal as a message (None: the string is good); without a layer
    count yet, only its letters and stage count are judged."""
    try:
        if num_layers is None:
            num_layers = _expand(text).count("t")
        parse_layout(text, pp, num_layers, mtp_layers)
    except ConfigError as e:
        return str(e)
    return None


def virtual_stages_of(text: Optional[str], pp: int) -> Optional[int]:
    """VPP a layout string fixes (None without one); its stage count divided by PP."""
    if not text:
        return None
    return max(1, len(_expand(text).split("|")) // max(1, pp))
