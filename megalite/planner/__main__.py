"""``python -m megalite.planner ...`` is ``megalite plan ...``."""
import sys

from megalite.commands.plan import main

if __name__ == "__main__":
    sys.exit(main())
