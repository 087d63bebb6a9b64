"""Fused dense GEMM + equal-split All-to-All."""
from .api import GemmAllToAll, gemm_all_to_all
from .reference import gemm_all_to_all_reference

__all__ = ["GemmAllToAll", "gemm_all_to_all", "gemm_all_to_all_reference"]
