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


class ColumnParallelLinear(nn.Module):
    """Sequence-parallel column-parallel linear: rank r holds its ``[r * S/W, (r+1) * S/W)``
    rows of the input and rows ``[r * out/W, (r+1) * out/W)`` of the weight, and gets
    ``all_gather(x)[...] @ W_rᵀ + bias_r``, i.e. all ``S`` rows of its ``out_features / world``
    output columns (Megatron's sequence parallelism before a column-parallel layer).

    The gather runs on copy engines overlapped with the GEMM (``all_gather_matmul``, FiCCO
    schedules) when no gradient is being recorded (the fused op has no backward yet); otherwise,
    or with ``fused=False``, the reference path (``all_gather_into_tensor`` then the GEMM).
    Collective to construct; inputs are ``[rows, in_features]`` with the same row count on every
    rank. Not measured on GPUs yet (see docs/allgather_gemm.md).
    """

    def __init__(self, in_features: int, out_features: int, world, *, max_rows: int,
                 bias: bool = False, dtype: torch.dtype = torch.bfloat16, fused: bool = True,
                 ctx=None):
        super().__init__()
        from ..ops.allgather_gemm import AllGatherMatmul

        W = world.world_size
        if out_features % W:
            raise ValueError(f"out_features={out_features} must divide by the world size {W}")
        self.world = world
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features // W, in_features, dtype=dtype,
                                               device=world.device))
        self.bias = nn.Parameter(torch.zeros(out_features // W, dtype=dtype,
                                             device=world.device)) if bias else None
        self.fused = fused
        self.ctx = ctx if ctx is not None or not fused else \
            AllGatherMatmul(world, max_shard_elems=max_rows * in_features)
        with torch.no_grad():
            self.weight.normal_(0.0, in_features ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..ops.allgather_gemm import all_gather_matmul

        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"ColumnParallelLinear: x must be [rows, {self.in_features}], got "
                             f"{tuple(x.shape)}")
        W = self.world.world_size
        if self.fused and not (torch.is_grad_enabled() and
                               (self.weight.requires_grad or x.requires_grad)):
            y = all_gather_matmul(x.contiguous(), self.weight.T, self.ctx)
        else:
            full = x.new_empty((W * x.shape[0], x.shape[1]))
            if W > 1:
                dist.all_gather_into_tensor(full, x.contiguous(), group=self.world.group)
            else:
                full.copy_(x)
            y = full @ self.weight.T
        return y + self.bias if self.bias is not None else y

    def close(self) -> None:
        if self.ctx is not None:
            self.ctx.close()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"world={self.world.world_size}, fused={self.fused}")
