"""The torch reference of GEMV + AllReduce: compute, then an ordinary all_reduce.

It is the baseline the tests compare against and the fallback for shapes the fused kernel does not
take (M > 64)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def gemv_all_reduce_reference(x: torch.Tensor, w: torch.Tensor,
                              group: Optional[dist.ProcessGroup] = None,
                              accumulate_fp32: bool = True) -> torch.Tensor:
    """``y = Σ_r x_r @ w_rᵀ`` on every rank. With ``accumulate_fp32`` the product and the sum run
    in float32 (the precise reference for tests); without, it is the plain ``x @ w.T`` then
    ``all_reduce`` in the input dtype (what a model would run: the benchmark's sequential path)."""
    if accumulate_fp32:
        y = x.float() @ w.float().T
    else:
        y = x @ w.T
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(y, group=group)
    return y.to(x.dtype)
