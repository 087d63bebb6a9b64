"""Reference of the MoE dispatch: expert-parallel routing of each rank's tokens with torch and
torch.distributed (three ``all_to_all_single`` calls and a host sync for their splits).

Rank r routes its S tokens to top-k experts; expert ``g`` lives on rank ``g // E_local`` as local
expert ``g % E_local``. Slot ``s * k + j`` names token s's j-th choice. After the dispatch each
rank holds the rows routed to its experts, by source rank then by local expert (within a segment
in slot order), with their counts and slots: exactly the inputs of ``moe_gemm_combine``. Only
real rows travel (no capacity padding).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ...errors import InvalidInputError, PeerTimeoutError, RankMismatchError

#: the flag column of the counts exchange: this source found an expert id out of range, or
#: refused the call before sending anything (``refuse_dispatch``); a bit beside them: autograd
#: records the call on this source (``records_grad``)
BAD_IDS, REFUSED, RECORDS_GRAD = 1, 2, 4


def moe_dispatch_reference(tokens: torch.Tensor, topk_ids: torch.Tensor, experts_per_rank: int,
                           group: Optional[dist.ProcessGroup] = None,
                           records_grad: bool = False):
    """Returns ``(x, counts, slots)``: ``x`` [R, D] the rows this rank's experts must process,
    ``counts`` int32 [world, experts_per_rank] (rows from source q for local expert e),
    ``slots`` int32 [R] (each row's slot on its source rank). Also the ``sequential``
    transport of :class:`~portable_overlap.ops.moe_dispatch.MoeDispatch`.

    ``records_grad``: whether autograd records the layer call this dispatch is part of (its
    backward exchanges rows with every rank, so either every rank records it or none does):
    ranks that differ raise ``RankMismatchError`` on every rank, after the counts exchange."""
    S, k = topk_ids.shape
    W = dist.get_world_size(group) if dist.is_initialized() else 1
    E = experts_per_rank * W
    experts = topk_ids.reshape(-1).long()
    bad = (experts < 0) | (experts >= E)
    order = torch.argsort(torch.where(bad, E, experts), stable=True)  # by rank, local expert
    order = order[:experts.numel() - int(bad.sum())]  # (the bad ids sort last)
    send_rows = tokens[order // k]
    send_slots = order.to(torch.int32)
    send_counts = torch.bincount(experts[order], minlength=E).to(torch.int32).view(W, -1)
    # one more column tells every destination whether the source found a bad id, so that every
    # rank raises for the same call (a rank raising alone would leave its peers in a collective)
    flags = bad.any().to(torch.int32) + (RECORDS_GRAD if records_grad else 0)
    send_counts = torch.cat([send_counts, flags.expand(W, 1)], 1)
    if W == 1:
        counts = send_counts
    else:
        counts = torch.empty_like(send_counts)
        dist.all_to_all_single(counts, send_counts, group=group)  # row q: what q sends here
    refused = (counts[:, -1] == REFUSED).nonzero().flatten().tolist()
    if refused:
        raise PeerTimeoutError(f"moe_dispatch: rank(s) {refused} gave up on this call (they raise "
                               f"their own error); this rank's output of that call is not valid")
    recording = (counts[:, -1] & RECORDS_GRAD).bool()
    if recording.any() and not recording.all():
        raise RankMismatchError(records_grad_mismatch(recording.nonzero().flatten().tolist(),
                                                      (~recording).nonzero().flatten().tolist()))
    flagged = ((counts[:, -1] & ~RECORDS_GRAD) == BAD_IDS).nonzero().flatten().tolist()
    if flagged:
        # (InvalidInputError, as the "stores" kernels raise it: under "auto" either may run)
        raise InvalidInputError(f"moe_dispatch: expert ids must be in [0, {E}); rank(s) "
                                f"{flagged} passed others")
    send_counts, counts = send_counts[:, :-1].contiguous(), counts[:, :-1].contiguous()
    if W == 1:
        return send_rows.contiguous(), counts, send_slots
    send_splits = send_counts.sum(1).tolist()
    recv_splits = counts.sum(1).tolist()
    x = tokens.new_empty((sum(recv_splits), tokens.shape[1]))
    dist.all_to_all_single(x, send_rows.contiguous(), recv_splits, send_splits, group=group)
    slots = send_slots.new_empty(sum(recv_splits))
    dist.all_to_all_single(slots, send_slots, recv_splits, send_splits, group=group)
    return x, counts, slots


def records_grad_mismatch(recording: list, not_recording: list) -> str:
    """The message for a layer call autograd records on some ranks and not on others."""
    return (f"moe_dispatch: autograd records this MoE layer call on rank(s) {recording} and not "
            f"on rank(s) {not_recording}: the layer's backward exchanges rows with every rank, "
            f"so every rank must train it (or run it under torch.no_grad()) in the same call; "
            f"nothing of this call was exchanged")


def refuse_dispatch(world_size: int, experts_per_rank: int, device, group=None) -> None:
    """A source's part of the counts exchange of ``moe_dispatch_reference`` for a call it
    refuses (bad input, found before the exchange): its peers, already in the exchange or
    about to enter it, raise for that same call instead of pairing it with this rank's next
    one."""
    if world_size == 1:
        return
    send = torch.zeros((world_size, experts_per_rank + 1), dtype=torch.int32, device=device)
    send[:, -1] = REFUSED
    dist.all_to_all_single(torch.empty_like(send), send, group=group)


def moe_dispatch_swiglu_reference(tokens, topk_ids, w_gate, w_up, experts_per_rank: int,
                                  group=None) -> tuple:
    """``(h, counts, slots)``: ``moe_dispatch_reference``, then the experts' gated first GEMM
    on the rows received (``expert_swiglu_reference``; float32, rounded to the rows' dtype)."""
    from ..moe_experts.reference import expert_swiglu_reference

    x, counts, slots = moe_dispatch_reference(tokens, topk_ids, experts_per_rank, group)
    return expert_swiglu_reference(x, w_gate, w_up, counts), counts, slots
