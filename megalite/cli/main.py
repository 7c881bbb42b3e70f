"""The ``megalite`` command: ``megalite <subcommand> ...``.

Subcommands are "module:function" strings imported only when used, so ``megalite plan``
never pays for torch and another engineer adds ``megalite viz`` with one line here (or
``register("viz", "megalite.viz.cli:main")`` at import time of a plugin).
"""
from __future__ import annotations

import importlib
import sys
from typing import Dict, List, Optional

SUBCOMMANDS: Dict[str, str] = {
    "plan": "megalite.commands.plan:main",
    "viz": "megalite.viz.timeline:main",
    "hangs": "megalite.diagnostics.hang_diagnosis:main",
}
HELP = {"plan": "choose a parallel layout for a model on a cluster",
        "hangs": "say which rank a hung run waits on, from its flight-recorder dumps",
        "viz": "draw pipeline schedules (simulated) and timelines (--pipeline-timeline)"}


def register(name: str, target: str, help: str = "") -> None:
    SUBCOMMANDS[name] = target
    HELP[name] = help


def usage() -> str:
    lines = ["usage: megalite <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {HELP.get(name, '')}" for name in sorted(SUBCOMMANDS)]
    lines.append("\nrun 'megalite <command> --help' for a command's options")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"megalite: error: unknown command '{name}'; choose from "
              f"{', '.join(sorted(SUBCOMMANDS))}", file=sys.stderr)
        return 2
    module, func = SUBCOMMANDS[name].split(":")
    return getattr(importlib.import_module(module), func)(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
