"""Fused embedding pooling + All-to-All (DLRM, table-wise sharded embedding tables)."""
from .api import EmbeddingAllToAll, embedding_all_to_all
from .plan import ShardingPlan
from .reference import embedding_all_to_all_reference

__all__ = ["EmbeddingAllToAll", "ShardingPlan", "embedding_all_to_all",
           "embedding_all_to_all_reference"]
