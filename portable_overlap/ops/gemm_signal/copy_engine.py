"""GEMM + ReduceScatter with the wave-group counters gating copy-engine transfers (issue 4, item
3: FlashOverlap's signals, FiCCO's zero-SM DMA).

What it computes is ``gemm_reduce_scatter``'s (``a_r [M, K_r]``, ``b_r [K_r, N]`` on rank r,
the K dimension split over W ranks)::

    out_r = sum_q a_q @ b_q [r*M/W : (r+1)*M/W]  (+ bias + residual)     # [M/W, N] on rank r

One call on rank r:

1. the signal GEMM (the tile-group-signal op's kernel, ``kernel.gemm_signal_kernel``) runs on
   the caller's stream over the whole grid; each finished tile goes to its staging slot and
   bumps its wave group's counter;
2. a side stream, per group g: ``stream_wait_value(count[g] >= size_g)`` (no CPU polling, no
   SM), resets the counter, and copies by DMA group g's tiles for each peer d (contiguous in
   staging) into region r of d's receive buffer in the heap, then sets d's ready flag for g;
3. the caller's stream, after the GEMM: a bounded wait for every peer's every group, then
   ``signal_reduce_kernel`` sums this rank's own partial (from staging) and the peers' (from
   the heap) in fp32, adds bias / residual, rounds once into ``out``; then, once the side
   stream's transfers have landed too, tells the peers their buffers here are free again.

Why not NCCL here: the tile-group-signal op's collectives need SMs, and on 2x H200 they made no
measurable progress beside the persistent GEMM (``comm_slowdown`` 5-717), so its
groups bought no overlap. Copy engines need no SM: the transfers run while the GEMM holds every
SM, and only the last group's copy and the reduction follow the GEMM.

Flags and waits are the copy-engine transport's (``transports/copy_engine.py``): epochs in the
heap (CUDA-graph replays stay correct), tags carry the shape and partition (a rank called with
another shape raises instead of reading garbage), every wait is bounded. The counters are the
signal op's, reset by their waiter as there (``api.py`` explains why not epochs).
"""
from __future__ import annotations

from typing import Optional

import torch

from ...transports.copy_engine import FLAG_NAMES as CE_FLAG_NAMES, CopyEngineLinks
from ...transports.gate import wait_counter
from ..context import align_key, collective_call, OverlapContext, output_tensor, shape_tag
from ..matmul.api import DTYPES, default_config, vector_checks
from .api import GemmSignal, signal_gemm_args
from .config import MAX_GROUPS, SignalConfig
from .kernel import signal_reduce_kernel

OP = "matmul_reduce_scatter"  # the public op this transport serves (errors name it)
#: the default partition for copy-engine transfers: up to 8 groups (one wave, then doubling up to
#: a quarter of the tiles) — a group costs one DMA and one flag per peer, a few microseconds,
#: while the last group's transfer is what nothing hides
DEFAULT = SignalConfig(max_groups=8)


def _check_partition(cfg: SignalConfig) -> None:
    if cfg.partition == "tune":  # the tuner times NCCL collectives, not these copies
        raise ValueError(f"{OP}: partition='tune' tunes NCCL collectives; pass group sizes "
                         f"or None")


