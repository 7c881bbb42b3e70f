"""``python -m megalite.generate``: sample from a checkpoint."""
import sys

from megalite.generate import main

sys.exit(main())
