"""Reference of embedding pooling + All-to-All: ``F.embedding_bag`` per local table, then
``all_to_all_single`` (the differentiable one from ``torch.distributed.nn``), then the columns put
in global table order. Also the sequential baseline of the benchmark."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .plan import ShardingPlan


def embedding_all_to_all_reference(weight: torch.Tensor, lengths: torch.Tensor,
                                   indices: torch.Tensor,
                                   per_sample_weights: Optional[torch.Tensor],
                                   plan: ShardingPlan, rank: int, batch_splits: Sequence[int],
                                   pooling: str = "sum",
                                   group: Optional[dist.ProcessGroup] = None,
                                   accumulate_fp32: bool = True) -> torch.Tensor:
    """``[batch_splits[rank], T * D]``: see ``api.py``. Differentiable in ``weight`` and
    ``per_sample_weights``. ``accumulate_fp32`` pools in float32 and casts (tests); else pools
    in the table dtype (the benchmark's sequential baseline)."""
    W = plan.world_size
    D = plan.dim
    local = plan.tables_of(rank)
    B = sum(batch_splits)
    w = weight.float() if accumulate_fp32 else weight
    psw = per_sample_weights
    if psw is not None:
        psw = psw.to(w.dtype)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    pooled = []
    for j, top in enumerate(plan.row_offsets(rank)):
        table = w[top:top + plan.table_rows[local[j]]]
        lo, hi = offsets[j * B], offsets[(j + 1) * B]  # (host reads: reference only)
        idx = indices[lo:hi].long()
        pooled.append(F.embedding_bag(idx, table, offsets[j * B:(j + 1) * B] - lo, mode=pooling,
                                      per_sample_weights=None if psw is None else psw[lo:hi]))
    # pooled[j]: [B, D]; rank d gets rows [boff[d], boff[d+1]) of every local table
    bounds = [0]
    for n in batch_splits:
        bounds.append(bounds[-1] + n)
    # [B, n_loc, D]; a rank without tables sends an empty view of its weight, so that its
    # backward still takes part in the reverse exchange (a collective)
    mine = torch.stack(pooled, 1) if pooled else w.reshape(-1)[:0].view(B, 0, D)
    send = mine.reshape(-1)
    B_r = batch_splits[rank]
    if W > 1:
        n_of = [len(plan.tables_of(q)) for q in range(W)]
        recv = _AllToAll.apply(send, [B_r * n_of[q] * D for q in range(W)],
                               [batch_splits[d] * len(local) * D for d in range(W)], group)
        parts = list(recv.split([B_r * n_of[q] * D for q in range(W)]))
        cols = torch.cat([p.view(B_r, n_of[q], D) for q, p in enumerate(parts)], 1)
        order = [t for q in range(W) for t in plan.tables_of(q)]  # column i holds table order[i]
        where = torch.empty(plan.num_tables, dtype=torch.long)
        where[torch.tensor(order, dtype=torch.long)] = torch.arange(plan.num_tables)
        out = cols[:, where.to(cols.device)]
    else:
        out = mine
    return out.reshape(B_r, plan.num_tables * D).to(weight.dtype)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` whose backward is the reverse exchange (splits swapped)."""

    @staticmethod
    def forward(ctx, send, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        recv = send.new_empty(sum(out_splits))
        dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=out_splits,
                               input_split_sizes=in_splits, group=group)
        return recv

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits))
        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=in_splits,
                               input_split_sizes=out_splits, group=ctx.group)
        return back, None, None, None
