"""The three GEMM patterns with a choice of transport, as the tests drive them: each public op's
context, its reference with bias and residual, and the rows of rank r's result."""
import torch

import portable_overlap as po
from portable_overlap.ops.gemm_signal import (gemm_all_reduce_reference,
                                              gemm_all_to_all_signal_reference,
                                              gemm_reduce_scatter_reference)

GEMM_PATTERNS = {  # op -> (context, reference with bias and residual, rows of the result)
    "matmul_all_reduce": (po.MatmulAllReduce, gemm_all_reduce_reference, lambda M, W: M),
    "matmul_reduce_scatter": (po.MatmulReduceScatter, gemm_reduce_scatter_reference,
                              lambda M, W: M // W),
    "matmul_all_to_all": (po.MatmulAllToAll, gemm_all_to_all_signal_reference, lambda M, W: M),
}


def pattern_inputs(gen: torch.Generator, M: int, N: int, K: int, rows: int, dtype):
    """Fresh random ``a [M, K]``, ``b [K, N]``, ``bias [N]`` and ``residual [rows, N]``."""
    a = torch.randn(M, K, generator=gen).to(dtype)
    b = torch.randn(K, N, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    residual = torch.randn(rows, N, generator=gen).to(dtype)
    return a, b, bias, residual
