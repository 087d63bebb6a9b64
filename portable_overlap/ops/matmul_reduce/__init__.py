"""GEMM + ReduceScatter / AllReduce (K split) with the communication on copy engines."""
from .api import MODES, MatmulReduce, matmul_all_reduce, matmul_reduce_scatter
from .reference import matmul_all_reduce_reference, matmul_reduce_scatter_reference

__all__ = ["MatmulReduce", "matmul_reduce_scatter", "matmul_all_reduce",
           "matmul_reduce_scatter_reference", "matmul_all_reduce_reference", "MODES"]
