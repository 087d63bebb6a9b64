"""Predictive wave-group search (the FlashOverlap paper's tuning): a timeline model of a GEMM whose
wave groups each trigger a collective, fed by a calibration measured once per device and world,
and a search over group partitions that uses the model instead of running every candidate.

Model, for groups of ``n_g`` tiles in schedule order (``waves_g = n_g / tiles_per_wave``)::

    gemm_end_g = sum_{i <= g} waves_i * wave_ms * (1 if i == 0 else slowdown)   # T = gemm_end_last
    work_g     = comm_ms(n_g * bytes_per_tile) + (group_overhead_ms if g > 0 else 0)
    start_g    = max(gemm_end_g, comm_end_{g-1})
    comm_end_g = finish(start_g, work_g, T, comm_slowdown)
    predicted  = comm_end_last + reorder_ms

``finish``: a collective progresses at ``1 / comm_slowdown`` of its alone rate while the GEMM
runs and at its full rate after ``T``::

    start + work * comm_slowdown               if that is <= T (wholly beside the GEMM)
    T + work - (T - start) / comm_slowdown     if start < T    (partly beside, the rest alone)
    start + work                               otherwise       (after the GEMM)

``comm_ms`` interpolates the measured collective time over message sizes (linear between points,
the last bandwidth beyond them). ``slowdown`` is how much slower the GEMM runs while a collective
shares the GPU; ``comm_slowdown`` how much slower a collective runs while the GEMM holds its
SMs (the persistent GEMM leaves only its reserve to the collective's kernels);
``group_overhead_ms`` what a collective that follows another one costs beyond the curve (the
per-call cost that an isolated measurement includes once per collective: launch, gating,
latency; negative when back-to-back collectives share part of what the curve counts per call).
With ``comm_slowdown = 1`` and ``group_overhead_ms = 0`` (the defaults) this is the plain
overlap model. ``invert_comm_slowdown`` reads ``comm_slowdown`` off one collective timed beside
the GEMM.

The search may bound the first group (communication starts early) and the last (nothing hides
the last collective); by default it does not: the model prices late starts and costly tails
itself. ``candidate_partitions`` gives a bounded exhaustive set of partitions to measure the
model and the search against.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from typing import Optional, Sequence

from .wave_groups import WaveGroups


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What the model needs, measured once per (device, world, collective, dtype)."""
    wave_ms: float  # GEMM time of one wave (every resident program computing one tile)
    tiles_per_wave: int  # resident programs of the GEMM
    comm_curve: tuple  # ((bytes, ms), ...) of the collective, sorted by bytes
    slowdown: float = 1.0  # GEMM time factor while a collective runs beside it
    reorder_ms: float = 0.0  # the post-communication reorder (same for every partition)
    comm_slowdown: float = 1.0  # collective time factor while the GEMM runs beside it
    group_overhead_ms: float = 0.0  # extra time of each collective after the first (may be < 0)

    def __post_init__(self):
        curve = tuple(sorted((int(b), float(t)) for b, t in self.comm_curve))
        if (not curve or self.wave_ms <= 0 or self.tiles_per_wave < 1 or self.slowdown <= 0
                or not self.comm_slowdown >= 1 or not math.isfinite(self.group_overhead_ms)):
            raise ValueError(f"bad calibration {self}")
        object.__setattr__(self, "comm_curve", curve)

    def comm_ms(self, nbytes: int) -> float:
        """Collective time for ``nbytes``, interpolated from the curve."""
        xs = [b for b, _ in self.comm_curve]
        i = bisect.bisect_left(xs, nbytes)
        if i < len(xs) and xs[i] == nbytes:
            return self.comm_curve[i][1]
        if i == 0:  # below the smallest measured size: its time (latency dominates)
            return self.comm_curve[0][1]
        if i == len(xs):  # beyond: the last segment's bandwidth
            (b0, t0), (b1, t1) = (self.comm_curve[-2] if len(xs) > 1 else (0, 0.0)), \
                self.comm_curve[-1]
            slope = (t1 - t0) / (b1 - b0) if b1 > b0 else 0.0
            return t1 + slope * (nbytes - b1)
        (b0, t0), (b1, t1) = self.comm_curve[i - 1], self.comm_curve[i]
        return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)


