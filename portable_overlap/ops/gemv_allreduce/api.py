"""Fused GEMV + AllReduce: validation, workspace, launch, and the torch.library op.

What it computes, with ``x_r``, ``w_r`` the tensors rank r passes::

    y = sum(x_r.float() @ w_r.float().T for r in ranks).to(x.dtype)   # [M, N], on every rank

x_r is [M, K_local] (1 <= M <= 64: a decode batch), w_r is [N, K_local]: rank r holds the K-slice
r of a row-parallel weight, so the sum over ranks is the full product. Every rank receives the
same bits (each column block is summed once, by its owner, in rank order).
"""
from __future__ import annotations

import threading
import zlib
from typing import Optional

import torch

from ...errors import ContextBrokenError
from ...shmem.heap import SymmetricHeap, heap_bytes
from ...shmem.status import StatusBoard
from ...tiles.gemv import dot_upcast
from .config import GemvConfig, pick_config
from .kernel import FLAG_NAMES, gemv_allreduce_kernel

OP = "gemv_all_reduce"
MAX_M = 64
G_MAX = 1024  # most programs one launch may have (flag slots per peer)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_contexts: dict[int, "GemvAllReduce"] = {}
_lock = threading.Lock()


class GemvAllReduce:
    """The workspace of the fused op on one rank: a symmetric heap with the partial and result
    buffers and the flags, a status board, and the per-shape launch choices.

    Collective: every rank of ``world`` must create it with the same arguments, and then make the
    same sequence of calls (same shapes, same order) on one stream.

    Args:
        world: the :class:`portable_overlap.World`.
        max_n: the largest N (output features) this context will be called with.
        timeout_s: how long a kernel waits for a peer before it gives up and reports
            (approximate: converted to polls with the backend's poll rate).
        config: force one launch configuration (else tuned table, else heuristic).
    """

    def __init__(self, world, max_n: int, *, timeout_s: float = 10.0,
                 config: Optional[GemvConfig] = None):
        if max_n < 1:
            raise ValueError(f"{OP}: max_n must be >= 1, got {max_n}")
        world.check_same(f"{OP} context arguments (max_n, config)", (max_n, config))
        self.world = world
        self.rank = world.rank
        self.max_n = max_n
        self.config = config
        self.max_spins = max(1, int(timeout_s * getattr(world.backend, "poll_rate_hz", 1e6)))
        W = world.world_size
        layout = [((W * MAX_M * max_n,), torch.float32), ((MAX_M * max_n,), torch.float32),
                  ((W, G_MAX), torch.int64), ((W, G_MAX), torch.int64), ((2,), torch.int64)]
        self.heap = SymmetricHeap(world, heap_bytes(layout))
        self.partial = self.heap.alloc(*layout[0])
        self._result_raw = self.heap.alloc(*layout[1])
        self.ready = self.heap.alloc(*layout[2])
        self.bcast = self.heap.alloc(*layout[3])
        self.ctl = self.heap.alloc(*layout[4])
        self.status = StatusBoard(world.backend, G_MAX)
        self._result = {dt: self._result_raw.view(torch.uint8).view(dt) for dt in DTYPES}
        self._plans: dict = {}
        self._broken: Optional[str] = None
        self._sync_errors = world.backend.name == "cpu"  # the interpreter runs synchronously
        with _lock:
            self.handle = max(_contexts, default=0) + 1
            _contexts[self.handle] = self

    # -- the call ------------------------------------------------------------------------------
    def __call__(self, x: torch.Tensor, w: torch.Tensor, out: Optional[torch.Tensor] = None,
                 *, config: Optional[GemvConfig] = None) -> torch.Tensor:
        """Run the op (see the module docstring); ``out`` is filled if given. ``config``
        overrides the launch configuration for this call (tuning sweeps)."""
        # This path runs on every decode step: no torch op beyond the output allocation, the
        # status board read from host memory, the compiled kernel launched without the JIT's
        # argument binding (which costs tens of microseconds a call).
        if self._broken is not None or self.status.failed():
            self.check()
        if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)) \
                or x.dim() != 2 or w.dim() != 2:
            _validate(x, w, self.world.device, self.max_n)  # raises with the reason
        M, K = x.shape
        N = w.shape[0]
        if out is None:
            out = torch.empty((M, N), dtype=x.dtype, device=x.device)
        elif out.shape != (M, N) or out.dtype != x.dtype or out.device != x.device \
                or not out.is_contiguous():
            _check_out(out, M, N, x)
        # the kernel is specialized on 16-byte alignment of its pointers: part of the key
        key = (M, K, N, x.dtype, w.dtype, x.device, w.device, x.is_contiguous(),
               w.is_contiguous(), x.stride(0), w.stride(0), x.data_ptr() % 16,
               w.data_ptr() % 16, out.data_ptr() % 16, config)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(x, w, out, config or self.config)
        plan(self._args(x, w, out, plan.tag, plan.n_blocks, plan.programs))
        if self._sync_errors:
            self.check()
        return out

    def check(self) -> None:
        """Raise if a kernel of this context reported a timeout or a shape mismatch. Reads
        host-visible memory only (no device sync); call after ``torch.cuda.synchronize()`` to
        include the last call."""
        if self._broken is not None:
            raise ContextBrokenError(f"{OP} context on rank {self.rank} failed before and is out "
                                     f"of step with its peers; create a new one. First error:\n"
                                     f"{self._broken}")
        try:
            self.status.raise_if_failed(OP, self.rank, FLAG_NAMES)
        except Exception as e:
            self._broken = str(e)
            raise

    def synchronize(self) -> None:
        """Wait for this rank's queued calls, then :meth:`check`."""
        self.world.backend.synchronize(self.world.device)
        self.check()

    def close(self) -> None:
        """Collective (every rank): free the workspace once all ranks' calls have finished."""
        with _lock:
            _contexts.pop(self.handle, None)
        self.heap.close()

    def _args(self, x, w, out, tag, n_blocks, programs):
        M, K = x.shape
        return (x, w, out, self.partial, self._result[x.dtype], self.ready, self.bcast, self.ctl,
                self.heap.bases, self.status.address, M, w.shape[0], K, x.stride(0), w.stride(0),
                n_blocks, programs, self.rank, self.world.world_size, tag, self.max_spins)

    # -- planning (once per shape) -------------------------------------------------------------
    def _plan(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
              config: Optional[GemvConfig]) -> "_Launch":
        _validate(x, w, self.world.device, self.max_n)
        M, K = x.shape
        N = w.shape[0]
        facts = self.world.facts
        cfg = config or pick_config(M, N, K, x.dtype, facts.arch, facts.sm_count,
                                    self.world.world_size)
        n_blocks = -(-N // cfg.block_n)
        consts = dict(
            BLOCK_M=max(16, 1 << (M - 1).bit_length()), BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages, EVEN_K=K % cfg.block_k == 0,
            EVEN_N=N % cfg.block_n == 0,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            UPCAST=dot_upcast(x.dtype), G_MAX=G_MAX,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        programs = min(n_blocks, facts.sm_count * cfg.programs_per_sm, G_MAX)
        if facts.vendor == "cpu":  # the interpreter has no compiled kernel to hold on to
            return _Launch(None, programs, consts, _tag(M, N, K, x.dtype, cfg, programs),
                           n_blocks, None)
        # compile with the very arguments of the launch (the JIT specializes on values)
        tag = _tag(M, N, K, x.dtype, cfg, programs)
        k = gemv_allreduce_kernel.warmup(*self._args(x, w, out, tag, n_blocks, programs),
                                         grid=(programs,), **consts)
        fit = min(programs, self._resident_programs(k, consts, facts))
        if fit != programs:  # G is an argument the JIT specializes on: compile for the real one
            programs = fit
            tag = _tag(M, N, K, x.dtype, cfg, programs)
            k = gemv_allreduce_kernel.warmup(*self._args(x, w, out, tag, n_blocks, programs),
                                             grid=(programs,), **consts)
        backend, device = self.world.backend, self.world.device
        return _Launch(k, programs, consts, tag, n_blocks,
                       lambda: backend.current_stream(device))

    @staticmethod
    def _resident_programs(k, consts, facts) -> int:
        """How many programs of the compiled kernel ``k`` fit on the device at once. A program
        waits for its counterpart on the peers, and a wait must never hold an SM that a program
        it depends on needs, so the grid never exceeds this."""
        k._init_handles()
        warps = consts["num_warps"]
        by_warps = facts.max_warps_per_sm // warps
        by_regs = facts.max_regs_per_sm // max(1, k.n_regs * facts.warp_size * warps)
        by_smem = facts.max_shared_bytes_per_sm // max(1, k.metadata.shared)
        return facts.sm_count * max(1, min(by_warps, by_regs, by_smem))


class _Launch:
    """One planned launch: the compiled kernel (None under the interpreter), its grid and
    constants, the shape tag and the number of column blocks."""

    def __init__(self, compiled, programs, consts, tag, n_blocks, stream_fn):
        self.compiled, self.programs, self.consts = compiled, programs, consts
        self.tag, self.n_blocks, self.stream_fn = tag, n_blocks, stream_fn
        names = gemv_allreduce_kernel.arg_names
        self.const_args = tuple(consts[n] for n in names if n in consts)  # constexprs come last
        if compiled is not None:
            compiled._init_handles()

    def __call__(self, args) -> None:
        k = self.compiled
        if k is None:
            gemv_allreduce_kernel[(self.programs,)](*args, **self.consts)
            return
        from triton import knobs

        stream = self.stream_fn()
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        meta = k.launch_metadata((self.programs, 1, 1), stream, *args) if enter else None
        k.run(self.programs, 1, 1, stream, k.function, k.packed_metadata, meta, enter, leave,
              *args, *self.const_args)


def _tag(M, N, K, dtype, cfg: GemvConfig, programs: int) -> int:
    """What the flags carry besides the epoch: ranks run the same code, so a rank called with
    other shapes, or planned with another tiling or grid (a per-call config on one rank only), is
    caught by the first flag it sends instead of mixing up column blocks."""
    return zlib.crc32(repr((M, N, K, str(dtype), cfg.block_n, programs)).encode()) & 0x7FFFFFFF


def _validate(x: torch.Tensor, w: torch.Tensor, device: torch.device, max_n: int) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        raise TypeError(f"{OP}: x and w must be tensors")
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"{OP}: x must be [M, K] and w [N, K]; got x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)}")
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        raise TypeError(f"{OP}: x and w must share one dtype of {DTYPES}; got {x.dtype}, {w.dtype}")
    if x.device != device or w.device != device:
        raise ValueError(f"{OP}: x and w must be on this rank's device {device}; "
                         f"got {x.device}, {w.device}")
    M, K = x.shape
    N, Kw = w.shape
    if K != Kw:
        raise ValueError(f"{OP}: x has K={K} columns but w has K={Kw}")
    if not 1 <= M <= MAX_M:
        raise ValueError(f"{OP}: M (rows of x) must be in 1..{MAX_M}, got {M}; "
                         f"use a GEMM path for larger batches")
    if not 1 <= N <= max_n:
        raise ValueError(f"{OP}: N={N} is outside 1..max_n={max_n} of this context")
    if K < 1:
        raise ValueError(f"{OP}: K must be >= 1")
    if not x.is_contiguous() or not w.is_contiguous():
        raise ValueError(f"{OP}: x and w must be contiguous (call .contiguous() first)")


def _check_out(out: torch.Tensor, M: int, N: int, x: torch.Tensor) -> None:
    if out.shape != (M, N) or out.dtype != x.dtype or out.device != x.device \
            or not out.is_contiguous():
        raise ValueError(f"{OP}: out must be a contiguous {x.dtype} [{M}, {N}] tensor on "
                         f"{x.device}; got {out.dtype} {tuple(out.shape)} on {out.device}")


def get_context(handle: int) -> GemvAllReduce:
    try:
        return _contexts[handle]
    except KeyError:
        raise ValueError(f"{OP}: no open context with handle {handle}") from None


def gemv_all_reduce(x: torch.Tensor, w: torch.Tensor, ctx: GemvAllReduce,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y = Σ_r x_r @ w_rᵀ`` over the ranks of ``ctx.world``; see the module docstring.

    Under ``torch.compile`` this goes through ``torch.ops.portable_overlap.gemv_all_reduce`` so
    the graph holds one opaque op; eagerly it launches the kernel directly (less overhead)."""
    if out is None and torch.compiler.is_compiling():
        return torch.ops.portable_overlap.gemv_all_reduce(x, w, ctx.handle)
    return ctx(x, w, out)


@torch.library.custom_op("portable_overlap::gemv_all_reduce", mutates_args=())
def _gemv_all_reduce_op(x: torch.Tensor, w: torch.Tensor, handle: int) -> torch.Tensor:
    return get_context(handle)(x, w)


@_gemv_all_reduce_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))
