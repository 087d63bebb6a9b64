"""Drop-in torch.nn modules built on the fused ops."""
from .linear import RowParallelLinear

__all__ = ["RowParallelLinear"]
