"""The rule engine's vocabulary (``megalite/cli/features.py`` holds the table itself): the
four kinds of rule, the "any of these features" name lists they take, the reason that quotes
the machine, and the relations between layout sizes as functions of numbers, which the
planner's search also calls.  Pure Python (no torch, no config)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

Names = Union[str, Tuple[str, ...]]      # one feature, or any of several


def any_of(names: Names) -> Tuple[str, ...]:
    return (names,) if isinstance(names, str) else tuple(names)


def _label(names: Names) -> str:
    return "|".join(any_of(names))


@dataclass(frozen=True)
class Needs:
    """``feature`` (when ``also`` is on too, if given) needs any of ``needs`` on."""
    feature: str
    needs: Names
    reason: Union[str, Callable, "QuotesEnvironment"]   # text, or cfg -> text (its values)
    also: Optional[str] = None
    dry_run: bool = True           # False: only a run is refused (hardware, kernels)

    @property
    def name(self) -> str:
        return f"{self.feature} needs {_label(self.needs)}" + \
            (f" with {self.also}" if self.also else "")

    def broken(self, cfg, on) -> bool:
        return self.feature in on and (self.also is None or self.also in on) and \
            not on & set(any_of(self.needs))


@dataclass(frozen=True)
class Excludes:
    """No feature of ``a`` combines with one of ``b``."""
    a: Names
    b: Names
    reason: str
    dry_run: bool = True

    @property
    def name(self) -> str:
        return f"{_label(self.a)} excludes {_label(self.b)}"

    def broken(self, cfg, on) -> bool:
        return bool(on & set(any_of(self.a))) and bool(on & set(any_of(self.b)))


@dataclass(frozen=True)
class Refuses:
    """``feature`` (any of) refuses a setting (``when(cfg)``), e.g. CP with attention dropout."""
    feature: Names
    setting: str
    when: Callable
    reason: Union[str, Callable]
    dry_run: bool = True

    @property
    def name(self) -> str:
        return f"{_label(self.feature)} refuses {self.setting}"

    def broken(self, cfg, on) -> bool:
        return bool(on & set(any_of(self.feature))) and bool(self.when(cfg))


@dataclass(frozen=True)
class Relation:
    """A relation between values that no feature names (heads over TP, MLA's head layout):
    ``when(cfg)`` is true when ``cfg`` breaks it.  ``layout``: a relation between layout
    sizes, so the planner's search applies it too."""
    name: str
    when: Callable
    reason: Union[str, Callable]
    layout: bool = False
    dry_run: bool = True

    def broken(self, cfg, on) -> bool:
        return bool(self.when(cfg))


Rule = Union[Needs, Excludes, Refuses, Relation]


@dataclass(frozen=True)
class QuotesEnvironment:
    """A reason that quotes what the machine offers: ``text(cfg, environment)``, where the
    reader (validation) passes backend selection's description of the machine -- the
    rules never import selection, selection never decides what combines."""
    text: Callable


# ---- relations between layout sizes, as functions of numbers (the planner's search reads them)
def heads_split(heads: int, groups: int, tp: int) -> bool:
    """Attention heads and K/V groups split over TP (each rank holds whole heads)."""
    return heads % tp == 0 and groups % tp == 0


def cp_sequence_split(seq: int, cp: int) -> bool:
    """Load-balanced CP gives each rank two chunks of the sequence."""
    return cp == 1 or seq % (2 * cp) == 0


def a2a_heads_split(heads: int, groups: int, tp: int, cp: int) -> bool:
    """All-to-all (Ulysses) CP scatters the heads of a TP rank over CP."""
    return heads % (tp * cp) == 0 and groups % (tp * cp) == 0


def schedule_fits(schedule, vpp: int) -> bool:
    """A schedule runs v > 1 model chunks per rank exactly when it has virtual stages (as
    many as it fixes, if it does: DualPipeV's 2)."""
    return schedule.virtual_stages == (vpp > 1) and \
        schedule.chunks_per_rank in (None, vpp)


def hsdp_splits(instances: int, sizes) -> bool:
    return all(size % instances == 0 for size, _ in sizes)
