"""``python -m megalite.planner ...`` is ``megalite plan ...``."""
import sys

from megalite.planner.cli import main

if __name__ == "__main__":
    sys.exit(main())
