"""``python -m megalite.cli`` is the ``megalite`` command."""
import sys

from megalite.cli.main import main

sys.exit(main())
