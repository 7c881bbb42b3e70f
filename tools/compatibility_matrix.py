"""Write docs/compatibility.md from the feature table (megalite/cli/features.py).

    python tools/compatibility_matrix.py           # (re)write the page
    python tools/compatibility_matrix.py --check   # exit 1 when the page is stale
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megalite.cli.compatibility_doc import PAGE, counts, render  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the page is stale")
    args = ap.parse_args(argv)
    path = os.path.join(ROOT, PAGE)
    text = render()
    n = counts()
    summary = (f"{n['pairs']} pairs: {n['covered']} covered, {n['excluded']} excluded "
               f"({n['alternatives']} alternatives, {n['implied']} implied)")
    if args.check:
        current = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
        if current != text:
            print(f"{PAGE} is stale: run python tools/compatibility_matrix.py", file=sys.stderr)
            return 1
        print(f"{PAGE} is current: {summary}")
        return 0
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    print(f"wrote {PAGE}: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
