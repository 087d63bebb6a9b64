"""Reference of AllGather + GEMM: all_gather of the row shards, then one matmul."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def all_gather_matmul_reference(a: torch.Tensor, b: torch.Tensor,
                                group: Optional[dist.ProcessGroup] = None,
                                accumulate_fp32: bool = True) -> torch.Tensor:
    """``cat(all_gather(a)) @ b``: in float32 then cast (tests), or in the input dtype."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        parts = [torch.empty_like(a) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, a.contiguous(), group=group)
        full = torch.cat(parts)
    else:
        full = a
    return ((full.float() @ b.float()) if accumulate_fp32 else (full @ b)).to(a.dtype)
