"""Drop-in torch.nn modules built on the fused ops."""
from .embedding import ShardedEmbeddingBagCollection
from .linear import RowParallelLinear

__all__ = ["RowParallelLinear", "ShardedEmbeddingBagCollection"]
