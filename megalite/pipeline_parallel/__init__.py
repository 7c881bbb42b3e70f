"""Pipeline parallelism: stage splitting, p2p and schedules."""
from megalite.pipeline_parallel.schedules import get_forward_backward_func  # noqa: F401
