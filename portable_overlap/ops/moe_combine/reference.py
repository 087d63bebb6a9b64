"""Reference of the MoE expert GEMM + combine: per-segment torch.matmul, all_to_all_single with
splits (rows and their slots back to their source ranks), placement by slot, weighted top-k sum.
It is also the sequential baseline of the benchmark."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def expert_outputs(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor,
                   accumulate_fp32: bool = True) -> torch.Tensor:
    """``y[i] = x[i] @ w[e(i)]`` for the dispatch layout (rows by source rank, then by local
    expert; ``counts[q, e]`` rows each), rounded to x's dtype as the fused kernel stores them."""
    y = torch.empty((x.shape[0], w.shape[2]), dtype=x.dtype, device=x.device)
    W, E = counts.shape
    bounds = [0] + torch.cumsum(counts.flatten().long(), 0).tolist()
    for s in range(W * E):
        lo, hi = bounds[s], bounds[s + 1]
        if hi > lo:
            e = s % E
            if accumulate_fp32:
                y[lo:hi] = (x[lo:hi].float() @ w[e].float()).to(x.dtype)
            else:
                torch.matmul(x[lo:hi], w[e], out=y[lo:hi])
    return y


def return_rows(y: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, n_slots: int,
                group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Send each row of ``y`` (and its slot) back to its source rank and place the rows this
    rank gets by slot: ``placed`` float32 [n_slots, D], zero where no row came back. Rows of
    ``y`` lie by source rank (``counts[q]`` rows for source q), as the dispatch left them."""
    send_splits = counts.sum(1).tolist()  # rows of y going back to each source rank
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        W = dist.get_world_size(group)
        sizes = torch.tensor(send_splits, dtype=torch.int64, device=y.device)
        recv_sizes = torch.empty_like(sizes)
        dist.all_to_all_single(recv_sizes, sizes, group=group)
        recv_splits = recv_sizes.tolist()
        rows = y.new_empty((sum(recv_splits), y.shape[1]))
        dist.all_to_all_single(rows, y.contiguous(), recv_splits, send_splits, group=group)
        got = slots.new_empty(sum(recv_splits))
        dist.all_to_all_single(got, slots.contiguous(), recv_splits, send_splits, group=group)
        assert len(recv_splits) == W
    else:
        rows, got = y, slots
    placed = torch.zeros((n_slots, y.shape[1]), dtype=torch.float32, device=y.device)
    placed[got.long()] = rows.float()
    return placed


def combine_rows(y: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, topk_weights,
                 group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Send each row of ``y`` (and its slot) back to its source rank, place rows by slot and
    return ``out[s] = sum_j topk_weights[s, j] * rows[s * k + j]`` (float32 sum, y's dtype)."""
    S, k = topk_weights.shape
    placed = return_rows(y, slots, counts, S * k, group)
    out = (placed.view(S, k, y.shape[1]) * topk_weights.float().unsqueeze(-1)).sum(1)
    return out.to(y.dtype)


def moe_gemm_combine_reference(x, w, counts, slots, topk_weights,
                               group: Optional[dist.ProcessGroup] = None,
                               accumulate_fp32: bool = True) -> torch.Tensor:
    """What :func:`moe_gemm_combine` computes, with torch and torch.distributed."""
    return combine_rows(expert_outputs(x, w, counts, accumulate_fp32), slots, counts,
                        topk_weights, group)
