"""The context of GEMM + All-to-All (equal splits), with the transport as an argument.

What it computes, with ``a_r`` [M, K_r] and ``b_r`` [K_r, N] the tensors rank r passes (``K_r``
rank r's own, which may differ across ranks: only the products move; M, N and the dtype are
the same on every rank)::

    c_r = a_r @ b_r                                           # [M, N] on rank r
    out_d[r*M/W:(r+1)*M/W] = c_r[d*M/W:(d+1)*M/W]             # on rank d, every r
    out_d += bias_d (+ residual_d)                            # rank d's own, after the exchange

i.e. ``torch.distributed.all_to_all_single(out, a @ b); out += bias (+ residual)``: the bias
[N] and the residual [M, N] are those of the rank that receives the rows, so every row on rank
d gets ``bias_d``, whichever rank computed it, not the bias of the rank whose ``b_r`` made it
(a bias that belongs with ``b_r``, such as an expert's, is not what this op adds). Every
transport computes the same.
Transports (``transport=``):

- ``"stores"`` (the default on CPU-emulated ranks, ``"auto"`` on a GPU): one persistent Triton
  kernel computes the rows for the peers first and stores each finished tile straight into the
  destination's buffer (``gemm_alltoall.api``; options ``config``, and per call ``config``);
- ``"copy_engine"``: the vendor BLAS computes each destination's rows in pieces, copy engines
  move each finished piece (option ``pieces``);
- ``"signal_collective"``: a persistent GEMM's wave-group counters gate the vendor library's
  All-to-All on a side stream (``gemm_signal.api.GemmSignal``; option ``config``);
- ``"sequential"``: ``torch.matmul``, then the vendor library's ``all_to_all_single`` on the whole
  product (``ops/sequential.py``; no options): the baseline;
- ``"auto"``: every transport's workspace; each call shape runs the one that timed fastest at
  that shape's first call (``ops/planner.py``; ``"sequential"`` unless beaten by more than
  3 %). A call that passes ``config`` runs on the transport whose config it is
  (``MatmulConfig``: ``"stores"``, ``SignalConfig``: ``"signal_collective"``), one that passes
  ``rms_weight``, ``eps`` or ``normed`` on ``"signal_collective"``.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..gemm_signal.config import SIGNAL_CALL_OPTIONS
from ..matmul.api import MatmulConfig
from ..pattern import MatmulPattern, timeout_kw
from ..registry import OpSpec, define


class MatmulAllToAll(MatmulPattern):
    """Workspace of :func:`portable_overlap.matmul_all_to_all` on one rank (module docstring):
    ``MatmulAllToAll(world, max_m, max_n, transport=None)`` for results of at most ``max_m`` x
    ``max_n``; ``transport`` one of ``TRANSPORTS`` or ``"auto"``, the default on a GPU world
    (``PatternContext.default_transport``). Collective to create and to close; the same calls
    in the same order on every rank."""

    OP = "matmul_all_to_all"
    TRANSPORTS = ("stores", "copy_engine", "signal_collective", "sequential")
    CALL_OPTIONS = {"stores": {"config": MatmulConfig}, "signal_collective": SIGNAL_CALL_OPTIONS}
    OUTPUT_OPTIONS = ("normed",)

    def _make(self, world, transport, timeout_s, **options):
        if transport == "signal_collective":
            from ..gemm_signal.api import GemmSignal

            return GemmSignal(world, **options, **timeout_kw(timeout_s))
        if transport == "sequential":
            from ..sequential import SequentialMatmul

            return SequentialMatmul(world, self.OP, self.max_m, self.max_n, **options,
                                    **timeout_kw(timeout_s))
        from .api import GemmAllToAll

        return GemmAllToAll(world, self.max_m * self.max_n, transport=transport, **options,
                            **timeout_kw(timeout_s))

    def __call__(self, a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 residual: Optional[torch.Tensor] = None, *,
                 out: Optional[torch.Tensor] = None, **options) -> torch.Tensor:
        return self._dispatch(*self._bind(a, b, bias, residual, out=out, **options))

    def _bind(self, a, b, bias=None, residual=None, *, out=None, **options) -> tuple:
        return {"a": a, "b": b, "bias": bias, "residual": residual}, out, options

    def _run(self, transport, impl, inputs, out, options):
        run = impl.all_to_all if transport in ("signal_collective", "sequential") else impl
        return run(inputs["a"], inputs["b"], out, bias=inputs["bias"],
                   residual=inputs["residual"], **options)


ALL_TO_ALL = define(OpSpec(
    "matmul_all_to_all",
    "(Tensor a, Tensor b, int handle, Tensor? bias=None, Tensor? residual=None) -> Tensor",
    context=MatmulAllToAll, transports=MatmulAllToAll.TRANSPORTS,
    compile_specs=("portable_overlap.ops.gemm_alltoall.compile_specs",
                   "portable_overlap.ops.gemm_signal.compile_specs",
                   "portable_overlap.transports.compile_specs"),
    fake=lambda ctx, a, b, bias=None, residual=None: a.new_empty((a.shape[0], b.shape[1]))))


def matmul_all_to_all(a: torch.Tensor, b: torch.Tensor, ctx: MatmulAllToAll,
                      out: Optional[torch.Tensor] = None, *, bias: Optional[torch.Tensor] = None,
                      residual: Optional[torch.Tensor] = None, **options) -> torch.Tensor:
    """``all_to_all_single(out, a @ b); out += bias (+ residual)`` with equal splits: on rank
    d, rows ``[r*M/W, (r+1)*M/W)`` of the result are rows ``[d*M/W, (d+1)*M/W)`` of rank r's
    ``a_r @ b_r`` (M divisible by W), plus rank d's own ``bias`` and ``residual``, added after
    the exchange. Each rank's K is its own (``a_r`` [M, K_r], ``b_r`` [K_r, N]); M, N and the
    dtype are the same on every rank. ``options``: the transport's per-call options (module
    docstring). Under ``torch.compile`` one opaque op,
    ``torch.ops.portable_overlap.matmul_all_to_all(a, b, ctx.handle, bias, residual)``."""
    return ALL_TO_ALL(ctx, (a, b, bias, residual), out=out, **options)
