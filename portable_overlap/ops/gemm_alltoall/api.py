"""Fused dense GEMM + equal-split All-to-All (the uniform-routing setting of MoE expert
parallelism and of the fused-collectives paper).

What it computes, with ``a_r``, ``b_r`` the tensors rank r passes (a [M, K_r], b [K_r, N])::

    c_r = a_r @ b_r                                          # [M, N] on rank r; chunk = M // world
    out_d[r*chunk:(r+1)*chunk] = c_r[d*chunk:(d+1)*chunk]    # on rank d, for every source r

i.e. ``torch.distributed.all_to_all_single(out, a @ b)``. ``K_r`` is rank r's own and may differ
across ranks: only the products move. M, N and the dtype must match on every rank. The
communication is overlapped by one of two transports (``GemmAllToAll(..., transport=...)``):

- ``"stores"`` (default): one persistent Triton kernel computes the tiles, rows for other ranks
  first, and stores each finished tile straight into the destination's heap (kernel.py);
- ``"copy_engine"``: the device's BLAS computes the rows for each destination in ``pieces`` row
  blocks, destinations other than this rank first, and each finished block goes to its
  destination by DMA on a side stream (transports/copy_engine.py) while the next block is computed;
  the receiver's side stream copies arrived blocks into ``out`` while its own rows are computed.
  No SM is spent on communication, and the GEMM is the vendor's own.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...tiles.gemv import dot_precision, dot_upcast
from ..context import (align_key, collective_call, G_MAX, output_tensor, OverlapContext,
                       shape_tag)
from ...transports.copy_engine import FLAG_NAMES as CE_FLAG_NAMES, CopyEngineLinks
from ..matmul.api import (DTYPES, MatmulConfig, add_epilogue, check_k_steps, check_operands,
                          default_config, describable, tile_descriptors, vector_checks)
from .kernel import FLAG_NAMES, gemm_alltoall_kernel

TRANSPORTS = ("stores", "copy_engine")

OP = "matmul_all_to_all"  # the public op this transport serves (errors name it)


class GemmAllToAll(OverlapContext):
    """Workspace of the fused GEMM + All-to-All on one rank: a receive buffer of ``max_elems``
    elements (M × N of the largest call) in the symmetric heap, flags, status board. Collective to
    create and close; the same calls in the same order on every rank, on any streams (each
    call runs after the last)."""

    OP = OP
    FLAG_NAMES = FLAG_NAMES

    def __init__(self, world, max_elems: int, *, timeout_s: float = 10.0,
                 config: Optional[MatmulConfig] = None, transport: str = "stores",
                 pieces: int = 4):
        if max_elems < 1:
            raise ValueError(f"{OP}: max_elems must be >= 1, got {max_elems}")
        _check_config(config)
        if transport not in TRANSPORTS:
            raise ValueError(f"{OP}: transport must be one of {TRANSPORTS}, got {transport!r}")
        # an int, not a float or bool: a float count was taken here and failed in the call's
        # slicing with a TypeError naming no argument ("slice indices must be integers")
        if isinstance(pieces, bool) or not isinstance(pieces, int) \
                or not 1 <= pieces <= G_MAX // world.world_size:
            raise ValueError(f"{OP}: pieces must be an int in [1, {G_MAX // world.world_size}], "
                             f"got {pieces!r}")
        # the tiling, not the warps and stages: each rank compiles with its own
        world.check_same(f"{OP} context arguments (max_elems, config's tiling, transport, "
                         f"pieces)", (max_elems, getattr(config, "tiling", None), transport,
                                      pieces))
        W = world.world_size
        if W > 64:  # the kernel keeps one bit per peer ("its receive buffer is free") in an int64
            raise ValueError(f"{OP}: at most 64 ranks, got {W}")
        super().__init__(world, [
            ("_recv_raw", (max_elems,), torch.float32),  # rows from peers, viewed per dtype
            ("sent", (W, G_MAX), torch.int64), ("consumed", (W,), torch.int64),
            ("ctl", (2,), torch.int64),
            # copy-engine transport: per-piece ready flags, consumed flags, epoch
            ("ce_ready", (W, pieces), torch.int64), ("ce_consumed", (W,), torch.int64),
            ("ce_ctl", (1,), torch.int64),
        ], timeout_s)
        self.call_protocol(self.ctl, call_flags=(self.sent,), free_flags=(self.consumed,))
        self.max_elems = max_elems
        self.config = config
        self.transport = transport
        self.pieces = pieces
        self._recv = {dt: self._recv_raw.view(torch.uint8).view(dt) for dt in DTYPES}
        self._links = None
        if transport == "copy_engine":
            self.FLAG_NAMES = CE_FLAG_NAMES
            self._links = CopyEngineLinks(self, self.ce_ready, self.ce_consumed, self.ce_ctl)
            # a peer releases this rank's receive buffer after its last put of the call (one
            # side stream): after a call this rank refused or failed, those puts land first
            self.late_stores_guard(self.ce_consumed, "recv-consumed", epoch=self.ce_ctl)
        else:
            # after a call this rank refused or failed, the peers' late stores of it land first
            self.late_stores_guard(self.consumed, "recv-consumed", epoch=self.ctl)

    @collective_call
    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None,
                 *, bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
                 config: Optional[MatmulConfig] = None) -> torch.Tensor:
        """``all_to_all_single(a @ b)``, then + this rank's bias [N] + residual [M, N] on the
        rows it received: module docstring."""
        _validate(a, b, self.world, self.max_elems)
        _check_config(config)
        M, K = a.shape
        N = b.shape[1]
        out = output_tensor(OP, out, (M, N), a, dict(a=a, b=b, bias=bias, residual=residual))
        vector_checks(OP, a, N, M, bias=bias, residual=residual)
        if self._links is not None:
            if config is not None:  # (its GEMM is the vendor BLAS's: no tiles to choose)
                raise TypeError(f"{OP}: transport 'copy_engine' takes no config (its GEMM is "
                                f"torch.matmul); pass config to transport 'stores'")
            self._call_copy_engine(a, b, out)
            add_epilogue(out, bias, residual)
            return out
        key = (M, K, N, a.dtype, a.stride(), b.stride(), align_key(a, b, out), config)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(a, b, out, config or self.config)
        plan(self._args(a, b, out, plan.tag, plan.programs, plan.cfg))
        add_epilogue(out, bias, residual)
        return out

    def _call_copy_engine(self, a, b, out) -> None:
        """Rows for each destination in ``pieces`` blocks, by BLAS on this stream; each block to
        its destination by DMA on the side stream (see the module docstring). ``out``'s rows of
        peer d first stage what goes to d, then receive what d sent (both on the side stream, in
        that order)."""
        links, W, r = self._links, self.world.world_size, self.rank
        M, N = a.shape[0], b.shape[1]
        chunk = M // W
        bounds = [chunk * i // self.pieces for i in range(self.pieces + 1)]
        # not K: each rank's K is its own (only the [M, N] products move); M, N, dtype and
        # pieces fix which rows each put carries and where they land
        tag = shape_tag(OP, M=M, N=N, dtype=str(a.dtype), pieces=self.pieces)
        recv = self._recv[a.dtype][: M * N].view(M, N)
        links.begin()
        for i in range(1, W):  # communication first: rows of rank r+1, r+2, ...
            d = (r + i) % W
            for k in range(self.pieces):
                lo, hi = d * chunk + bounds[k], d * chunk + bounds[k + 1]
                torch.matmul(a[lo:hi], b, out=out[lo:hi])
                links.follow()
                with links.on_side():
                    if k == 0:
                        links.wait_consumed(d)
                    # into d's recv at the rows d's output takes from this rank
                    dst = recv[r * chunk + bounds[k]: r * chunk + bounds[k + 1]]
                    links.put(d, dst, out[lo:hi], k, tag)
        with links.on_side():  # what the peers sent, copied into place as it lands
            for i in range(1, W):
                q = (r - i) % W  # q computed this rank's rows i-th: the order they finish in
                for k in range(self.pieces):
                    lo, hi = q * chunk + bounds[k], q * chunk + bounds[k + 1]
                    links.wait_ready(q, k, tag)
                    links.copy_local(out[lo:hi], recv[lo:hi])
                links.release(q)
        lo, hi = r * chunk, (r + 1) * chunk
        torch.matmul(a[lo:hi], b, out=out[lo:hi])  # this rank's own rows last
        links.rejoin()

    def _args(self, a, b, out, tag, programs, cfg):
        M, K = a.shape
        W = self.world.world_size
        # descriptors where the device and operands allow; the plan's key (strides, alignment)
        # fixes the same choice its kernel was compiled for
        a_desc, b_desc = tile_descriptors(a, b, cfg, self.world.facts)
        return (a, b, out, self._recv[a.dtype], self.sent, self.consumed, self.ctl,
                self.call_clock, self.heap.bases, self.status.address, M, b.shape[1], K,
                a.stride(0), a.stride(1),
                b.stride(0), b.stride(1), M // W, programs, self.rank, W, tag, self.timeout_us,
                a_desc, b_desc)

    def _plan(self, a, b, out, config: Optional[MatmulConfig]):
        M, K = a.shape
        N = b.shape[1]
        # tiles by the product's shape, the same on every rank; warps by whether this rank's
        # operands take descriptors (``tile_config``)
        cfg = config or default_config(a.dtype, a.device, M, N,
                                       describable(a, b, self.world.facts))
        check_k_steps(OP, a, b, cfg)
        n_tiles = -(-M // cfg.block_m) * -(-N // cfg.block_n)
        use_desc = tile_descriptors(a, b, cfg, self.world.facts)[0] is not None
        consts = dict(USE_DESC=use_desc, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, NUM_STAGES=cfg.num_stages,
                      EVEN_K=K % cfg.block_k == 0,
                      PRECISION=dot_precision(a.dtype),
                      UPCAST=dot_upcast(a.dtype), G_MAX=G_MAX, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages)
        # at least one program: a call with no rows (M = 0) still signals and waits for the
        # peers' sent flags, whose shape tag catches a peer called with rows
        programs = max(1, min(n_tiles, self.world.facts.sm_count, G_MAX))

        # what the peers' copy-outs read of this rank's launch (kernel.py: they recompute its
        # tile list from M, N, the tiling and the grid) and the dtype of the rows it stores:
        # a rank planned differently is caught. Not K: each rank's K is its own, read only by
        # its own K loop
        def tag_of(g):
            return shape_tag(M=M, N=N, dtype=str(a.dtype), tiling=cfg.tiling, programs=g)

        plan = self._compile(gemm_alltoall_kernel, programs, consts,
                             lambda g: self._args(a, b, out, tag_of(g), g, cfg))
        plan.tag, plan.cfg = tag_of(plan.programs), cfg
        return plan


def _check_config(config) -> None:
    """A ``config`` that is no ``MatmulConfig`` (a ``SignalConfig``, meant for the
    ``"signal_collective"`` transport, say) raised an AttributeError naming a tile field from
    inside the plan; refused here with a TypeError naming the argument."""
    if config is not None and not isinstance(config, MatmulConfig):
        raise TypeError(f"{OP}: config must be a MatmulConfig or None, got "
                        f"{type(config).__name__} (a SignalConfig is the 'signal_collective' "
                        f"transport's)")


def _validate(a, b, world, max_elems: int) -> None:
    check_operands(OP, a, b, world.device)
    M, N = a.shape[0], b.shape[1]
    if M % world.world_size:
        raise ValueError(f"{OP}: M={M} rows must split evenly over {world.world_size} ranks "
                         f"(equal-split All-to-All)")
    if M * N > max_elems:
        raise ValueError(f"{OP}: M*N={M * N} exceeds this context's max_elems={max_elems}")
