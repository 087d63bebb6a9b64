"""Wave-group tuning of the tile-group-signal ops (ops/gemm_signal/tune.py) on CPU-emulated
ranks: calibration, the predictor's top partitions measured through the op, the decision shared
by every rank and cached, cached decisions reused without measuring, and caches that disagree
or hold no partition of the shape."""
import json

import pytest
import torch

from portable_overlap.ops.gemm_signal import (GemmSignal, SignalConfig, gemm_all_reduce_reference,
                                              gemm_reduce_scatter_reference)
from portable_overlap.ops.gemm_signal import tune as tune_mod
from portable_overlap.schedule import TuningCache
from portable_overlap.testing import environ

SMALL = dict(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1)
REF = {"all_reduce": gemm_all_reduce_reference, "reduce_scatter": gemm_reduce_scatter_reference}


def _inputs(world, M, N, K, seed):
    g = torch.Generator().manual_seed(seed + world.rank)
    return (torch.randn(M, K, generator=g).to(torch.bfloat16),
            torch.randn(K, N, generator=g).to(torch.bfloat16))


def _tune(world, tmp, kind, M, N, K, reserve):
    from portable_overlap.ops.matmul import MatmulConfig

    ctx = GemmSignal(world, config=SignalConfig(matmul=MatmulConfig(**SMALL),
                                                reserve_sms=reserve))
    cache = TuningCache(f"{tmp}/rank{world.rank}.json")
    try:
        a, b = _inputs(world, M, N, K, 7)
        cfg = ctx.tune(kind, a, b, cache=cache, top_k=3, iters=2)
        # the tuned config computes the op (fresh inputs, poisoned output)
        a, b = _inputs(world, M, N, K, 99)
        out = torch.full((M // world.world_size if kind == "reduce_scatter" else M, N),
                         float("nan"), dtype=torch.bfloat16)
        getattr(ctx, kind)(a, b, out, config=cfg)
        ref = REF[kind](a, b, world.group).float()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        entry = next(iter(cache.entries.values()))
        # a decision every rank holds is reused: nothing is calibrated or measured again
        real = tune_mod.calibrate
        tune_mod.calibrate = lambda *a_, **k_: (_ for _ in ()).throw(AssertionError("measured"))
        try:
            again = ctx.tune(kind, a, b, cache=TuningCache(cache.path), top_k=3, iters=2)
        finally:
            tune_mod.calibrate = real
        return ((cfg.partition, cfg.reserve_sms), (again.partition, again.reserve_sms), err,
                entry)
    finally:
        ctx.close()


@pytest.mark.parametrize("kind,M,N,K,ranks,reserve", [("all_reduce", 45, 40, 24, 2, None),
                                                      ("reduce_scatter", 32, 33, 20, 4, 1)])
def test_tune_measures_the_top_partitions_and_caches(world2, world4, tmp_path, kind, M, N, K,
                                                     ranks, reserve):
    got = (world2 if ranks == 2 else world4).run(_tune, str(tmp_path), kind, M, N, K, reserve)
    picks = {g[0] for g in got}
    assert len(picks) == 1, got  # every rank uses rank 0's decision
    (part, res), again, err, entry = got[0]
    assert again == (part, res) and err < 1.5e-2, (again, part, err)
    assert all(g[3] == entry for g in got)  # the same record in every rank's cache
    cands = entry["candidates"]
    whys = [c["why"] for c in cands]
    assert "one group" in whys or any(len(c["partition"]) == 1 for c in cands)
    assert len({(tuple(c["partition"]), c["reserve_sms"]) for c in cands}) == len(cands) >= 2
    assert all(c["measured_ms"] > 0 and c["predicted_ms"] > 0 for c in cands)
    # the other reserve is tried too (one group and the fastest partition): none against the
    # configured 1; with none configured, 16 of 132 SMs scaled to the 4 emulated ones is 0
    # again, so there is nothing else to try
    assert ("other reserve" in whys) == (reserve is not None), whys
    best = min(cands, key=lambda c: c["measured_ms"])
    assert tuple(best["partition"]) == part == tuple(entry["partition"])
    assert best["reserve_sms"] == res == entry["reserve_sms"]
    n_tiles = entry["calibration"]["n_tiles"]
    assert all(sum(c["partition"]) == n_tiles for c in cands)


def _stale(world, tmp, edit):
    """A decision tuned into each rank's own file, then rank 1's entry edited (``edit``: to
    another partition of the tiles, as another run would write, or to none of them), then tuned
    again: the configs the ranks got, their warnings, and the entries their files hold."""
    import warnings

    from portable_overlap.ops.matmul import MatmulConfig

    ctx = GemmSignal(world, config=SignalConfig(matmul=MatmulConfig(**SMALL)))
    path = f"{tmp}/rank{world.rank}.json"
    try:
        a, b = _inputs(world, 40, 32, 16, 3)
        ctx.tune("all_reduce", a, b, cache=TuningCache(path), top_k=2, iters=1)
        if world.rank == 1 or edit == "reserve past the SMs":  # (that one on every rank)
            entries = json.load(open(path))
            for v in entries.values():
                n = sum(v["partition"])
                if edit == "reserve past the SMs":  # (the emulated device has 4)
                    v["reserve_sms"] = 100
                else:
                    v["partition"] = [1] * n if edit == "other partition" else [n + 1]
            json.dump(entries, open(path, "w"))
        world.barrier()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = ctx.tune("all_reduce", a, b, cache=TuningCache(path), top_k=2, iters=1)
        ctx.grid_programs(cfg)  # a reserve the device can leave
        return (cfg.partition, [str(w.message) for w in caught],
                [v["partition"] for v in json.load(open(path)).values()])
    finally:
        ctx.close()


@pytest.mark.parametrize("edit", ["other partition", "no partition", "reserve past the SMs"])
def test_ranks_whose_tuning_caches_disagree_tune_again(world2, tmp_path, edit):
    """Ranks whose files hold different partitions (another run's), or one that holds no
    partition of the shape's tiles, raised on every rank at every tune of the shape: now every
    rank warns, tunes again and records rank 0's pick. An SM reserve the device cannot leave,
    in every rank's file, was taken as the decision, and every call of the shape raised."""
    got = world2.run(_stale, str(tmp_path), edit)
    assert got[0][0] == got[1][0] and got[0][2] == got[1][2] == [list(got[0][0])], got
    why = "disagree" if edit == "other partition" else "not a decision of this call"
    assert any(why in w for w in got[1][1]), got[1][1]


def _bad(world):
    ctx = GemmSignal(world)
    try:
        a, b = _inputs(world, 8, 8, 8, 1)
        out = []
        for kw in (dict(kind="gather"), dict(kind="all_reduce", top_k=0),
                   dict(kind="all_reduce", iters=0)):
            kind = kw.pop("kind")
            try:
                ctx.tune(kind, a, b, **kw)
                out.append(None)
            except ValueError as e:
                out.append(str(e))
        try:  # shapes are checked as the op checks them
            ctx.tune("reduce_scatter", a[:7], b)
            out.append(None)
        except ValueError as e:
            out.append(str(e))
        return out
    finally:
        ctx.close()


def test_bad_tune_arguments(world2):
    for msgs in world2.run(_bad):
        assert all(m and ("gemm_signal tune" in m or m.startswith("matmul_")) for m in msgs), msgs


def test_curve_sizes():
    assert tune_mod.curve_sizes(1) == [1 << 20, 2 << 20]
    assert tune_mod.curve_sizes(128 << 20) == [1 << (20 + i) for i in range(8)]
    assert tune_mod.curve_sizes((128 << 20) + 1)[-1] == 256 << 20


def _tune_config(world, tmp):
    """``SignalConfig(partition="tune")``: the first call of a shape tunes (collective), later
    calls reuse the pick without any collective; results match the reference."""
    from portable_overlap.ops.matmul import MatmulConfig

    with environ(PORTABLE_OVERLAP_TUNING_CACHE=f"{tmp}/rank{world.rank}.json"):
        ctx = GemmSignal(world, config=SignalConfig(matmul=MatmulConfig(**SMALL),
                                                    partition="tune"))
        calls = []
        real = tune_mod.tune_partition

        def counting(*a, **k):
            calls.append(1)
            return real(*a, **k)

        tune_mod.tune_partition = counting
        try:
            errs = []
            for seed in (5, 6, 7):  # the first call tunes, the next two reuse its pick
                a, b = _inputs(world, 40, 24, 16, seed)
                out = torch.full((40, 24), float("nan"), dtype=torch.bfloat16)
                ctx.all_reduce(a, b, out)
                ref = gemm_all_reduce_reference(a, b, world.group).float()
                errs.append(((out.float() - ref).norm() / ref.norm()).item())
            picked = next(iter(ctx._tuned.values())).partition
            return len(calls), max(errs), picked
        finally:
            tune_mod.tune_partition = real
            ctx.close()


def test_partition_tune_tunes_once_per_shape(world2, tmp_path):
    got = world2.run(_tune_config, str(tmp_path))
    assert all(n == 1 and err < 1.5e-2 for n, err, _ in got), got
    assert got[0][2] == got[1][2] and isinstance(got[0][2], tuple)


def test_partition_config_validation():
    with pytest.raises(ValueError, match="'tune'"):
        SignalConfig(partition="fast")
    assert SignalConfig(partition="tune").partition == "tune"
    assert SignalConfig().max_groups == 2


def _tune_k_shard_changes_on_one_rank(world, tmp):
    """A named ``signal_collective`` context with ``partition="tune"``, one rank's K shard
    changing while its peer's stays: the tuned pick was keyed by the whole shape of ``a``, so
    that rank tuned again (collective) alone and waited in the tuner's exchange for ever, its
    peer's call paired with the tuner's collectives."""
    from portable_overlap import MatmulAllReduce, matmul_all_reduce_reference
    from portable_overlap.ops.matmul import MatmulConfig

    with environ(PORTABLE_OVERLAP_TUNING_CACHE=f"{tmp}/rank{world.rank}.json"):
        ctx = MatmulAllReduce(world, 32, 32, transport="signal_collective", timeout_s=20,
                              config=SignalConfig(matmul=MatmulConfig(**SMALL),
                                                  partition="tune"))
        errs = []
        try:
            for i, k0 in enumerate((16, 32, 16)):  # rank 0's K shard; its peers keep 16
                g = torch.Generator().manual_seed(10 * i + world.rank)
                K = k0 if world.rank == 0 else 16
                a, b = torch.randn(32, K, generator=g), torch.randn(K, 16, generator=g)
                y = ctx(a, b)
                ref = matmul_all_reduce_reference(a, b, world.group)
                errs.append(((y - ref).norm() / ref.norm()).item())
        finally:
            ctx.close()
    return errs


def test_partition_tune_with_k_shards_changing_on_one_rank(world2, tmp_path):
    for errs in world2.run(_tune_k_shard_changes_on_one_rank, str(tmp_path), timeout=120):
        assert len(errs) == 3 and max(errs) < 1e-5, errs


def _tune_k_shards_with_shared_cache(world, tmp):
    """Three tunings of one [M, N] into one cache file that every rank shares: K = 16 on every
    rank, K = 32 on every rank (the file then holds a decision of each, which differ: each
    keeps its own measurements), then K shards of 16 and 32. The key held this rank's K only,
    so each rank found the decision of its own uniform K, and the ranks raised a mismatch of
    their caches. Returns the relative error of a call with the third tuning's config."""
    from portable_overlap.ops.matmul import MatmulConfig

    path = f"{tmp}/shared.json"
    ctx = GemmSignal(world, config=SignalConfig(matmul=MatmulConfig(**SMALL)))
    try:
        for ks in ((16, 16), (32, 32), (16, 32)):
            K = ks[world.rank]
            a, b = _inputs(world, 32, 16, K, K)
            cfg = ctx.tune("all_reduce", a, b, cache=TuningCache(path), top_k=1, iters=1)
            world.barrier()  # (every rank's write of the file before the next tuning reads it)
        out = torch.full((32, 16), float("nan"), dtype=torch.bfloat16)
        ctx.all_reduce(a, b, out, config=cfg)
        ref = gemm_all_reduce_reference(a, b, world.group).float()
        return ((out.float() - ref).norm() / ref.norm()).item()
    finally:
        ctx.close()


def test_tune_k_shards_with_a_shared_cache_file(world2, tmp_path):
    """The tuner's cache key holds every rank's K: ranks of K shards share one key."""
    for err in world2.run(_tune_k_shards_with_shared_cache, str(tmp_path), timeout=300):
        assert err < 1.5e-2, err


def _tune_without_a_file(world, tmp):
    """``tune`` given no cache and no PORTABLE_OVERLAP_TUNING_CACHE: decisions stay in the
    process (the second tune of the shape measures nothing) and nothing is written to disk."""
    import os

    from portable_overlap.ops.matmul import MatmulConfig
    from portable_overlap.schedule import tuning

    home = os.path.join(tmp, f"home{world.rank}")
    os.makedirs(home)
    with environ(HOME=home, **{tuning.CACHE_VAR: None}):
        ctx = GemmSignal(world, config=SignalConfig(matmul=MatmulConfig(**SMALL)))
        real = tune_mod.calibrate
        try:
            a, b = _inputs(world, 24, 20, 16, 5)
            cfg = ctx.tune("all_reduce", a, b, top_k=2, iters=1)
            tune_mod.calibrate = lambda *a_, **k_: (_ for _ in ()).throw(AssertionError("measured"))
            again = ctx.tune("all_reduce", a, b, top_k=2, iters=1)
            return cfg.partition == again.partition, os.listdir(home)
        finally:
            tune_mod.calibrate = real
            ctx.close()


def test_tune_without_a_cache_file_keeps_decisions_in_memory(world2, tmp_path):
    for same, home in world2.run(_tune_without_a_file, str(tmp_path), timeout=300):
        assert same and home == []


def test_a_tuning_cache_needs_a_path():
    from portable_overlap.schedule import tuning

    with environ(**{tuning.CACHE_VAR: None}), \
            pytest.raises(ValueError, match="give the file's path"):
        TuningCache()


def _refused_on_one_rank(world, how):
    """Rank 1 passes rows that do not split over the ranks, at a shape's first call (``how``:
    "tune" or "call"): (error type, message, seconds) on this rank. Its peer went into the
    plan's check of the ranks on the world's group and waited there for the process group's
    timeout."""
    import time

    ctx = GemmSignal(world, timeout_s=5)
    t0 = time.monotonic()
    try:
        a, b = _inputs(world, 8, 8, 8, 1)
        if world.rank == 1:
            a = a[:7]
        if how == "tune":
            ctx.tune("reduce_scatter", a, b, iters=1, top_k=1)
        else:
            ctx.reduce_scatter(a, b)
        return "ran", "", time.monotonic() - t0
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    finally:
        ctx.close()


@pytest.mark.parametrize("how", ["tune", "call"])
def test_a_first_call_refused_on_one_rank_raises_on_every_rank(world2, how):
    mine, peer = world2.run(_refused_on_one_rank, how, timeout=120)
    assert peer[0] == "ValueError" and "split evenly" in peer[1], peer
    if how == "tune":  # the ranks compare their checks: the refusal is named on every rank
        assert mine[0] == "RankMismatchError" and "rank 1" in mine[1] and \
            "split evenly" in mine[1], mine
    else:  # the peer's plan check ends at the context's timeout
        assert mine[0] == "PeerTimeoutError" and mine[2] < 60, mine


def _tune_after_close(world):
    """``tune`` of a closed context on one rank: (error type, seconds). Taken for a refused
    input, it went into the ranks' comparison on the world's signal group, which other
    contexts of the world share, and waited there for the peer."""
    import time

    ctx = GemmSignal(world, timeout_s=5)
    ctx.close()
    if world.rank == 0:
        return None
    a, b = _inputs(world, 8, 8, 8, 1)
    t0 = time.monotonic()
    try:
        ctx.tune("all_reduce", a, b, iters=1, top_k=1)
        return "ran", time.monotonic() - t0
    except Exception as e:
        return type(e).__name__, time.monotonic() - t0


def test_tune_of_a_closed_context_raises_before_any_collective(world2):
    kind, seconds = world2.run(_tune_after_close, timeout=60)[1]
    assert kind == "ContextClosedError" and seconds < 2, (kind, seconds)
