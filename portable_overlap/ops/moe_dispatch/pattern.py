"""The context of the MoE dispatch (expert parallelism), with the transport as an argument, and its
torch.library op.

What it computes on rank r (``E`` local experts per rank, expert ``g`` on rank ``g // E``)::

    # tokens [S, H], topk_ids [S, k]: rank r's tokens and the global experts of each
    x, counts, slots = moe_dispatch_reference(tokens, topk_ids, E)   # all_to_all of real rows
    # x [R, H]: the rows routed to r's experts, by source rank q, then local expert e, in slot
    # order within a segment; counts [W, E] int32 (rows from q for e); slots [R] int32 (the
    # row's slot s * k + j on its source rank)

``MoeDispatch(world, ...)(tokens, topk_ids)`` returns ``(x, counts, slots)`` with ``x`` and
``slots`` of ``capacity`` rows: the first ``counts.sum()`` are the dispatch's, the rest are
left as they were. They are views of the context's buffers, valid until its next call or its
``close()``, which unmaps them (reading them after it faults; clone them to keep them): the
layout ``moe_gemm_combine`` takes, so its ``x`` may be these very buffers (after the expert's
first GEMM). Ranks may pass different token counts S. Transports:

- ``"stores"`` (api.py, scale-up): three kernels count the routing, exchange the counts and
  store every row straight into its destination's receive buffer; no host sync, capturable,
  routing faults found on the device and raised at the context's next check;
- ``"shmem"`` (api.py, the scale-out design): the same kernels, the rows put by the SHMEM
  library of the process (NVSHMEM / ROC_SHMEM);
- ``"sequential"`` (sequential.py): ``all_to_all_single`` with splits read on the host, the
  rows copied into the same buffers: the torch path. Not capturable;
- ``"auto"``, the default on a GPU world: the context times ``"stores"`` and ``"sequential"``
  at the first eager call of each call key and keeps the faster (``ops/planner.py``); calls
  made under CUDA-graph capture run the fastest transport that can be captured. Both fill one
  set of receive buffers (the memory of one transport). ``"shmem"`` is a candidate only when
  ``candidates=`` names it (it needs the SHMEM library on every rank). The routing changes at
  every call and the ranks' token counts differ, so the key holds the dtypes and ``H``, not
  ``S``: the first call of a key decides for every later one, whatever its token count.

``dispatch_swiglu`` (``moe_dispatch_swiglu``, the dispatch with the experts' gated first GEMM
fused into it) runs on the ``"stores"`` workspace wherever the context has one (named, or
``"auto"``'s), else on the named transport's (``"sequential"``: the dispatch, then
``expert_swiglu``; ``"shmem"`` raises).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..pattern import PatternContext, timeout_kw
from ..planner import AUTO, Jagged
from ..registry import OpSpec, define
from .api import check_sizes, FUSED_TRANSPORTS, MoeDispatchKernel, OP

TRANSPORTS = (*FUSED_TRANSPORTS, "sequential")
#: what ``"auto"`` chooses from unless ``candidates=`` says otherwise
AUTO_CANDIDATES = ("stores", "sequential")


class MoeDispatch(PatternContext):
    """The op's context on one rank (module docstring). Collective to create and to close; the
    same calls in the same order on every rank, on any streams (each call runs after the last).

    Args:
        world: the :class:`portable_overlap.World`.
        max_tokens: the most tokens (S) any rank passes in a call.
        top_k, hidden, experts_per_rank: k, H and the local experts E of every call.
        dtype: the tokens' dtype (the receive buffer's).
        capacity: the most rows any rank may receive in a call (default ``world * max_tokens *
            top_k``, which no routing exceeds; a smaller one saves memory, and a call that
            passes it raises).
        transport: one of ``TRANSPORTS`` or ``"auto"`` (default: ``"auto"`` on a GPU world,
            ``"stores"`` on CPU-emulated ranks; ``PatternContext``).
        timeout_s: how long a fused kernel waits for a peer before it reports and gives up
            (default: 10 s).
        dedup: the ``"stores"`` transport sends a token to a peer rank once, however many of its
            experts that rank holds (``api.MoeDispatchKernel``; None: its rule), also under
            ``"auto"``; True with another transport named is a ``ValueError``.
        **options: ``"auto"``'s (``candidates``, ``cache_path``, ``iters``, ``warmup``,
            ``graph``; ``PatternContext``).
    """

    OP = OP
    TRANSPORTS = TRANSPORTS
    AUTO_CANDIDATES = AUTO_CANDIDATES

    def __init__(self, world, *, max_tokens: int, top_k: int, hidden: int,
                 experts_per_rank: int, dtype: torch.dtype = torch.bfloat16,
                 capacity: Optional[int] = None, transport: Optional[str] = None,
                 timeout_s: Optional[float] = None, dedup: Optional[bool] = None, **options):
        capacity = check_sizes(world, max_tokens, top_k, hidden, experts_per_rank, dtype,
                               capacity)
        if dedup is not None and not isinstance(dedup, bool):
            raise ValueError(f"{OP}: dedup must be True, False or None, got {dedup!r}")
        if dedup and transport not in (None, AUTO, "stores"):
            raise ValueError(f"{OP}: dedup=True is an option of transport='stores', not of "
                             f"{transport!r}")
        self.max_tokens, self.top_k, self.hidden = max_tokens, top_k, hidden
        self.experts_per_rank, self.dtype, self.capacity = experts_per_rank, dtype, capacity
        self._dedup = dedup
        # the first workspace made: the one whose buffers "auto"'s "sequential" candidate fills
        self._first = None
        self._last = None  # the workspace of the last call: its buffers hold that call's data
        world.check_same(f"{OP} context arguments", (max_tokens, top_k, hidden, experts_per_rank,
                                                     str(dtype), capacity, dedup))
        super().__init__(world, transport, timeout_s, options)

    def _make(self, world, transport, timeout_s, **options):
        self.refuse_own_options(transport, options, "the receive buffers' size",
                                "capacity=, dedup=")
        sizes = dict(max_tokens=self.max_tokens, top_k=self.top_k, hidden=self.hidden,
                     experts_per_rank=self.experts_per_rank, dtype=self.dtype,
                     capacity=self.capacity, **timeout_kw(timeout_s))
        if transport == "sequential":
            from .sequential import SequentialMoeDispatch

            impl = SequentialMoeDispatch(world, **sizes, share=self._first)
        else:
            impl = MoeDispatchKernel(world, **sizes, transport=transport,
                                     dedup=self._dedup if transport == "stores" else None)
        if self._first is None:
            self._first = impl
        return impl

    def __call__(self, tokens: torch.Tensor, topk_ids: torch.Tensor) -> tuple:
        """Run the dispatch (module docstring) on the context's transport: ``(x, counts,
        slots)``, views of the context's buffers."""
        return self._dispatch(*self._bind(tokens, topk_ids))

    def _bind(self, tokens, topk_ids) -> tuple:
        return {"tokens": tokens, "topk_ids": topk_ids}, None, {}

    def _run(self, transport, impl, inputs, out, options):
        self._last = impl
        return impl(inputs["tokens"], inputs["topk_ids"])

    def _key_inputs(self, inputs: dict) -> dict:
        """The tokens and their ids by dtype only (``planner.Jagged``): S changes from call to
        call and differs across ranks; ``H`` is the context's."""
        return {k: Jagged.of(v) if isinstance(v, torch.Tensor) else v
                for k, v in inputs.items()}

    def _matched(self, inputs: dict) -> Optional[dict]:
        """The rows' dtype and width: what the exchange moves (each rank's S may differ)."""
        tokens = inputs["tokens"]
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            return None
        return {"dtype": str(tokens.dtype), "H": tokens.shape[1]}

    # -- the buffers, and the fused kernels' workspace ---------------------------------------------
    @property
    def recv(self) -> torch.Tensor:
        """The receive buffer [capacity, hidden] the last call's ``x`` is (before any call, the
        first workspace's; with ``"auto"`` each transport has its own)."""
        return (self._last or self._first).recv

    @property
    def recv_slots(self) -> torch.Tensor:
        """The slots [capacity] of the last call's received rows (its ``slots``)."""
        return (self._last or self._first).recv_slots

    @property
    def counts(self) -> torch.Tensor:
        """The routing counts [world, experts_per_rank] of the last call (its ``counts``)."""
        return (self._last or self._first).counts

    @property
    def dedup(self) -> bool:
        """Whether the ``"stores"`` workspace sends a token once per peer rank it reaches."""
        kernel = self.kernel()
        return bool(kernel is not None and kernel.dedup)

    def kernel(self) -> Optional[MoeDispatchKernel]:
        """The ``"stores"`` workspace this context runs (named, or ``"auto"``'s candidate): what
        the fused dispatch + gated GEMM and the one-launch MoE layer (ops/moe_layer) launch
        on; None where the context has none."""
        return self.workspace("stores")

    def swiglu_workspace(self):
        """The workspace ``dispatch_swiglu`` runs on: the ``"stores"`` one where the context
        has it, else the named transport's."""
        return self.kernel() or self._first

    def dispatch_swiglu(self, tokens, topk_ids, w_gate, w_up, out=None, *, senders=None,
                        config=None, rows_per_segment=None) -> tuple:
        """The dispatch with the experts' gated first GEMM fused into it: ``(h, counts,
        slots)`` (``swiglu.py``; ``moe_dispatch_swiglu`` is the function form), on
        :meth:`swiglu_workspace`."""
        return self.swiglu_workspace().dispatch_swiglu(
            tokens, topk_ids, w_gate, w_up, out, senders=senders, config=config,
            rows_per_segment=rows_per_segment)


