"""GEMM + ReduceScatter and GEMM + AllReduce with the reduction's traffic on copy engines.

What they compute, with ``a_q`` [M, K_q] and ``b_q`` [K_q, N] the tensors rank q passes (the K
dimension split over the ranks: a row-parallel linear layer, each rank holding a K shard)::

    c = sum_q a_q @ b_q                                  # [M, N], never formed on one rank
    reduce_scatter:  out_r = c[M*r//W : M*(r+1)//W]      # rank r's row block (M % W == 0)
    all_reduce:      out_r = c                           # on every rank

Schedule on rank r (``pieces`` = P row blocks per rank's block; the vendor BLAS computes, DMA
moves, no SM is spent on communication):

1. *partials for the peers first* (communication-aware order): for k = 0..P-1 and
   d = r+1, r+2, ..., piece k of rank d's rows is computed (``a_r[rows] @ b_r``) and sent by DMA
   into d's heap (on d's lane, ``put_lanes``) while the next piece is computed;
2. *own rows*: piece k of rank r's block waits (bounded, on the device) for piece k from every
   peer, then one ``addmm`` adds the peers' partial to this rank's own product (W = 2; with more
   ranks the own product goes beside the peers' and one sum reduces them). By then the peers'
   piece k has long landed: they sent it during their step 1;
3. *all_reduce only*: each reduced piece is written to this rank's heap and offered (a flag);
   every peer's copy engine pulls it straight into the peer's ``out`` on a stream of its own, so
   a pull waiting for one piece never holds back the sends, and no staging copy is made on the
   receiving side. Only the last piece's transfer is not hidden.

Reductions are done in float32 inside the BLAS epilogue (or torch.sum) and rounded once, so with
two ranks the result is closer to the float32 sum than NCCL's reduction of two rounded partials.
Every wait is a bounded one-program kernel (transports/copy_engine.py): a rank that never calls
makes the others raise ``PeerTimeoutError`` at their next check instead of hanging; a rank called
with another M, N, dtype or piece count is caught by the tag its pieces carry.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...transports.copy_engine import FLAG_NAMES as CE_FLAG_NAMES, CopyEngineLinks
from ..context import check_sizes, collective_call, OverlapContext, output_tensor, shape_tag
from ..matmul.api import DTYPES, add_epilogue, check_operands, vector_checks

OP = "matmul_reduce"
MODES = ("reduce_scatter", "all_reduce")


class MatmulReduce(OverlapContext):
    """Workspace of GEMM + ReduceScatter / AllReduce on one rank: a receive buffer for the peers'
    partials and one for their reduced rows, ``max_elems`` elements each (any dtype of
    ``DTYPES``), in the symmetric heap; piece flags. Collective to create and close; the same
    calls in the same order on every rank, on any streams (each call runs after the last).

    A call needs ``MatmulReduce.elems_needed(M, N, W)`` = W·⌈M/W⌉·N elements: rank r receives
    W partials of its own row block, and the largest block has ⌈M/W⌉ rows. That is M·N when W
    divides M (always for reduce_scatter); size the context with ``elems_needed`` of the largest
    call otherwise."""

    OP = OP
    FLAG_NAMES = CE_FLAG_NAMES

    def __init__(self, world, max_elems: int, *, pieces: int = 4,
                 put_lanes: Optional[int] = None, timeout_s: float = 10.0, op: str = OP):
        self.OP = op  # the public op the errors name (the pattern contexts pass theirs)
        W = world.world_size
        if max_elems < 1:
            raise ValueError(f"{OP}: max_elems must be >= 1, got {max_elems}")
        # an int, not a float or bool: a float count was taken here and failed in the call's
        # slicing with a TypeError naming no argument ("slice indices must be integers")
        if isinstance(pieces, bool) or not isinstance(pieces, int) or not 1 <= pieces <= 128:
            raise ValueError(f"{OP}: pieces must be an int in [1, 128], got {pieces!r}")
        # Default: one lane per peer. On 4 H200s reduce_scatter at 8192^3 takes 0.608 ms with
        # it against 0.695 with a single lane, and it is faster at 9 of the 12 benchmark cases. The
        # copies themselves still run one at a time (profiles in docs/scaling.md), but a lane's
        # flag waits and signals do not hold back the copies queued for the other peers.
        if put_lanes is None:
            put_lanes = max(1, W - 1)
        check_sizes(OP, put_lanes=put_lanes)
        # more lanes than peers would stay idle
        put_lanes = min(put_lanes, max(1, W - 1))
        world.check_same(f"{OP} context arguments (max_elems, pieces, put_lanes)",
                         (max_elems, pieces, put_lanes))
        super().__init__(world, [
            ("_partials_raw", (max_elems,), torch.float32),  # peers' partials of my rows
            # all_reduce: this rank's reduced rows, pulled by the peers (reduce_scatter: staging)
            ("_reduced_raw", (max_elems,), torch.float32),
            # slots 0..P-1: partial pieces, P..2P-1: reduced pieces
            ("ce_ready", (W, 2 * pieces), torch.int64), ("ce_consumed", (W,), torch.int64),
            ("ce_ctl", (1,), torch.int64),
        ], timeout_s)
        self.max_elems, self.pieces, self.put_lanes = max_elems, pieces, put_lanes
        self._partials = {dt: self._partials_raw.view(torch.uint8).view(dt) for dt in DTYPES}
        self._reduced = {dt: self._reduced_raw.view(torch.uint8).view(dt) for dt in DTYPES}
        # lanes 0..put_lanes-1: partials out (peer r+i on lane (i-1) % put_lanes, so with
        # W-1 lanes each peer's sends queue on a stream of their own); lane 0 also offers the
        # reduced pieces; the last lane pulls the peers' reduced pieces in
        self._pull_lane = put_lanes
        self._links = CopyEngineLinks(self, self.ce_ready, self.ce_consumed, self.ce_ctl,
                                      lanes=put_lanes + 1)
        # a peer releases this rank after all its puts of the call, to every rank, have landed:
        # after a call this rank refused or failed, a late peer's partials land before this
        # rank puts the next call's partials where they would fall
        self.late_stores_guard(self.ce_consumed, "recv-consumed", epoch=self.ce_ctl)

    @staticmethod
    def elems_needed(M: int, N: int, world_size: int) -> int:
        """Receive room (elements) a call with an [M, N] result needs on W = ``world_size``
        ranks: W partials of the largest row block (⌈M/W⌉ rows)."""
        return world_size * -(-M // world_size) * N

    def reduce_scatter(self, a: torch.Tensor, b: torch.Tensor,
                       out: Optional[torch.Tensor] = None, *,
                       bias: Optional[torch.Tensor] = None,
                       residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rank r's row block ``[M*r/W, M*(r+1)/W)`` of ``sum_q a_q @ b_q`` (+ bias [N]
        + residual [M/W, N]) (module docstring)."""
        return self._call("reduce_scatter", a, b, out, bias, residual)

    def all_reduce(self, a: torch.Tensor, b: torch.Tensor,
                   out: Optional[torch.Tensor] = None, *, bias: Optional[torch.Tensor] = None,
                   residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``sum_q a_q @ b_q`` (+ bias [N] + residual [M, N]) on every rank (module
        docstring)."""
        return self._call("all_reduce", a, b, out, bias, residual)

    @collective_call
    def _call(self, mode, a, b, out, bias=None, residual=None):
        # errors name the public op (matmul_reduce_scatter / matmul_all_reduce)
        check_operands(f"matmul_{mode}", a, b, self.world.device)
        W, r, P = self.world.world_size, self.rank, self.pieces
        M, N = a.shape[0], b.shape[1]
        if mode == "reduce_scatter" and M % W:
            raise ValueError(f"matmul_reduce_scatter: M={M} rows must split evenly over {W} ranks")
        need = self.elems_needed(M, N, W)
        if need > self.max_elems:
            raise ValueError(f"matmul_{mode}: an [{M}, {N}] result on {W} ranks needs "
                             f"{W}*ceil({M}/{W})*{N} = {need} elements of receive room; this "
                             f"context has max_elems={self.max_elems} (size it with "
                             f"MatmulReduce.elems_needed(M, N, world_size) of the largest call)")
        block = [M * q // W for q in range(W + 1)]  # rank q's rows: [block[q], block[q+1])
        rows_out = block[r + 1] - block[r] if mode == "reduce_scatter" else M
        out = output_tensor(f"matmul_{mode}", out, (rows_out, N), a,
                            dict(a=a, b=b, bias=bias, residual=residual))
        vector_checks(f"matmul_{mode}", a, N, rows_out, bias=bias, residual=residual)
        links = self._links
        partials = self._partials[a.dtype]
        reduced = self._reduced[a.dtype][: M * N].view(M, N)
        tag = self.call_tag(shape_tag(self.OP, mode, M=M, N=N, dtype=str(a.dtype), pieces=P))

        # Equal pieces. (Tapered all_reduce pieces, weights P..1 so that the exposed pull of the
        # last reduced piece shrinks, were measured slower: 1.088 vs 0.926 ms at 8192^2 x 4096;
        # the large first pieces' transfers and the uneven BLAS calls cost more than the tail
        # saves.)
        def piece(q, k):  # rows of piece k of rank q's block
            n = block[q + 1] - block[q]
            return block[q] + n * k // P, block[q] + n * (k + 1) // P

        def partial_slot(q, k, src):  # in rank q's heap: piece k of its block, from rank src
            lo, hi = piece(q, k)
            start = W * (lo - block[q]) * N + src * (hi - lo) * N
            return partials[start:start + (hi - lo) * N].view(hi - lo, N)

        pull_lane = self._pull_lane
        links.begin()
        links.follow(pull_lane)  # forks here: its pulls (queued below) wait for flags only
        # 1. the peers' rows (peer r+1 first within each piece index); a piece leaves while the
        #    next one is computed.
        #    Staging: all_reduce's own out rows (the pulls of step 3b overwrite them only after
        #    the peer has reduced this data, so after the copy read it); reduce_scatter's unused
        #    reduced buffer.
        #    Piece k for every peer before piece k+1 for any, so every lane has work from the
        #    start. (Measured on 4 H200s: no change beyond noise against peer by peer, RS
        #    8192^3 0.665 against 0.631 ms, AR 1.088 against 1.140: the copies of different lanes
        #    do not overlap there, one 8 MiB copy at a time at 170-300 GB/s; docs/scaling.md.)
        for k in range(P):
            for i in range(1, W):
                d, lane = (r + i) % W, (i - 1) % self.put_lanes
                lo, hi = piece(d, k)
                stage = out[lo:hi] if mode == "all_reduce" else reduced[lo:hi]
                if hi > lo:
                    torch.matmul(a[lo:hi], b, out=stage)
                links.follow(lane)
                with links.on_side(lane):
                    if k == 0:
                        links.wait_consumed(d)
                    links.put(d, partial_slot(d, k, r), stage, k, tag)
        # 2. this rank's rows: own product plus what the peers sent (bounded waits on this
        #    stream); all_reduce reduces into the heap, where the peers pull from
        peers = [(r - i) % W for i in range(1, W)]
        for k in range(P):
            lo, hi = piece(r, k)
            for q in peers:
                links.wait_ready(q, k, tag)
            if mode == "reduce_scatter":
                o = out[lo - block[r]:hi - block[r]]
            else:
                o = reduced[lo:hi]
            if hi > lo:
                if W == 2:  # one BLAS call: its epilogue adds the peer's partial in fp32
                    torch.addmm(partial_slot(r, k, peers[0]), a[lo:hi], b, out=o)
                else:
                    torch.matmul(a[lo:hi], b, out=partial_slot(r, k, r))
                    torch.sum(partials[W * (lo - block[r]) * N:W * (hi - block[r]) * N]
                              .view(W, hi - lo, N), 0, out=o)
            if mode == "all_reduce":  # 3a. offer the reduced piece; keep a copy in out
                links.follow()
                with links.on_side():
                    for q in peers:
                        links.notify(q, P + k, tag)
                    links.copy_local(out[lo:hi], o)
        if mode == "all_reduce":
            # 3b. the peers' reduced pieces, pulled as they are offered. Queued last on the host
            # (where there are no side streams, as in the interpreter, program order must not
            # wait for a peer's step 2 before this rank's step 1), but the pull lane only waited
            # for the call's start, so on a GPU they run during step 2.
            with links.on_side(pull_lane):
                for i in range(1, W):
                    q = (r + i) % W
                    for k in range(P):
                        lo, hi = piece(q, k)
                        links.wait_ready(q, P + k, tag)
                        links.pull(q, out[lo:hi], reduced[lo:hi])
        # the release (the peers may overwrite what they sent and what this rank pulled) after
        # every read of those buffers (this stream's sums, the pull lane's pulls) and every put
        # lane's puts: a peer that failed the call waits for it (settle_late_stores) before it
        # puts the next call's partials into a rank this one may still be putting into
        links.rejoin()
        for q in peers:
            links.release(q)
        add_epilogue(out, bias, residual)
        return out
