"""The wave-group predictor and search (host-side), the shared tuning decisions and the
collective calibration on emulated ranks."""
import dataclasses
import json
import math
import os

import pytest
import torch

from portable_overlap import RankMismatchError
from portable_overlap.world import host_layout
from portable_overlap.schedule import (Calibration, TuningCache, WaveGroups, cache_key,
                                       candidate_partitions, decide, measure_comm_curve,
                                       predict_ms, search, search_top)
from portable_overlap.schedule.predict import _compositions, _finish, invert_comm_slowdown

# about what 2x H200 measured: a 132-tile wave of 128x256 bf16 tiles at 8192^3 / 2 ranks, and
# NCCL all_reduce at ~280 GB/s bus bandwidth with ~15 us of latency
CAL = Calibration(wave_ms=0.05, tiles_per_wave=132,
                  comm_curve=((1 << 16, 0.015), (1 << 20, 0.02), (1 << 24, 0.08), (1 << 27, 0.5)),
                  slowdown=1.1)
TILE_BYTES = 128 * 256 * 2


def test_comm_interpolation():
    assert CAL.comm_ms(1 << 20) == pytest.approx(0.02)
    assert CAL.comm_ms(1 << 10) == pytest.approx(0.015)  # below the curve: the latency
    assert CAL.comm_ms(3 << 22) == pytest.approx(0.02 + 0.06 * ((3 << 22) - (1 << 20))
                                                 / ((1 << 24) - (1 << 20)))
    assert CAL.comm_ms(1 << 28) > CAL.comm_ms(1 << 27)  # the last bandwidth beyond


