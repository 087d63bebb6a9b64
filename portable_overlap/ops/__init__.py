"""The fused ops, one folder each: api (validate, workspace, launch), kernel, reference."""
from .gemv_allreduce import GemvAllReduce, GemvConfig, gemv_all_reduce, gemv_all_reduce_reference

__all__ = ["GemvAllReduce", "GemvConfig", "gemv_all_reduce", "gemv_all_reduce_reference"]
