"""The pure-PyTorch layer spec (works on CPU/gloo and CUDA/NCCL)."""
from __future__ import annotations

from megalite.backends import LayerSpec


def local_spec() -> LayerSpec:
    from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megalite.transformer.attention import DotProductAttention
    from megalite.transformer.norms import build_norm

    return LayerSpec(column_parallel_linear=ColumnParallelLinear,
                     row_parallel_linear=RowParallelLinear,
                     norm=build_norm,
                     core_attention=DotProductAttention)