def test_prediction_follows_the_timeline():
    # one group: all the GEMM, then all the communication
    n = 132 * 10
    one = predict_ms([n], CAL, TILE_BYTES)
    assert one == pytest.approx(10 * 0.05 + CAL.comm_ms(n * TILE_BYTES))
    # two groups hide the first collective behind the second half of the GEMM
    two = predict_ms([n // 2, n // 2], CAL, TILE_BYTES)
    assert two < one


def _old_model(sizes, cal, tile_bytes):
    """The model before comm_slowdown and group_overhead_ms, written out again."""
    gemm_end = comm_end = 0.0
    for g, n in enumerate(sizes):
        gemm_end += n / cal.tiles_per_wave * cal.wave_ms * (1.0 if g == 0 else cal.slowdown)
        comm_end = max(gemm_end, comm_end) + cal.comm_ms(n * tile_bytes)
    return comm_end + cal.reorder_ms


def test_default_collective_terms_keep_the_plain_model():
    cal = dataclasses.replace(CAL, reorder_ms=0.03)
    assert cal.comm_slowdown == 1.0 and cal.group_overhead_ms == 0.0
    for parts in _compositions(10, 5):
        sizes = [p * 132 for p in parts]
        assert predict_ms(sizes, cal, TILE_BYTES) == pytest.approx(
            _old_model(sizes, cal, TILE_BYTES))


def test_finish_of_a_collective_beside_the_gemm():
    # after the GEMM: full rate, whatever the factor
    assert _finish(2.0, 0.5, 1.0, 4.0) == pytest.approx(2.5)
    # wholly beside: 4 times longer
    assert _finish(0.0, 0.1, 1.0, 4.0) == pytest.approx(0.4)
    # partly: 0.4 ms beside does 0.1 ms of work, the remaining 0.2 after the GEMM
    assert _finish(0.6, 0.3, 1.0, 4.0) == pytest.approx(1.2)
    # no progress at all beside the GEMM
    assert _finish(0.6, 0.3, 1.0, math.inf) == pytest.approx(1.3)
    assert _finish(0.0, 0.3, 1.0, 1.0) == pytest.approx(0.3)


def test_comm_slowdown_and_group_overhead_in_the_timeline():
    n = 132 * 10
    one = predict_ms([n], CAL, TILE_BYTES)
    # one group: its collective starts when the GEMM ends, nothing to slow or add
    stuck = dataclasses.replace(CAL, comm_slowdown=math.inf, group_overhead_ms=0.01)
    assert predict_ms([n], stuck, TILE_BYTES) == pytest.approx(one)
    # collectives that make no progress beside the GEMM all run after it: no overlap, every
    # collective after the first costs the overhead on top
    sizes = [132 * 2, 132 * 3, 132 * 5]
    gemm = 2 * 0.05 + 8 * 0.05 * CAL.slowdown
    serial = gemm + sum(CAL.comm_ms(s * TILE_BYTES) for s in sizes) + 2 * 0.01
    assert predict_ms(sizes, stuck, TILE_BYTES) == pytest.approx(serial)
    assert predict_ms(sizes, stuck, TILE_BYTES) > one > predict_ms(sizes, CAL, TILE_BYTES)
    # a slower collective and a costlier group never make the op faster
    for f in (1.0, 2.0, 8.0):
        slow = dataclasses.replace(CAL, comm_slowdown=f)
        slower = dataclasses.replace(CAL, comm_slowdown=f * 2, group_overhead_ms=0.005)
        assert (predict_ms(sizes, CAL, TILE_BYTES) <= predict_ms(sizes, slow, TILE_BYTES)
                <= predict_ms(sizes, slower, TILE_BYTES))
    # a negative overhead (the curve counts per-call costs that back-to-back collectives
    # share) shortens later collectives, never below nothing
    cheap = dataclasses.replace(stuck, group_overhead_ms=-0.01)
    assert predict_ms(sizes, cheap, TILE_BYTES) == pytest.approx(serial - 4 * 0.01)
    free = dataclasses.replace(stuck, group_overhead_ms=-10.0)
    assert predict_ms(sizes, free, TILE_BYTES) == pytest.approx(
        gemm + CAL.comm_ms(sizes[0] * TILE_BYTES))


def test_bad_collective_terms():
    for bad in ({"comm_slowdown": 0.5}, {"comm_slowdown": math.nan},
                {"group_overhead_ms": math.inf}, {"group_overhead_ms": math.nan}):
        with pytest.raises(ValueError):
            dataclasses.replace(CAL, **bad)


@pytest.mark.parametrize("f", [1.0, 1.5, 4.0, 50.0])
@pytest.mark.parametrize("alone", [0.1, 0.5, 2.0])
def test_invert_comm_slowdown(f, alone):
    gemm = 0.8
    beside = _finish(0.0, alone, gemm, f)  # what the benchmark would time
    assert invert_comm_slowdown(gemm, alone, beside) == pytest.approx(f)


def test_invert_comm_slowdown_bounds():
    assert invert_comm_slowdown(0.8, 0.5, 1.3) == 1000.0  # no progress beside the GEMM
    assert invert_comm_slowdown(0.8, 0.5, 1.4, cap=50.0) == 50.0  # later still: the cap
    assert invert_comm_slowdown(0.8, 0.5, 0.45) == 1.0  # faster than alone: noise
    with pytest.raises(ValueError):
        invert_comm_slowdown(0.8, 0.0, 1.0)


def test_search_follows_the_collective_terms():
    n = 132 * 12
    # collectives overlapping freely: several groups
    assert search(n, CAL, TILE_BYTES)[0].n_groups > 1
    # collectives stuck until the GEMM ends and a cost per group: one group, found by both the
    # exhaustive and the local search (which starts from one group and merges groups)
    stuck = dataclasses.replace(CAL, comm_slowdown=1000.0, group_overhead_ms=0.005)
    for budget in (200_000, 0):
        got, ms = search(n, stuck, TILE_BYTES, budget=budget)
        assert got == WaveGroups((n,)) and ms == pytest.approx(predict_ms([n], stuck,
                                                                          TILE_BYTES))
    # bounds, when asked for, still exclude one group
    got, _ = search(n, stuck, TILE_BYTES, first_max_waves=2)
    assert got.sizes[0] <= 2 * 132 and got.n_groups > 1


@pytest.mark.parametrize("waves", [4, 9, 15])
def test_search_matches_exhaustive_enumeration(waves):
    n = 132 * waves - 17  # a partial last wave
    got, ms = search(n, CAL, TILE_BYTES, first_max_waves=waves, last_max_frac=1.0)
    assert got.n_tiles == n
    best = min(predict_ms([p * 132 for p in parts[:-1]] + [parts[-1] * 132 - 17], CAL,
                          TILE_BYTES) for parts in _compositions(waves, 8))
    assert ms == pytest.approx(best)


def test_local_search_on_large_grids_is_close_to_exhaustive():
    # 14 waves: exhaustive is cheap enough to compare with the local search (forced by budget=0)
    n = 132 * 14
    exact = search(n, CAL, TILE_BYTES, first_max_waves=14, last_max_frac=1.0)[1]
    local = search(n, CAL, TILE_BYTES, first_max_waves=14, last_max_frac=1.0, budget=0)[1]
    assert local <= exact * 1.03


@pytest.mark.parametrize("budget", [200_000, 0])  # exhaustive, then the local search
def test_search_top_ranks_what_search_scores(budget):
    n = 132 * 9 - 17
    kw = dict(first_max_waves=9, last_max_frac=1.0, budget=budget)
    top = search_top(n, CAL, TILE_BYTES, 5, **kw)
    assert 1 <= len(top) <= 5
    assert top[0] == search(n, CAL, TILE_BYTES, **kw)  # the first is search's pick
    ms = [t for _, t in top]
    assert ms == sorted(ms)
    assert len({g.sizes for g, _ in top}) == len(top)  # distinct partitions
    for g, t in top:
        g.validate(n)
        assert predict_ms(g.sizes, CAL, TILE_BYTES) == pytest.approx(t)
    if budget:  # exhaustive: nothing outside the top 5 predicts faster than the 5th
        worst = ms[-1]
        assert sum(predict_ms([p * 132 for p in parts[:-1]] + [parts[-1] * 132 - 17], CAL,
                              TILE_BYTES) < worst - 1e-12
                   for parts in _compositions(9, 8)) <= 4
    assert len(search_top(5, CAL, TILE_BYTES, 3)) == 1  # less than a wave: one partition
    with pytest.raises(ValueError):
        search_top(n, CAL, TILE_BYTES, 0)


def test_bounds_and_destinations():
    got, _ = search(132 * 12, CAL, TILE_BYTES, multiple_of=2, first_max_waves=1,
                    last_max_frac=0.25)
    assert got.sizes[0] <= 132 and got.sizes[-1] <= 0.25 * 132 * 12
    assert all(s % 2 == 0 for s in got.sizes)
    got.validate(132 * 12, multiple_of=2)
    tiny, _ = search(5, CAL, TILE_BYTES)  # less than a wave: one group
    assert tiny == WaveGroups((5,))


@pytest.mark.parametrize("n,wave,dests,cap,unit", [(1024, 116, 1, 32, 2), (2048, 116, 2, 32, 3),
                                                    (2048, 116, 2, 40, 3), (132 * 4, 132, 1, 8, 1),
                                                    (5, 132, 1, 32, None)])
def test_candidate_partitions(n, wave, dests, cap, unit):
    got = candidate_partitions(n, wave, multiple_of=dests, max_groups=4, cap=cap)
    assert 1 <= len(got) <= cap and len(set(got)) == len(got)
    assert got[0] == (n,)  # one group (no overlap) is always a candidate
    for sizes in got:
        assert sum(sizes) == n and len(sizes) <= 4
        assert all(s >= 1 and s % dests == 0 for s in sizes)
        # whole units of k waves, the last group takes the remainder
        assert all(s % (unit * wave) == 0 for s in sizes[:-1]) if unit else sizes == (n,)
    # every composition of that many units is there (exhaustive within the bound)
    if unit:
        units = -(-(-(-n // wave)) // unit)
        assert len(got) == sum(1 for p in _compositions(units, 4))
    with pytest.raises(ValueError):
        candidate_partitions(1023, 116, multiple_of=2)


def test_cache_key_covers_versions():
    k = json.loads(cache_key("gemm_all_reduce", {"M": 1}, torch.bfloat16, 2, "H200"))
    assert {"torch", "triton", "portable_overlap", "device", "world", "hosts"} <= set(k)


def test_cache_key_tells_groups_on_other_hosts_apart():
    """A pair inside a host and a pair across two hosts (the same world size, device and call)
    get two keys, so a decision timed over NVLink is not taken for the network."""
    def key(hosts):
        return cache_key("gemm_all_reduce", {"M": 1}, torch.bfloat16, 2, "H200", hosts)

    assert key([2]) == key(None) != key([1, 1])
    for bad in ([1], [3], [2, 0], [-1, 3]):
        with pytest.raises(ValueError):
            key(bad)
    assert host_layout(["a", "b", "a", "b"]) == (2, 2)
    assert host_layout(["b", "b", "b", "a"]) == (3, 1)
    assert host_layout(["h"] * 8) == (8,)


def _layouts(world):
    first = world.host_layout()
    before = world.collectives
    return first, world.host_layout(), world.collectives - before


def test_world_host_layout_is_one_host_for_emulated_ranks(world2):
    """The emulated ranks share this host; the layout is gathered once and kept."""
    for first, again, collectives in world2.run(_layouts):
        assert first == again == (2,) and collectives == 0


def _decide(world, tmp, stale):
    cache = TuningCache(f"{tmp}/rank{world.rank}.json")
    key = "k"
    if stale and world.rank == 1:
        cache.put(key, [1, 2, 3])  # a rank with an old decision
    calls = []
    try:
        v = decide(world, key, lambda: calls.append(1) or [world.rank, 7], cache)
    except RankMismatchError as e:
        return "mismatch", str(e)
    again = decide(world, key, lambda: calls.append(1) or None, cache)  # cached now
    return v, again, len(calls)


def test_ranks_use_rank0s_decision_and_stale_caches_are_decided_again(world2, tmp_path):
    for v, again, calls in world2.run(_decide, str(tmp_path), False):
        assert v == [0, 7] and again == [0, 7] and calls == 1
    res = world2.run(_decide, str(tmp_path / "b"), True)
    # rank 1 holds a decision rank 0 does not: not a disagreement yet; rank 0's wins everywhere
    assert all(r[0] == [0, 7] for r in res), res
    # now rank 1's cache holds [0, 7] but make rank 0 hold something else: the ranks decide
    # again (measured once on every rank), and every rank takes and keeps rank 0's decision
    TuningCache(str(tmp_path / "b" / "rank0.json")).put("k", [9])
    for r in world2.run(_decide, str(tmp_path / "b"), False):
        assert r == ([0, 7], [0, 7], 1), r


def _curve(world):
    return measure_comm_curve(world, "all_reduce", [1 << 10, 1 << 14], torch.float32, iters=3)


def test_comm_curve_on_emulated_ranks(world2):
    for curve in world2.run(_curve):
        assert [b for b, _ in curve] == [1 << 10, 1 << 14] and all(t > 0 for _, t in curve)


def _decide_cache_refused_on_one_rank(world, tmp):
    """``$PORTABLE_OVERLAP_TUNING_CACHE`` names a folder on rank 1 only, and ``decide`` takes
    the cache it names: rank 1's refusal came before the decision's collective, where rank 0
    then waited for ever. (error type, message) on this rank."""
    import os

    if world.rank == 1:
        os.environ["PORTABLE_OVERLAP_TUNING_CACHE"] = tmp + os.sep
    try:
        decide(world, "k", lambda: [7])
        return "decided", ""
    except Exception as e:
        return type(e).__name__, str(e)
    finally:
        os.environ.pop("PORTABLE_OVERLAP_TUNING_CACHE", None)


def test_a_tuning_cache_refused_on_one_rank_raises_on_every_rank(world2, tmp_path):
    mine, peer = world2.run(_decide_cache_refused_on_one_rank, str(tmp_path), timeout=120)
    assert peer[0] == "ValueError" and "PORTABLE_OVERLAP_TUNING_CACHE" in peer[1], peer
    assert mine[0] == "PeerSetupError" and "rank 1" in mine[1] and \
        "PORTABLE_OVERLAP_TUNING_CACHE" in mine[1], mine


def _decide_cache_unreadable_on_one_rank(world):
    """Rank 1's cache file opens and fails to read (EIO): that rank warns and decides with
    its peers; raised there, its peers waited in the decision's collective for ever."""
    import os
    import warnings

    if world.rank == 1:
        os.environ["PORTABLE_OVERLAP_TUNING_CACHE"] = "/proc/self/mem"
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            got = decide(world, "k", lambda: [7])
        return got, [str(w.message) for w in said]
    finally:
        os.environ.pop("PORTABLE_OVERLAP_TUNING_CACHE", None)


@pytest.mark.skipif(not os.path.isfile("/proc/self/mem"), reason="needs Linux's /proc")
def test_a_tuning_cache_unreadable_on_one_rank_is_ignored_there(world2):
    (mine, said0), (peer, said1) = world2.run(_decide_cache_unreadable_on_one_rank,
                                              timeout=120)
    assert mine == peer == [7], (mine, peer)
    assert any("cannot be read" in w for w in said1), said1
