"""The unfused path of embedding pooling + All-to-All as a transport (``transport="sequential"``):
the pooled lookup of this rank's tables for the whole batch (lookup.py: one Triton launch, the
fused kernel's gather without its flag rounds), written straight in the exchange's send order,
then the collective library's ``all_to_all_single`` (NCCL / RCCL on GPUs, gloo on emulated
ranks), then one gather that puts the received columns in global table order. Nothing
overlaps. It is what ``transport="auto"`` times the fused kernel against, and its pick where the
fused kernel's fixed cost (its flag rounds, its persistent grid) outweighs the overlap: on 4
H200s at 1024 samples of 8 tables of D = 64 fp16 the fused kernel took 0.036 ms,
``F.embedding_bag`` per table + NCCL 0.030 and this transport 0.030 (graph replay;
``docs/embedding_alltoall.md``).

Calls are matched the way the collective library matches them: a rank that skips a call or
calls with another batch split waits in the collective until the process group's timeout
(``timeout_s`` is checked but not used); under ``transport="auto"`` a call first agrees with its
peers, with a deadline (``ops/planner.py``). The input checks are the fused transports'
(``tables.RankTables``). An index outside its table, in a call made without the data check
(``validate=False`` or under graph capture), leaves its tile of bags unpooled (zeros) and is
raised as :class:`~portable_overlap.errors.InvalidInputError` at the next :meth:`synchronize`:
reading the count earlier would cost every call a host sync."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ...errors import InvalidInputError
from ..context import collective_call, ContextBase, output_tensor
from .fused import default_block_b, default_num_warps
from .lookup import pooled_lookup
from .tables import BagOffsets, OP, RankTables


class SequentialEmbeddingAllToAll(ContextBase):
    """The ``"sequential"`` transport's workspace on one rank: the send and receive buffers of
    the exchange, made once for the context's largest batch (``tables.max_local_batch`` samples
    per rank) and viewed per dtype, and the bags' offsets. ``block_b`` / ``num_warps``: the
    lookup's tiling (default: the fused kernel's for the call's dtype and D)."""

    OP = OP

    def __init__(self, world, tables: RankTables, *, timeout_s: float = 10.0,
                 block_b: Optional[int] = None, num_warps: Optional[int] = None):
        super().__init__(world, timeout_s)
        self.tables = tables
        self.block_b, self.num_warps = block_b, num_warps
        plan, W, dev = tables.plan, world.world_size, world.device
        T, D = plan.num_tables, plan.dim
        B_max = tables.max_local_batch
        # 4 bytes per element: room for every dtype the op takes
        self._send_raw = torch.empty(max(1, tables.n_loc * W * B_max * D) * 4, dtype=torch.uint8,
                                     device=dev)
        self._recv_raw = torch.empty(max(1, B_max * T * D) * 4, dtype=torch.uint8, device=dev)
        # per global table t: its owner's place in the received rows (the tables of the ranks
        # before it), its owner's table count, its index among its owner's tables (_gather_for)
        before, n_of_owner, j_of = [0] * T, [0] * T, [0] * T
        n = 0
        for q in range(W):
            q_tables = plan.tables_of(q)
            for j, t in enumerate(q_tables):
                before[t], n_of_owner[t], j_of[t] = n, len(q_tables), j
            n += len(q_tables)
        self._before, self._n_of_owner, self._j = (
            torch.tensor(v, dtype=torch.int64, device=dev) for v in (before, n_of_owner, j_of))
        self._gathers: dict = {}  # samples of this rank -> the receive gather
        self._bad = torch.zeros((), dtype=torch.int64, device=dev)  # unchecked calls' bad indices
        self._bag_offsets = BagOffsets(dev)
        # a stand-in for absent per-index weights (the kernel never reads it)
        self._stub = torch.zeros(16, dtype=torch.float32, device=dev)
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
                                    f"(validate=False or graph capture); the tiles of bags "
                                    f"that hold them were not pooled (zeros)")

    @collective_call
    def __call__(self, weight: torch.Tensor, lengths: torch.Tensor, indices: torch.Tensor,
                 per_sample_weights: Optional[torch.Tensor] = None, *,
                 batch_splits: Optional[Sequence[int]] = None, pooling: str = "sum",
                 out: Optional[torch.Tensor] = None,
                 validate: Optional[bool] = None) -> torch.Tensor:
        """The op (``api.py``) on the plain path; ``validate`` as the fused transports'."""
        t, psw = self.tables, per_sample_weights
        splits, checked = t.check(weight, lengths, indices, psw, batch_splits, pooling,
                                  self.validate if validate is None else validate)
        if out is not None or not self.checking_only:  # (a check makes no output)
            out = output_tensor(OP, out, t.output_shape(splits), weight,
                                dict(weight=weight, per_sample_weights=psw))
        if self.checking_only:
            return out
        W, r, D = self.world.world_size, self.rank, t.plan.dim
        B, B_r, n_loc = sum(splits), splits[r], t.n_loc
        # this rank's tables for every rank's samples, [B, n_loc, D]: destination d's samples
        # are rows [boff[d], boff[d+1]), contiguous, in all_to_all_single's send order
        send = self._send_raw.view(weight.dtype)[:B * n_loc * D]
        offsets = self._bag_offsets(lengths, indices.numel(), checked)
        bb = self.block_b or default_block_b(D, self.world.facts.arch, weight.dtype.itemsize)
        nw = self.num_warps or default_num_warps(D, self.world.facts.arch, weight.dtype.itemsize)
        if indices.numel() == 0:  # (no bag reads it)
            indices = torch.zeros(1, dtype=indices.dtype, device=indices.device)
        pooled_lookup(weight, indices, psw if psw is not None and psw.numel() else self._stub,
                      offsets, send, t.row_off, t.rows, self._bad, B, n_loc, D,
                      psw is not None, pooling == "mean", bb, nw)
        if W > 1:
            n_of = [len(t.plan.tables_of(q)) for q in range(W)]
            recv = self._recv_raw.view(weight.dtype)[:B_r * t.plan.num_tables * D]
            dist.all_to_all_single(recv, send,
                                   output_split_sizes=[B_r * n_of[q] * D for q in range(W)],
                                   input_split_sizes=[splits[d] * n_loc * D for d in range(W)],
                                   group=self.world.group)
        else:
            recv = send
        if out.numel():
            torch.index_select(recv.view(-1, D), 0, self._gather_for(B_r),
                               out=out.view(-1, D))
        return out

    def _gather_for(self, B_r: int) -> torch.Tensor:
        """Where row ``s * T + t`` of the output (table t, sample s) is in what this rank
        received: rank q's block ``[B_r, n_q, D]`` starts at row ``B_r * (tables of the ranks
        before q)``, table t is q's j-th: row ``B_r * before[t] + s * n_q + j``. Made by device
        ops only (a call under graph capture can make it), kept for later calls (not one made
        under capture, whose memory is the graph's)."""
        gather = self._gathers.get(B_r)
        if gather is None:
            s = torch.arange(B_r, dtype=torch.int64, device=self._before.device)[:, None]
            gather = (self._before[None, :] * B_r + s * self._n_of_owner[None, :]
                      + self._j[None, :]).reshape(-1)
            if not self.capturing():
                self._gathers[B_r] = gather
        return gather
