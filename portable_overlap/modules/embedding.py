"""Table-wise sharded embedding bags whose output All-to-All is fused into the pooling kernel:
the embedding layer of a DLRM trained with model-parallel tables and a data-parallel top MLP."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..errors import PeerTimeoutError, RankMismatchError
from ..ops.embedding_alltoall import (EmbeddingAllToAll, ShardingPlan, embedding_all_to_all,
                                      embedding_all_to_all_reference)
from ..ops.context import check_sizes
from ..ops.embedding_alltoall.tables import DTYPES, POOLINGS, RankTables, even_splits
from ..world import collective_setup
from .agreement import same_arguments
from .copying import FusedLayerState

NAME = "ShardedEmbeddingBagCollection"


class ShardedEmbeddingBagCollection(FusedLayerState, nn.Module):
    """T embedding tables of width D, table t (``num_embeddings[t]`` rows) held whole by rank
    ``plan.table_ranks[t]``; this rank's tables are packed in one parameter ``weight``
    (``[sum of local rows, D]``, see :class:`ShardingPlan`). Forward::

        # lengths/indices (+ per_sample_weights): this rank's tables for the GLOBAL batch,
        # table-major jagged (KeyedJaggedTensor) layout; returns [local batch, T * D]
        out[:, t*D:(t+1)*D] = embedding_bag(table t, bags of this rank's samples, pooling)

    ``fused=True`` runs the op :func:`embedding_all_to_all` over ``transport`` (default: the
    context's, ``"auto"`` on a GPU world: the fused kernel or the plain path, whichever measured
    faster for the batch; ``"stores"`` on CPU-emulated ranks); ``fused=False`` the reference
    (``F.embedding_bag`` per table + ``all_to_all_single``), for comparison. Both are
    differentiable in ``weight`` (dense gradient). Without ``batch_splits`` both paths split
    the global batch evenly over the ranks; a batch that does not split evenly, or a plan with
    a rank that holds no tables, fails the call on every rank (the reference path raises
    ``ValueError`` before its all-to-all): pass ``batch_splits`` then. The reference path
    checks its input as the fused op does and refuses a call one rank refuses on every rank
    (``_checked_splits``). Collective to construct
    (every rank, same arguments); call :meth:`close` (collective) when done.

    Tables are initialized uniform(-1/sqrt(rows), 1/sqrt(rows)) from a generator seeded by
    ``(seed, t)``, so the model does not depend on the sharding. A state dict holds this
    rank's packed tables and the layout they were packed under (``_extra_state``): loading it
    into a module of another plan, or on another rank, raises ``ValueError``. The ranks
    compare their arguments (``RankMismatchError`` on every rank where they differ), and an
    argument refused on one rank raises ``PeerSetupError`` on the others.
    """

    @collective_setup
    def __init__(self, world, num_embeddings: Sequence[int], embedding_dim: int, *,
                 max_local_batch: int, table_ranks: Optional[Sequence[int]] = None,
                 pooling: str = "sum", dtype: torch.dtype = torch.float32, fused: bool = True,
                 seed: int = 0, timeout_s: float = 10.0, transport: Optional[str] = None):
        super().__init__()
        check_sizes(NAME, embedding_dim=embedding_dim, max_local_batch=max_local_batch)
        if pooling not in POOLINGS:  # (else refused at the first call only)
            raise ValueError(f"{NAME}: pooling must be one of {POOLINGS}, got {pooling!r}")
        if dtype not in DTYPES:  # (else float64 made the layer and every call refused it)
            raise ValueError(f"{NAME}: dtype must be one of {DTYPES}, got {dtype!r}")
        self.world = world
        self.plan = ShardingPlan.make(num_embeddings, embedding_dim, world.world_size,
                                      table_ranks)
        # the seed too: the tables' values must not depend on which rank holds them
        same_arguments(world, NAME, plan=self.plan, max_local_batch=max_local_batch,
                       pooling=pooling, dtype=dtype, fused=bool(fused), seed=seed,
                       timeout_s=timeout_s, transport=transport)
        self.pooling = pooling
        self.fused = fused
        rank = world.rank
        tables = []
        for t in self.plan.tables_of(rank):
            n = self.plan.table_rows[t]
            g = torch.Generator().manual_seed(seed * 100003 + t)
            tables.append((torch.rand(n, embedding_dim, generator=g) * 2 - 1) * n ** -0.5)
        w = torch.cat(tables) if tables else torch.empty(0, embedding_dim)
        self.weight = nn.Parameter(w.to(device=world.device, dtype=dtype))
        self.ctx = EmbeddingAllToAll(world, self.plan.table_rows, embedding_dim, max_local_batch,
                                     table_ranks=self.plan.table_ranks, transport=transport,
                                     timeout_s=timeout_s) if fused else None
        # the reference path's input checks: the fused op's (no collective to make)
        self._tables = None if fused else RankTables(world, self.plan, max_local_batch)

    @property
    def local_tables(self) -> list:
        return self.plan.tables_of(self.world.rank)

    # -- checkpoints -----------------------------------------------------------------------------
    def _layout(self) -> torch.Tensor:
        """``[rank, dim, T, table_rows..., table_ranks...]``: what this rank's packed weight
        holds (a tensor, so a state dict stays all tensors: safetensors, ``.cpu()`` loops)."""
        p = self.plan
        return torch.tensor([self.world.rank, p.dim, p.num_tables, *p.table_rows,
                             *p.table_ranks], dtype=torch.int64)

    @staticmethod
    def _describe(layout) -> dict:
        v = [int(x) for x in layout.tolist()] if isinstance(layout, torch.Tensor) else []
        if len(v) < 3 or len(v) != 3 + 2 * v[2]:
            return {"layout": v}
        T = v[2]
        return {"rank": v[0], "dim": v[1], "table_rows": v[3:3 + T], "table_ranks": v[3 + T:]}

    def get_extra_state(self) -> torch.Tensor:
        """The layout the packed ``weight`` of a state dict was packed under (a state dict
        holds one rank's local tables, end to end): checked when it is loaded."""
        return self._layout()

    def set_extra_state(self, state) -> None:
        """Nothing to set: the layout is checked before any tensor is copied
        (``_load_from_state_dict``)."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        """Refuse a state dict packed under another plan or by another rank, before its weight
        is copied: the weight may have this module's shape (two tables of equal rows placed
        the other way round, rank 0's tables loaded on rank 1) and would load as other
        tables' rows, with no error. A weight without its layout (a state dict made by hand)
        is refused too, with ``strict=False`` as well: nothing else would check it."""
        key = prefix + "_extra_state"
        if prefix + "weight" in state_dict:
            if key not in state_dict:
                raise ValueError(
                    f"{NAME}: the state dict holds a weight but not the layout it was packed "
                    f"under ({key!r}): a table placement or rank of its own cannot be told from "
                    f"this module's. Save it with this module's state_dict(), or, where it is "
                    f"known to be this rank's tables under this plan, add "
                    f"state[{key!r}] = module.get_extra_state()")
            mine, theirs = (self._describe(t) for t in (self._layout(), state_dict[key]))
            diff = [k for k in mine if theirs.get(k) != mine[k]]
            if diff:
                raise ValueError(
                    f"{NAME}: the state dict's weight was packed under another layout ("
                    + ", ".join(f"{k} {theirs.get(k)!r} there, {mine[k]!r} here" for k in diff)
                    + "): each rank loads its own state dict into a module of the same tables, "
                      "width and table_ranks")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def forward(self, lengths: torch.Tensor, indices: torch.Tensor,
                per_sample_weights: Optional[torch.Tensor] = None,
                batch_splits: Optional[Sequence[int]] = None) -> torch.Tensor:
        if self.fused:
            return embedding_all_to_all(self.weight, lengths, indices, self.ctx,
                                        per_sample_weights, batch_splits=batch_splits,
                                        pooling=self.pooling)
        splits = self._checked_splits(lengths, indices, per_sample_weights, batch_splits)
        return embedding_all_to_all_reference(self.weight, lengths, indices, per_sample_weights,
                                              self.plan, self.world.rank, list(splits),
                                              self.pooling, self.world.group,
                                              accumulate_fp32=False)

    def _checked_splits(self, lengths, indices, per_sample_weights, batch_splits) -> tuple:
        """The reference path's batch split, after the fused op's checks of the call
        (``RankTables.check``: types, shapes, the split, index ranges, lengths against indices)
        and one exchange of a row per rank (refused or not, its split): a call one rank
        refuses raises on every rank (the peers: ``PeerTimeoutError`` naming it), and ranks
        that pass different splits raise ``RankMismatchError``; otherwise the peers of such a
        rank would wait in the reference's all-to-all until the process group's timeout
        (gloo: half an hour)."""
        W, r = self.world.world_size, self.world.rank
        error, splits = None, (0,) * W
        try:
            if batch_splits is None:
                batch_splits = self._default_splits(lengths)
            splits, _ = self._tables.check(self.weight, lengths, indices, per_sample_weights,
                                           batch_splits, self.pooling, True)
        except (TypeError, ValueError) as e:
            error = e
        if W > 1:
            rows = torch.zeros(W, W + 1, dtype=torch.int64, device=self.world.device)
            rows[r, 0] = error is not None
            rows[r, 1:] = torch.tensor(splits, dtype=torch.int64)
            dist.all_reduce(rows, group=self.world.group)
            refused = rows[:, 0].nonzero().flatten().tolist()
            seen = {tuple(row[1:]) for row in rows.tolist() if not row[0]}
        else:
            refused, seen = [], set()
        if error is not None:
            raise error
        if refused:
            raise PeerTimeoutError(f"{NAME}: rank(s) {refused} refused this call (they raise "
                                   f"their own error); rank {r} stopped it too")
        if len(seen) > 1:
            raise RankMismatchError(f"{NAME}: the ranks passed different batch_splits: "
                                    f"{sorted(seen)}")
        return splits

    def _default_splits(self, lengths) -> tuple:
        """The reference path's default split, refused where the fused op refuses it. Decided
        from the plan and the global batch alone (the same on every rank), before the
        reference's all-to-all, so every rank raises rather than one entering the exchange: a
        rank that holds no tables refuses on every rank, not only on itself."""
        W = self.world.world_size
        empty = [q for q in range(W) if not self.plan.tables_of(q)]
        if empty:
            raise ValueError(f"{NAME}: rank {empty[0]} holds no tables, so the global batch "
                             f"cannot be read off lengths: pass batch_splits")
        return even_splits(NAME, lengths, len(self.local_tables), W, self.world.rank)

    def close(self) -> None:
        """Collective: free the fused path's context. Closing twice does nothing; a fused call
        after it raises ``ContextClosedError``."""
        if self.ctx is not None:
            # the closed context stays: a call after close() gets its ContextClosedError, not
            # the op's TypeError about a missing context
            self.ctx.close()

    def extra_repr(self) -> str:
        return (f"tables={self.plan.num_tables}, dim={self.plan.dim}, "
                f"local={self.local_tables}, pooling={self.pooling}, fused={self.fused}")
