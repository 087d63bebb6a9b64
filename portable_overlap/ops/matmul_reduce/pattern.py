"""The contexts of GEMM + ReduceScatter and GEMM + AllReduce (K split over the ranks: a
row-parallel linear layer), one per pattern, with the transport as an argument.

What they compute, with ``a_q`` [M, K_q] and ``b_q`` [K_q, N] the tensors rank q passes::

    c = sum_q a_q @ b_q (+ bias [N])                         # [M, N], fp32 accumulation
    MatmulReduceScatter:  out_r = c[r*M/W:(r+1)*M/W] (+ residual [M/W, N])   # rank r's rows
    MatmulAllReduce:      out_r = c (+ residual [M, N])                       # every rank

Transports (``transport=``):

- ``"copy_engine"`` (the default on CPU-emulated ranks, ``"auto"`` on a GPU): the vendor BLAS
  computes the peers' row blocks first in pieces;
  copy engines (DMA) move each finished piece, no SM spent on communication
  (``matmul_reduce.api.MatmulReduce``; options ``pieces``, ``put_lanes``);
- ``"stores"``: one persistent Triton GEMM stores each partial tile straight into its owner's
  heap, the peers' blocks first, all peers at once; the owner adds the peers' partials in the
  epilogue of its own tiles (AllReduce: and stores the reduced tiles into every peer's heap)
  (``matmul_reduce.stores``, ``matmul_reduce.kernel``; option ``config``);
- ``"signal_collective"``: one persistent Triton GEMM counts finished tiles per wave group; each
  group's counter gates an ordinary collective of the vendor's library on a side stream, a
  reorder restores the layout (``gemm_signal.api.GemmSignal``; option ``config``, per call also
  ``config``, ``rms_weight``, ``eps``, ``normed``);
- ``"signal_copy_engine"`` (ReduceScatter only): the same GEMM, its group counters gating
  copy-engine transfers, a reduction kernel at the end
  (``gemm_signal.copy_engine.GemmReduceScatterCE``; option ``config``);
- ``"torch_fused"`` (ReduceScatter only): torch's
  ``torch.ops.symm_mem.fused_matmul_reduce_scatter``, then bias and residual
  (``ops/torch_fused.py``; no options; GPU worlds of one host only, elsewhere it raises
  ``BackendUnavailable``);
- ``"sequential"``: ``torch.matmul``, then the vendor library's collective on the whole product
  (``ops/sequential.py``; no options): the baseline, and the choice where a fused transport
  measured slower;
- ``"auto"``: the workspace of every transport that can run on the world; each call shape runs
  the one that timed fastest at that shape's first call (``ops/planner.py``; ``"sequential"``
  unless beaten by more than 3 %). A call that passes per-call options runs on the transports
  that take them (``config``, ``rms_weight``, ``eps``, ``normed``: ``"signal_collective"``;
  ``config`` also ``"signal_copy_engine"``; ``"torch_fused"`` takes none).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..gemm_signal.config import SIGNAL_CALL_OPTIONS, SignalConfig
from ..matmul.api import DTYPES, default_config
from ..pattern import MatmulPattern, timeout_kw
from ..registry import OpSpec, define


class _MatmulReduction(MatmulPattern):
    """Shared by the two patterns: the workspace of ``transport`` for results of at most
    ``max_m`` x ``max_n`` (the full product's rows and columns) and the call."""

    MODE = ""
    CALL_OPTIONS = {"signal_collective": SIGNAL_CALL_OPTIONS,
                    "signal_copy_engine": {"config": SignalConfig}}
    OUTPUT_OPTIONS = ("normed",)

    def _make(self, world, transport, timeout_s, **options):
        W, M, N = world.world_size, self.max_m, self.max_n
        if transport == "copy_engine":
            from .api import MatmulReduce

            return MatmulReduce(world, MatmulReduce.elems_needed(M, N, W), op=self.OP, **options,
                                **timeout_kw(timeout_s))
        if transport == "signal_collective":
            from ..gemm_signal.api import GemmSignal

            return GemmSignal(world, **options, **timeout_kw(timeout_s))
        if transport == "stores":
            from .stores import MatmulReduceStores

            return MatmulReduceStores(world, self.OP, self.MODE, M, N, **options,
                                      **timeout_kw(timeout_s))
        if transport == "torch_fused":
            from ..torch_fused import TorchFusedMatmul

            return TorchFusedMatmul(world, self.OP, M, N, **options, **timeout_kw(timeout_s))
        if transport == "sequential":
            from ..sequential import SequentialMatmul

            return SequentialMatmul(world, self.OP, M, N, **options, **timeout_kw(timeout_s))
        from ..gemm_signal.api import SignalConfig
        from ..gemm_signal.copy_engine import GemmReduceScatterCE

        cfg = options.get("config") or SignalConfig()
        tilings = [cfg.matmul] if cfg.matmul else [default_config(d, world.device)
                                                   for d in DTYPES]
        need = max(GemmReduceScatterCE.elems_needed(M, N, W, t.block_m, t.block_n)
                   for t in tilings)
        return GemmReduceScatterCE(world, need, **options, **timeout_kw(timeout_s))

    def __call__(self, a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 residual: Optional[torch.Tensor] = None, *,
                 out: Optional[torch.Tensor] = None, **options) -> torch.Tensor:
        return self._dispatch(*self._bind(a, b, bias, residual, out=out, **options))

    def _bind(self, a, b, bias=None, residual=None, *, out=None, **options) -> tuple:
        return {"a": a, "b": b, "bias": bias, "residual": residual}, out, options

    def _run(self, transport, impl, inputs, out, options):
        return getattr(impl, self.MODE)(inputs["a"], inputs["b"], out, bias=inputs["bias"],
                                        residual=inputs["residual"], **options)


class MatmulReduceScatter(_MatmulReduction):
    """Workspace of :func:`portable_overlap.matmul_reduce_scatter` on one rank (module
    docstring): ``MatmulReduceScatter(world, max_m, max_n, transport=None)``, ``transport`` one
    of ``TRANSPORTS`` or ``"auto"``, the default on a GPU world
    (``PatternContext.default_transport``). Collective to create and to close; the same calls
    in the same order on every rank."""

    OP = "matmul_reduce_scatter"
    MODE = "reduce_scatter"
    TRANSPORTS = ("copy_engine", "stores", "signal_collective", "signal_copy_engine",
                  "torch_fused", "sequential")


class MatmulAllReduce(_MatmulReduction):
    """Workspace of :func:`portable_overlap.matmul_all_reduce` on one rank (module docstring):
    ``MatmulAllReduce(world, max_m, max_n, transport=None)``, ``transport`` one of
    ``TRANSPORTS`` or ``"auto"``, the default on a GPU world
    (``PatternContext.default_transport``). Collective to create and to close; the same calls
    in the same order on every rank."""

    OP = "matmul_all_reduce"
    MODE = "all_reduce"
    TRANSPORTS = ("copy_engine", "stores", "signal_collective", "sequential")


def _rows_of(ctx, M: int) -> int:
    W, r = ctx.world.world_size, ctx.rank
    return M * (r + 1) // W - M * r // W


_KERNELS = ("portable_overlap.ops.gemm_signal.compile_specs",
            "portable_overlap.transports.compile_specs",
            "portable_overlap.ops.matmul_reduce.compile_specs")
_SCHEMA = ("(Tensor a, Tensor b, int handle, Tensor? bias=None, Tensor? residual=None) "
           "-> Tensor")

REDUCE_SCATTER = define(OpSpec(
    "matmul_reduce_scatter", _SCHEMA, context=MatmulReduceScatter,
    transports=MatmulReduceScatter.TRANSPORTS, compile_specs=_KERNELS,
    fake=lambda ctx, a, b, bias=None, residual=None: a.new_empty((_rows_of(ctx, a.shape[0]),
                                                                  b.shape[1]))))

ALL_REDUCE = define(OpSpec(
    "matmul_all_reduce", _SCHEMA, context=MatmulAllReduce, transports=MatmulAllReduce.TRANSPORTS,
    compile_specs=_KERNELS,
    fake=lambda ctx, a, b, bias=None, residual=None: a.new_empty((a.shape[0], b.shape[1]))))


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, ctx: MatmulReduceScatter,
                          out: Optional[torch.Tensor] = None, *,
                          bias: Optional[torch.Tensor] = None,
                          residual: Optional[torch.Tensor] = None, **options) -> torch.Tensor:
    """Rows ``[r*M/W, (r+1)*M/W)`` of ``sum_q a_q @ b_q + bias (+ residual)`` on rank r, where
    ``a_q`` [M, K_q] and ``b_q`` [K_q, N] are what rank q passes (M divisible by W). ``options``
    are the transport's per-call options (module docstring). Under ``torch.compile`` one opaque
    op, ``torch.ops.portable_overlap.matmul_reduce_scatter(a, b, ctx.handle, bias,
    residual)``."""
    return REDUCE_SCATTER(ctx, (a, b, bias, residual), out=out, **options)


def matmul_all_reduce(a: torch.Tensor, b: torch.Tensor, ctx: MatmulAllReduce,
                      out: Optional[torch.Tensor] = None, *, bias: Optional[torch.Tensor] = None,
                      residual: Optional[torch.Tensor] = None, **options) -> torch.Tensor:
    """``sum_q a_q @ b_q + bias (+ residual)`` [M, N] on every rank, where ``a_q`` [M, K_q] and
    ``b_q`` [K_q, N] are what rank q passes. ``options`` are the transport's per-call options
    (module docstring). Under ``torch.compile`` one opaque op,
    ``torch.ops.portable_overlap.matmul_all_reduce(a, b, ctx.handle, bias, residual)``."""
    return ALL_REDUCE(ctx, (a, b, bias, residual), out=out, **options)