def _finish(start: float, work: float, gemm_end: float, comm_slowdown: float) -> float:
    """When a collective of ``work`` ms alone, started at ``start``, ends if it runs at
    ``1 / comm_slowdown`` of its rate until ``gemm_end`` and at full rate after."""
    if start >= gemm_end:
        return start + work
    beside = gemm_end - start
    if work * comm_slowdown <= beside:
        return start + work * comm_slowdown
    return gemm_end + work - beside / comm_slowdown


def predict_ms(sizes: Sequence[int], cal: Calibration, bytes_per_tile: int) -> float:
    """Predicted time of the fused op with groups of ``sizes`` tiles (module docstring)."""
    gemm_ends, t = [], 0.0
    for g, n in enumerate(sizes):
        t += n / cal.tiles_per_wave * cal.wave_ms * (1.0 if g == 0 else cal.slowdown)
        gemm_ends.append(t)
    comm_end = 0.0
    for g, n in enumerate(sizes):
        work = cal.comm_ms(n * bytes_per_tile) + (cal.group_overhead_ms if g else 0.0)
        # a negative overhead never makes a collective take less than no time
        comm_end = _finish(max(gemm_ends[g], comm_end), max(0.0, work), t, cal.comm_slowdown)
    return comm_end + cal.reorder_ms


def invert_comm_slowdown(gemm_ms: float, comm_alone_ms: float, comm_beside_ms: float,
                         cap: float = 1000.0) -> float:
    """The ``comm_slowdown`` under which ``finish`` (module docstring) ends a collective of
    ``comm_alone_ms``, started together with a GEMM lasting ``gemm_ms``, at ``comm_beside_ms``
    after their common start; within ``[1, cap]`` (``cap`` when the collective made no measurable
    progress beside the GEMM)."""
    if gemm_ms <= 0 or comm_alone_ms <= 0 or comm_beside_ms <= 0:
        raise ValueError(f"invert_comm_slowdown: times must be > 0, got "
                         f"{(gemm_ms, comm_alone_ms, comm_beside_ms)}")
    if comm_beside_ms <= gemm_ms:  # ended beside the GEMM: the whole collective ran slowed
        f = comm_beside_ms / comm_alone_ms
    else:  # beside for gemm_ms, at 1/f of its rate; the rest at full rate after
        left = gemm_ms + comm_alone_ms - comm_beside_ms  # the work done beside the GEMM
        f = gemm_ms / left if left > 0 else cap
    return min(cap, max(1.0, f))


def _compositions(units: int, max_parts: int):
    """Every way to write ``units`` as an ordered sum of at most ``max_parts`` positive parts."""
    for parts in range(1, min(units, max_parts) + 1):
        for cuts in itertools.combinations(range(1, units), parts - 1):
            yield [b - a for a, b in zip((0, *cuts), (*cuts, units))]


def _n_compositions(units: int, max_parts: int) -> int:
    from math import comb

    return sum(comb(units - 1, k - 1) for k in range(1, min(units, max_parts) + 1))


def _wave_tiles(tiles_per_wave: int, multiple_of: int) -> int:
    """Tiles of one wave, rounded down to whole rounds of ``multiple_of`` destinations."""
    return max(multiple_of, tiles_per_wave - tiles_per_wave % multiple_of)


def _unit_sizes(parts, unit: int, n_tiles: int) -> list:
    """Group sizes in tiles of ``parts`` units of ``unit`` tiles; the last takes the remainder
    (the units overshoot ``n_tiles`` by less than one unit)."""
    sizes = [p * unit for p in parts]
    sizes[-1] -= sum(sizes) - n_tiles
    return sizes


