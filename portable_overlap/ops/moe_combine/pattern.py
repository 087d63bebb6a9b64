"""The context of MoE expert GEMM + combine All-to-All, with the transport as an argument, and its
torch.library op.

What it computes on rank r, with the dispatch layout of ``moe_dispatch`` (ops/moe_dispatch)::

    # x [R, I]: rows for r's experts, by source rank q, then local expert e (counts[q, e] rows)
    # w [E_local, I, H]: r's experts (global expert r * E_local + e); slots [R]: row -> slot
    y = cat([x[seg(q, e)] @ w[e] for q in ranks for e in local experts])      # [R, H]
    rows_q = all_to_all(y, splits=counts.sum(1))       # rows back to the ranks their tokens left
    placed[slots_q] = rows_q                           # [S * k, H] on each source rank
    out[s] = sum_j topk_weights[s, j] * placed[s * k + j]                       # [S, H]

Ranks may receive different row counts R and hold different token counts S; the rows of ``x``
past ``counts.sum()`` are not read. Transports (``MoeGemmCombine(..., transport=...)``):

- ``"stores"`` (api.py, scale-up): one persistent grouped-GEMM kernel stores each finished
  tile's rows straight into the source rank's heap at their slots, the peers' tiles first, and
  a second kernel takes the weighted sum as the rows arrive; no host sync, capturable;
- ``"shmem"`` (api.py, the scale-out design): the same kernels, the rows put by the SHMEM
  library of the process (NVSHMEM / ROC_SHMEM);
- ``"sequential"`` (sequential.py): per-segment ``torch.matmul``, ``all_to_all_single`` with
  splits read on the host, placement and weighted sum: the torch path. Not capturable;
- ``"auto"``, the default on a GPU world: the context times ``"stores"`` and ``"sequential"``
  at the first eager call of each call key and keeps the faster (``ops/planner.py``); calls
  made under CUDA-graph capture run the fastest transport that can be captured. ``"shmem"`` is
  a candidate only when ``candidates=`` names it (it needs the SHMEM library on every rank).
  The routing changes at every call and the ranks' sizes differ, so the key holds the dtypes,
  ``I``, ``w``'s shape and the strides, not ``R`` nor ``S``: the first call of a key decides for
  every later one, whatever its token count.

The fused transports find faults in the routing data on the device and raise them at the
context's next check (``api.py``); the sequential one at its next :meth:`synchronize`.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..context import check_sizes
from ..pattern import PatternContext, timeout_kw
from ..planner import Jagged
from ..registry import OpSpec, define
from .api import FUSED_TRANSPORTS, MoeGemmCombineKernel, OP, WALKS

TRANSPORTS = (*FUSED_TRANSPORTS, "sequential")
#: what ``"auto"`` chooses from unless ``candidates=`` says otherwise
AUTO_CANDIDATES = ("stores", "sequential")


class MoeGemmCombine(PatternContext):
    """The op's context on one rank (module docstring). Collective to create and to close; the
    same calls in the same order on every rank, on any streams (each call runs after the last).

    Args:
        world: the :class:`portable_overlap.World`.
        max_tokens: the most tokens (S) any rank passes in a call.
        top_k, hidden, experts_per_rank: k, H and the local experts E of every call.
        transport: one of ``TRANSPORTS`` or ``"auto"`` (default: ``"auto"`` on a GPU world,
            ``"stores"`` on CPU-emulated ranks; ``PatternContext``).
        timeout_s: how long a fused kernel waits for a peer before it reports and gives up
            (default: 10 s).
        config, combine_config, walk: the fused kernels' GEMM tiles, weighted-sum tiles and
            tile order (``api.MoeGemmCombineKernel``), also under ``"auto"``.
        **options: ``"auto"``'s (``candidates``, ``cache_path``, ``iters``, ``warmup``,
            ``graph``; ``PatternContext``).
    """

    OP = OP
    TRANSPORTS = TRANSPORTS
    AUTO_CANDIDATES = AUTO_CANDIDATES

    def __init__(self, world, *, max_tokens: int, top_k: int, hidden: int,
                 experts_per_rank: int, transport: Optional[str] = None,
                 timeout_s: Optional[float] = None, config=None, combine_config=None,
                 walk: str = "auto", **options):
        check_sizes(OP, max_tokens=max_tokens, top_k=top_k, hidden=hidden,
                    experts_per_rank=experts_per_rank)
        if walk not in WALKS:
            raise ValueError(f"{OP}: walk must be one of {WALKS}, got {walk!r}")
        if world.world_size > 64:  # the GEMM kernel keeps one bit per peer in an int64
            raise ValueError(f"{OP}: at most 64 ranks, got {world.world_size}")
        self.max_tokens, self.top_k, self.hidden = max_tokens, top_k, hidden
        self.experts_per_rank = experts_per_rank
        self.max_slots = max_tokens * top_k
        self.config, self.combine_config, self.walk = config, combine_config, walk
        # (the fused workspaces check their own arguments too; the sequential one has none)
        world.check_same(f"{OP} context arguments",
                         (max_tokens, top_k, hidden, experts_per_rank, walk))
        super().__init__(world, transport, timeout_s, options)

    def _make(self, world, transport, timeout_s, **options):
        self.refuse_own_options(transport, options, "the fused kernels' tiling",
                                "config=, combine_config=, walk=")
        sizes = dict(max_tokens=self.max_tokens, top_k=self.top_k, hidden=self.hidden,
                     experts_per_rank=self.experts_per_rank, **timeout_kw(timeout_s))
        if transport == "sequential":
            from .sequential import SequentialMoeGemmCombine

            return SequentialMoeGemmCombine(world, **sizes)
        return MoeGemmCombineKernel(world, **sizes, config=self.config,
                                    combine_config=self.combine_config, transport=transport,
                                    walk=self.walk)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor,
                 slots: torch.Tensor, topk_weights: torch.Tensor,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run the op (module docstring) on the context's transport; ``out`` [S, H] is filled
        if given."""
        return self._dispatch(*self._bind(x, w, counts, slots, topk_weights, out))

    def _bind(self, x, w, counts, slots, topk_weights, out=None) -> tuple:
        return ({"x": x, "w": w, "counts": counts, "slots": slots,
                 "topk_weights": topk_weights}, out, {})

    def _run(self, transport, impl, inputs, out, options):
        return impl(inputs["x"], inputs["w"], inputs["counts"], inputs["slots"],
                    inputs["topk_weights"], out)

    def _key_inputs(self, inputs: dict) -> dict:
        """The received rows, their slots and the tokens' weights by dtype only
        (``planner.Jagged``): R changes with the routing at every call and differs across
        ranks, and so may S; ``I`` and the experts' sizes are ``w``'s shape."""
        return {k: Jagged.of(v) if k in ("x", "slots", "topk_weights")
                and isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    def _matched(self, inputs: dict) -> Optional[dict]:
        """The rows' dtype and ``I``: what the exchange moves and the fused kernels' tag hold
        (each rank's R and S may differ)."""
        x = inputs["x"]
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            return None
        return {"dtype": str(x.dtype), "I": x.shape[1]}

    # -- the fused kernels' workspace --------------------------------------------------------------
    def kernel(self) -> Optional[MoeGemmCombineKernel]:
        """The ``"stores"`` workspace this context runs (named, or ``"auto"``'s candidate): what
        the one-launch MoE layer (ops/moe_layer) launches its down GEMM and weighted sum on;
        None where the context has none."""
        return self.workspace("stores")

    def phases(self, x, w, counts, slots, topk_weights, out) -> dict:
        """``MoeGemmCombineKernel.phases`` of the context's ``"stores"`` workspace (:meth:`kernel`):
        one call of the op, then its two kernels as separate launches, to time or inspect."""
        kernel = self.kernel()
        if kernel is None:
            raise ValueError(f"{OP}: phases() times the 'stores' kernels, and this context has "
                             f"none (transport {self.transport!r})")
        return kernel.phases(x, w, counts, slots, topk_weights, out)


MOE_GEMM_COMBINE = define(OpSpec(
    OP, "(Tensor x, Tensor w, Tensor counts, Tensor slots, Tensor topk_weights, int handle) "
        "-> Tensor",
    context=MoeGemmCombine, transports=TRANSPORTS,
    compile_specs=("portable_overlap.ops.moe_combine.compile_specs",),
    fake=lambda ctx, x, w, counts, slots, topk_weights: x.new_empty((topk_weights.shape[0],
                                                                    w.shape[2]))))


def moe_gemm_combine(x, w, counts, slots, topk_weights, ctx: MoeGemmCombine,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The expert GEMMs of this rank's received rows and the weighted combine back at their
    sources: ``out[s] = sum_k topk_weights[s, k] * expert_k(x_s)`` [S, H] for each of this
    rank's S tokens; see the module docstring for the routing tensors. Under ``torch.compile``
    one opaque op, ``torch.ops.portable_overlap.moe_gemm_combine(x, w, counts, slots,
    topk_weights, ctx.handle)``."""
    return MOE_GEMM_COMBINE(ctx, (x, w, counts, slots, topk_weights), out=out)
