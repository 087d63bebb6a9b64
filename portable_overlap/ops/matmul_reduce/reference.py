"""Reference of GEMM + ReduceScatter / AllReduce: the local product, then the collective."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ... import collectives


def _product(a, b, accumulate_fp32):
    return (a.float() @ b.float()) if accumulate_fp32 else a @ b


def matmul_reduce_scatter_reference(a: torch.Tensor, b: torch.Tensor,
                                    group: Optional[dist.ProcessGroup] = None,
                                    accumulate_fp32: bool = True) -> torch.Tensor:
    """Rank r's row block of ``sum_q a_q @ b_q`` by a reduce-scatter: in float32 then
    cast (tests), or in the input dtype (the sequential baseline)."""
    c = _product(a, b, accumulate_fp32)
    W = dist.get_world_size(group) if dist.is_initialized() else 1
    if W > 1:
        out = c.new_empty((c.shape[0] // W, c.shape[1]))
        collectives.reduce_scatter(out, c.contiguous(), group=group)
        c = out
    return c.to(a.dtype)


def matmul_all_reduce_reference(a: torch.Tensor, b: torch.Tensor,
                                group: Optional[dist.ProcessGroup] = None,
                                accumulate_fp32: bool = True) -> torch.Tensor:
    """``sum_q a_q @ b_q`` by ``all_reduce`` (float32 then cast, or in the input dtype)."""
    c = _product(a, b, accumulate_fp32)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(c, group=group)
    return c.to(a.dtype)
