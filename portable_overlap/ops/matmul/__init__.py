"""Persistent tile GEMM (the shared GEMM core, its reference and API)."""
from .api import MatmulConfig, persistent_matmul
from .reference import matmul_reference

__all__ = ["MatmulConfig", "persistent_matmul", "matmul_reference"]
