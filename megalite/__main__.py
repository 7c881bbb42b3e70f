"""``python -m megalite`` is the ``megalite`` command (for environments without the console
script on PATH)."""
import sys

from megalite.cli.main import main

sys.exit(main())
