"""References of the tile-group-signal ops: torch.matmul, then the plain collective on the whole
output, then bias and residual. Also the sequential baseline of the benchmark."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ... import collectives


def _mm(a, b, accumulate_fp32):
    return ((a.float() @ b.float()) if accumulate_fp32 else (a @ b)).to(a.dtype).contiguous()


def epilogue(y, bias, residual, rms_weight=None, eps=1e-6):
    """``h = y + bias + residual`` in fp32, rounded once; with ``rms_weight`` also
    ``(h, h * rsqrt(mean(h**2, -1) + eps) * rms_weight)`` from the fp32 ``h``."""
    if bias is None and residual is None and rms_weight is None:
        return y
    z = y.float()
    if bias is not None:
        z = z + bias.float()
    if residual is not None:
        z = z + residual.float()
    if rms_weight is None:
        return z.to(y.dtype)
    normed = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps) * rms_weight.float()
    return z.to(y.dtype), normed.to(y.dtype)


def gemm_all_reduce_reference(a: torch.Tensor, b: torch.Tensor,
                              group: Optional[dist.ProcessGroup] = None,
                              bias: Optional[torch.Tensor] = None,
                              residual: Optional[torch.Tensor] = None,
                              accumulate_fp32: bool = True,
                              rms_weight: Optional[torch.Tensor] = None, eps: float = 1e-6):
    """``all_reduce(a @ b) (+ bias + residual)``: [M, N] on every rank."""
    c = _mm(a, b, accumulate_fp32)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(c, group=group)
    return epilogue(c, bias, residual, rms_weight, eps)


def gemm_reduce_scatter_reference(a: torch.Tensor, b: torch.Tensor,
                                  group: Optional[dist.ProcessGroup] = None,
                                  bias: Optional[torch.Tensor] = None,
                                  residual: Optional[torch.Tensor] = None,
                                  accumulate_fp32: bool = True,
                                  rms_weight: Optional[torch.Tensor] = None, eps: float = 1e-6):
    """Rows ``[r*M/W, (r+1)*M/W)`` of ``sum_r a_r @ b_r`` (+ bias + residual) on rank r."""
    c = _mm(a, b, accumulate_fp32)
    W = dist.get_world_size(group) if dist.is_initialized() else 1
    if W > 1:
        out = c.new_empty((c.shape[0] // W, c.shape[1]))
        collectives.reduce_scatter(out, c, group=group)
        c = out
    return epilogue(c, bias, residual, rms_weight, eps)


def gemm_all_to_all_signal_reference(a: torch.Tensor, b: torch.Tensor,
                                     group: Optional[dist.ProcessGroup] = None,
                                     bias: Optional[torch.Tensor] = None,
                                     residual: Optional[torch.Tensor] = None,
                                     accumulate_fp32: bool = True,
                                     rms_weight: Optional[torch.Tensor] = None,
                                     eps: float = 1e-6):
    """``all_to_all_single(a @ b)`` with equal splits (+ bias + residual)."""
    c = _mm(a, b, accumulate_fp32)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        out = torch.empty_like(c)
        dist.all_to_all_single(out, c, group=group)
        c = out
    return epilogue(c, bias, residual, rms_weight, eps)
