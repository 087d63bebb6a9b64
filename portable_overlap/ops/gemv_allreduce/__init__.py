"""Fused GEMV + AllReduce (row-parallel linear for decode)."""
from .api import GemvAllReduce, gemv_all_reduce
from .config import GemvConfig
from .reference import gemv_all_reduce_reference

__all__ = ["GemvAllReduce", "GemvConfig", "gemv_all_reduce", "gemv_all_reduce_reference"]
