"""Row-parallel linear layer whose all-reduce is fused into the GEMV at decode time."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..ops.gemv_allreduce import GemvAllReduce, gemv_all_reduce
from ..ops.gemv_allreduce.api import MAX_M


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_r @ W_rᵀ) + bias`` where rank r holds columns
    ``[r * in_features / world, (r + 1) * in_features / world)`` of the full weight (the K-slice)
    and receives the matching slice of the input activations, as in Megatron-style tensor
    parallelism. ``y`` is the full ``[..., out_features]`` on every rank.

    Up to 64 rows (a decode step) run the fused GEMV + AllReduce kernel; more rows (prefill) take
    the reference path: ``x @ W_rᵀ`` then ``torch.distributed.all_reduce``.

    Collective to construct (every rank, same arguments). ``fused=False`` forces the reference
    path, for comparisons.
    """

    def __init__(self, in_features: int, out_features: int, world, *, bias: bool = False,
                 dtype: torch.dtype = torch.bfloat16, fused: bool = True,
                 ctx: Optional[GemvAllReduce] = None):
        super().__init__()
        W = world.world_size
        if in_features % W:
            raise ValueError(f"in_features={in_features} must divide by the world size {W}")
        self.world = world
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features // W, dtype=dtype,
                                               device=world.device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=world.device)) \
            if bias else None
        self.fused = fused
        self.ctx = ctx if ctx is not None else (
            GemvAllReduce(world, max_n=out_features) if fused else None)
        with torch.no_grad():
            self.weight.normal_(0.0, (in_features ** -0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.fused and x2.shape[0] <= MAX_M:
            y = gemv_all_reduce(x2.contiguous(), self.weight, self.ctx)
        else:
            y = x2 @ self.weight.T
            if self.world.world_size > 1:
                dist.all_reduce(y, group=self.world.group)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"world={self.world.world_size}, fused={self.fused}")
