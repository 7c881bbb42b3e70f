"""Parallelism planner: memory, FLOPs, communication and step-time models, and a search
over the layouts megalite's own validation accepts.  Pure Python -- no torch import.

Entry points: ``megalite plan`` (cli.py), ``search`` / ``evaluate`` (search.py), and for
checking a real run against the model, ``predict_rank_memory`` (memory.py) and
``predict_comm_volume`` (comm_model.py).
"""
from megalite.planner.comm_model import predict_comm_volume
from megalite.planner.estimate import Estimate, ModelOptions, estimate
from megalite.planner.hardware import GPU_PRESETS, Cluster, make_cluster
from megalite.planner.layout import Layout, layout_from_config
from megalite.planner.memory import Precision, predict_rank_memory
from megalite.planner.model_spec import RECIPES, recipe, stage_params, total_params
from megalite.planner.search import SearchSpace, evaluate, search

__all__ = ["predict_comm_volume", "Estimate", "ModelOptions", "estimate", "GPU_PRESETS",
           "Cluster", "make_cluster", "Layout", "layout_from_config", "Precision",
           "predict_rank_memory", "RECIPES", "recipe", "stage_params", "total_params",
           "SearchSpace", "evaluate", "search"]
