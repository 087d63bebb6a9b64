"""GEMM + All-to-All (equal splits): the pattern context and op (pattern.py) and the
Triton-stores and copy-engine transports (api.py)."""
from .api import GemmAllToAll
from .pattern import MatmulAllToAll, matmul_all_to_all
from .reference import gemm_all_to_all_reference

matmul_all_to_all_reference = gemm_all_to_all_reference

__all__ = ["MatmulAllToAll", "matmul_all_to_all", "matmul_all_to_all_reference", "GemmAllToAll",
           "gemm_all_to_all_reference"]