def candidate_partitions(n_tiles: int, tiles_per_wave: int, *, multiple_of: int = 1,
                         max_groups: int = 4, cap: int = 32) -> list:
    """A bounded exhaustive set to check the search against: every composition of the waves
    into at most ``max_groups`` groups of whole units of ``k`` waves (the last group takes the
    remainder), for the smallest ``k`` that gives at most ``cap`` partitions. Returns tuples of
    group sizes in tiles (multiples of ``multiple_of``), one group first."""
    if (n_tiles < 1 or tiles_per_wave < 1 or multiple_of < 1 or max_groups < 1 or cap < 1
            or n_tiles % multiple_of):
        raise ValueError("candidate_partitions: bad arguments (n_tiles, tiles_per_wave, "
                         f"multiple_of, max_groups, cap) = "
                         f"{(n_tiles, tiles_per_wave, multiple_of, max_groups, cap)}")
    wave = _wave_tiles(tiles_per_wave, multiple_of)
    waves = -(-n_tiles // wave)
    for k in range(1, waves + 1):
        units = -(-waves // k)
        if _n_compositions(units, max_groups) <= cap or units == 1:
            return [tuple(_unit_sizes(parts, k * wave, n_tiles))
                    for parts in _compositions(units, max_groups)]
    raise AssertionError("unreachable: k = waves gives one partition")


def search(n_tiles: int, cal: Calibration, bytes_per_tile: int, *, multiple_of: int = 1,
           max_groups: int = 8, first_max_waves: Optional[int] = None,
           last_max_frac: float = 1.0, budget: int = 200_000) -> tuple:
    """The partition of ``n_tiles`` with the smallest predicted time: ``(WaveGroups, ms)``.

    Groups are whole waves (the last takes the remainder), multiples of ``multiple_of`` tiles
    (destinations), at most ``max_groups``; optionally the first group at most
    ``first_max_waves`` waves (one group then only when nothing else is admissible) and the last
    at most ``last_max_frac`` of the tiles. Every admissible composition is tried when there
    are at most ``budget`` of them; otherwise a local search (move one wave between neighbouring
    groups, or merge two, while the prediction improves) from one group and from geometric
    starting points."""
    return search_top(n_tiles, cal, bytes_per_tile, 1, multiple_of=multiple_of,
                      max_groups=max_groups, first_max_waves=first_max_waves,
                      last_max_frac=last_max_frac, budget=budget)[0]


def search_top(n_tiles: int, cal: Calibration, bytes_per_tile: int, k: int, *,
               multiple_of: int = 1, max_groups: int = 8, first_max_waves: Optional[int] = None,
               last_max_frac: float = 1.0, budget: int = 200_000) -> list:
    """The ``k`` partitions with the smallest predicted times among those ``search`` scores,
    best first: ``[(WaveGroups, ms), ...]`` (fewer when fewer were scored). A tuner measures
    these instead of trusting the first alone: near the optimum the model's ranking is within
    its error (a few percent), which a handful of measurements settles."""
    if k < 1:
        raise ValueError(f"search_top: k must be >= 1, got {k}")
    wave = _wave_tiles(cal.tiles_per_wave, multiple_of)
    units = -(-n_tiles // wave)
    scored: dict = {}  # parts -> predicted ms, every admissible partition scored

    def to_sizes(parts):
        return _unit_sizes(parts, wave, n_tiles)

    def admissible(parts):
        sizes = to_sizes(parts)
        return (sizes[-1] >= 1 and len(parts) <= max_groups
                and (first_max_waves is None or parts[0] <= first_max_waves)
                and (len(parts) == 1 or sizes[-1] <= last_max_frac * n_tiles))

    def score(parts):
        key = tuple(parts)
        if key not in scored:
            scored[key] = predict_ms(to_sizes(parts), cal, bytes_per_tile)
        return scored[key]

    if _n_compositions(units, max_groups) <= budget:
        for parts in _compositions(units, max_groups):
            if admissible(parts):
                score(parts)
    else:
        starts = [[units]]
        for first in range(1, min(first_max_waves or 2, units) + 1):
            for ratio in (1.0, 1.5, 2.0, 3.0):
                parts, size, left = [], float(first), units
                while left:
                    take = min(left, max(1, round(size)))
                    if len(parts) == max_groups - 1:
                        take = left
                    parts.append(take)
                    left -= take
                    size *= ratio
                starts.append(parts)
        for parts in starts:
            cur = (score(parts), parts) if admissible(parts) else None
            improved = cur is not None
            while improved:
                improved = False
                moves = []
                for i in range(len(cur[1]) - 1):
                    for d in (-1, 1):
                        cand = list(cur[1])
                        cand[i] += d
                        cand[i + 1] -= d
                        moves.append(cand)
                    moves.append(cur[1][:i] + [cur[1][i] + cur[1][i + 1]] + cur[1][i + 2:])
                for cand in moves:
                    if min(cand) >= 1 and admissible(cand):
                        s = score(cand)
                        if s < cur[0]:
                            cur, improved = (s, cand), True
    if not scored:  # nothing admissible (tiny GEMMs, tight bounds): one group
        score([units])
    # ties keep the order they were scored in (fewer groups first): stable across ranks
    best = sorted(scored.items(), key=lambda kv: kv[1])[:k]
    return [(WaveGroups(tuple(to_sizes(list(parts)))), ms) for parts, ms in best]
