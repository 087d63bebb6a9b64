"""GEMM + ReduceScatter / AllReduce (K split over the ranks): the pattern contexts and ops
(pattern.py) and the copy-engine transport (api.py)."""
from .api import MODES, MatmulReduce
from .pattern import (MatmulAllReduce, MatmulReduceScatter, matmul_all_reduce,
                      matmul_reduce_scatter)
from .reference import matmul_all_reduce_reference, matmul_reduce_scatter_reference

__all__ = ["MatmulReduceScatter", "MatmulAllReduce", "matmul_reduce_scatter",
           "matmul_all_reduce", "matmul_reduce_scatter_reference", "matmul_all_reduce_reference",
           "MatmulReduce", "MODES"]