class GemmReduceScatterCE(OverlapContext):
    """Workspace of GEMM + ReduceScatter over copy engines on one rank: the receive buffer
    (``max_elems`` elements of any dtype of ``DTYPES``, in the heap), ready / consumed flags, a
    side stream, and a ``GemmSignal`` for the GEMM, its counters and staging. Collective to
    create and close; the same calls in the same order on every rank.

    A call needs ``elems_needed(M, N, W, tiling)`` elements: W regions of this rank's row block
    padded to whole tiles."""

    OP = OP
    FLAG_NAMES = CE_FLAG_NAMES

    def __init__(self, world, max_elems: int, *, config: Optional[SignalConfig] = None,
                 timeout_s: float = 10.0):
        if max_elems < 1:
            raise ValueError(f"{OP}: max_elems must be >= 1, got {max_elems}")
        config = config or DEFAULT
        _check_partition(config)
        world.check_same(f"{OP} context arguments", (max_elems, config))
        W = world.world_size
        super().__init__(world, [
            ("_recv_raw", (max_elems,), torch.float32),
            ("ce_ready", (W, MAX_GROUPS), torch.int64), ("ce_consumed", (W,), torch.int64),
            ("ce_ctl", (1,), torch.int64),
        ], timeout_s)
        self.max_elems, self.config = max_elems, config
        self.sig = GemmSignal(world, config=config, collectives=False)
        self._recv = {dt: self._recv_raw.view(torch.uint8).view(dt) for dt in DTYPES}
        self._links = CopyEngineLinks(self, self.ce_ready, self.ce_consumed, self.ce_ctl)
        # a peer releases this rank after all its puts of the call have landed: after a call
        # this rank refused or failed, a late peer's tiles land before this rank puts the next
        # call's tiles where they would fall
        self.late_stores_guard(self.ce_consumed, "recv-consumed", epoch=self.ce_ctl)
        self._own: dict = {}  # id(plan) -> int32 [per_dest]: staging slot of own tile u
        self._reduce: dict = {}

    @staticmethod
    def elems_needed(M: int, N: int, world_size: int, block_m: int, block_n: int) -> int:
        """Receive room (elements) of an [M, N] result on ``world_size`` ranks with
        ``block_m`` x ``block_n`` tiles: W regions of one row block in whole tiles."""
        rows = M // world_size
        return world_size * -(-rows // block_m) * block_m * -(-N // block_n) * block_n

    def close(self) -> None:
        # this context's own first: it waits for a call another thread is making, whose
        # GEMM runs in ``sig``'s workspace
        super().close()
        self.sig.close()

    @collective_call
    def reduce_scatter(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None,
                       *, bias: Optional[torch.Tensor] = None,
                       residual: Optional[torch.Tensor] = None,
                       config: Optional[SignalConfig] = None) -> torch.Tensor:
        """Rank r's row block of ``sum_q a_q @ b_q`` (+ bias + residual): module docstring."""
        sig, links, W, r = self.sig, self._links, self.world.world_size, self.rank
        cfg = config or self.config
        _check_partition(cfg)
        op, cfg, M, N, K, rows = sig.check_call("reduce_scatter", a, b, cfg)
        if M == 0:
            # its flags are per wave group of tiles: with no tiles none would carry the call's
            # shape tag (and its calls agree only at a new shape's first call). Refused before
            # any launch, so every rank raises in this call
            raise ValueError(f"{OP}: the 'signal_copy_engine' transport takes no empty "
                             f"product (a has 0 rows); the other transports return the empty "
                             f"result")
        checking = self.checking_only  # (a check makes no output: the call that follows does)
        if out is not None or not checking:
            out = output_tensor(OP, out, (rows, N), a,
                                dict(a=a, b=b, bias=bias, residual=residual))
        vector_checks(OP, a, N, rows, bias=bias, residual=residual)
        # the receive room first: planning grows the staging buffer, which a refused call
        # must not leave grown
        mm = cfg.matmul or default_config(a.dtype, self.world.device)
        need = self.elems_needed(M, N, W, mm.block_m, mm.block_n)
        if need > self.max_elems:
            raise ValueError(f"{OP}: an [{M}, {N}] result on {W} ranks with {mm.block_m}x"
                             f"{mm.block_n} tiles needs {need} elements of receive room; this "
                             f"context has max_elems={self.max_elems} (size it with "
                             f"GemmReduceScatterCE.elems_needed)")
        if checking:  # a planner's check before the first call's agreement: no more
            return out
        plan = sig.plan_call("reduce_scatter", op, M, N, K, a.dtype, cfg)
        T, pd = plan.tile_elems, plan.groups.n_tiles // W
        first = id(plan) not in self._own
        if first and sig.capturing():
            raise RuntimeError(f"{OP}: call it once with these shapes outside graph capture "
                               f"first (the first call plans and checks the ranks agree)")
        if first:
            self._own[id(plan)] = plan.slot_t[r::W].contiguous()  # tile u = t // W, t % W == r
        gemm, _ = sig.launch_plan(plan, a, b, out, None, None, None, None, with_reorder=False)
        stage = sig.stage_raw[:plan.stage_bytes].view(a.dtype)
        recv = self._recv[a.dtype]
        reduce, reduce_args = self._reduce_launch(plan, stage, recv, out, bias, residual, a)
        # not K: each rank's K shard may have its own width. The tiling: it fixes which rows
        # and columns a staged tile holds, and ranks whose calls' plans were each made (each
        # planned at an earlier call) with another tiling summed mismatched tiles of equal
        # counts without an error (tiles grouped by 2 and by 1: relative errors 0.73)
        tag = self.call_tag(shape_tag(OP, M=M, N=N, dtype=str(a.dtype),
                                      groups=plan.groups.sizes, tiling=plan.mm.tiling))
        be, counters = self.world.backend, sig.counters

        links.begin()
        links.follow()  # the side stream starts after the epoch and the caller's earlier work
        gemm(signal_gemm_args(plan, a, b, stage, sig.counters, gemm.programs, self.world.facts))
        with links.on_side():
            side = be.current_stream(self.world.device)
            for g, (start, size) in enumerate(zip(plan.groups.starts, plan.groups.sizes)):
                # group g's tiles are done: no SM polls, the copy engine reads them next
                wait_counter(be, side, counters.address(g), size)
                per, u0 = size // W, start // W
                for i in range(1, W):
                    d = (r + i) % W
                    if g == 0:  # d has reduced what this rank sent it last call
                        links.wait_consumed(d)
                    src = stage[(start + d * per) * T:(start + (d + 1) * per) * T]
                    dst = recv[(r * pd + u0) * T:(r * pd + u0 + per) * T]  # region r on d
                    links.put(d, dst, src, g, tag)
        peers = [(r - i) % W for i in range(1, W)]
        for q in peers:  # after the GEMM on this stream: every peer's groups have landed
            for g in range(plan.groups.n_groups):
                links.wait_ready(q, g, tag)
        reduce(reduce_args)
        # their regions here are read, and this rank's puts have landed (the side stream
        # joined): they may send the next call's, and a peer that failed this call waits for
        # it (settle_late_stores) before it puts into a rank this one may still be putting into
        links.rejoin()
        for q in peers:
            links.release(q)
        if first:
            self.synchronize()  # the first call of a plan: kernels loaded, errors surface here
        return out

    def _reduce_launch(self, plan, stage, recv, out, bias, residual, a):
        mm, W = plan.mm, self.world.world_size
        pd = plan.groups.n_tiles // W
        rows = min(mm.block_m, 32)  # a 32 x BLOCK_N slab per program keeps registers low
        bias_ = bias if bias is not None else out
        res_, stride_rm = (residual, residual.stride(0)) if residual is not None else (out, 0)
        args = (stage, self._own[id(plan)], recv, plan.table_t, out, bias_, res_, out.shape[1],
                out.stride(0), stride_rm, self.rank, W, pd * plan.tile_elems)
        # (the JIT specializes the pointers on their 16-byte alignment: a kernel compiled for an
        # aligned out would store to a misaligned one in 16-byte vectors)
        key = (id(plan), out.stride(0), stride_rm, bias is not None, residual is not None,
               a.dtype, align_key(out, bias_, res_))
        launch = self._reduce.get(key)
        if launch is None:
            consts = dict(BLOCK_M=mm.block_m, BLOCK_N=mm.block_n, ROWS=rows,
                          HAS_BIAS=bias is not None, HAS_RES=residual is not None, num_warps=4)
            # one program per slab (not a persistent grid: never capped at what is resident)
            launch = self._reduce[key] = self.sig.compile_launch(
                signal_reduce_kernel, pd * (mm.block_m // rows), consts, lambda g: args, False)
        return launch, args
