"""portable_overlap: fused computation + communication kernels for multi-GPU PyTorch.

Ops start sending the first finished tiles of their output to the other GPUs while the rest is
still being computed. See README.md for how the pieces fit.
"""
from .backends import get_backend
from .errors import (BackendUnavailable, ConcurrentUseError, ContextBrokenError,
                     ContextClosedError, InvalidInputError, PeerSetupError, PeerTimeoutError,
                     PortableOverlapError, RankMismatchError)
from .modules.embedding import ShardedEmbeddingBagCollection
from .modules.linear import ColumnParallelLinear, RowParallelLinear
from .modules.moe import ExpertParallelMoE
from .ops.embedding_alltoall import (EmbeddingAllToAll, ShardingPlan, embedding_all_to_all,
                                     embedding_all_to_all_reference)
from .ops import GemvAllReduce, GemvConfig, gemv_all_reduce, gemv_all_reduce_reference
from .ops.allgather_gemm import AllGatherMatmul, all_gather_matmul
from .ops.matmul_reduce import MatmulReduce, matmul_all_reduce, matmul_reduce_scatter
from .ops.gemm_alltoall import GemmAllToAll, gemm_all_to_all
from .ops.moe_combine import MoeGemmCombine, moe_gemm_combine
from .ops.gemm_signal import (GemmSignal, SignalConfig, gemm_all_reduce,
                              gemm_all_reduce_reference, gemm_all_to_all_signal,
                              gemm_all_to_all_signal_reference, gemm_reduce_scatter,
                              gemm_reduce_scatter_reference)
from .world import World

__version__ = "0.1.0"
__all__ = ["World", "get_backend", "GemvAllReduce", "GemvConfig", "gemv_all_reduce",
           "gemv_all_reduce_reference", "RowParallelLinear", "PortableOverlapError",
           "BackendUnavailable", "PeerTimeoutError", "RankMismatchError", "ContextBrokenError",
           "ContextClosedError", "ConcurrentUseError", "PeerSetupError",
           "InvalidInputError", "GemmAllToAll", "gemm_all_to_all", "MoeGemmCombine",
           "moe_gemm_combine", "GemmSignal", "SignalConfig", "gemm_all_reduce",
           "gemm_reduce_scatter", "gemm_all_to_all_signal", "gemm_all_reduce_reference",
           "gemm_reduce_scatter_reference", "gemm_all_to_all_signal_reference",
           "EmbeddingAllToAll", "ShardingPlan", "embedding_all_to_all",
           "embedding_all_to_all_reference", "ShardedEmbeddingBagCollection",
           "AllGatherMatmul", "all_gather_matmul", "ColumnParallelLinear", "MatmulReduce",
           "matmul_reduce_scatter", "matmul_all_reduce"]
__all__ += ["ExpertParallelMoE"]
