"""The unfused path of MoE expert GEMM + combine as a transport (``transport="sequential"``): the
torch path of an expert-parallel layer. One ``torch.matmul`` per (source rank, local expert)
segment of the received rows (cuBLAS / rocBLAS on GPUs), the rows and their slots sent back to
their source ranks by the collective library's ``all_to_all_single`` (NCCL / RCCL, gloo on
emulated ranks), placed by slot, then the weighted top-k sum in float32. Nothing overlaps. It
is what ``transport="auto"`` times the fused kernels against.

The splits of the exchange are data: the host reads the routing counts at every call (two
device syncs), so a call cannot be captured in a CUDA graph (:attr:`capturable` is False: under
``"auto"`` the calls made under capture run the fastest fused transport) and named, it raises
under capture before it reads anything.

Calls are matched the way the collective library matches them: a rank that skips a call waits in
the collective until the process group's timeout (``timeout_s`` is checked but not used); under
``transport="auto"`` a call first agrees with its peers, with a deadline (``ops/planner.py``).
The row counts are exchanged with a flag, so where a rank's counts are not its rows' (a negative
count, more rows counted than ``x`` holds) every rank raises ``ValueError`` in that call,
without a hang; a rank that refuses its input before that exchange (bad shapes, dtypes, ``out``)
still takes part in it with a refusal, and its peers raise
:class:`~portable_overlap.errors.PeerTimeoutError` for that call. The slots are data the host
does not read: a row whose slot is outside its source rank's ``S * top_k`` is dropped, a slot of
``[0, S * k)`` that gets no row or more than one makes its token NaN, as the fused transports
do, and both are raised as :class:`~portable_overlap.errors.InvalidInputError` at the next
:meth:`synchronize`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ...errors import InvalidInputError, PeerTimeoutError
from ..context import collective_call, ContextBase, output_tensor, refuse_grad
from .api import check_inputs, OP


#: the flag of the sizes exchange: this rank's counts are not its rows of x; it refused the
#: call before the exchange (``_abandon_call``)
BAD_COUNTS, REFUSED = 1, 2


class SequentialMoeGemmCombine(ContextBase):
    """The ``"sequential"`` transport's state on one rank: the sizes the calls are checked
    against (``max_tokens``, ``top_k``, ``hidden``, ``experts_per_rank``) and a device counter
    of the routing faults found since the last :meth:`synchronize`. Each call allocates its
    own exchange buffers, as the torch path does."""

    OP = OP
    #: the host reads the routing counts at every call (module docstring)
    capturable = False

    def __init__(self, world, *, max_tokens: int, top_k: int, hidden: int,
                 experts_per_rank: int, timeout_s: float = 10.0):
        super().__init__(world, timeout_s)
        self.max_tokens, self.top_k, self.hidden = max_tokens, top_k, hidden
        self.experts_per_rank = experts_per_rank
        self.max_slots = max_tokens * top_k
        # [rows whose slot is outside their source's slots, slots without exactly one row]
        self._faults = torch.zeros(2, dtype=torch.int64, device=world.device)
        self._exchanging = False
        self.register()

    def synchronize(self) -> None:
        """Wait for this rank's queued calls, then raise :class:`InvalidInputError` where a call
        met slots that were not one per row (module docstring)."""
        super().synchronize()
        outside, unmatched = (int(v) for v in self._faults.tolist())
        if outside or unmatched:
            self._faults.zero_()
            raise InvalidInputError(
                f"{OP}: rank {self.rank}: invalid routing data in calls since the last check: "
                f"{outside} rows came back with a slot outside this rank's S * top_k slots "
                f"(dropped), {unmatched} slots got no row or more than one (their tokens are "
                f"NaN)")

    # -- the call's guards -----------------------------------------------------------------------
    def _before_call(self) -> None:
        super()._before_call()
        self._exchanging = False

    def _abandon_call(self, error: BaseException) -> None:
        """A call refused before its sizes exchange takes part in that exchange with a refusal
        instead, so the peers raise for it too and stay in step; not where ``"auto"`` only
        checks the input (``checking_only``: the planner's agreement tells the peers)."""
        if self._exchanging or self.checking_only or self.world.world_size == 1:
            return
        try:
            self._exchange_sizes([0] * self.world.world_size, REFUSED)
        except PeerTimeoutError:
            pass  # (a peer refused the same call)
        except ValueError:
            pass  # (a peer's counts were not its rows: that peer raises for it)
        except Exception as e:
            self._broken = (f"{OP}: rank {self.rank} could not tell its peers it refused a call "
                            f"({type(e).__name__}: {e})")

    @collective_call
    def __call__(self, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor,
                 slots: torch.Tensor, topk_weights: torch.Tensor,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        refuse_grad(OP, x, w, topk_weights)  # the fused transports' rule: one behaviour
        check_inputs(self, x, w, counts, slots, topk_weights)
        S, k = topk_weights.shape
        if out is not None or not self.checking_only:  # (a check makes no output)
            out = output_tensor(OP, out, (S, self.hidden), x,
                                dict(x=x, w=w, topk_weights=topk_weights))
        if self.checking_only:
            return out
        if self.capturing():
            raise RuntimeError(f"{OP}: transport 'sequential' reads the routing counts on the "
                               f"host at every call and cannot be captured in a CUDA graph; "
                               f"capture a fused transport ('stores')")
        W, E, R = self.world.world_size, self.experts_per_rank, x.shape[0]
        per_segment = counts.reshape(-1).tolist()  # (a device sync: the splits are data)
        total = sum(per_segment)
        bad = min(per_segment) < 0 or total > R
        send_rows = [0] * W if bad else [sum(per_segment[q * E:(q + 1) * E]) for q in range(W)]
        self._exchanging = True  # (from here on the peers hear of this call through it)
        recv_rows = self._exchange_sizes(send_rows, BAD_COUNTS if bad else 0)
        y = x.new_empty((total, self.hidden))
        at = 0
        for s, n in enumerate(per_segment):
            if n:
                torch.matmul(x[at:at + n], w[s % E], out=y[at:at + n])
            at += n
        if W > 1:
            rows = y.new_empty((sum(recv_rows), self.hidden))
            dist.all_to_all_single(rows, y, recv_rows, send_rows, group=self.world.group)
            got = slots.new_empty(sum(recv_rows))
            dist.all_to_all_single(got, slots[:total], recv_rows, send_rows,
                                   group=self.world.group)
        else:
            rows, got = y, slots[:total]
        self._place_and_sum(rows, got, topk_weights, out)
        return out

    def _exchange_sizes(self, send_rows: list, flag: int) -> list:
        """The rows each source sends here, exchanged with every rank's flag: ``BAD_COUNTS``
        (its counts are not its rows': every rank raises ``ValueError`` in this call) or
        ``REFUSED`` (it refused the call before: the others raise ``PeerTimeoutError``)."""
        W = self.world.world_size
        if W == 1:
            recv = [[send_rows[0], flag]]
        else:
            mine = torch.tensor([[n, flag] for n in send_rows], dtype=torch.int64,
                                device=self.world.device)
            theirs = torch.empty_like(mine)
            dist.all_to_all_single(theirs, mine, group=self.world.group)
            recv = theirs.tolist()
        refused = [q for q, (_, f) in enumerate(recv) if f == REFUSED]
        if refused:
            raise PeerTimeoutError(f"{OP}: rank(s) {refused} gave up on this call (they raise "
                                   f"their own error); this rank's output of that call is not "
                                   f"valid")
        flagged = [q for q, (_, f) in enumerate(recv) if f == BAD_COUNTS]
        if flagged:
            raise ValueError(f"{OP}: the routing counts of rank(s) {flagged} are not their rows "
                             f"of x (a negative count, or more rows counted than x has); "
                             f"nothing was exchanged")
        return [n for n, _ in recv]

    def _place_and_sum(self, rows, got, topk_weights, out) -> None:
        """``out[s] = sum_j topk_weights[s, j] * rows[slot s * k + j]`` in float32, the rows
        placed by slot without a host sync: a slot outside ``[0, S * k)`` goes to a spare row,
        a slot that gets no row or more than one makes its token NaN; both are counted."""
        S, k = topk_weights.shape
        n = S * k
        slot = got.long()
        inside = (slot >= 0) & (slot < n)
        slot = torch.where(inside, slot, n)
        placed = torch.empty((n + 1, self.hidden), dtype=torch.float32, device=rows.device)
        if slot.numel():
            placed.index_copy_(0, slot, rows.float())
        unmatched = torch.bincount(slot, minlength=n + 1)[:n] != 1
        self._faults[0] += (~inside).sum()
        self._faults[1] += unmatched.sum()
        # (torch.where, not a masked assignment: that one reads the mask's count on the host)
        placed = torch.where(unmatched[:, None], float("nan"), placed[:n])
        out.copy_((placed.view(S, k, self.hidden) * topk_weights.float().unsqueeze(-1)).sum(1))
