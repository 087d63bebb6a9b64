"""MoE expert GEMM + combine All-to-All (grouped, payload-efficient): the fused kernels, the torch
path as a transport, and ``transport="auto"``."""
from .api import CombineConfig, validate_routing
from .pattern import TRANSPORTS, MoeGemmCombine, moe_gemm_combine
from .reference import moe_gemm_combine_reference

__all__ = ["CombineConfig", "MoeGemmCombine", "TRANSPORTS", "moe_gemm_combine",
           "moe_gemm_combine_reference", "validate_routing"]
