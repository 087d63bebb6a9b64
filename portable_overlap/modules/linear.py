"""Tensor-parallel linear layers whose collective is fused with the GEMM / GEMV: row-parallel
(all-reduce or reduce-scatter after the GEMM) and column-parallel (all-gather before it)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..ops.gemv_allreduce import GemvAllReduce, gemv_all_reduce
from ..ops.gemv_allreduce.api import MAX_M
from ..ops.matmul_reduce import (MatmulAllReduce, MatmulReduceScatter, matmul_all_reduce,
                                 matmul_reduce_scatter)

REDUCES = ("all_reduce", "reduce_scatter")


def _fused_ok(module: nn.Module, x: torch.Tensor) -> bool:
    """The fused ops define no backward: take them only when no gradient is being recorded."""
    return module.fused and not (torch.is_grad_enabled() and
                                 (module.weight.requires_grad or x.requires_grad))


def _scatter_rows(full, group, W):
    out = full.new_empty((full.shape[0] // W, full.shape[1]))
    dist.reduce_scatter_tensor(out, full.contiguous(), group=group)
    return out


def _gather_rows(x, group, W):
    full = x.new_empty((W * x.shape[0], x.shape[1]))
    dist.all_gather_into_tensor(full, x.contiguous(), group=group)
    return full


class _ScatterRows(torch.autograd.Function):
    """``reduce_scatter`` of ``[S, N]`` into rank r's ``[S/W, N]`` row block; its gradient is the
    all-gather of the row blocks' gradients (sequence parallelism's pair of collectives)."""

    @staticmethod
    def forward(ctx, full, group, W):
        ctx.group, ctx.W = group, W
        return _scatter_rows(full, group, W)

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad, ctx.group, ctx.W), None, None


class _GatherRows(torch.autograd.Function):
    """All-gather of every rank's ``[m, K]`` rows into ``[W * m, K]`` (rank order); its gradient
    is the reduce-scatter of the gathered rows' gradient."""

    @staticmethod
    def forward(ctx, x, group, W):
        ctx.group, ctx.W = group, W
        return _gather_rows(x, group, W)

    @staticmethod
    def backward(ctx, grad):
        return _scatter_rows(grad, ctx.group, ctx.W), None, None


