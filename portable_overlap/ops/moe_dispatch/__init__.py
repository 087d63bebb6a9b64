"""MoE dispatch: each rank's tokens routed to the ranks of their experts (the fused kernels, the
torch path as a transport, and ``transport="auto"``); and the dispatch with the experts' gated
first GEMM fused into it."""
from .pattern import TRANSPORTS, MoeDispatch, moe_dispatch
from .reference import moe_dispatch_reference, moe_dispatch_swiglu_reference
from .swiglu import moe_dispatch_swiglu

__all__ = ["MoeDispatch", "TRANSPORTS", "moe_dispatch", "moe_dispatch_reference",
           "moe_dispatch_swiglu", "moe_dispatch_swiglu_reference"]
