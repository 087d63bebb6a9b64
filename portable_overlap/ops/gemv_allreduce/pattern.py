"""The context of GEMV + AllReduce (a row-parallel linear layer at decode batch sizes), with the
transport as an argument, and its torch.library op.

What it computes, with ``x_r`` [M, K_r] (0 <= M <= 64) and ``w_r`` [N, K_r] the tensors rank r
passes (its K-slice of a row-parallel weight; K_r >= 0 may differ across ranks)::

    y = sum(x_r.float() @ w_r.float().T for r in ranks).to(x.dtype)   # [M, N], on every rank

Transports (``transport=``):

- ``"stores"`` (the default on CPU-emulated ranks, ``"auto"`` on a GPU): one persistent Triton
  kernel; each rank stores its fp32 partials straight into the owners' heaps, owners reduce in
  rank order and store the result into every rank (two flag rounds;
  ``api.GemvAllReduceKernel``, kernel.py; options ``config``, per call ``config``);
- ``"one_shot"``: the same kernel storing every partial into every rank, each rank reducing all
  of them (one flag round; for latency-bound steps on many ranks; same options, and the only
  one that takes a ``config`` with ``split_k`` > 1: K slices per column block, which the
  default config picks at narrow N on a GPU);
- ``"torch_fused"``: torch's path: ``torch.mm`` in the input dtype into a torch
  symmetric-memory buffer, then torch's ``one_shot_all_reduce_out`` of it (``ops/torch_fused.py``;
  no options; GPU worlds of one host only, elsewhere it raises ``BackendUnavailable`` and
  ``"auto"`` leaves it out; fp16 calls reduce with the vendor library's ``all_reduce``);
- ``"sequential"``: ``torch.mm`` in the input dtype, then the vendor library's ``all_reduce`` of
  the product (``ops/sequential.py``; no options): the baseline, and the choice where the fused
  kernel measured slower;
- ``"auto"``: the workspace of each and, per call shape, the one that timed fastest at that
  shape's first call (``ops/planner.py``; ``"sequential"`` unless beaten by more than 3 %).

The fused transports give every rank the same bits (each block summed in rank order); the
sequential one gives what the collective library gives (the same on every rank for NCCL's and
gloo's all-reduce, rounded in the input dtype), and ``"torch_fused"`` what ``"sequential"``
computes (the product rounded to the input dtype, summed in it by torch's kernel).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..context import check_sizes
from ..pattern import PatternContext, matrix_sizes, timeout_kw
from ..registry import OpSpec, define
from .config import GemvConfig

OP = "gemv_all_reduce"


class GemvAllReduce(PatternContext):
    """Workspace of :func:`gemv_all_reduce` on one rank (module docstring):
    ``GemvAllReduce(world, max_n, transport=None, timeout_s=None, **options)``, ``transport``
    one of ``TRANSPORTS`` or ``"auto"``, the default on a GPU world
    (``PatternContext.default_transport``). ``max_n``: the largest N (output features) it will
    be called with. ``config=`` (an option of ``"stores"`` and ``"one_shot"``): their launch
    configuration (default: the tuned table, else the heuristic of ``config.pick_config``).
    Collective to create and to close; the same calls in the same order on every rank, on any
    streams (each call runs after the last)."""

    OP = OP
    TRANSPORTS = ("stores", "one_shot", "torch_fused", "sequential")
    CALL_OPTIONS = {"stores": {"config": GemvConfig}, "one_shot": {"config": GemvConfig}}

    def __init__(self, world, max_n: int, *, transport: Optional[str] = None,
                 timeout_s: Optional[float] = None, **options):
        check_sizes(OP, max_n=max_n)
        self.max_n = max_n
        super().__init__(world, transport, timeout_s, options)

    def _make(self, world, transport, timeout_s, **options):
        if transport == "sequential":
            from ..sequential import SequentialGemv

            return SequentialGemv(world, OP, self.max_n, **options, **timeout_kw(timeout_s))
        if transport == "torch_fused":
            from ..torch_fused import TorchFusedGemv

            return TorchFusedGemv(world, OP, self.max_n, **options, **timeout_kw(timeout_s))
        from .api import GemvAllReduceKernel

        return GemvAllReduceKernel(world, self.max_n, transport=transport, **options,
                                   **timeout_kw(timeout_s))

    def __call__(self, x: torch.Tensor, w: torch.Tensor, out: Optional[torch.Tensor] = None,
                 **options) -> torch.Tensor:
        """Run the op (module docstring); ``out`` is filled if given. ``options``: the
        transport's per-call options (``config`` for the fused ones: tuning sweeps)."""
        # as gemv_all_reduce refuses it: the fused transports' result would carry no gradient,
        # the sequential one's torch.mm(out=) raise autograd's own, unclear error; refused on
        # every rank (check_grad), the peers' waits end at once
        # the decode path: one call less than ``_dispatch``; traced by dynamo, ``_dispatch``
        # runs the torch op instead
        if self.planner is None and not torch.compiler.is_dynamo_compiling():
            self.check_grad({"x": x, "w": w}, options)
            return self.impl(x, w, out, **options)
        return self._dispatch(*self._bind(x, w, out, **options))

    def _bind(self, x, w, out=None, **options) -> tuple:
        return {"x": x, "w": w}, out, options

    def _run(self, transport, impl, inputs, out, options):
        return impl(inputs["x"], inputs["w"], out, **options)

    def _matched(self, inputs: dict):
        """The result's rows and columns and the dtype (each rank's K may differ)."""
        return matrix_sizes(
            lambda x, w: {"M": x.shape[0], "N": w.shape[0], "dtype": str(x.dtype)},
            inputs["x"], inputs["w"])


GEMV_ALL_REDUCE = define(OpSpec(
    OP, "(Tensor x, Tensor w, int handle) -> Tensor", context=GemvAllReduce,
    transports=GemvAllReduce.TRANSPORTS,
    compile_specs=("portable_overlap.ops.gemv_allreduce.compile_specs",),
    fake=lambda ctx, x, w: x.new_empty((x.shape[0], w.shape[0]))))


def gemv_all_reduce(x: torch.Tensor, w: torch.Tensor, ctx: GemvAllReduce,
                    out: Optional[torch.Tensor] = None, **options) -> torch.Tensor:
    """``y = Σ_r x_r @ w_rᵀ`` [M, N] on every rank of ``ctx.world``, where ``x_r`` [M, K_r]
    (0 <= M <= 64, K_r >= 0) and ``w_r`` [N, K_r] are what rank r passes; see the module
    docstring.
    Under ``torch.compile`` one opaque op,
    ``torch.ops.portable_overlap.gemv_all_reduce(x, w, ctx.handle)``."""
    return GEMV_ALL_REDUCE(ctx, (x, w), out=out, **options)
