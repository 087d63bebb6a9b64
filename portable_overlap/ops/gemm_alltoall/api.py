"""Fused dense GEMM + equal-split All-to-All (the uniform-routing setting of MoE expert
parallelism and of the fused-collectives paper).

What it computes, with ``a_r``, ``b_r`` the tensors rank r passes (a [M, K], b [K, N])::

    c_r = a_r @ b_r                                          # [M, N] on rank r; chunk = M // world
    out_d[r*chunk:(r+1)*chunk] = c_r[d*chunk:(d+1)*chunk]    # on rank d, for every source r

i.e. ``torch.distributed.all_to_all_single(out, a @ b)``, each tile stored into the destination's
heap as soon as it is computed (see kernel.py).

Status: correct on CPU-emulated ranks (2 and 4) and compiled for sm_90 and gfx942; not yet run or
measured on GPUs.
"""
from __future__ import annotations

import zlib
from typing import Optional

import torch

from ...tiles.gemv import dot_upcast
from ...shmem.device import TAG_MASK
from ..context import G_MAX, OverlapContext, align_key, get_context
from ..matmul.api import DTYPES, MatmulConfig, check_operands, default_config
from .kernel import FLAG_NAMES, gemm_alltoall_kernel

OP = "gemm_all_to_all"


class GemmAllToAll(OverlapContext):
    """Workspace of the fused GEMM + All-to-All on one rank: a receive buffer of ``max_elems``
    elements (M × N of the largest call) in the symmetric heap, flags, status board. Collective to
    create and close; the same calls in the same order on every rank, on one stream."""

    OP = OP
    FLAG_NAMES = FLAG_NAMES

    def __init__(self, world, max_elems: int, *, timeout_s: float = 10.0,
                 config: Optional[MatmulConfig] = None):
        if max_elems < 1:
            raise ValueError(f"{OP}: max_elems must be >= 1, got {max_elems}")
        world.check_same(f"{OP} context arguments (max_elems, config)", (max_elems, config))
        W = world.world_size
        if W > 64:  # the kernel keeps one bit per peer ("its receive buffer is free") in an int64
            raise ValueError(f"{OP}: at most 64 ranks, got {W}")
        super().__init__(world, [
            ("_recv_raw", (max_elems,), torch.float32),  # rows from peers, viewed per dtype
            ("sent", (W, G_MAX), torch.int64), ("consumed", (W,), torch.int64),
            ("ctl", (2,), torch.int64),
        ], timeout_s)
        self.max_elems = max_elems
        self.config = config
        self._recv = {dt: self._recv_raw.view(torch.uint8).view(dt) for dt in DTYPES}

    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None,
                 *, config: Optional[MatmulConfig] = None) -> torch.Tensor:
        self._before_call()
        _validate(a, b, self.world, self.max_elems)
        M, K = a.shape
        N = b.shape[1]
        if out is None:
            out = torch.empty((M, N), dtype=a.dtype, device=a.device)
        elif out.shape != (M, N) or out.dtype != a.dtype or out.device != a.device \
                or not out.is_contiguous():
            raise ValueError(f"{OP}: out must be a contiguous {a.dtype} [{M}, {N}] tensor on "
                             f"{a.device}")
        key = (M, K, N, a.dtype, a.stride(), b.stride(), align_key(a, b, out), config)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(a, b, out, config or self.config)
        plan(self._args(a, b, out, plan.tag, plan.programs))
        self._after_call()
        return out

    def _args(self, a, b, out, tag, programs):
        M, K = a.shape
        W = self.world.world_size
        return (a, b, out, self._recv[a.dtype], self.sent, self.consumed, self.ctl,
                self.heap.bases, self.status.address, M, b.shape[1], K, a.stride(0), a.stride(1),
                b.stride(0), b.stride(1), M // W, programs, self.rank, W, tag, self.max_spins)

    def _plan(self, a, b, out, config: Optional[MatmulConfig]):
        M, K = a.shape
        N = b.shape[1]
        cfg = config or default_config(a.dtype, a.device)
        n_tiles = -(-M // cfg.block_m) * -(-N // cfg.block_n)
        consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                      GROUP_M=cfg.group_m, NUM_STAGES=cfg.num_stages,
                      EVEN_K=K % cfg.block_k == 0,
                      PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
                      UPCAST=dot_upcast(a.dtype), G_MAX=G_MAX, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages)
        programs = min(n_tiles, self.world.facts.sm_count, G_MAX)

        def tag_of(g):  # shapes, tiling and grid: a rank planned differently is caught
            return zlib.crc32(repr((M, N, K, str(a.dtype), cfg, g)).encode()) & TAG_MASK

        plan = self._compile(gemm_alltoall_kernel, programs, consts,
                             lambda g: self._args(a, b, out, tag_of(g), g))
        plan.tag = tag_of(plan.programs)
        return plan


def _validate(a, b, world, max_elems: int) -> None:
    check_operands(OP, a, b, world.device)
    M, N = a.shape[0], b.shape[1]
    if M % world.world_size:
        raise ValueError(f"{OP}: M={M} rows must split evenly over {world.world_size} ranks "
                         f"(equal-split All-to-All)")
    if M * N > max_elems:
        raise ValueError(f"{OP}: M*N={M * N} exceeds this context's max_elems={max_elems}")


def gemm_all_to_all(a: torch.Tensor, b: torch.Tensor, ctx: GemmAllToAll,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """See the module docstring; under ``torch.compile`` it is one opaque op."""
    if out is None and torch.compiler.is_compiling():
        return torch.ops.portable_overlap.gemm_all_to_all(a, b, ctx.handle)
    return ctx(a, b, out)


@torch.library.custom_op("portable_overlap::gemm_all_to_all", mutates_args=())
def _gemm_all_to_all_op(a: torch.Tensor, b: torch.Tensor, handle: int) -> torch.Tensor:
    return get_context(handle)(a, b)


@_gemm_all_to_all_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, handle: int) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]))
