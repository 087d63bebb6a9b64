"""The wave-group predictor and search (host-side), the shared tuning decisions and the
collective calibration on emulated ranks."""
import json

import pytest
import torch

from portable_overlap import RankMismatchError
from portable_overlap.schedule import (Calibration, TuningCache, WaveGroups, cache_key,
                                       candidate_partitions, decide, measure_comm_curve,
                                       predict_ms, search)
from portable_overlap.schedule.predict import _compositions

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
    assert {"torch", "triton", "portable_overlap", "device", "world"} <= set(k)


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


def test_ranks_use_rank0s_decision_and_stale_caches_are_caught(world2, tmp_path):
    for v, again, calls in world2.run(_decide, str(tmp_path), False):
        assert v == [0, 7] and again == [0, 7] and calls == 1
    res = world2.run(_decide, str(tmp_path / "b"), True)
    # rank 1 holds a decision rank 0 does not: not a disagreement yet; rank 0's wins everywhere
    assert all(r[0] == [0, 7] for r in res), res
    # now rank 1's cache holds [0, 7] but make rank 0 hold something else: caught
    TuningCache(str(tmp_path / "b" / "rank0.json")).put("k", [9])
    for r in world2.run(_decide, str(tmp_path / "b"), False):
        assert r[0] == "mismatch" and "disagree" in r[1], r


def _curve(world):
    return measure_comm_curve(world, "all_reduce", [1 << 10, 1 << 14], torch.float32, iters=3)


def test_comm_curve_on_emulated_ranks(world2):
    for curve in world2.run(_curve):
        assert [b for b, _ in curve] == [1 << 10, 1 << 14] and all(t > 0 for _, t in curve)
