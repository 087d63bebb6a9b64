"""The fused ops, one folder each: api (validate, workspace, launch), kernel, reference."""
from .gemm_alltoall import GemmAllToAll, gemm_all_to_all, gemm_all_to_all_reference
from .gemv_allreduce import GemvAllReduce, GemvConfig, gemv_all_reduce, gemv_all_reduce_reference

__all__ = ["GemvAllReduce", "GemvConfig", "gemv_all_reduce", "gemv_all_reduce_reference",
           "GemmAllToAll", "gemm_all_to_all", "gemm_all_to_all_reference"]
