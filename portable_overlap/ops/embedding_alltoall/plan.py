"""The table-wise sharding plan every rank agrees on: which rank holds which embedding table, and
how a rank packs its tables into one flat weight buffer."""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from ..context import exact_int


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """``table_rows[t]`` rows of width ``dim`` in global table t, held whole by rank
    ``table_ranks[t]``. Rank r's local tables are its tables in increasing global order; it packs
    them into one ``[sum of their rows, dim]`` buffer, table after table (table-batched layout)::

        local = [t for t in range(T) if table_ranks[t] == r]
        weight_r = torch.cat([table[t] for t in local])      # table[t]: [table_rows[t], dim]
        row_offsets_r[j] = sum(table_rows[t] for t in local[:j])

    Rows, ranks and ``dim`` are integers (ints, NumPy ints, integer tensors); floats and bools
    are refused with a ``ValueError``, not rounded.
    """

    table_rows: tuple
    table_ranks: tuple
    dim: int
    world_size: int

    def __post_init__(self):
        for name, values in (("table_rows", self.table_rows), ("table_ranks", self.table_ranks),
                             ("dim", (self.dim,)), ("world_size", (self.world_size,))):
            _integers(name, values)
        if not self.table_rows:
            raise ValueError("embedding plan: at least one table is needed")
        if any(int(n) < 1 for n in self.table_rows):
            raise ValueError(f"embedding plan: every table needs >= 1 row, got {self.table_rows}")
        if len(self.table_ranks) != len(self.table_rows):
            raise ValueError(f"embedding plan: table_ranks has {len(self.table_ranks)} entries for "
                             f"{len(self.table_rows)} tables")
        if any(not 0 <= int(r) < self.world_size for r in self.table_ranks):
            raise ValueError(f"embedding plan: table_ranks {self.table_ranks} must be ranks in "
                             f"0..{self.world_size - 1}")
        if self.dim < 1:
            raise ValueError(f"embedding plan: dim must be >= 1, got {self.dim}")

    @classmethod
    def make(cls, table_rows: Sequence[int], dim: int, world_size: int,
             table_ranks: Optional[Sequence[int]] = None) -> "ShardingPlan":
        """Default placement: largest table first onto the rank with the fewest rows so far
        (ties: fewer tables, then lower rank), a deterministic greedy balance of memory."""
        rows = _integers("table_rows", table_rows)
        if table_ranks is None:
            load = [(0, 0, r) for r in range(world_size)]
            ranks = [0] * len(rows)
            for t in sorted(range(len(rows)), key=lambda t: (-rows[t], t)):
                n_rows, n_tabs, r = min(load)
                ranks[t] = r
                load[r] = (n_rows + rows[t], n_tabs + 1, r)
            table_ranks = ranks
        return cls(rows, _integers("table_ranks", table_ranks), _integers("dim", (dim,))[0],
                   _integers("world_size", (world_size,))[0])

    @property
    def num_tables(self) -> int:
        return len(self.table_rows)

    def tables_of(self, rank: int) -> list:
        return [t for t, r in enumerate(self.table_ranks) if r == rank]

    def local_rows(self, rank: int) -> list:
        return [self.table_rows[t] for t in self.tables_of(rank)]

    def row_offsets(self, rank: int) -> list:
        offs, top = [], 0
        for n in self.local_rows(rank):
            offs.append(top)
            top += n
        return offs

    def weight_rows(self, rank: int) -> int:
        return sum(self.local_rows(rank))


def _integers(name: str, values) -> tuple:
    """``values`` as Python ints: ints, NumPy ints and integer tensors. Floats and bools are
    refused, not rounded: ``int()`` took 7.9 rows as 7 and ``True`` as 1, and the tables the
    caller packed no longer matched the plan's."""
    try:
        out = tuple(exact_int(v) for v in values)
    except TypeError:
        out = (None,)
    if any(v is None for v in out):
        one = name in ("dim", "world_size")  # (passed as a tuple of one)
        raise ValueError(f"embedding plan: {name} must be {'an integer' if one else 'integers'}"
                         f" (floats and bools are not rounded), got "
                         f"{values[0] if one else values!r}")
    return out
