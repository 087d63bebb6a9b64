"""Drop-in torch.nn modules built on the fused ops."""
from .embedding import ShardedEmbeddingBagCollection
from .linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["RowParallelLinear", "ColumnParallelLinear", "ShardedEmbeddingBagCollection"]
