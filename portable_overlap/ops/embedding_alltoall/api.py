"""Embedding pooling + All-to-All (DLRM's model-parallel → data-parallel switch): the op's
context, its transports, the torch.library op and its backward.

What it computes. Tables are sharded table-wise (``ShardingPlan``: global table t, of
``table_rows[t]`` rows × D, is held whole by rank ``table_ranks[t]``); the global batch of
``B = sum(batch_splits)`` samples is split over the ranks, rank d owning samples
``[boff[d], boff[d+1])`` with ``boff = [0, *cumsum(batch_splits)]``. Rank r passes its local
tables packed in one buffer ``weight_r`` ([sum of local rows, D], see ``ShardingPlan``) and the
sparse features of its tables for the WHOLE global batch in KeyedJaggedTensor layout (table-major:
``lengths_r[j * B + s]`` indices of local table j for sample s, ``indices_r`` concatenated in that
order, optional ``per_sample_weights_r`` one per index)::

    local = plan.tables_of(r); offs = [0, *cumsum(lengths_r)]
    pooled_r[j][s] = sum(w[i] * weight_r[row_offsets_r[j] + indices_r[i]]
                         for i in range(offs[j*B + s], offs[j*B + s + 1]))   # / length if mean
    # rank d receives, from every rank r, its tables for d's samples:
    out_d[s - boff[d], t*D:(t+1)*D] = pooled_{table_ranks[t]}[j_t][s]  for boff[d] <= s < boff[d+1]

i.e. ``F.embedding_bag`` per table, ``all_to_all_single``, columns put in global table order
(reference.py). ``out_d`` is ``[batch_splits[d], T * D]`` in the tables' dtype, ready for the
feature interaction.

Transports (``EmbeddingAllToAll(..., transport=...)``):

- ``"stores"`` (fused.py): one persistent kernel pools and stores each pooled tile straight into
  the destination's heap, pooling in float32;
- ``"shmem"`` (fused.py, the scale-out design): the same kernel puts each tile's rows with the
  SHMEM library of the process (NVSHMEM / ROC_SHMEM);
- ``"sequential"`` (sequential.py): the pooled lookup alone (one Triton launch, lookup.py),
  then the collective library's ``all_to_all_single``, nothing overlapped;
- ``"auto"``, the default on a GPU world: the context times ``"stores"`` and ``"sequential"``
  at the first eager call of each new call key and keeps the faster (``ops/planner.py``).
  ``"shmem"`` is a candidate only when ``candidates=`` names it: it needs the SHMEM library on
  every rank. The key holds the lengths' shape (tables × batch), the per-call options (the
  batch split, the pooling, ``validate``) and the indices' dtype, not their number
  (``planner.Jagged``), which changes from batch to batch and from rank to rank: a batch of
  the same size keeps its first batch's decision.

Backward (through :func:`embedding_all_to_all` when ``weight`` or ``per_sample_weights``
requires grad) sends ``grad_out`` back through the reverse All-to-All (``all_to_all_single``)
and accumulates row gradients with ``index_add_`` into a dense gradient of the packed weight
(and the per-index weights' gradient when they require it), whatever the transport.

Every rank must record the call for autograd or none: the backward's reverse All-to-All runs
only on the ranks that did, and would wait for ever for the others. Whether autograd records
the call (``records_grad``: grad mode on and ``weight`` or ``per_sample_weights`` requiring
grad) is part of what the ranks agree on: the fused kernels' shape tag, and under ``"auto"``
the call's agreement where it makes one (a key's first call, a decided ``"sequential"``
call), so a call recorded on some ranks only raises ``RankMismatchError`` on every rank in
the forward, at no cost per call. The named ``"sequential"`` makes no agreement
(``docs/reliability.md``, "What is not caught").
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..context import check_sizes
from ..pattern import PatternContext, timeout_kw
from ..planner import Jagged
from ..registry import OpSpec, PartSpec, check_context, define, define_part
from .fused import check_tiling, FusedEmbeddingAllToAll
from .plan import ShardingPlan
from .sequential import SequentialEmbeddingAllToAll
from .tables import OP, RankTables

TRANSPORTS = ("stores", "shmem", "sequential")
#: what ``"auto"`` chooses from unless ``candidates=`` says otherwise
AUTO_CANDIDATES = ("stores", "sequential")
#: every transport takes every per-call option; each checks the values itself (its errors are
#: the op's), so any value reaches it
_CALL = {"batch_splits": object, "pooling": object, "validate": object}


class EmbeddingAllToAll(PatternContext):
    """The op's context on one rank: the sharding plan, and the workspace of the transport (or,
    with ``"auto"``, of every candidate). Collective to create and to close; the same calls in
    the same order on every rank, on any streams (each call runs after the last).

    Args:
        world: the :class:`portable_overlap.World`.
        table_rows: rows of every global table (T entries).
        dim: embedding dimension D (same for all tables).
        max_local_batch: the most samples any rank will own in one call.
        table_ranks: the rank holding each global table (default: ``ShardingPlan.make``).
        transport: one of ``TRANSPORTS`` or ``"auto"`` (default: ``"auto"`` on a GPU world,
            ``"stores"`` on CPU-emulated ranks; ``PatternContext``).
        timeout_s: how long a fused kernel waits for a peer before it reports and gives up
            (default: 10 s).
        block_b, num_warps, max_programs: the fused kernel's tiling (``fused.py``; default: by
            the call's dtype and the device), also under ``"auto"``; the sequential transport's
            lookup takes ``block_b`` and ``num_warps``.
        **options: ``"auto"``'s (``candidates``, ``cache_path``, ``iters``, ``warmup``,
            ``graph``; ``PatternContext``).

    ``validate`` (attribute, default True): calls check their data (index ranges, lengths
    against indices; one host sync) unless the call passes ``validate=False`` or is captured.
    """

    OP = OP
    TRANSPORTS = TRANSPORTS
    AUTO_CANDIDATES = AUTO_CANDIDATES
    CALL_OPTIONS = {t: _CALL for t in TRANSPORTS}

    def __init__(self, world, table_rows: Sequence[int], dim: int, max_local_batch: int, *,
                 table_ranks: Optional[Sequence[int]] = None, transport: Optional[str] = None,
                 timeout_s: Optional[float] = None, block_b: Optional[int] = None,
                 num_warps: Optional[int] = None, max_programs: Optional[int] = None,
                 **options):
        plan = ShardingPlan.make(table_rows, dim, world.world_size, table_ranks)
        check_sizes(OP, max_local_batch=max_local_batch)
        check_tiling(block_b, num_warps, max_programs)
        world.check_same(f"{OP} context arguments (plan, max_local_batch)",
                         (plan, max_local_batch))
        self.tables = RankTables(world, plan, max_local_batch)
        self._tiling = dict(block_b=block_b, num_warps=num_warps, max_programs=max_programs)
        self.validate = True
        super().__init__(world, transport, timeout_s, options)

    def _make(self, world, transport, timeout_s, **options):
        self.refuse_own_options(transport, options, "the fused kernel's tiling",
                                "block_b=, num_warps=, max_programs=")
        if transport == "sequential":  # (the lookup takes the fused kernel's tile)
            return SequentialEmbeddingAllToAll(world, self.tables, block_b=self._tiling["block_b"],
                                               num_warps=self._tiling["num_warps"],
                                               **timeout_kw(timeout_s))
        return FusedEmbeddingAllToAll(world, self.tables, transport=transport, **self._tiling,
                                      **timeout_kw(timeout_s))

    # -- what the rank holds ---------------------------------------------------------------------
    @property
    def plan(self) -> ShardingPlan:
        return self.tables.plan

    @property
    def local_tables(self) -> list:
        return self.tables.local_tables

    @property
    def n_loc(self) -> int:
        return self.tables.n_loc

    @property
    def weight_rows(self) -> int:
        return self.tables.weight_rows

    @property
    def max_local_batch(self) -> int:
        return self.tables.max_local_batch

    @property
    def num_tables(self) -> int:
        return self.tables.plan.num_tables

    @property
    def dim(self) -> int:
        return self.tables.plan.dim

    def output_shape(self, batch_splits: Sequence[int]) -> tuple:
        return self.tables.output_shape(batch_splits)

    def resolve_splits(self, lengths: torch.Tensor,
                       batch_splits: Optional[Sequence[int]]) -> tuple:
        return self.tables.resolve_splits(lengths, batch_splits)

    # -- the call --------------------------------------------------------------------------------
    def __call__(self, weight: torch.Tensor, lengths: torch.Tensor, indices: torch.Tensor,
                 per_sample_weights: Optional[torch.Tensor] = None, *,
                 batch_splits: Optional[Sequence[int]] = None, pooling: str = "sum",
                 out: Optional[torch.Tensor] = None,
                 validate: Optional[bool] = None) -> torch.Tensor:
        """Run the op (module docstring) on the context's transport. Where autograd must
        record it (grad mode on, ``weight`` or ``per_sample_weights`` requiring grad), the call
        is :func:`embedding_all_to_all`'s, the differentiable op, as it is under
        ``torch.compile``: a plain call there would return a result with no gradient path, and
        the tables would silently not train. ``out`` and ``validate`` are options of the plain
        call only."""
        if torch.is_grad_enabled() and (weight.requires_grad or (
                per_sample_weights is not None and per_sample_weights.requires_grad)):
            if out is not None or validate is not None:
                # refused as this call (its peers raise in it too, not wait for this rank)
                self.refuse(ValueError(
                    f"{OP}: out and validate cannot be used when autograd records the call "
                    f"(the differentiable op is functional)"), weight, lengths, indices,
                    per_sample_weights, batch_splits=batch_splits, pooling=pooling, out=out,
                    validate=validate)
            return embedding_all_to_all(weight, lengths, indices, self, per_sample_weights,
                                        batch_splits=batch_splits, pooling=pooling)
        return self._dispatch(*self._bind(weight, lengths, indices, per_sample_weights,
                                          batch_splits=batch_splits, pooling=pooling, out=out,
                                          validate=validate))

    def _bind(self, weight, lengths, indices, per_sample_weights=None, *, batch_splits=None,
              pooling="sum", out=None, validate=None) -> tuple:
        try:
            splits = self.tables.resolve_splits(lengths, batch_splits)
        except (TypeError, ValueError):
            # the transport's own check raises it, as a refused call its peers hear of
            splits = batch_splits
        return ({"weight": weight, "lengths": lengths, "indices": indices,
                 "per_sample_weights": per_sample_weights}, out,
                {"batch_splits": splits, "pooling": pooling,
                 "validate": self.validate if validate is None else validate})

    def _run(self, transport, impl, inputs, out, options):
        return impl(inputs["weight"], inputs["lengths"], inputs["indices"],
                    inputs["per_sample_weights"], out=out, **options)

    def _recorded(self, weight, lengths, indices, psw, batch_splits, pooling,
                  records_grad=False):
        """The op's eager call (its torch op's kernel, or the plain call); ``records_grad``:
        whether autograd records this call, which the call carries (``recording``)."""
        call = self._bind(weight, lengths, indices, psw, batch_splits=batch_splits,
                          pooling=pooling)
        if not records_grad:
            return self._dispatch(*call)
        with self.recording():
            return self._dispatch(*call)

    def _as_op(self, inputs: dict, out, options: dict):
        """A traced call (``PatternContext._dispatch``) as :func:`embedding_all_to_all` makes it
        (the op takes the split and the pooling as arguments); with ``out`` or a ``validate``
        other than the context's, which the op does not take, a graph break around the eager
        call."""
        if out is not None or options["validate"] != self.validate:
            return torch.compiler.disable(self._dispatch)(inputs, out, options)
        return embedding_all_to_all(inputs["weight"], inputs["lengths"], inputs["indices"], self,
                                    inputs["per_sample_weights"],
                                    batch_splits=options["batch_splits"],
                                    pooling=options["pooling"])

    def _key_inputs(self, inputs: dict) -> dict:
        """The indices by dtype only (``planner.Jagged``): their count changes with every
        batch, on each rank its own way. The per-index weights not at all: each rank passes
        them or not, of any float dtype, for its own tables, and a key that held them was new
        on a rank that started or stopped weighting its lookups while decided on its peers,
        which the agreement refuses (the valid call raised ``RankMismatchError``)."""
        return {k: (Jagged.of(v) if isinstance(v, torch.Tensor) else v) if k == "indices"
                else None if k == "per_sample_weights" else v for k, v in inputs.items()}

    def _matched_call(self, inputs: dict, options: dict) -> Optional[dict]:
        """The batch split, the dtype and the pooling: what the exchange moves (and, as every
        pattern's agreement, whether autograd records the call: ``_call_shares``)."""
        weight = inputs["weight"]
        if not isinstance(weight, torch.Tensor):
            return None
        return {"batch_splits": repr(options.get("batch_splits")), "dtype": str(weight.dtype),
                "pooling": repr(options.get("pooling"))}

    def check_grad(self, inputs: dict, options: dict) -> None:
        """Nothing to refuse: the op has a backward (:func:`embedding_all_to_all`)."""

    # -- backward --------------------------------------------------------------------------------
    def backward(self, grad_out, weight, lengths, indices, psw, splits, pooling,
                 need_psw_grad: bool = False):
        """``RankTables.backward``: the same whatever the transport."""
        return self.tables.backward(grad_out, weight, lengths, indices, psw, splits, pooling,
                                    need_psw_grad)


def _setup_context(ctx, inputs, output):
    weight, lengths, indices, psw, splits, pooling, handle, _ = inputs
    ctx.save_for_backward(weight, lengths, indices, psw)
    ctx.splits, ctx.pooling, ctx.handle = list(splits), pooling, handle


def _backward(ctx, grad):
    weight, lengths, indices, psw = ctx.saved_tensors
    need_psw = psw is not None and ctx.needs_input_grad[3]
    # through its own op: under torch.compile the backward is traced with fake tensors, which
    # neither the reverse All-to-All (a collective) nor the context's tensors (the tables' row
    # offsets) take; traced inline it failed the compile of every training step
    grad_w, grad_psw = BACKWARD.op(grad, weight, lengths, indices, psw, ctx.splits, ctx.pooling,
                                   need_psw, ctx.handle)
    return grad_w, None, None, grad_psw if need_psw else None, None, None, None, None


def _backward_run(grad, weight, lengths, indices, psw, splits, pooling, need_psw, ctx):
    """``EmbeddingAllToAll.backward``: the gradients of the packed weight and of the per-index
    weights (an empty tensor where ``need_psw`` is False: an op returns tensors)."""
    check_context(EMBEDDING_ALL_TO_ALL, ctx)
    grad_w, grad_psw = ctx.backward(grad, weight, lengths, indices, psw, list(splits), pooling,
                                    need_psw)
    return grad_w, weight.new_empty(0) if grad_psw is None else grad_psw


def _backward_fake(grad, weight, lengths, indices, psw, splits, pooling, need_psw, ctx):
    return (weight.new_empty(weight.shape),
            psw.new_empty(psw.shape) if need_psw else weight.new_empty(0))


#: the backward as one opaque op (the reverse All-to-All and the rows' gradients)
BACKWARD = define_part(PartSpec(
    OP + "_backward",
    "(Tensor grad, Tensor weight, Tensor lengths, Tensor indices, Tensor? per_sample_weights, "
    "SymInt[] batch_splits, str pooling, bool psw_grad, int handle) -> (Tensor, Tensor)",
    run=_backward_run, fake=_backward_fake))


EMBEDDING_ALL_TO_ALL = define(OpSpec(
    OP, "(Tensor weight, Tensor lengths, Tensor indices, Tensor? per_sample_weights, "
        "SymInt[] batch_splits, str pooling, int handle, bool records_grad=False) -> Tensor",
    context=EmbeddingAllToAll, transports=TRANSPORTS,
    compile_specs=("portable_overlap.ops.embedding_alltoall.compile_specs",),
    fake=lambda ctx, weight, lengths, indices, psw, batch_splits, pooling, records_grad=False:
    weight.new_empty(ctx.output_shape(batch_splits)),
    # the plain call (not ``ctx(...)``, which routes a call that needs grad back here), with
    # whether autograd records it (``records_grad``: its ranks must agree)
    eager=lambda ctx, weight, lengths, indices, psw, batch_splits, pooling, records_grad=False:
    ctx._recorded(weight, lengths, indices, psw, batch_splits, pooling, records_grad),
    backward=_backward, setup_context=_setup_context))


def embedding_all_to_all(weight: torch.Tensor, lengths: torch.Tensor, indices: torch.Tensor,
                         ctx: EmbeddingAllToAll,
                         per_sample_weights: Optional[torch.Tensor] = None, *,
                         batch_splits: Optional[Sequence[int]] = None,
                         pooling: str = "sum") -> torch.Tensor:
    """Pooled lookups of this rank's tables for every rank's samples, exchanged so that rank r
    gets every table's pooled rows for its own samples; see the module docstring.
    Differentiable (through ``torch.ops.portable_overlap.embedding_all_to_all``) when
    ``weight`` or ``per_sample_weights`` require grad, and one opaque op under
    ``torch.compile``; else the context is called directly (less overhead)."""
    check_context(EMBEDDING_ALL_TO_ALL, ctx)
    try:
        splits = list(ctx.resolve_splits(lengths, batch_splits))
    except (TypeError, ValueError):  # the context's call raises it on every rank
        # never traced by torch.compile: this frame may run eagerly after the exception (so
        # is_compiling() says False) while dynamo still compiles every frame it calls, and
        # the refusal's flag kernels then ran on traced values (on emulated ranks the
        # refusing rank died of a segfault)
        # (the plain call: ``ctx(...)`` with weights that require grad comes back here)
        return torch.compiler.disable(ctx._dispatch)(*ctx._bind(
            weight, lengths, indices, per_sample_weights, batch_splits=batch_splits,
            pooling=pooling))
    grad = torch.is_grad_enabled() and (
        weight.requires_grad or (per_sample_weights is not None
                                 and per_sample_weights.requires_grad))
    return EMBEDDING_ALL_TO_ALL(ctx, (weight, lengths, indices, per_sample_weights, splits,
                                      pooling, grad), grad=grad)
