"""Which layers a pipeline stage holds (the model chunks themselves are built by
``megalite.models.stages``: pipeline_parallel never imports a model).

Which layers each (pipeline rank, virtual stage) holds is decided by one pure rule,
``megalite.pipeline_parallel.split`` (uneven first/last stages, interleaved virtual stages,
the embedding/loss counted as pipeline layers); the planner and the checkpoint converter
use the same rule.
"""
from __future__ import annotations

from typing import List

from megalite.pipeline_parallel.split import pipeline_split


def layers_of_stage(cfg, pp_rank: int, vpp_rank: int = 0) -> List[int]:
    """Global layer numbers held by chunk ``vpp_rank`` of pipeline rank ``pp_rank``."""
    return pipeline_split(cfg).layers(pp_rank, vpp_rank)
