"""Fused GEMV + AllReduce: validation, the fused transports' workspace and launch (the public
context with its transports, and the torch.library op, are in pattern.py).

What it computes, with ``x_r``, ``w_r`` the tensors rank r passes::

    y = sum(x_r.float() @ w_r.float().T for r in ranks).to(x.dtype)   # [M, N], on every rank

x_r is [M, K_local] (0 <= M <= 64: a decode batch), w_r is [N, K_local] (K_local >= 0, and may
differ across ranks; an empty shard adds zeros): rank r holds the K-slice r of a row-parallel
weight, so the sum over ranks is the full product. Every rank receives the
same bits (each column block is summed once, by its owner, in rank order).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ...tiles.gemv import dot_precision, dot_upcast
from ..context import (check_no_overlap, check_transport, collective_call, G_MAX,
                       OverlapContext, shape_tag)
from .config import GemvConfig, pick_config, split_misfit
from .kernel import FLAG_LABELS, gemv_allreduce_kernel

OP = "gemv_all_reduce"
MAX_M = 64
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: ``"stores"``: one persistent kernel, partial sums stored into the owners' heaps, which reduce
#: them and store the result into every rank (two flag rounds); ``"one_shot"``: every partial
#: stored into every rank, each reducing all of them (one flag round, ``world`` times the
#: stores and the reduction: for latency-bound decode steps on many ranks)
KERNEL_TRANSPORTS = ("stores", "one_shot")


class GemvAllReduceKernel(OverlapContext):
    """The workspace of the fused transports on one rank (``pattern.GemvAllReduce`` makes it):
    a symmetric heap with the partial and result buffers and the flags, a status board, and the
    per-shape launch choices.

    Collective: every rank of ``world`` must create it with the same arguments, and then make the
    same sequence of calls (same shapes, same order) on any streams (each call runs after the last).

    Args:
        world: the :class:`portable_overlap.World`.
        max_n: the largest N (output features) this context will be called with.
        timeout_s: how long a call's waits for its peers may take in all before the kernel
            gives up and reports (one wall-clock deadline per call, from its first wait that
            had to spin).
        config: force one launch configuration (else tuned table, else heuristic). Its
            ``split_k`` > 1 (K slices per column block) needs ``"one_shot"``.
        transport: ``"stores"`` (two-shot) or ``"one_shot"`` (``KERNEL_TRANSPORTS``). The
            one-shot form keeps two calls' partials (``2 * world * 64 * max_n`` floats).
            The partials must stay under 2**31 elements (``ValueError`` otherwise).
    """

    OP = OP
    FLAG_LABELS = FLAG_LABELS

    def __init__(self, world, max_n: int, *, timeout_s: float = 10.0,
                 config: Optional[GemvConfig] = None, transport: str = "stores"):
        self.transport = check_transport(OP, transport, KERNEL_TRANSPORTS)
        if max_n < 1:
            raise ValueError(f"{OP}: max_n must be >= 1, got {max_n}")
        check_config_type(config)
        world.check_same(f"{OP} context arguments (max_n, config, transport)",
                         (max_n, config, transport))
        W = world.world_size
        one_shot = transport == "one_shot"
        if config is not None:
            check_split(config, transport)
        partials = (2 if one_shot else 1) * W * MAX_M * max_n
        if partials >= 2 ** 31:  # the kernel offsets into them in int32 (kernel.py)
            raise ValueError(f"{OP}: max_n={max_n} on {W} ranks needs {partials} partial "
                             f"elements ({'2 x ' if one_shot else ''}world x {MAX_M} x max_n), "
                             f"past the kernel's 2**31; use max_n < "
                             f"{-(-2 ** 31 // ((2 if one_shot else 1) * W * MAX_M))}")
        super().__init__(world, [
            # fp32 partials [src, M, N]; the one-shot form keeps two calls' (kernel.py)
            ("partial", (partials,), torch.float32),
            # reduced tiles, viewed per dtype (the two-shot form's broadcast)
            ("_result_raw", (1 if one_shot else MAX_M * max_n,), torch.float32),
            ("ready", (W, G_MAX), torch.int64), ("bcast", (W, G_MAX), torch.int64),
        ], timeout_s)
        self.call_protocol(self.ctx, call_flags=(self.ready, self.bcast))
        # after a call this rank refused or failed, the peers' late partials of it land first:
        # their call counters (pol.end_call, after each program's stores) say when
        self.late_stores_guard(None, "call-counter")
        self.max_n = max_n
        self.config = config
        self._result = {dt: self._result_raw.view(torch.uint8).view(dt) for dt in DTYPES}
        # the heap buffers' addresses, fixed for the context's life (``_result``'s views share
        # one): a compiled launch takes them as integers (``_args``)
        self._heap_ptrs = tuple(t.data_ptr() for t in (
            self.partial, self._result_raw, self.ready, self.bcast, self.ctx))
        # one half of the one-shot partials (kernel.py: a call's half is at a fixed offset)
        self._half = W * MAX_M * max_n if one_shot else 0

    # -- the call ------------------------------------------------------------------------------
    @collective_call
    def __call__(self, x: torch.Tensor, w: torch.Tensor, out: Optional[torch.Tensor] = None,
                 *, config: Optional[GemvConfig] = None) -> torch.Tensor:
        """Run the op (see the module docstring); ``out`` is filled if given. ``config``
        overrides the launch configuration for this call (tuning sweeps)."""
        # This path runs on every decode step: no torch op beyond the output allocation, the
        # status board read from host memory, the compiled kernel launched without the JIT's
        # argument binding and with its pointers as integers (``_args``).
        if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)) \
                or x.dim() != 2 or w.dim() != 2:
            validate(x, w, self.world.device, self.max_n)  # raises with the reason
        M, K = x.shape
        N = w.shape[0]
        if out is None:  # (x's dtype and device; 1.2 us less than torch.empty naming them)
            out = x.new_empty((M, N))
        else:
            check_out(out, M, N, x, w)
        xp, wp, op = x.data_ptr(), w.data_ptr(), out.data_ptr()
        sx, sw = x.stride(0), w.stride(0)
        if config is not None and type(config) is not GemvConfig:  # (before it is hashed)
            check_config_type(config)
        # alignment to 16 bytes: what the compiled kernel assumes of each pointer; w's own K,
        # as the plan validated it (a one-row w [1, K_w] is contiguous whatever its row stride,
        # so sw need not tell a w narrower than x)
        key = (M, K, N, w.shape[1], x.dtype, w.dtype, x.device, w.device, x.is_contiguous(),
               w.is_contiguous(), sx, sw, xp % 16, wp % 16, op % 16, config)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(x, w, out, config or self.config)
        tag = self.call_tag(plan.tag)  # (a layer's count of op changes: ContextBase.call_tag)
        if plan.compiled is None:  # the interpreter maps tensors, not addresses
            plan(self._args(x, w, out, tag, plan.n_blocks, plan.programs))
        else:
            plan((xp, wp, op, *self._heap_ptrs, M, N, K, sx, sw, plan.n_blocks,
                  plan.programs, tag, self._half))
        return out

    def _args(self, x, w, out, tag, n_blocks, programs):
        """The kernel's arguments with tensors (its compile, the interpreter). A compiled
        launch takes the same with every pointer an integer (``__call__``): Triton's launcher
        then skips each tensor's ``data_ptr()`` call and the driver's query of its address
        (``cuPointerGetAttribute``), nine pointers per call."""
        M, K = x.shape
        return (x, w, out, self.partial, self._result[x.dtype], self.ready, self.bcast, self.ctx,
                M, w.shape[0], K, x.stride(0), w.stride(0), n_blocks, programs, tag, self._half)

    # -- planning (once per shape) -------------------------------------------------------------
    def _plan(self, x, w, out, config: Optional[GemvConfig]):
        validate(x, w, self.world.device, self.max_n)
        M, K = x.shape
        N = w.shape[0]
        facts = self.world.facts
        one_shot = self.transport == "one_shot"
        room = MAX_M * self.max_n  # one rank's slot of the one-shot partials (kernel.py)
        if config is not None:
            check_split(config, self.transport)
            why = split_misfit(config, M, N, facts.sm_count, room) if config.split_k > 1 \
                else None
            if why is not None:
                raise ValueError(f"{OP}: {why}")
        cfg = config or pick_config(M, N, K, x.dtype, facts.arch, facts.sm_count,
                                    self.world.world_size, facts.shared_per_program,
                                    room if one_shot else 0)
        plan = self._plan_with(x, w, out, cfg)
        if plan is None and config is not None:
            raise ValueError(f"{OP}: split_k={config.split_k} needs all of its "
                             f"{-(-N // config.block_n) * config.split_k} programs resident at "
                             f"once, more than fit on this device with {config}; use a smaller "
                             f"split_k or fewer warps or stages")
        split = cfg.split_k
        while plan is None:  # the rule's split does not fit the device's residency: halve it
            split //= 2  # (1 always fits: its grid is capped at what is resident)
            plan = self._plan_with(x, w, out, dataclasses.replace(cfg, split_k=max(split, 1)))
        return plan

    def _plan_with(self, x, w, out, cfg: GemvConfig):
        """The compiled launch of ``cfg``, or None where its K split's grid (every program of
        which must be resident at once: kernel.py) is more than fits on the device."""
        M, K = x.shape
        N = w.shape[0]
        facts = self.world.facts
        n_blocks = -(-N // cfg.block_n)
        consts = dict(
            BLOCK_M=max(16, 1 << (M - 1).bit_length()), BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages, EVEN_K=K % cfg.block_k == 0,
            EVEN_N=N % cfg.block_n == 0,
            PRECISION=dot_precision(x.dtype),
            UPCAST=dot_upcast(x.dtype), G_MAX=G_MAX, ONE_SHOT=self.transport == "one_shot",
            SPLIT_K=cfg.split_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if cfg.split_k > 1:  # one program per (column block, K slice)
            programs = n_blocks * cfg.split_k
        else:
            programs = min(n_blocks, facts.sm_count * cfg.programs_per_sm, G_MAX)
        tag_of = lambda g: _tag(M, N, x.dtype, cfg, g, self.transport)  # noqa: E731
        plan = self._compile(gemv_allreduce_kernel, programs, consts,
                             lambda g: self._args(x, w, out, tag_of(g), n_blocks, g))
        if plan.programs != programs and cfg.split_k > 1:
            return None
        plan.tag, plan.n_blocks = tag_of(plan.programs), n_blocks
        return plan


def _tag(M, N, dtype, cfg: GemvConfig, programs: int, transport: str) -> int:
    """What the flags carry besides the epoch: ranks run the same code, so a rank called with
    other shapes, or planned with another tiling or grid (a per-call config on one rank only), is
    caught by the first flag it sends instead of mixing up column blocks. Not K: each rank
    passes its own K shard (``x_r`` [M, K_r]), which only its own K loop reads; the partials
    that travel are [M, N] whatever K_r (``pick_config`` does not choose by K either)."""
    return shape_tag(M=M, N=N, dtype=str(dtype), block_n=cfg.block_n, programs=programs,
                     transport=transport, split_k=cfg.split_k)


def check_config_type(config) -> None:
    """A ``config`` (the context's or a call's) is a :class:`GemvConfig` or None: a name or a
    dict of its fields failed later as an ``AttributeError`` or "unhashable type"."""
    if config is not None and not isinstance(config, GemvConfig):
        raise TypeError(f"{OP}: config must be a GemvConfig or None, got "
                        f"{type(config).__name__} {config!r}")


def check_split(cfg: GemvConfig, transport: str) -> None:
    """A K split (``split_k`` > 1) runs on the one-shot transport only: the two-shot form's
    owners reduce blocks whose partials come from one program per rank."""
    if cfg.split_k > 1 and transport != "one_shot":
        raise ValueError(f"{OP}: config split_k={cfg.split_k} needs transport=\"one_shot\" "
                         f"(the {transport!r} transport computes each column block in one "
                         f"program: split_k=1)")


def validate(x: torch.Tensor, w: torch.Tensor, device: torch.device, max_n: int) -> None:
    """The op's input checks (every transport's): ``ValueError`` / ``TypeError`` naming what
    is wrong."""
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
    # M = 0 is a call (every rank's batch empty): the kernel still runs its flag exchange,
    # whose shape tag holds M, so a rank called with rows beside one without is caught
    if M > MAX_M:
        raise ValueError(f"{OP}: M (rows of x) must be in 0..{MAX_M}, got {M}; use a GEMM "
                         f"path for larger batches")
    if not 1 <= N <= max_n:
        raise ValueError(f"{OP}: N={N} is outside 1..max_n={max_n} of this context")
    # K = 0 (this rank's shard empty) is a call: its partial is zeros, as torch's x @ w.T of
    # [M, 0] by [0, N]; its K loop runs no step, and the flags' tag holds no K
    for name, t in (("x", x), ("w", w)):
        if not t.is_contiguous():
            raise ValueError(f"{OP}: {name} must be contiguous, got strides {t.stride()} for "
                             f"{tuple(t.shape)} (call .contiguous() first)")


def check_out(out: torch.Tensor, M: int, N: int, x: torch.Tensor, w: torch.Tensor) -> None:
    """``out`` must be a contiguous [M, N] tensor of x's dtype and device that shares no memory
    with ``x`` or ``w`` (``context.check_no_overlap``: the kernel's programs store result
    blocks while others still read x, and the sequential transport's ``torch.mm`` writes
    ``out`` as it reads them), and that does not require grad where grad mode is on (as
    ``torch.mm(out=...)`` refuses it)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{OP}: out must be a tensor or None, got {type(out).__name__}")
    if out.shape != (M, N) or out.dtype != x.dtype or out.device != x.device \
            or not out.is_contiguous():
        raise ValueError(f"{OP}: out must be a contiguous {x.dtype} [{M}, {N}] tensor on "
                         f"{x.device}; got {out.dtype} {tuple(out.shape)} on {out.device}")
    # written in place, as torch's ``mm(out=...)`` writes it, which refuses an ``out`` that
    # requires grad while grad mode is on: the result would carry no gradient. The sequential
    # transport met that error only in ``torch.mm``, after its checks (under ``"auto"``, after
    # the call's agreement), on this rank alone, its peers left in the all-reduce
    if out.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{OP}: out requires grad, and the op writes it in place (no "
                         f"gradient would flow through it); pass an out that does not "
                         f"require grad, or call under torch.no_grad()")
    # the decode path: address arithmetic only (0.5 us against 4 for the general check); x and
    # w are contiguous wherever a launch follows (validate, and the plan key)
    o = out.data_ptr()
    for t in (x, w):
        p = t.data_ptr()
        if p < o + out.nbytes and o < p + t.nbytes:
            check_no_overlap(OP, out, {"x": x, "w": w})  # raises, naming the input
