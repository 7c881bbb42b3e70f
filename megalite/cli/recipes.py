"""Launch recipes: a YAML file of pretrain_gpt.py settings (``--config``) plus a ``recipe:``
section that says what the file reproduces.

The ``recipe:`` section is not a set of flags.  It names the model preset whose shapes the
run uses (``model:``, the same table ``megalite plan --recipe`` reads, so shapes exist once),
the published source, and the cluster the layout was published for (``num_gpus``,
``gpus_per_node``, ``gpu``), which ``--dry-run`` uses when no world size is given.  A CPU-scale
twin says ``twin_of:`` the recipe whose parallel structure it keeps.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, fields
from typing import List, Optional, Sequence

import yaml

from megalite.config import ConfigError, ParallelDims

RECIPE_SECTION = "recipe"


@dataclass(frozen=True)
class RecipeInfo:
    path: Optional[str] = None
    model: Optional[str] = None          # model preset (megalite/cli/presets.py)
    source: str = ""                     # where the layout was published
    num_gpus: Optional[int] = None       # the published world size
    gpus_per_node: int = 8
    gpu: str = "h100-80gb"               # planner GPU preset (megalite/planner/hardware.py)
    twin_of: Optional[str] = None        # a CPU-scale twin: the recipe it scales down

    @property
    def name(self) -> str:
        return os.path.splitext(os.path.basename(self.path))[0] if self.path else "(flags)"


def load_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"--config: file '{path}' does not exist")
    wants = "--config takes a YAML file of 'setting: value' lines (e.g. launch/recipes/*.yaml)"
    try:
        with open(path, encoding="utf-8") as fh:
            raw = yaml.safe_load(fh) or {}
    except UnicodeDecodeError:
        raise ConfigError(f"--config: '{path}' is not a text file; {wants}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"--config: '{path}' is not valid YAML{where}; {wants}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config: '{path}' is not a YAML mapping; {wants}")
    return raw


def read_recipe_info(path: Optional[str]) -> RecipeInfo:
    """The ``recipe:`` section of a --config file (defaults when there is none)."""
    if not path:
        return RecipeInfo()
    section = load_yaml(path).get(RECIPE_SECTION) or {}
    if not isinstance(section, dict):
        raise ConfigError(f"--config: '{RECIPE_SECTION}:' in {path} must be a mapping")
    known = {f.name for f in fields(RecipeInfo)} - {"path"}
    bad = sorted(set(section) - known)
    if bad:
        raise ConfigError(f"--config: unknown key(s) {bad} in the '{RECIPE_SECTION}:' section "
                          f"of {path}; known: {sorted(known)}")
    return RecipeInfo(path=path, **section)


def flag_value(argv: Sequence[str], flag: str) -> Optional[str]:
    """The value of ``flag`` in ``argv`` (``--flag V`` or ``--flag=V``; the last one wins)."""
    value = None
    for i, tok in enumerate(argv):
        if tok == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif tok.startswith(flag + "="):
            value = tok.split("=", 1)[1]
    return value


def recipe_files(root: str) -> List[str]:
    """Every recipe under ``root`` (launch/recipes), twins included, sorted."""
    out = []
    for folder, _, files in os.walk(root):
        out += [os.path.join(folder, f) for f in files if f.endswith(".yaml")]
    return sorted(out)


def min_world(path: str) -> int:
    """The smallest world a recipe's layout runs on: both grids' model-parallel sizes (DP 1)."""
    flat = {}
    for key, value in load_yaml(path).items():
        if key != RECIPE_SECTION:
            flat.update(value if isinstance(value, dict) else {key: value})
    get = {str(k).replace("_", "-"): v for k, v in flat.items()}.get
    dims = ParallelDims(world=1, tp=int(get("tensor-model-parallel-size") or 1),
                        pp=int(get("pipeline-model-parallel-size") or 1),
                        cp=int(get("context-parallel-size") or 1),
                        ep=int(get("expert-model-parallel-size") or 1),
                        etp=int(get("expert-tensor-parallel-size") or 0) or None)
    return dims.world_step


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m megalite.cli.recipes min-world FILE`` (used by launch/run_local.sh)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "min-world":
        print("usage: python -m megalite.cli.recipes min-world RECIPE.yaml", file=sys.stderr)
        return 2
    print(min_world(args[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
