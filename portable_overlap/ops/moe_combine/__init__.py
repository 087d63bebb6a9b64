"""Fused MoE expert GEMM + combine All-to-All (grouped, payload-efficient)."""
from .api import CombineConfig, MoeGemmCombine, moe_gemm_combine, validate_routing
from .reference import moe_gemm_combine_reference

__all__ = ["CombineConfig", "MoeGemmCombine", "moe_gemm_combine", "moe_gemm_combine_reference",
           "validate_routing"]
