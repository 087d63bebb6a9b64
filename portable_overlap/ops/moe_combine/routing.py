"""Expert-parallel dispatch in the layout the fused combine takes (torch + torch.distributed).

Rank r routes its S tokens to top-k experts; expert ``g`` lives on rank ``g // E_local`` as local
expert ``g % E_local``. Slot ``s * k + j`` names token s's j-th choice. After :func:`dispatch`
each rank holds the rows routed to its experts, by source rank then by local expert, with their
counts and slots: exactly the inputs of ``moe_gemm_combine``. Only real rows travel (no capacity
padding).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def dispatch(tokens: torch.Tensor, topk_ids: torch.Tensor, experts_per_rank: int,
             group: Optional[dist.ProcessGroup] = None):
    """Returns ``(x, counts, slots)``: ``x`` [R, D] the rows this rank's experts must process,
    ``counts`` int32 [world, experts_per_rank] (rows from source q for local expert e),
    ``slots`` int32 [R] (each row's slot on its source rank)."""
    S, k = topk_ids.shape
    W = dist.get_world_size(group) if dist.is_initialized() else 1
    E = experts_per_rank * W
    experts = topk_ids.reshape(-1).long()
    if experts.numel() and (int(experts.min()) < 0 or int(experts.max()) >= E):
        raise ValueError(f"dispatch: expert ids must be in [0, {E}), got "
                         f"[{int(experts.min())}, {int(experts.max())}]")
    order = torch.argsort(experts, stable=True)  # by destination rank, then local expert
    send_rows = tokens[order // k]
    send_slots = order.to(torch.int32)
    send_counts = torch.bincount(experts, minlength=E).to(torch.int32).view(W, experts_per_rank)
    if W == 1:
        return send_rows.contiguous(), send_counts, send_slots
    counts = torch.empty_like(send_counts)
    dist.all_to_all_single(counts, send_counts, group=group)  # row q: what q sends this rank
    send_splits = send_counts.sum(1).tolist()
    recv_splits = counts.sum(1).tolist()
    x = tokens.new_empty((sum(recv_splits), tokens.shape[1]))
    dist.all_to_all_single(x, send_rows.contiguous(), recv_splits, send_splits, group=group)
    slots = send_slots.new_empty(sum(recv_splits))
    dist.all_to_all_single(slots, send_slots, recv_splits, send_splits, group=group)
    return x, counts, slots
