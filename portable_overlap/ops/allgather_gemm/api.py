"""AllGather + GEMM, one context per pattern with the transport as an argument: the copy-engine
transport with the FiCCO schedules (1-D and 2-D, below), ``"stores"`` (``stores.py``),
``"torch_fused"`` (``ops/torch_fused.py``) or the plain sequential path.

What it computes, with ``a_r`` [m, K] the row shard rank r passes and ``b`` [K, N] (of one shape on
every rank, e.g. a column-parallel weight's local columns; ranks whose N differs are refused)::

    out = cat([a_0, a_1, ..., a_{W-1}]) @ b          # [W * m, N] on every rank

i.e. ``all_gather(a) @ b`` (sequence-parallel input of a column-parallel linear), with the gather
done by DMA (copy engines: no SM) one level finer than the shards (FiCCO): each shard is cut into
``pieces`` pieces (default: W), rank r pushes piece p of its shard to every peer's heap, piece
after piece, as soon as the call starts (one copy stream per peer), and computes on what has
arrived. Schedules (``schedule=``; default: ``pick_schedule``), 1-D ones (a piece is a block of
rows, ``a_r[i0:i1]``, gathered piece-major ``[p][q][rows, K]``):

- ``"hetero-unfused-1d"``: this rank's own shard first (no waiting), then one GEMM per arrived
  (peer, piece) buffer, each written straight into its rows of ``out``;
- ``"hetero-fused-1d"``: own shard first, then one GEMM per step p over every peer's piece p
  (the buffers sit together in the heap, piece-major), scattered into ``out`` by row copies;
- ``"uniform-fused-1d"``: every step p is one GEMM over all W ranks' piece p (this rank's own
  piece copied beside the peers'), so every step runs the same GEMM.

2-D ones (a piece is a block of columns, ``a_r[:, k0:k1]``, pieces along K, moved by one 2-D DMA
copy each; gathered rank-major, so the buffer is ``cat(all_gather(a))`` as a row-major
[W*m, K] matrix once every piece is in), each GEMM a partial sum over its K block::

    out[q*m:(q+1)*m]  = a_q[:, k_0] @ b[k_0]         # first non-empty piece
    out[q*m:(q+1)*m] += a_q[:, k_p] @ b[k_p]         # every later piece, in place (addmm)

- ``"hetero-unfused-2d"``: own rows first over the whole K (no waiting), then per piece p one
  GEMM per peer q as its block p arrives;
- ``"uniform-fused-2d"`` (the paper's 2-D schedule): per piece p one GEMM over all W*m rows
  (this rank's block copied beside the peers').

The 2-D partial sums round ``out`` once per piece: bf16/fp16 results carry about sqrt(pieces)
times the 1-D schedules' rounding error (see ``_call_2d``). On 2x H200 (docs/allgather_gemm.md)
neither 2-D schedule beat the 1-D pick at any benchmark shape, the M < K one included, so
``pick_schedule`` never returns them: ask for them by name.

Every wait is a bounded one-program kernel on the compute stream (transports/copy_engine.py): a
rank that never sends makes the call raise ``PeerTimeoutError`` at the next check, not hang.

Transports (``AllGatherMatmul(..., transport=)``): ``"copy_engine"`` (the above; the default
on CPU-emulated ranks, ``"auto"`` on a GPU; options ``pieces``, ``schedule``, and
``direction="pull"``: whole shards pulled by the receivers, torch's way, ``AllGatherMatmulCE``);
``"stores"``: one persistent Triton kernel whose first programs store the shard into every
peer's heap, all peers at once, while the others multiply the rows that have arrived
(``stores.py``, ``kernel.py``; options ``config``, ``senders``, ``copy_block``, ``join``,
``pull_share``, ``pull_pieces``, ``bulk_copies``);
``"torch_fused"``: torch's ``torch.ops.symm_mem.fused_all_gather_matmul`` (``ops/torch_fused.py``;
no options; GPU worlds of one host only, elsewhere it raises ``BackendUnavailable``); and
``"sequential"``: the vendor library's ``all_gather_into_tensor``, then ``torch.matmul``
(``ops/sequential.py``; no options), the baseline and the choice where the copy engines
measured slower. ``"auto"`` makes every transport that can run on the world and keeps, per
call shape, the one that timed fastest at that shape's first call (``ops/planner.py``;
``sequential`` unless beaten by more than 3 %); a call that passes ``schedule`` runs on
``"copy_engine"``, the one transport with schedules.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...transports.copy_engine import FLAG_NAMES as CE_FLAG_NAMES, CopyEngineLinks
from ..context import check_sizes, collective_call, OverlapContext, output_tensor, shape_tag
from ...kept import GrowingBuffer
from ..pattern import GEMM_AGREED, PatternContext, matrix_sizes, timeout_kw
from ..registry import OpSpec, define
from ..matmul.api import DTYPES, check_operands

OP = "all_gather_matmul"
#: ``"copy_engine"``: the shards travel by DMA while the BLAS computes (module docstring);
#: ``"stores"``: one persistent kernel stores the shard into every peer's heap while it
#: multiplies what has arrived (stores.py, kernel.py);
#: ``"torch_fused"``: torch's ``fused_all_gather_matmul`` (ops/torch_fused.py; GPUs only);
#: ``"sequential"``: gather, then multiply
TRANSPORTS = ("copy_engine", "stores", "torch_fused", "sequential")
SCHEDULES = ("hetero-unfused-1d", "hetero-fused-1d", "uniform-fused-1d", "hetero-unfused-2d",
             "uniform-fused-2d")

#: machine op-to-byte ratios (dense bf16 FLOP/s over HBM bytes/s) from the figures measured on the
#: 2-GPU machine (../shared/DESIGN.md: cuBLAS 671 TFLOP/s, HBM 4.37 TB/s); other devices use the
#: H200 value until they are measured
MACHINE_OTB = {"sm_90": 671e12 / 4.37e12}


def pick_schedule(M: int, N: int, K: int, elem_bytes: int, arch: str) -> str:
    """The FiCCO heuristic for the 1-D schedules: GEMMs whose arithmetic intensity (op-to-byte,
    FLOPs over the bytes of A, B and C) is low lose least to one large GEMM per step
    (``uniform-fused``), intense ones lose least to small independent GEMMs starting on the local
    shard at once (``hetero-unfused``, above 5× the machine's ratio), ``hetero-fused`` between.
    The paper also weighs memory traffic and picks its 2-D schedule when M <= K. This library has
    2-D schedules (``hetero-unfused-2d``, ``uniform-fused-2d``), measured on 2x H200
    (docs/allgather_gemm.md): ``hetero-unfused-2d`` within 4.3 % of ``hetero-unfused-1d`` (ahead
    only at M < K, 0.722 vs 0.744 ms at 4096x8192x16384, where the pick measured 0.699),
    ``uniform-fused-2d`` 3-9 % behind ``uniform-fused-1d``. Neither beat the pick at any shape,
    so the heuristic never returns them: ask for them by name."""
    otb = 2.0 * M * N * K / (elem_bytes * (M * K + K * N + M * N))
    machine = MACHINE_OTB.get(arch, MACHINE_OTB["sm_90"])
    if otb < machine:
        return "uniform-fused-1d"
    if otb > 5 * machine:
        return "hetero-unfused-1d"
    return "hetero-fused-1d"


def check_input(a: torch.Tensor, b: torch.Tensor, world, max_shard_elems: int) -> None:
    """What every transport checks of the operands first, with the same errors (switching the
    transport changes nothing but speed): the operands, the shard's size, a contiguous ``a``
    (its rows are copied by DMA)."""
    check_operands(OP, a, b, world.device)
    m, K = a.shape
    if m * K > max_shard_elems:
        raise ValueError(f"{OP}: the shard's m*K={m * K} exceeds this context's "
                         f"max_shard_elems={max_shard_elems}")
    if not a.is_contiguous():
        raise ValueError(f"{OP}: a must be contiguous (its rows are copied by DMA)")


def refuse_schedule(transport: str, schedule: Optional[str]) -> None:
    """A transport without copy-engine schedules (every one but ``"copy_engine"``) refuses a
    ``schedule`` argument with the same words."""
    if schedule is not None:
        raise ValueError(f"{OP}: the {transport!r} transport has no schedules; got "
                         f"schedule={schedule!r}")


def check_call(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor], world,
               max_shard_elems: int) -> torch.Tensor:
    """``check_input``, then ``out`` of shape [W * m, N] (made if None). Returns ``out``."""
    check_input(a, b, world, max_shard_elems)
    return output_tensor(OP, out, (world.world_size * a.shape[0], b.shape[1]), a,
                         dict(a=a, b=b))


class AllGatherMatmul(PatternContext):
    """Workspace of :func:`all_gather_matmul` on one rank, for shards of at most
    ``max_shard_elems`` elements (m × K of the largest call): ``AllGatherMatmul(world,
    max_shard_elems, transport=None, **options)``, ``transport`` one of ``TRANSPORTS`` or
    ``"auto"``, the default on a GPU world (``PatternContext.default_transport``; a per-call
    ``schedule`` keeps an ``"auto"`` call on ``"copy_engine"``), ``options`` the named
    transport's (``"copy_engine"``: ``pieces=``, ``direction=``). Collective to create and
    close; the same calls in the same order on every rank, on any streams (each call runs
    after the last)."""

    OP = OP
    TRANSPORTS = TRANSPORTS
    CALL_OPTIONS = {"copy_engine": {"schedule": str}}
    AGREED_TRANSPORTS = GEMM_AGREED

    def __init__(self, world, max_shard_elems: int, *, transport: Optional[str] = None,
                 timeout_s: Optional[float] = None, **options):
        check_sizes(OP, max_shard_elems=max_shard_elems)
        self.max_shard_elems = max_shard_elems
        super().__init__(world, transport, timeout_s, options)

    def _make(self, world, transport, timeout_s, **options):
        if transport == "sequential":
            from ..sequential import SequentialAllGatherMatmul

            return SequentialAllGatherMatmul(world, OP, self.max_shard_elems, **options,
                                             **timeout_kw(timeout_s))
        if transport == "stores":
            from .stores import AllGatherMatmulStores

            return AllGatherMatmulStores(world, self.max_shard_elems, **options,
                                         **timeout_kw(timeout_s))
        if transport == "torch_fused":
            from ..torch_fused import TorchFusedAllGatherMatmul

            return TorchFusedAllGatherMatmul(world, OP, self.max_shard_elems, **options,
                                             **timeout_kw(timeout_s))
        return AllGatherMatmulCE(world, self.max_shard_elems, **options, **timeout_kw(timeout_s))

    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None, *,
                 schedule: Optional[str] = None) -> torch.Tensor:
        return self._dispatch(*self._bind(a, b, out, schedule=schedule))

    def _bind(self, a, b, out=None, *, schedule=None) -> tuple:
        return {"a": a, "b": b}, out, {"schedule": schedule}

    def _run(self, transport, impl, inputs, out, options):
        return impl(inputs["a"], inputs["b"], out, **options)

    def _matched(self, inputs: dict):
        """The shard (every rank's is gathered: its rows and K), the columns and the dtype."""
        return matrix_sizes(lambda a, b: {"m": a.shape[0], "K": a.shape[1], "N": b.shape[1],
                                          "dtype": str(a.dtype)}, inputs["a"], inputs["b"])


class AllGatherMatmulCE(OverlapContext):
    """The ``"copy_engine"`` transport's workspace: a gather buffer for ``max_shard_elems``
    (m × K of the largest call) from every rank, piece flags (module docstring).

    ``direction="pull"`` moves whole shards the other way, receiver-driven, as torch's fused op
    does: each rank copies its shard into its own slot of its gather buffer (one fixed slot per
    rank, whatever the call's shape: ``_pull_slot``) and tells its peers;
    every rank pulls each peer's shard from that peer's slot into the same slot of its own
    buffer with its own copy engine, on two side streams taken in turn (peer r+1 first), and
    multiplies each shard on the stream that pulled it once it has landed, while the caller's
    stream multiplies this rank's own shard. A rank restages only after every peer pulled the
    previous call's shard. No FiCCO schedule (``schedule`` and ``pieces`` are the push side's).
    """

    OP = OP
    FLAG_NAMES = CE_FLAG_NAMES
    DIRECTIONS = ("push", "pull")

    def __init__(self, world, max_shard_elems: int, *, pieces: Optional[int] = None,
                 schedule: Optional[str] = None, direction: str = "push",
                 timeout_s: float = 10.0):
        W = world.world_size
        if direction not in self.DIRECTIONS:
            raise ValueError(f"{OP}: direction must be one of {self.DIRECTIONS}, got "
                             f"{direction!r}")
        if direction == "pull" and (pieces is not None or schedule is not None):
            raise ValueError(f"{OP}: direction='pull' moves whole shards and has no schedules; "
                             f"got pieces={pieces!r}, schedule={schedule!r}")
        pieces = W if pieces is None else pieces
        if max_shard_elems < 1:
            raise ValueError(f"{OP}: max_shard_elems must be >= 1, got {max_shard_elems}")
        # an int, not a float or bool: a float count was taken here and failed in the call's
        # slicing with a TypeError naming no argument ("slice indices must be integers")
        if isinstance(pieces, bool) or not isinstance(pieces, int) or not 1 <= pieces <= 256:
            raise ValueError(f"{OP}: pieces must be an int in [1, 256], got {pieces!r}")
        if schedule is not None and schedule not in SCHEDULES:
            raise ValueError(f"{OP}: schedule must be one of {SCHEDULES}, got {schedule!r}")
        world.check_same(f"{OP} context arguments (max_shard_elems, pieces, schedule, "
                         f"direction)", (max_shard_elems, pieces, schedule, direction))
        pull = direction == "pull"
        super().__init__(world, [
            ("_gather_raw", (W * max_shard_elems,), torch.float32),  # viewed per dtype
            # push: piece flags and "my buffer was read"; pull: "my shard is staged" and "I
            # pulled your shard"
            ("ce_ready", (W, 1 if pull else pieces), torch.int64),
            ("ce_consumed", (W,), torch.int64), ("ce_ctl", (1,), torch.int64),
        ], timeout_s)
        self.max_shard_elems, self.pieces, self.schedule = max_shard_elems, pieces, schedule
        self.direction = direction
        self._gather = {dt: self._gather_raw.view(torch.uint8).view(dt) for dt in DTYPES}
        # push: one lane per peer, so each peer's pieces queue on their own stream, and a wait
        # for one peer's consumed flag holds back no other peer's copies. On 4 H200s 8192^3
        # takes 0.556 ms with it against 0.723 with a single lane (16384: 1.018 against 1.233
        # ms; docs/scaling.md); 2 ranks have one lane. pull: a staging lane and two pull lanes
        # (a pull and its GEMM on one, the next pull on the other)
        lanes = min(3, W) if pull else max(1, W - 1)
        self._links = CopyEngineLinks(self, self.ce_ready, self.ce_consumed, self.ce_ctl,
                                      lanes=lanes)
        if not pull:
            # a peer releases this rank after all its pushes of the call, to every rank, have
            # landed: after a call this rank refused or failed, a late peer's pushes into any
            # rank land before this rank pushes the next call's pieces there. (Pull writes
            # only into the puller's own memory: nothing of a late peer lands here.)
            self.late_stores_guard(self.ce_consumed, "recv-consumed", epoch=self.ce_ctl)
        self._staging = GrowingBuffer(world.device)  # (schedule-fused) per-step outputs

    @collective_call
    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None, *,
                 schedule: Optional[str] = None) -> torch.Tensor:
        W, r = self.world.world_size, self.rank
        out = check_call(a, b, out, self.world, self.max_shard_elems)
        if self.direction == "pull":
            if schedule is not None:
                raise ValueError(f"{OP}: direction='pull' has no schedules; got "
                                 f"schedule={schedule!r}")
            return self._call_pull(a, b, out)
        (m, K), N = a.shape, b.shape[1]
        sched = schedule or self.schedule or pick_schedule(
            W * m, N, K, a.element_size(), self.world.facts.arch)
        if sched not in SCHEDULES:
            raise ValueError(f"{OP}: schedule must be one of {SCHEDULES}, got {sched!r}")
        P = self.pieces
        peers = [(r - i) % W for i in range(1, W)]  # the order their first pieces arrive in
        # the shapes, the piece cut and the gather buffer's layout (1-D: piece-major, 2-D:
        # rank-major) must agree across ranks: a rank called differently is caught by the tag its
        # pieces carry. N too, though the gather does not move it: every other transport (the
        # stores kernel's tiles, the agreement of "sequential" and "auto") refuses ranks whose N
        # differs, and a transport switch must change nothing but speed
        tag = self.call_tag(shape_tag(OP, a=(m, K), N=N, dtype=str(a.dtype), pieces=P,
                                      layout=sched[-2:]))
        links = self._links
        links.begin()
        if sched.endswith("2d"):
            self._call_2d(a, b, out, sched, peers, tag)
        else:
            self._call_1d(a, b, out, sched, peers, tag)
        # the release after every lane's pushes too, not only this stream's reads of the
        # peers' pieces: a peer that failed the call waits for it (settle_late_stores) before
        # it pushes the next call's pieces into a rank this one may still be pushing into
        links.rejoin()
        for q in peers:
            links.release(q)
        return out

    def _call_pull(self, a, b, out) -> torch.Tensor:
        """Whole shards pulled by the receiver (class docstring)."""
        W, r = self.world.world_size, self.rank
        m, K = a.shape
        tag = self.call_tag(shape_tag(OP, a=(m, K), N=b.shape[1],  # N: see __call__
                                      dtype=str(a.dtype), direction="pull"))
        shards = [self._pull_slot(q, m, K, a.dtype) for q in range(W)]
        links = self._links
        links.begin()
        peers = [(r + i) % W for i in range(1, W)]
        if not peers:  # a world of one: its own shard only
            return torch.matmul(a, b, out=out)
        # fork every lane before the caller's stream queues the own shard's GEMM: a lane forked
        # after it would wait for it
        for lane in range(links.lanes):
            links.follow(lane)
        with links.on_side(0):
            for d in peers:  # every peer pulled what this slot held in the previous call
                links.wait_consumed(d)
            links.copy_local(shards[r], a)
            for d in peers:
                links.notify(d, 0, tag)
        torch.matmul(a, b, out=out[r * m:(r + 1) * m])  # no waiting for the local shard
        pull_lanes = list(range(1, links.lanes))
        for i, q in enumerate(peers):
            with links.on_side(pull_lanes[i % len(pull_lanes)]):
                links.wait_ready(q, 0, tag)
                links.pull(q, shards[q], shards[q])
                links.release(q)  # what q staged is read: q may restage for its next call
                torch.matmul(shards[q], b, out=out[q * m:(q + 1) * m])
        links.rejoin()
        return out

    def _pull_slot(self, q: int, m: int, K: int, dtype) -> torch.Tensor:
        """Rank q's shard [m, K] in the gather buffer of ``direction="pull"``: the q-th of W
        fixed slots of ``max_shard_elems`` fp32 words, whatever the call's shape and dtype. This
        rank's own slot is then written by its staging alone, which waits for every peer's pull
        of the previous call; packed slots would move with the shape, and this rank's pulls of
        the next call (which wait for nothing of its own peers') could overwrite the shard a
        slower peer is still pulling: that peer would multiply the new call's bytes."""
        S = self.max_shard_elems
        slot = self._gather_raw[q * S:(q + 1) * S].view(torch.uint8).view(dtype)
        return slot[:m * K].view(m, K)

    def _call_1d(self, a, b, out, sched, peers, tag) -> None:
        """Pieces are row blocks of the shards (see the module docstring)."""
        W, r = self.world.world_size, self.rank
        m, K = a.shape
        N = b.shape[1]
        P = self.pieces
        bounds = [m * p // P for p in range(P + 1)]
        gather = self._gather[a.dtype][: W * m * K]

        def slot(p, q):  # rank q's piece p in the piece-major gather buffer: [p][q][rows, K]
            lo = W * bounds[p] * K + q * (bounds[p + 1] - bounds[p]) * K
            return gather[lo:lo + (bounds[p + 1] - bounds[p]) * K]

        links = self._links
        for i in range(1, W):  # push this rank's shard, piece by piece, to every peer
            d = (r + i) % W
            links.follow(i - 1)
            with links.on_side(i - 1):  # peer r+i's lane
                links.wait_consumed(d)
                for p in range(P):
                    links.put(d, slot(p, r), a[bounds[p]:bounds[p + 1]], p, tag)
        if sched.startswith("hetero"):
            torch.matmul(a, b, out=out[r * m:(r + 1) * m])  # no waiting for the local shard
        for p in range(P):
            rows = bounds[p + 1] - bounds[p]
            if rows == 0:
                for q in peers:  # nothing to compute, but the flag must still be consumed
                    links.wait_ready(q, p, tag)
                continue
            if sched == "hetero-unfused-1d":
                for q in peers:
                    links.wait_ready(q, p, tag)
                    lo = q * m + bounds[p]
                    torch.matmul(slot(p, q).view(rows, K), b, out=out[lo:lo + rows])
                continue
            if sched == "uniform-fused-1d":  # this rank's piece beside the peers'
                slot(p, r).view(rows, K).copy_(a[bounds[p]:bounds[p + 1]])
                runs = [(0, W)]
            else:  # the peers' pieces only: the runs of ranks before and after this one
                runs = [(q0, q1) for q0, q1 in ((0, r), (r + 1, W)) if q1 > q0]
            for q in peers:
                links.wait_ready(q, p, tag)
            step = gather[W * bounds[p] * K:W * bounds[p + 1] * K].view(W * rows, K)
            for q0, q1 in runs:  # one GEMM per run of ranks, then its rows into place
                res = self._stage_out((q1 - q0) * rows, N, a.dtype)
                torch.matmul(step[q0 * rows:q1 * rows], b, out=res)
                for q in range(q0, q1):
                    out[q * m + bounds[p]:q * m + bounds[p + 1]].copy_(
                        res[(q - q0) * rows:(q - q0 + 1) * rows])

    def _call_2d(self, a, b, out, sched, peers, tag) -> None:
        """Pieces are column blocks of the shards (pieces along K), each GEMM a partial sum.

        The gather buffer is rank-major: rank q's shard is a whole row-major [m, K] block there,
        so piece p of it, ``a_q[:, k0:k1]``, is a strided view (m rows of k1-k0 elements, pitch
        K) that one 2-D DMA copy fills, and rank q's rows of ``out`` are its GEMM's rows, with no
        scatter afterwards.

        Precision: the partial sums accumulate in ``out`` itself (``addmm_``, beta 1), so a bf16
        or fp16 ``out`` is rounded once per non-empty piece instead of once: about sqrt(P) times
        the 1-D schedules' rounding error (fp32 stays at fp32's). An fp32 staging buffer would
        round once, but it costs [W*m, N] fp32 of workspace, partial sums read and written at
        twice ``out``'s bytes per piece (bf16) and a final cast pass, all on the path this
        schedule exists to shorten; for the default P = W (2 to 8) the extra error stays well
        inside what a bf16 result carries, so the sums stay in ``out``. Revisit if P grows toward
        64 (the paper's deepest cut)."""
        W, r = self.world.world_size, self.rank
        m, K = a.shape
        P = self.pieces
        kb = [K * p // P for p in range(P + 1)]  # K < P leaves some pieces empty
        gathered = self._gather[a.dtype][: W * m * K].view(W * m, K)  # cat(all_gather(a))
        shards = gathered.view(W, m, K)
        links = self._links
        for i in range(1, W):  # push this rank's shard, column block by block, to every peer
            d = (r + i) % W
            links.follow(i - 1)
            with links.on_side(i - 1):  # peer r+i's lane
                links.wait_consumed(d)
                for p in range(P):  # an empty block copies nothing but still sets its flag
                    links.put(d, shards[r, :, kb[p]:kb[p + 1]], a[:, kb[p]:kb[p + 1]], p, tag)
        first = next(p for p in range(P) if kb[p + 1] > kb[p])  # K >= 1: there is one
        hetero = sched.startswith("hetero")
        if hetero:
            torch.matmul(a, b, out=out[r * m:(r + 1) * m])  # no waiting for the local shard
            runs = [(q, q + 1) for q in peers]  # one GEMM per peer, as its piece arrives
        else:  # uniform: every step is one GEMM over all W shards' block p (this rank's too)
            runs = [(0, W)]
        for p in range(P):
            k0, k1 = kb[p], kb[p + 1]
            if not hetero:
                for q in peers:
                    links.wait_ready(q, p, tag)
                if k1 > k0:
                    shards[r, :, k0:k1].copy_(a[:, k0:k1])
            for q0, q1 in runs:
                if hetero:
                    links.wait_ready(q0, p, tag)
                if k1 == k0:  # nothing to add, but the flag above had to be consumed
                    continue
                rows = out[q0 * m:q1 * m]
                piece = gathered[q0 * m:q1 * m, k0:k1]  # strided: pitch K, no copy
                if p == first:
                    torch.matmul(piece, b[k0:k1], out=rows)
                else:
                    rows.addmm_(piece, b[k0:k1])

    def _stage_out(self, rows: int, N: int, dtype) -> torch.Tensor:
        """The fused schedules' per-step output [rows, N]: a view of one buffer kept for the
        largest step met so far (``kept.GrowingBuffer``: kept per (rows, N, dtype), a buffer
        would be added for every new shard size). Every step's GEMM and its copies into
        ``out`` run on the caller's stream, so a step may overwrite the previous step's
        output."""
        nbytes = rows * N * dtype.itemsize
        return self._staging.get(nbytes).view(dtype).view(rows, N)


ALL_GATHER_MATMUL = define(OpSpec(
    OP, "(Tensor a, Tensor b, int handle) -> Tensor", context=AllGatherMatmul,
    transports=TRANSPORTS, compile_specs=("portable_overlap.transports.compile_specs",
                                          "portable_overlap.ops.allgather_gemm.compile_specs"),
    fake=lambda ctx, a, b: a.new_empty((ctx.world.world_size * a.shape[0], b.shape[1]))))


def all_gather_matmul(a: torch.Tensor, b: torch.Tensor, ctx: AllGatherMatmul,
                      out: Optional[torch.Tensor] = None, *,
                      schedule: Optional[str] = None) -> torch.Tensor:
    """``cat([a_0, ..., a_{W-1}]) @ b`` [W*m, N] on every rank, where ``a_r`` [m, K] is rank r's
    row shard and ``b`` [K, N] this rank's weight; see the module docstring. Under
    ``torch.compile`` one opaque op, ``torch.ops.portable_overlap.all_gather_matmul(a, b,
    ctx.handle)``."""
    return ALL_GATHER_MATMUL(ctx, (a, b), out=out, schedule=schedule)
