"""MoE dispatch: each rank's tokens routed to the ranks of their experts, started on the GPU."""
from .api import MoeDispatch, moe_dispatch
from .reference import moe_dispatch_reference

__all__ = ["MoeDispatch", "moe_dispatch", "moe_dispatch_reference"]
