"""The plain path of embedding pooling + All-to-All as a transport (``transport="sequential"``):
torch's ``F.embedding_bag`` pools all of this rank's tables in one call (their rows are packed
in one weight, so each index is offset by its table's first row), the pooled rows are put in
destination order, the collective library's ``all_to_all_single`` exchanges them (NCCL / RCCL on
GPUs, gloo on emulated ranks), and one gather puts the received columns in global table order.
Nothing overlaps. It is the baseline the fused transports are timed against by
``transport="auto"``, and the pick where they lose: at small batches the fused kernel's fixed
cost (its flag rounds) exceeds the whole plain path (on 4 H200s, 1024 samples of 8 tables of
D = 64 fp16: fused 0.037 ms, embedding_bag + NCCL 0.031, graph replay).

Pooling runs in the tables' dtype (``F.embedding_bag``), where the fused kernel accumulates in
float32. Calls are matched the way the collective library matches them: a rank that skips a call
or calls with another batch split waits in the collective until the process group's timeout
(``timeout_s`` is checked but not used); under ``transport="auto"`` a call first agrees with its
peers, with a deadline (``ops/planner.py``). The input checks are the fused transports'
(``tables.RankTables``). An index outside its table, in a call made without the data check
(``validate=False`` or under graph capture), reads its table's first row instead and is raised
as :class:`~portable_overlap.errors.InvalidInputError` at the next :meth:`synchronize`: reading
the count earlier would cost every call a host sync."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...errors import InvalidInputError
from ..context import collective_call, ContextBase, output_tensor
from .tables import OP, capturing, RankTables


class SequentialEmbeddingAllToAll(ContextBase):
    """The ``"sequential"`` transport's workspace on one rank: the send and receive buffers of
    the exchange, made once for the context's largest batch (``tables.max_local_batch`` samples
    per rank), viewed per dtype; each call allocates only ``F.embedding_bag``'s result."""

    OP = OP

    def __init__(self, world, tables: RankTables, *, timeout_s: float = 10.0):
        super().__init__(world, timeout_s)
        self.tables = tables
        plan, W, dev = tables.plan, world.world_size, world.device
        T, D = plan.num_tables, plan.dim
        B_max = tables.max_local_batch
        # 4 bytes per element: room for every dtype the op takes
        self._send_raw = torch.empty(max(1, tables.n_loc * W * B_max * D) * 4, dtype=torch.uint8,
                                     device=dev)
        self._recv_raw = torch.empty(max(1, B_max * T * D) * 4, dtype=torch.uint8, device=dev)
        # column i of the exchange's result (rank q's tables in q order, each q's in its order)
        # holds global table order[i]; pos[t] is where table t arrives
        order = [t for q in range(W) for t in plan.tables_of(q)]
        pos = [0] * T
        for i, t in enumerate(order):
            pos[t] = i
        self._pos = torch.tensor(pos, dtype=torch.int64, device=dev)
        self._maps: dict = {}  # batch split -> (send order, receive gather)
        self._bad = torch.zeros((), dtype=torch.int64, device=dev)  # unchecked calls' bad indices
        self.validate = True
        self.register()

    def synchronize(self) -> None:
        """Wait for this rank's queued calls, then raise :class:`InvalidInputError` where an
        unchecked call met an index outside its table (module docstring)."""
        super().synchronize()
        bad = int(self._bad)
        if bad:
            self._bad.zero_()
            raise InvalidInputError(f"{OP}: rank {self.rank}: {bad} indices outside their "
                                    f"tables in calls made without the data check "
                                    f"(validate=False or graph capture); their bags read the "
                                    f"table's first row instead")

    @collective_call
    def __call__(self, weight: torch.Tensor, lengths: torch.Tensor, indices: torch.Tensor,
                 per_sample_weights: Optional[torch.Tensor] = None, *,
                 batch_splits: Optional[Sequence[int]] = None, pooling: str = "sum",
                 out: Optional[torch.Tensor] = None,
                 validate: Optional[bool] = None) -> torch.Tensor:
        """The op (``api.py``) on the plain path; ``validate`` as the fused transports'."""
        t, psw = self.tables, per_sample_weights
        splits = t.resolve_splits(lengths, batch_splits)
        t.check_call(weight, lengths, indices, psw, splits, pooling)
        checked = (self.validate if validate is None else validate) and not capturing(weight)
        if checked:
            t.check_data(lengths, indices)
        if out is not None or not self.checking_only:  # (a check makes no output)
            out = output_tensor(OP, out, t.output_shape(splits), weight,
                                dict(weight=weight, per_sample_weights=psw))
        if self.checking_only:
            return out
        W, r, D = self.world.world_size, self.rank, t.plan.dim
        B, B_r, n_loc = sum(splits), splits[r], t.n_loc
        send_order, gather = self._maps_for(splits)
        send = self._send_raw.view(weight.dtype)[:n_loc * B * D].view(n_loc * B, D)
        if n_loc and B:
            pooled = self._pool(weight, lengths, indices, psw, pooling, B, checked)
            torch.index_select(pooled, 0, send_order, out=send)
        if W > 1:
            n_of = [len(t.plan.tables_of(q)) for q in range(W)]
            recv = self._recv_raw.view(weight.dtype)[:B_r * t.plan.num_tables * D]
            dist.all_to_all_single(recv, send.view(-1),
                                   output_split_sizes=[B_r * n_of[q] * D for q in range(W)],
                                   input_split_sizes=[splits[d] * n_loc * D for d in range(W)],
                                   group=self.world.group)
        else:
            recv = send
        if out.numel():
            torch.index_select(recv.view(-1, D), 0, gather, out=out.view(-1, D))
        return out

    def _pool(self, weight, lengths, indices, psw, pooling: str, B: int,
              checked: bool) -> torch.Tensor:
        """``[n_loc * B, D]``: bag ``j * B + s`` pooled from local table j, one
        ``F.embedding_bag`` over the packed weight. Unchecked lengths are read as the fused
        transports read them: a negative one counts as 0 and the bags end at the last index."""
        t, n = self.tables, indices.numel()
        lengths = lengths.to(torch.int64)
        if not checked:
            lengths = lengths.clamp(min=0)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
        torch.cumsum(lengths, 0, out=offsets[1:])
        if not checked:
            offsets.clamp_(max=n)
        # each index's table: table j's bags hold indices [offsets[j*B], offsets[(j+1)*B]); the
        # indices past the last bag (unchecked lengths only) are counted to the last table
        counts = offsets[::B].diff()
        counts[-1] += n - offsets[-1]
        idx = indices.to(torch.int64)
        if not checked:
            rows = torch.repeat_interleave(t.rows, counts, output_size=n)
            bad = (idx < 0) | (idx >= rows)
            in_bag = torch.arange(n, device=idx.device) < offsets[-1]
            self._bad += (bad & in_bag).sum()
            idx = idx.masked_fill(bad, 0)
        idx = idx + torch.repeat_interleave(t.row_off, counts, output_size=n)
        weights = None if psw is None else psw.to(weight.dtype)
        return F.embedding_bag(idx, weight, offsets, mode=pooling, per_sample_weights=weights,
                               include_last_offset=True)

    def _maps_for(self, splits: tuple) -> tuple:
        """For a batch split: the pooled rows in the exchange's order (for each destination d,
        each local table j, d's samples s: bag ``j * B + boff[d] + s``), and the gather from the
        received rows into the output's (row ``s * T + t`` of the output: table t's row s, which
        arrives at ``pos[t] * B_r + s``). Made by device ops only, so a call under graph capture
        can make them; kept for later calls (not those made under capture, whose memory is the
        graph's)."""
        maps = self._maps.get(splits)
        if maps is not None:
            return maps
        dev, n_loc = self.world.device, self.tables.n_loc
        B, B_r = sum(splits), splits[self.rank]
        j = torch.arange(n_loc, dtype=torch.int64, device=dev)[:, None] * B
        parts, lo = [], 0
        for n in splits:
            parts.append((j + lo + torch.arange(n, dtype=torch.int64, device=dev)[None, :])
                         .reshape(-1))
            lo += n
        send_order = torch.cat(parts) if parts else j.reshape(-1)
        gather = (self._pos[None, :] * B_r
                  + torch.arange(B_r, dtype=torch.int64, device=dev)[:, None]).reshape(-1)
        if not self.capturing():
            self._maps[splits] = (send_order, gather)
        return send_order, gather

