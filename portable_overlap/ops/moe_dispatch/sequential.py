"""The unfused MoE dispatch as a transport (``transport="sequential"``): the torch path of an
expert-parallel layer. ``moe_dispatch_reference`` sorts the slots by expert, exchanges the
counts with ``all_to_all_single`` (NCCL / RCCL, gloo on emulated ranks), reads the splits on the
host and moves the rows and their slots with two more ``all_to_all_single`` calls; the rows are
then copied into the context's receive buffers, so a call returns the layout and buffers of the
fused transports. Nothing overlaps. It is what ``transport="auto"`` times the fused dispatch
against.

The host reads the splits at every call, so a call cannot be captured in a CUDA graph
(:attr:`capturable` is False: under ``"auto"`` the calls made under capture run a fused
transport) and named, it raises under capture before it moves anything.

Faults, each raised in the call that meets it: an expert id out of range on any rank raises
:class:`~portable_overlap.errors.InvalidInputError` (the class the ``"stores"`` kernels raise it
with, at their next check) on every rank (the counts exchange carries a flag); a call a rank
refuses before the exchange (bad input) raises on every rank, the refusing rank taking part in
the exchange with a refusal flag (``reference.refuse_dispatch``); more rows for a rank than its
``capacity`` raise :class:`~portable_overlap.errors.InvalidInputError` on every rank (one
``all_reduce`` of a flag per rank tells them), the overflowing rank's buffers then holding
nothing of the call. A rank that skips a call leaves its peers in the collective library's
wait (the process group's timeout; ``timeout_s`` is checked but not used); under
``transport="auto"`` a call first agrees with its peers, with a deadline (``ops/planner.py``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ...errors import InvalidInputError
from ..context import collective_call, ContextBase, refuse_grad
from .api import check_call, check_sizes, OP
from .reference import moe_dispatch_reference, refuse_dispatch


class SequentialMoeDispatch(ContextBase):
    """The ``"sequential"`` transport's state on one rank: the sizes calls are checked against
    and the receive buffers a call fills (``recv`` [capacity, hidden], ``recv_slots``
    [capacity], ``counts`` [W, experts_per_rank]). ``share``: a fused workspace of the same
    sizes whose buffers to fill instead of making its own (``"auto"`` makes its candidates
    share one set: a call returns the same buffers whichever transport ran it, at the memory
    of one)."""

    OP = OP
    #: the host reads the splits at every call (module docstring)
    capturable = False

    def __init__(self, world, *, max_tokens: int, top_k: int, hidden: int,
                 experts_per_rank: int, dtype: torch.dtype = torch.bfloat16,
                 capacity: Optional[int] = None, timeout_s: float = 10.0, share=None):
        super().__init__(world, timeout_s)
        capacity = check_sizes(world, max_tokens, top_k, hidden, experts_per_rank, dtype,
                               capacity)
        self.transport = "sequential"
        self.max_tokens, self.top_k, self.hidden = max_tokens, top_k, hidden
        self.experts_per_rank, self.dtype, self.capacity = experts_per_rank, dtype, capacity
        if share is not None:
            self.recv, self.recv_slots, self.counts = share.recv, share.recv_slots, share.counts
        else:
            dev = world.device
            self.recv = torch.zeros((capacity, hidden), dtype=dtype, device=dev)
            self.recv_slots = torch.zeros(capacity, dtype=torch.int32, device=dev)
            self.counts = torch.zeros((world.world_size, experts_per_rank), dtype=torch.int32,
                                      device=dev)
        self._exchanging = False
        self.register()

    def close(self) -> None:
        super().close()
        self.recv = self.recv_slots = self.counts = None

    @collective_call
    def __call__(self, tokens: torch.Tensor, topk_ids: torch.Tensor) -> tuple:
        refuse_grad(OP, tokens)  # the fused transports' rule: one behaviour
        check_call(self, tokens, topk_ids)
        if self.checking_only:
            return self.recv, self.counts, self.recv_slots
        self._refuse_capture()
        return self._dispatch(tokens, topk_ids)

    @collective_call
    def dispatch_swiglu(self, tokens: torch.Tensor, topk_ids: torch.Tensor,
                        w_gate: torch.Tensor, w_up: torch.Tensor,
                        out: Optional[torch.Tensor] = None, *, senders: Optional[int] = None,
                        config=None, rows_per_segment: Optional[float] = None) -> tuple:
        """``moe_dispatch_swiglu`` on the torch path: the dispatch, then ``expert_swiglu`` on
        the rows received (per-source row tiles and whole K loops, as the fused kernel's);
        ``senders`` is checked and has nothing to set here."""
        from . import swiglu
        from ..moe_experts import expert_swiglu

        out = swiglu.check_arguments(self, tokens, topk_ids, w_gate, w_up, out, senders, config,
                                     rows_per_segment)
        self._refuse_capture()
        x, counts, slots = self._dispatch(tokens, topk_ids)
        expert_swiglu(x, w_gate, w_up, counts, out, config=config, gather=False, split=False,
                      rows_per_segment=rows_per_segment)
        return out, counts, slots

    def _refuse_capture(self) -> None:
        if self.capturing():
            raise RuntimeError(f"{OP}: transport 'sequential' reads the splits on the host at "
                               f"every call and cannot be captured in a CUDA graph; capture a "
                               f"fused transport ('stores')")

    def _dispatch(self, tokens, topk_ids) -> tuple:
        self._exchanging = True  # (from here on the peers are in this call's exchanges)
        # (ContextBase.records_grad travels in the counts exchange's flags)
        x, counts, slots = moe_dispatch_reference(tokens, topk_ids, self.experts_per_rank,
                                                  self.world.group, self.records_grad)
        R = x.shape[0]
        over = self._overflowing(R)
        if R > self.capacity:
            self.counts.zero_()  # (no consumer reads rows this call did not store)
        else:
            self.recv[:R].copy_(x)
            self.recv_slots[:R].copy_(slots)
            self.counts.copy_(counts)
        if over:
            raise InvalidInputError(f"{OP}: rank(s) {over} receive more rows in this call than "
                                    f"their capacity of {self.capacity}"
                                    + (f" (this rank: {R})" if self.rank in over else ""))
        return self.recv, self.counts, self.recv_slots

    def _overflowing(self, rows: int) -> list:
        """The ranks that receive more than ``capacity`` rows in this call (this one's
        ``rows``), told to every rank by one ``all_reduce``: all of them raise for the call, as
        the fused transports do. Were the overflowing rank alone to raise, its peers would go
        on to the call's next op (the combine, in a layer), which it never makes."""
        W = self.world.world_size
        flags = torch.zeros(W, dtype=torch.int32, device=self.world.device)
        flags[self.rank] = int(rows > self.capacity)
        if W > 1:
            dist.all_reduce(flags, group=self.world.group)
        return flags.nonzero().flatten().tolist()

    # -- the call's guards -----------------------------------------------------------------------
    def _before_call(self) -> None:
        super()._before_call()
        self._exchanging = False

    def _abandon_call(self, error: BaseException) -> None:
        """A call refused before its counts exchange takes part in that exchange with a
        refusal instead, so the peers raise for it too (``refuse_dispatch``) and stay in step;
        not where ``"auto"`` only checks the input (``checking_only``: the planner's agreement
        tells the peers)."""
        if self._exchanging or self.checking_only:
            return
        try:
            refuse_dispatch(self.world.world_size, self.experts_per_rank, self.world.device,
                            self.world.group)
        except Exception as e:
            self._broken = (f"{OP}: rank {self.rank} could not tell its peers it refused a call "
                            f"({type(e).__name__}: {e})")
