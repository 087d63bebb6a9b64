"""GEMV + AllReduce (row-parallel linear for decode): the fused kernel and its transports."""
from .config import GemvConfig
from .pattern import GemvAllReduce, gemv_all_reduce
from .reference import gemv_all_reduce_reference

__all__ = ["GemvAllReduce", "GemvConfig", "gemv_all_reduce", "gemv_all_reduce_reference"]
