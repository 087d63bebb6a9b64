"""Wave groups: the unit in which a GEMM producer hands finished tiles to a collective.

A persistent GEMM of ``G`` programs walks its tiles in *schedule order*: program ``pid`` takes
tiles ``pid, pid + G, ...``, so the tiles ``[i·G, (i+1)·G)`` form wave ``i`` and finish at about
the same time. A partition cuts the schedule order into consecutive *groups* of tiles (sizes
``s_0, s_1, ...``); each group is communicated by one ordinary collective as soon as all of its
tiles are done.

Staging layout. Every group owns the consecutive staging slots ``[start_g, start_g + s_g)``, one
``[BLOCK_M, BLOCK_N]`` tile per slot, so a group is one contiguous chunk. A slot is a function of
the tile index only (deterministic, not completion order): a reduction (AllReduce,
ReduceScatter) sums slot ``i`` of every rank, so slot ``i`` must hold the same tile on every
rank, which completion order — different on every GPU — would not give.

With ``dests`` destinations (1 for AllReduce, the world size for ReduceScatter and All-to-All),
the schedule order interleaves them: tile ``t`` belongs to destination ``d = t % dests`` and is
tile ``u = t // dests`` of that destination's row block. Group sizes are multiples of ``dests``,
so every group holds the same number of tiles ``s_g / dests`` for every destination, and its
chunk is laid out ``[dests, s_g / dests]`` tiles: destination d's part is contiguous, as
``reduce_scatter_tensor`` and ``all_to_all_single`` with equal splits want it.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Sequence


@dataclasses.dataclass(frozen=True)
class WaveGroups:
    """A partition of ``sum(sizes)`` tiles (schedule order) into consecutive groups."""

    sizes: tuple

    def __post_init__(self):
        sizes = tuple(int(s) for s in self.sizes)
        object.__setattr__(self, "sizes", sizes)
        if not sizes:
            raise ValueError("a wave-group partition needs at least one group")
        if any(s < 1 for s in sizes):
            raise ValueError(f"every wave group needs at least one tile: {sizes}")

    @property
    def n_groups(self) -> int:
        return len(self.sizes)

    @property
    def n_tiles(self) -> int:
        return sum(self.sizes)

    @property
    def starts(self) -> tuple:
        out, s = [], 0
        for n in self.sizes:
            out.append(s)
            s += n
        return tuple(out)

    def validate(self, n_tiles: int, multiple_of: int = 1, what: str = "partition") -> None:
        """Raise ValueError unless the groups cover exactly ``n_tiles`` tiles and every group is
        a multiple of ``multiple_of`` tiles (the number of destinations)."""
        if self.n_tiles != n_tiles:
            raise ValueError(f"{what}: group sizes {self.sizes} sum to {self.n_tiles}, the GEMM "
                             f"has {n_tiles} tiles")
        bad = [s for s in self.sizes if s % multiple_of]
        if bad:
            raise ValueError(f"{what}: group sizes must be multiples of {multiple_of} (one tile "
                             f"per destination rank each round); got {self.sizes}")

    def group_of(self, t: int) -> int:
        """The group of schedule-order tile ``t``."""
        if not 0 <= t < self.n_tiles:
            raise IndexError(f"tile {t} outside 0..{self.n_tiles - 1}")
        for g, (s, n) in enumerate(zip(self.starts, self.sizes)):
            if t < s + n:
                return g
        raise AssertionError("unreachable")


@dataclasses.dataclass(frozen=True)
class TileLayout:
    """Where the tiles of one planned call go (host lists; the ops copy them to the device).

    ``group[t]``, ``slot[t]``: group and staging slot of schedule-order tile ``t``;
    ``dest[t]``, ``local[t]``: its destination and its index ``u`` among that destination's tiles.
    """

    groups: WaveGroups
    dests: int
    group: tuple
    slot: tuple
    dest: tuple
    local: tuple

    def slot_of(self, t: int) -> int:
        return self.slot[t]

    def tile_of_slot(self, s: int) -> int:
        """The schedule-order tile at staging slot ``s`` (inverse of ``slot``)."""
        return self._inverse[s]

    @property
    def _inverse(self) -> tuple:
        inv = [0] * len(self.slot)
        for t, s in enumerate(self.slot):
            inv[s] = t
        return tuple(inv)


def tile_layout(groups: WaveGroups, dests: int = 1) -> TileLayout:
    """Group, staging slot, destination and per-destination index of every tile (see the module
    docstring for the layout). ``groups`` must already be validated with ``multiple_of=dests``."""
    if dests < 1:
        raise ValueError(f"dests must be >= 1, got {dests}")
    groups.validate(groups.n_tiles, dests)
    group, slot, dest, local = [], [], [], []
    for g, (start, size) in enumerate(zip(groups.starts, groups.sizes)):
        per_dest = size // dests
        for t in range(start, start + size):
            d, j = t % dests, (t - start) // dests
            group.append(g)
            slot.append(start + d * per_dest + j)
            dest.append(d)
            local.append(t // dests)
    return TileLayout(groups, dests, tuple(group), tuple(slot), tuple(dest), tuple(local))


def default_partition(n_tiles: int, programs: int, multiple_of: int = 1,
                      max_groups: int = 8) -> WaveGroups:
    """A simple partition heuristic (no measurements): the first group is one wave of the
    ``programs`` resident programs (so communication starts after one wave), later groups double
    in waves up to a quarter of the tiles (whole waves), so the last group — whose collective
    nothing hides — stays bounded; a remainder under half a wave joins the last group (no tiny,
    bandwidth-starved collective at the end), and at most ``max_groups`` groups (each collective
    costs about 10-20 us of launch and latency). Every size is a multiple of ``multiple_of``."""
    if n_tiles < 1 or programs < 1 or multiple_of < 1 or max_groups < 1:
        raise ValueError(f"default_partition: bad arguments (n_tiles, programs, multiple_of, "
                         f"max_groups) = {(n_tiles, programs, multiple_of, max_groups)}")
    if n_tiles % multiple_of:
        raise ValueError(f"default_partition: {n_tiles} tiles is not a multiple of {multiple_of}")
    wave = max(multiple_of, programs - programs % multiple_of)
    cap = max(wave, (n_tiles // 4) // wave * wave)
    sizes, left, size = [], n_tiles, wave
    while left:
        take = min(size, left)
        rest = left - take
        if len(sizes) == max_groups - 1 or (rest and rest < max(multiple_of, wave // 2)):
            take = left  # the remainder would make a tiny last group: merge it
        sizes.append(take)
        left -= take
        size = min(2 * size, cap)
    return WaveGroups(tuple(sizes))


def default_partitions(n_tiles: int, multiple_of: int = 1,
                       programs: Optional[Iterable[int]] = None) -> list:
    """Every distinct partition :func:`default_partition` gives for ``n_tiles`` tiles over a
    range of grid sizes (all of 1..n_tiles by default): what the tests sweep."""
    seen = {}
    for p in programs if programs is not None else range(1, n_tiles + 1):
        wg = default_partition(n_tiles, p, multiple_of)
        seen.setdefault(wg.sizes, wg)
    return list(seen.values())


def as_wave_groups(p: "WaveGroups | Sequence[int]") -> WaveGroups:
    return p if isinstance(p, WaveGroups) else WaveGroups(tuple(p))


def grouped_tile(t: int, num_pid_m: int, num_pid_n: int, group_m: int) -> tuple:
    """Host mirror of ``tiles.gemm.grouped_tile``: (pid_m, pid_n) of the t-th tile in grouped
    order (the reorder tables are built from it)."""
    per_group = group_m * num_pid_n
    first_m = (t // per_group) * group_m
    rows = min(num_pid_m - first_m, group_m)
    return first_m + (t % per_group) % rows, (t % per_group) // rows
