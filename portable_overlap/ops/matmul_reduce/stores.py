"""The ``"stores"`` transport of GEMM + ReduceScatter / AllReduce: one persistent Triton kernel
stores each partial tile straight into its owner's heap, peers' blocks first, and the owner adds
the peers' partials to its own in the epilogue of its last tiles (kernel.py has the protocol).

The copy engines of one GPU serve its peers one copy at a time (docs/scaling.md); SM stores
reach every peer's link at once, with no piece to stage and no reduction pass after the GEMM.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch

from ...tiles.gemv import dot_precision, dot_upcast
from ..context import align_key, collective_call, G_MAX, output_tensor, OverlapContext, shape_tag
from ..matmul.api import (DTYPES, MatmulConfig, check_k_steps, check_operands, default_config,
                          describable, operand_descriptors, vector_checks)
from .kernel import FLAG_LABELS, matmul_reduce_stores_kernel

MODES = ("reduce_scatter", "all_reduce")


class MatmulReduceStores(OverlapContext):
    """The ``"stores"`` transport's workspace for one mode (``"reduce_scatter"`` or
    ``"all_reduce"``) and results of at most ``max_m`` x ``max_n``: the peers' partials of this
    rank's block (W x ceil(max_m / W) x max_n elements, and at least a float32 64 x 128 tile
    per SM for split tiles' ranges) and, for AllReduce, every rank's reduced block (max_m x
    max_n) in the symmetric heap; flags; a float32 64 x 128 slot and a count per SM for the
    split tiles (``tile_parts``). Option ``config``: the GEMM tiling (default: the
    device's)."""

    FLAG_LABELS = FLAG_LABELS

    def __init__(self, world, op: str, mode: str, max_m: int, max_n: int, *,
                 config: Optional[MatmulConfig] = None, timeout_s: float = 10.0):
        self.OP = op
        W = world.world_size
        if mode not in MODES:
            raise ValueError(f"{op}: mode must be one of {MODES}, got {mode!r}")
        if config is not None and not isinstance(config, MatmulConfig):
            raise TypeError(f"{op}: config must be a MatmulConfig, got {type(config).__name__}")
        if W > 64:  # the kernel keeps one bit per peer ("its buffers are free") in an int64
            raise ValueError(f"{op}: at most 64 ranks, got {W}")
        # the tiling, not the warps and stages: each rank compiles with its own
        world.check_same(f"{op} context arguments (max_m, max_n, config's tiling)",
                         (max_m, max_n, getattr(config, "tiling", None)))
        block = -(-max_m // W)
        # room for split tiles' float32 ranges (tile_parts): at most a tile per program
        room = max(W * block * max_n, world.facts.sm_count * SPLIT_TILE)
        super().__init__(world, [
            ("_recv_raw", (room,), torch.float32),  # viewed per dtype
            ("_gathered_raw", (max_m * max_n if mode == "all_reduce" else 1,), torch.float32),
            ("sent", (W, G_MAX), torch.int64), ("reduced", (W, G_MAX), torch.int64),
            ("consumed", (W,), torch.int64),
        ], timeout_s)
        flags = (self.sent, self.reduced) if mode == "all_reduce" else (self.sent,)
        self.call_protocol(self.ctx, call_flags=flags, free_flags=(self.consumed,))
        # after a call this rank refused or failed, the peers' late stores of it land first
        self.late_stores_guard(self.consumed, "recv-consumed")
        self.mode, self.max_m, self.max_n, self.config = mode, max_m, max_n, config
        # the owner's slots and counts of split tiles (a slot per program at most; the counts
        # are left zeroed by the kernel)
        n_slots = world.facts.sm_count
        self._split_ws = torch.empty(n_slots * SPLIT_TILE, dtype=torch.float32,
                                     device=world.device)
        self._split_done = torch.zeros(n_slots, dtype=torch.int32, device=world.device)
        self._recv = {dt: self._recv_raw.view(torch.uint8).view(dt) for dt in DTYPES}
        self._gathered = {dt: self._gathered_raw.view(torch.uint8).view(dt) for dt in DTYPES}

    def reduce_scatter(self, a, b, out=None, *, bias=None, residual=None) -> torch.Tensor:
        """Rows ``[r*M/W, (r+1)*M/W)`` of ``sum_q a_q @ b_q`` (+ bias + residual) on rank r."""
        return self._call("reduce_scatter", a, b, out, bias, residual)

    def all_reduce(self, a, b, out=None, *, bias=None, residual=None) -> torch.Tensor:
        """``sum_q a_q @ b_q`` (+ bias + residual) [M, N] on every rank."""
        return self._call("all_reduce", a, b, out, bias, residual)

    @collective_call
    def _call(self, mode, a, b, out, bias, residual) -> torch.Tensor:
        if mode != self.mode:
            raise ValueError(f"{self.OP}: this workspace was made for {self.mode}")
        check_operands(self.OP, a, b, self.world.device)
        W = self.world.world_size
        M, K = a.shape
        N = b.shape[1]
        if mode == "reduce_scatter" and M % W:
            raise ValueError(f"{self.OP}: M={M} rows must split evenly over {W} ranks")
        if M > self.max_m or N > self.max_n:
            raise ValueError(f"{self.OP}: an [{M}, {N}] result exceeds this context's "
                             f"max_m x max_n = {self.max_m} x {self.max_n}")
        rows = M // W if mode == "reduce_scatter" else M
        out = output_tensor(self.OP, out, (rows, N), a,
                            dict(a=a, b=b, bias=bias, residual=residual))
        vector_checks(self.OP, a, N, rows, bias=bias, residual=residual)
        # the JIT specializes every pointer on its 16-byte alignment, bias and residual too: a
        # kernel compiled for an aligned residual would load a misaligned one in 16-byte vectors
        extra = [t for t in (bias, residual) if t is not None]
        key = (M, K, N, a.dtype, a.stride(), b.stride(), align_key(a, b, out, *extra),
               bias is None, None if residual is None else residual.stride(0))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(a, b, out, bias, residual)
        plan(self._args(a, b, out, bias, residual, plan))
        return out

    def _args(self, a, b, out, bias, residual, plan, programs=None, tag=None):
        M, K = a.shape
        W = self.world.world_size
        a_desc = b_desc = None
        if plan.use_desc:
            a_desc, b_desc, _ = operand_descriptors(a, b, plan.cfg, self.world.facts)
        return (a, b, out, out if bias is None else bias, out if residual is None else residual,
                self._recv[torch.float32 if plan.parts > 1 else a.dtype], self._gathered[a.dtype],
                self.sent, self.reduced, self.consumed, self.ctx, self._split_ws,
                self._split_done, M, b.shape[1], K, a.stride(0), a.stride(1), b.stride(0),
                b.stride(1), 0 if residual is None else residual.stride(0), -(-M // W),
                plan.programs if programs is None else programs,
                self.call_tag(plan.tag) if tag is None else tag, plan.parts, a_desc, b_desc)

    def _plan(self, a, b, out, bias, residual):
        M, K = a.shape
        N = b.shape[1]
        W, facts = self.world.world_size, self.world.facts
        # tiles by the product's shape, the same on every rank; warps by whether this rank's
        # operands take descriptors (``tile_config``)
        cfg = self.config or default_config(a.dtype, a.device, M, N,
                                            describable(a, b, facts, b_trans=True))
        check_k_steps(self.OP, a, b, cfg)
        block = -(-M // W)
        tpb = -(-block // cfg.block_m) * -(-N // cfg.block_n)
        parts = tile_parts(W, M, N, cfg, min(facts.sm_count, G_MAX), self._recv_raw.numel())
        if parts > 1 and (tpb * parts > self._split_done.numel()
                          or W * parts * block * N > self._recv_raw.numel()):
            raise RuntimeError(f"{self.OP}: {parts} ranges of {tpb} tiles pass the split "
                               f"tiles' slots or receive buffer (tile_parts)")
        # at least one program: a call with no rows (M = 0) still exchanges its flags, whose
        # shape tag catches a peer called with rows
        programs = max(1, min(W * tpb * parts, facts.sm_count, G_MAX))
        # descriptors where the device and operands allow, b's transpose where b is one (a
        # row-parallel weight, weight.t()); the plan's key (strides, alignment) fixes the choice
        a_desc, _, b_trans = operand_descriptors(a, b, cfg, facts)
        use_desc = a_desc is not None
        p = SimpleNamespace(cfg=cfg, use_desc=use_desc, parts=parts)

        # shapes (K is each rank's own), tiling, split, grid: a rank planned otherwise is caught
        def tag_of(g):
            return shape_tag(mode=self.mode, M=M, N=N, dtype=str(a.dtype), tiling=cfg.tiling,
                             parts=parts, programs=g)

        consts = dict(ALL_REDUCE=self.mode == "all_reduce", HAS_BIAS=bias is not None,
                      HAS_RES=residual is not None, USE_DESC=use_desc, B_TRANS=b_trans,
                      BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                      GROUP_M=cfg.group_m,
                      NUM_STAGES=cfg.num_stages, EVEN_K=K % cfg.block_k == 0,
                      PRECISION=dot_precision(a.dtype), UPCAST=dot_upcast(a.dtype), G_MAX=G_MAX,
                      SPLIT=parts > 1, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        plan = self._compile(matmul_reduce_stores_kernel, programs, consts,
                             lambda g: self._args(a, b, out, bias, residual, p, g, tag_of(g)))
        plan.cfg, plan.use_desc, plan.tag = cfg, use_desc, tag_of(plan.programs)
        plan.parts = parts
        return plan


#: the largest tile (elements) that ``tile_parts`` splits, and the most ranges a tile is cut
#: into: a range's float32 partial is written and read once more, and the part that completes
#: a tile reads every range's (8 of 64 x 128: 256 KiB). Not 128 x 128 (``MID_TILE``): over its
#: 4 warps the split epilogue spilled 112 bytes of registers on sm_90 (the whole tile's, 12).
SPLIT_TILE = 64 * 128
MAX_PARTS = 8


def tile_parts(W: int, M: int, N: int, cfg: MatmulConfig, programs: int, room: int) -> int:
    """How many ranges of K steps the kernel cuts each tile into (1: none): as
    many as keep every program busy once (W x tiles x parts <= ``programs``), at most
    ``MAX_PARTS``, while the peers' float32 ranges fit the receive buffer (``room`` float32
    elements). From M and N only, so every rank of a call cuts the same way whatever its own K
    (which may differ between ranks): a rank with fewer K steps than parts computes some
    empty ranges. Tiles larger than ``SPLIT_TILE`` stay whole: ``tile_config`` picks those
    only where their grid fills a third of the device or more."""
    if cfg.block_m * cfg.block_n > SPLIT_TILE:
        return 1
    block = -(-M // W)
    tiles = W * -(-block // cfg.block_m) * -(-N // cfg.block_n)
    if tiles == 0:  # no rows: nothing to cut
        return 1
    parts = min(MAX_PARTS, programs // tiles)
    while parts > 1 and W * parts * block * N > room:
        parts -= 1
    return max(parts, 1)