class RowParallelLinear(nn.Module):
    """Row-parallel linear (Megatron tensor parallelism): rank r holds columns
    ``[r * in_features / W, (r + 1) * in_features / W)`` of the full ``[out, in]`` weight (its
    K-slice, ``self.weight``) and receives the matching slice ``x_r`` of the input activations.
    With ``s = sum over ranks q of x_q @ W_qᵀ`` (the full product)::

        reduce="all_reduce":      y = s + bias                          # [..., out] on every rank
        reduce="reduce_scatter":  y = s[r*S/W:(r+1)*S/W] + bias         # [S/W, out] on rank r

    ``reduce_scatter`` is Megatron's sequence parallelism: ``x_r`` is ``[S, in/W]`` (all ``S``
    rows, this rank's columns), ``S`` a multiple of ``W``, and rank r keeps its row block of the
    summed output. The bias (replicated) is added after the reduction.

    Paths, with ``fused=True`` (the default):

    - ``all_reduce``, up to 64 rows (a decode step): the fused GEMV + AllReduce kernel, as before;
    - ``all_reduce``, more rows (prefill): ``matmul_all_reduce`` (GEMM split over K with the
      reduction on copy engines) when the module has a ``MatmulAllReduce`` context
      (``max_rows`` given, or ``reduce_ctx``), else the reference;
    - ``reduce_scatter``, any row count: ``matmul_reduce_scatter``.

    The reference path is ``x_r @ W_rᵀ`` then ``torch.distributed.all_reduce`` /
    ``reduce_scatter_tensor`` (whose gradient is the all-gather); it is taken with
    ``fused=False``, and on the GEMM paths also while autograd records (the fused GEMM ops have
    no backward; the decode GEMV path is taken as before).

    Collective to construct and to :meth:`close` (every rank, same arguments). ``ctx``
    (a ``GemvAllReduce``) and ``reduce_ctx`` (a ``MatmulAllReduce`` or, with
    ``reduce="reduce_scatter"``, a ``MatmulReduceScatter``) let layers share workspaces: they
    are used as given and stay the caller's to close. ``max_rows`` sizes the context the module
    makes itself (results of up to ``max_rows`` x ``out_features``); more rows on a fused GEMM
    path raise ``ValueError``.
    """

    def __init__(self, in_features: int, out_features: int, world, *, bias: bool = False,
                 dtype: torch.dtype = torch.bfloat16, fused: bool = True,
                 ctx: Optional[GemvAllReduce] = None, reduce: str = "all_reduce",
                 max_rows: Optional[int] = None, reduce_ctx=None):
        super().__init__()
        W = world.world_size
        if in_features % W:
            raise ValueError(f"in_features={in_features} must divide by the world size {W}")
        if reduce not in REDUCES:
            raise ValueError(f"RowParallelLinear: reduce must be one of {REDUCES}, got {reduce!r}")
        if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int)
                                     or max_rows < 1):
            raise ValueError(f"RowParallelLinear: max_rows must be an int >= 1, got {max_rows!r}")
        if fused and reduce == "reduce_scatter" and max_rows is None and reduce_ctx is None:
            raise ValueError("RowParallelLinear: reduce='reduce_scatter' with fused=True needs "
                             "max_rows (to size its MatmulReduceScatter context) or reduce_ctx")
        self.world = world
        self.in_features, self.out_features = in_features, out_features
        self.reduce, self.max_rows = reduce, max_rows
        self.weight = nn.Parameter(torch.empty(out_features, in_features // W, dtype=dtype,
                                               device=world.device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=world.device)) \
            if bias else None
        self.fused = fused
        # the contexts this module made (and frees in close()); given ones stay the caller's
        self._owned = []
        self.ctx = ctx
        if ctx is None and fused and reduce == "all_reduce":
            self.ctx = GemvAllReduce(world, max_n=out_features)
            self._owned.append(self.ctx)
        self.reduce_ctx = reduce_ctx
        if reduce_ctx is None and fused and max_rows is not None:
            make = MatmulReduceScatter if reduce == "reduce_scatter" else MatmulAllReduce
            self.reduce_ctx = make(world, max_rows, out_features)
            self._owned.append(self.reduce_ctx)
        with torch.no_grad():
            self.weight.normal_(0.0, (in_features ** -0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.weight.shape[1]
        if x.dim() < 1 or x.shape[-1] != k:
            raise ValueError(f"RowParallelLinear: x must be [..., {k}] (this rank's slice of "
                             f"in_features={self.in_features}), got {tuple(x.shape)}")
        if self.reduce == "reduce_scatter":
            return self._reduce_scatter(x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        rows = x2.shape[0]
        if rows <= MAX_M and _fused_ok(self, x):
            y = gemv_all_reduce(x2.contiguous(), self.weight, self.ctx)
        elif self.reduce_ctx is not None and _fused_ok(self, x):
            self._check_rows(rows)
            y = matmul_all_reduce(x2.contiguous(), self.weight.T, self.reduce_ctx)
        else:
            y = x2 @ self.weight.T
            if self.world.world_size > 1:
                dist.all_reduce(y, group=self.world.group)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def _reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        W = self.world.world_size
        if x.dim() != 2 or x.shape[0] % W:
            raise ValueError(f"RowParallelLinear(reduce='reduce_scatter'): x must be [S, "
                             f"{self.weight.shape[1]}] with S a multiple of the world size {W} "
                             f"(rank r keeps rows [r*S/W, (r+1)*S/W)), got {tuple(x.shape)}")
        if _fused_ok(self, x):
            self._check_rows(x.shape[0])
            y = matmul_reduce_scatter(x.contiguous(), self.weight.T, self.reduce_ctx)
        else:
            y = x @ self.weight.T
            if W > 1:
                y = _ScatterRows.apply(y, self.world.group, W)
        return y + self.bias if self.bias is not None else y

    def _check_rows(self, rows: int) -> None:
        if self.max_rows is not None and rows > self.max_rows:
            raise ValueError(f"RowParallelLinear: {rows} rows exceed max_rows={self.max_rows} "
                             f"(the size of its {type(self.reduce_ctx).__name__} context)")

    def close(self) -> None:
        """Collective: free the contexts this module made (not the ones it was given)."""
        while self._owned:
            self._owned.pop().close()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"world={self.world.world_size}, reduce={self.reduce}, fused={self.fused}")


class ColumnParallelLinear(nn.Module):
    """Sequence-parallel column-parallel linear: rank r holds its ``[r * S/W, (r+1) * S/W)``
    rows of the input and rows ``[r * out/W, (r+1) * out/W)`` of the weight, and gets
    ``all_gather(x)[...] @ W_rᵀ + bias_r``, i.e. all ``S`` rows of its ``out_features / world``
    output columns (Megatron's sequence parallelism before a column-parallel layer).

    The gather runs on copy engines overlapped with the GEMM (``all_gather_matmul``, FiCCO
    schedules) when no gradient is being recorded (the fused op has no backward yet); otherwise,
    or with ``fused=False``, the reference path (``all_gather_into_tensor`` then the GEMM; the
    gather's gradient is the reduce-scatter).
    Collective to construct and to :meth:`close`; inputs are ``[rows, in_features]`` with the
    same row count on every rank. A ``ctx`` given (an ``AllGatherMatmul`` shared by layers with
    the same ``in_features``) stays the caller's to close. Measured on GPUs inside
    ``examples/transformer/prefill.py`` (4 layers in one CUDA graph, fused vs reference: 14.90
    vs 17.25 ms on 2 H200s, 9.82 vs 9.92 ms on 4; docs/scaling.md); the op
    alone in docs/allgather_gemm.md.
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
        self._owns_ctx = ctx is None and self.ctx is not None
        with torch.no_grad():
            self.weight.normal_(0.0, in_features ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..ops.allgather_gemm import all_gather_matmul

        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"ColumnParallelLinear: x must be [rows, {self.in_features}], got "
                             f"{tuple(x.shape)}")
        W = self.world.world_size
        if _fused_ok(self, x):
            y = all_gather_matmul(x.contiguous(), self.weight.T, self.ctx)
        else:
            full = _GatherRows.apply(x, self.world.group, W) if W > 1 else x
            y = full @ self.weight.T
        return y + self.bias if self.bias is not None else y

    def close(self) -> None:
        """Collective: free the context this module made (not one it was given)."""
        if self._owns_ctx:
            self._owns_ctx = False
            self.ctx.close()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"world={self.world.world_size}, fused={self.fused}")
