"""Tensor-parallel building blocks: region mappings, parallel layers, vocab-parallel loss, RNG."""
from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.tensor_parallel.layers import (ColumnParallelLinear, DuplicatedLinear,
                                             RowParallelLinear,
                                             VocabParallelEmbedding,
                                             allreduce_sequence_parallel_grads,
                                             linear_with_sp_gather, make_param)
from megalite.tensor_parallel.mappings import (copy_to_tp_region, gather_from_sp_region,
                                               gather_from_tp_region, reduce_from_tp_region,
                                               reduce_scatter_to_sp_region, scatter_to_sp_region,
                                               scatter_to_tp_region)
from megalite.tensor_parallel.random import (MODEL_PARALLEL_RNG, RNGStatesTracker,
                                             init_parameters, model_parallel_tracker)

__all__ = [
    "ColumnParallelLinear", "DuplicatedLinear", "RowParallelLinear", "VocabParallelEmbedding", "make_param",
    "allreduce_sequence_parallel_grads", "linear_with_sp_gather", "vocab_parallel_cross_entropy",
    "copy_to_tp_region", "reduce_from_tp_region", "gather_from_sp_region",
    "reduce_scatter_to_sp_region", "scatter_to_sp_region", "gather_from_tp_region",
    "scatter_to_tp_region", "RNGStatesTracker", "MODEL_PARALLEL_RNG", "model_parallel_tracker",
    "init_parameters",
]
