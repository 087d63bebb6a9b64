"""portable_overlap: fused computation + communication kernels for multi-GPU PyTorch.

Ops start sending the first finished tiles of their output to the other GPUs while the rest is
still being computed. One op per communication pattern, each with a context (the collective
workspace, made once per shape budget) and a ``transport=`` choice:

======================  ============================  ===========================================
op                      context                       transports
======================  ============================  ===========================================
all_gather_matmul       AllGatherMatmul               copy_engine, stores, torch_fused,
                                                      sequential
matmul_reduce_scatter   MatmulReduceScatter           copy_engine, stores, signal_collective,
                                                      signal_copy_engine, torch_fused, sequential
matmul_all_reduce       MatmulAllReduce               copy_engine, stores, signal_collective,
                                                      sequential
matmul_all_to_all       MatmulAllToAll                stores, copy_engine, signal_collective,
                                                      sequential
gemv_all_reduce         GemvAllReduce                 stores, one_shot, torch_fused,
                                                      sequential
embedding_all_to_all    EmbeddingAllToAll             stores, shmem, sequential
moe_dispatch            MoeDispatch                   stores, shmem, sequential
moe_gemm_combine        MoeGemmCombine                stores, shmem, sequential
======================  ============================  ===========================================

Every op also takes ``transport="auto"``, its default on a GPU world: the context times every
transport that can run on its world (the embedding and MoE ops' ``shmem`` only when named) at
the first eager call of each new shape and keeps the fastest (``ops/planner.py``); on
CPU-emulated ranks the default is the first transport listed. ``torch_fused`` (torch's own fused
ops) runs on GPU worlds of one host only. Each op is also ``torch.ops.portable_overlap.<op>``
(``ops.registry.SPECS`` lists them). The modules (``RowParallelLinear``,
``ColumnParallelLinear``, ``ShardedEmbeddingBagCollection``, ``ExpertParallelMoE``) use them as
drop-in layers. See README.md.
"""
from .backends import get_backend
from .errors import (BackendUnavailable, ConcurrentUseError, ContextBrokenError,
                     ContextClosedError, InvalidInputError, PeerSetupError, PeerTimeoutError,
                     PortableOverlapError, RankMismatchError)
from .modules import (ColumnParallelLinear, ExpertParallelMoE, RowParallelLinear,
                      ShardedEmbeddingBagCollection)
from .ops.allgather_gemm import AllGatherMatmul, all_gather_matmul, all_gather_matmul_reference
from .ops.embedding_alltoall import (EmbeddingAllToAll, ShardingPlan, embedding_all_to_all,
                                     embedding_all_to_all_reference)
from .ops.gemm_alltoall import MatmulAllToAll, matmul_all_to_all, matmul_all_to_all_reference
from .ops.gemm_signal import SignalConfig
from .ops.gemv_allreduce import (GemvAllReduce, GemvConfig, gemv_all_reduce,
                                 gemv_all_reduce_reference)
from .ops.matmul_reduce import (MatmulAllReduce, MatmulReduceScatter, matmul_all_reduce,
                                matmul_all_reduce_reference, matmul_reduce_scatter,
                                matmul_reduce_scatter_reference)
from .ops.moe_combine import MoeGemmCombine, moe_gemm_combine, moe_gemm_combine_reference
from .ops.moe_dispatch import MoeDispatch, moe_dispatch, moe_dispatch_reference
from .ops.moe_layer import moe_layer, moe_layer_reference
from .ops.registry import SPECS
from .world import World
from .workspace import Workspace

__version__ = "0.1.0"

#: the ops and their contexts, from the op table (one entry per communication pattern)
OPS = tuple(SPECS)
__all__ = [
    "World", "Workspace", "get_backend", "OPS",
    *OPS, *(spec.context.__name__ for spec in SPECS.values()),
    *(f"{name}_reference" for name in OPS),
    "GemvConfig", "SignalConfig", "ShardingPlan",
    "RowParallelLinear", "ColumnParallelLinear", "ShardedEmbeddingBagCollection",
    "ExpertParallelMoE", "moe_layer", "moe_layer_reference",
    "PortableOverlapError", "BackendUnavailable", "PeerTimeoutError", "RankMismatchError",
    "ContextBrokenError", "ContextClosedError", "ConcurrentUseError", "PeerSetupError",
    "InvalidInputError",
]
