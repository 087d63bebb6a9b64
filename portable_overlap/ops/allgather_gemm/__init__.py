"""AllGather + GEMM over copy engines with the FiCCO schedules."""
from .api import SCHEDULES, AllGatherMatmul, all_gather_matmul, pick_schedule
from .reference import all_gather_matmul_reference

__all__ = ["AllGatherMatmul", "all_gather_matmul", "all_gather_matmul_reference",
           "pick_schedule", "SCHEDULES"]
