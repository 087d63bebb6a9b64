"""Drop-in torch.nn modules built on the fused ops."""
from .embedding import ShardedEmbeddingBagCollection
from .linear import ColumnParallelLinear, RowParallelLinear
from .moe import ExpertParallelMoE

__all__ = ["RowParallelLinear", "ColumnParallelLinear", "ShardedEmbeddingBagCollection",
           "ExpertParallelMoE"]
