"""Pipeline parallelism: stage splitting, p2p and schedules.

``split`` (the stage-split rule) imports no torch, so config-only code such as the planner
can use it; the schedules are loaded on first use of ``get_forward_backward_func``.
"""


def __getattr__(name):
    if name == "get_forward_backward_func":
        # start-up time: split is torch-free for the planner; the schedules import torch
        from megalite.pipeline_parallel.schedules import get_forward_backward_func
        return get_forward_backward_func
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
