"""Reference of GEMM + All-to-All: torch.matmul, then all_to_all_single with equal splits."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def gemm_all_to_all_reference(a: torch.Tensor, b: torch.Tensor,
                              group: Optional[dist.ProcessGroup] = None,
                              accumulate_fp32: bool = True) -> torch.Tensor:
    """``all_to_all_single(a @ b)``: in float32 then cast (tests), or in the input dtype."""
    c = ((a.float() @ b.float()) if accumulate_fp32 else (a @ b)).to(a.dtype).contiguous()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        out = torch.empty_like(c)
        dist.all_to_all_single(out, c, group=group)
        return out
    return c