def _fake(ctx, tokens, topk_ids):
    W = ctx.world.world_size
    return (tokens.new_empty((ctx.capacity, ctx.hidden)),
            tokens.new_empty((W, ctx.experts_per_rank), dtype=torch.int32),
            tokens.new_empty((ctx.capacity,), dtype=torch.int32))


MOE_DISPATCH = define(OpSpec(
    OP, "(Tensor tokens, Tensor topk_ids, int handle) -> (Tensor, Tensor, Tensor)",
    context=MoeDispatch, transports=TRANSPORTS,
    compile_specs=("portable_overlap.ops.moe_dispatch.compile_specs",), fake=_fake,
    copies=(0, 1, 2)))


def moe_dispatch(tokens, topk_ids, ctx: MoeDispatch) -> tuple:
    """Route this rank's tokens to the ranks of their top-k experts: returns ``(x, counts,
    slots)`` in the layout of the module docstring (``x`` and ``slots`` with the context's
    ``capacity`` rows, of which the first ``counts.sum()`` are this call's). Under
    ``torch.compile`` one opaque op, ``torch.ops.portable_overlap.moe_dispatch(tokens,
    topk_ids, ctx.handle)``, whose results are copies of the context's buffers (a functional
    op's results must not alias each other)."""
    return MOE_DISPATCH(ctx, (tokens, topk_ids))
