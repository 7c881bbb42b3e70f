"""matplotlib on the file-only Agg backend, for every figure megalite writes (loss curves,
pipeline timelines, the planner's plot): a run on a machine without a display still plots.

matplotlib is optional (the ``plot`` extra), so nothing imports it before a figure is asked for."""
from __future__ import annotations


def matplotlib_modules():
    """``(matplotlib, matplotlib.pyplot)``, the backend set to Agg before pyplot loads;
    ``matplotlib.colors`` and ``matplotlib.patches`` come loaded with pyplot."""
    import matplotlib  # optional dependency: matplotlib (the plot extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency: matplotlib (the plot extra)

    return matplotlib, plt
