"""Fused GEMV + AllReduce on CPU-emulated ranks (the real Triton kernel under the interpreter)
against the torch reference (fp32 product + gloo all_reduce)."""
import dataclasses

import pytest
import torch

from portable_overlap import (ContextBrokenError, GemvAllReduce, GemvConfig, PeerTimeoutError,
                              PortableOverlapError, RowParallelLinear,
                              gemv_all_reduce, gemv_all_reduce_reference)
from portable_overlap.language.host import calls_counted
from portable_overlap.ops.gemv_allreduce.api import KERNEL_TRANSPORTS
from portable_overlap.testing import not_refused_together, outcomes
from portable_overlap.testing.compare import rel_err

# bf16: the interpreter rounds float32 -> bfloat16 toward zero (the GPU rounds to nearest), so
# the output differs from the reference by up to an ulp (~0.4%).
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 1e-5}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _inputs(world, M, N, K, dtype, seed):
    g = torch.Generator().manual_seed(seed * 1000 + world.rank)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    return x, w


def _run_cases(world, cases, config=None, transport="stores"):
    """Each case on a fresh poisoned output; returns (rel error, output bytes) per case."""
    ctx = GemvAllReduce(world, max_n=max(c[1] for c in cases), config=config,
                        transport=transport)
    out = []
    try:
        for i, (M, N, K, dtype) in enumerate(cases):
            x, w = _inputs(world, M, N, K, dtype, seed=i)
            y = torch.full((M, N), float("nan"), dtype=dtype)
            ctx(x, w, out=y)
            assert not torch.isnan(y).any(), "output not fully written"
            ref = gemv_all_reduce_reference(x, w, world.group)
            out.append((rel_err(y, ref), y.view(torch.uint8).clone()))
    finally:
        ctx.close()
    return out


# (M, N, K): N not a multiple of the tile, odd K, M from 1 to 64, tiny and single-column shapes
SHAPES = [(1, 40, 33), (5, 100, 64), (3, 37, 130), (64, 48, 31), (17, 1, 9), (1, 16, 16),
          (2, 129, 257)]


@pytest.mark.parametrize("transport", KERNEL_TRANSPORTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_matches_reference_and_is_identical_on_ranks(world, dtype, transport):
    results = world.run(_run_cases, [(M, N, K, dtype) for M, N, K in SHAPES], None, transport)
    for rank_results in results:
        for (err, _), shape in zip(rank_results, SHAPES):
            assert err < TOL[dtype], f"shape {shape}: rel err {err}"
    for i in range(len(SHAPES)):  # bitwise identical on every rank
        assert all(torch.equal(r[i][1], results[0][i][1]) for r in results), SHAPES[i]


def test_other_tilings_and_several_rounds_per_program(world2):
    # one program (G=1) walking every block, and wide tiles: the persistent loop, ownership
    # rotation and the remote-first order all get exercised
    for cfg in (GemvConfig(block_n=16, block_k=16, num_warps=1, num_stages=1, programs_per_sm=1),
                GemvConfig(block_n=64, block_k=32, num_warps=2, num_stages=2, programs_per_sm=2)):
        results = world2.run(_run_cases, [(3, 150, 70, torch.float32), (1, 33, 48, torch.float32)],
                             config=cfg)
        for rank_results in results:
            assert all(err < 1e-5 for err, _ in rank_results), cfg


def _repeated_calls(world, transport="stores"):
    # epochs advance across calls of changing shapes; nothing is reset in between. The last
    # rank comes late to every other call, so the others run ahead into the next call while it
    # is still reducing (the one-shot form's partials of consecutive calls must not collide)
    import time

    ctx = GemvAllReduce(world, max_n=96, transport=transport)
    worst = 0.0
    try:
        for i in range(12):
            M, N, K = 1 + (7 * i) % 64, 16 + (29 * i) % 80, 8 + 5 * i
            x, w = _inputs(world, M, N, K, torch.float32, seed=100 + i)
            if world.rank == world.world_size - 1 and i % 2:
                time.sleep(0.2)
            y = ctx(x, w)
            worst = max(worst, rel_err(y, gemv_all_reduce_reference(x, w, world.group)))
        epoch = calls_counted(ctx.impl.ctx)  # the fused workspace's descriptor counts calls
    finally:
        ctx.close()
    return worst, epoch


@pytest.mark.parametrize("transport", KERNEL_TRANSPORTS)
def test_back_to_back_calls_with_changing_shapes(world2, transport):
    for worst, epoch in world2.run(_repeated_calls, transport):
        assert worst < 1e-5
        assert epoch == 12  # one epoch per call, kept in the heap


def _bad_inputs(world):
    ctx = GemvAllReduce(world, max_n=64)
    x = torch.randn(4, 32)
    w = torch.randn(64, 32)
    cases = {
        "dtype": (x, w.double()), "mixed": (x.half(), w), "int": (x.int(), w.int()),
        "K": (x, torch.randn(64, 31)), "rank": (x[None], w),
        "M65": (torch.randn(65, 32), w), "N>max": (x, torch.randn(65, 32)),
        "noncontig": (x, torch.randn(32, 64).t()), "noncontig_x": (torch.randn(32, 4).t(), w),
        "device": (x.to("meta"), w),
    }
    msgs = {}
    for name, (a, b) in cases.items():
        try:
            ctx(a, b)
            msgs[name] = None
        except (ValueError, TypeError) as e:
            msgs[name] = str(e)
    try:
        ctx(x, w, out=torch.empty(4, 63))
        msgs["out"] = None
    except ValueError as e:
        msgs["out"] = str(e)
    # the context still works after rejected calls (nothing was launched)
    y = ctx(x, w)
    ok = rel_err(y, gemv_all_reduce_reference(x, w, world.group)) < 1e-5
    ctx.close()
    return msgs, ok


def test_bad_input_raises_clear_errors(world2):
    for msgs, still_works in world2.run(_bad_inputs):
        assert still_works
        for name, msg in msgs.items():
            assert msg is not None, f"{name}: no error"
            assert msg.startswith("gemv_all_reduce"), msg
        assert "dtype" in msgs["dtype"] and "K=31" in msgs["K"] and "0..64" in msgs["M65"]
        assert "contiguous" in msgs["noncontig"] and "device" in msgs["device"]


def _oversized_partials(world):
    """Contexts whose partials would pass 2**31 elements (the kernel's int32 offsets)."""
    msgs = {}
    for transport, max_n in (("stores", 2 ** 24), ("one_shot", 2 ** 23)):
        try:
            GemvAllReduce(world, max_n=max_n, transport=transport).close()
            msgs[transport] = None
        except ValueError as e:
            msgs[transport] = str(e)
    return msgs


def test_partials_past_int32_offsets_are_refused_at_construction(world2):
    """2 ranks x 64 rows x max_n floats (twice for one-shot) reach 2**31: a clear error on
    every rank before anything is allocated, not offsets that wrap in the kernel."""
    for msgs in world2.run(_oversized_partials):
        for transport, msg in msgs.items():
            assert msg is not None and "2**31" in msg and "max_n <" in msg, (transport, msg)


def _disagree_on_shape(world):
    ctx = GemvAllReduce(world, max_n=64, timeout_s=2.0)
    N = 48 if world.rank == 0 else 40
    x, w = _inputs(world, 2, N, 24, torch.float32, seed=7)
    try:
        ctx(x, w)
        return "no error"
    except PortableOverlapError as e:
        err = type(e).__name__, str(e)
    # A mismatch found by the flags leaves the ranks in step (grids of other sizes included:
    # test_ranks_with_other_grids_raise_a_mismatch_at_once): the same disagreement raises
    # again, and agreeing calls work.
    try:
        ctx(x, w)
        second = "no error"
    except ContextBrokenError:
        second = "broken"
    except PortableOverlapError as e:
        second = type(e).__name__
    third = "broken"
    if second != "broken":
        x, w = _inputs(world, 2, 40, 24, torch.float32, seed=8)
        try:
            third = rel_err(ctx(x, w), gemv_all_reduce_reference(x, w, world.group)) < 1e-5
        except ContextBrokenError:
            pass
    ctx.close()
    return err, second, third


def test_ranks_disagreeing_on_a_shape_raise_on_every_rank(world2):
    for (kind, msg), second, third in world2.run(_disagree_on_shape, timeout=120):
        assert kind == "RankMismatchError", msg
        assert "gemv_all_reduce" in msg and "rank" in msg
        assert second == "RankMismatchError"
        assert third is True


def _disagree_on_grid(world, transport):
    """Rank 0 calls with N=64, its peers with N=32: 4 column blocks against 2, so 4 programs
    against 2 (one block each). Rank 0's programs 2 and 3 wait for words no peer writes; the
    peers' program 0 words say why, so every rank raises a mismatch at once, and the context
    stays usable: the same disagreement raises again, and an agreeing call is right."""
    import time

    cfg = GemvConfig(block_n=16, block_k=16, num_warps=1, num_stages=1, programs_per_sm=1)
    ctx = GemvAllReduce(world, max_n=64, transport=transport, timeout_s=30.0, config=cfg)
    N = 64 if world.rank == 0 else 32
    got = []
    try:
        for i in range(2):
            x, w = _inputs(world, 2, N, 24, torch.float32, seed=30 + i)
            t0 = time.monotonic()
            try:
                ctx(x, w)
                ctx.synchronize()
                got.append("no error")
            except PortableOverlapError as e:
                got.append((type(e).__name__, time.monotonic() - t0))
        x, w = _inputs(world, 2, 48, 24, torch.float32, seed=40)
        got.append(rel_err(ctx(x, w), gemv_all_reduce_reference(x, w, world.group)))
        return got
    finally:
        ctx.close()


@pytest.mark.parametrize("transport", KERNEL_TRANSPORTS)
def test_ranks_with_other_grids_raise_a_mismatch_at_once(world2, transport):
    for got in world2.run(_disagree_on_grid, transport, timeout=240):
        for kind, seconds in got[:2]:
            # (well inside the 30 s deadline: the waits stopped at the peer's program 0 word)
            assert kind == "RankMismatchError" and seconds < 20, got
        assert got[2] < TOL[torch.float32], got


def _mismatch_message(world):
    """Rank 0 calls with N=48, rank 1 with N=40; same grid, so the tags catch it."""
    cfg = GemvConfig(block_n=16, block_k=16, num_warps=1, num_stages=1, programs_per_sm=1)
    ctx = GemvAllReduce(world, max_n=64, transport="stores", timeout_s=5.0, config=cfg)
    x, w = _inputs(world, 2, 48 if world.rank == 0 else 40, 24, torch.float32, seed=7)
    try:
        ctx(x, w)
        return "no error"
    except PortableOverlapError as e:
        return type(e).__name__, str(e)
    finally:
        ctx.close()


def test_rank_mismatch_says_who_passed_what(world2):
    """The error names the ranks that disagree and what each passed, once (not one line per
    program, not hash tags)."""
    for rank, (kind, msg) in enumerate(world2.run(_mismatch_message, timeout=120)):
        assert kind == "RankMismatchError", msg
        assert msg.startswith("gemv_all_reduce: ranks 0 and 1 called it with different "), msg
        assert f"(this rank is {rank})" in msg, msg
        assert "rank 0: M=2, N=48, dtype=float32" in msg, msg
        assert "rank 1: M=2, N=40, dtype=float32" in msg, msg
        assert "they differ in: N" in msg, msg
        assert msg.count("rank 1:") == 1 and "0x" not in msg and "program 0" not in msg, msg


def _disagree_on_tiling(world):
    # same shapes, same grid (4 programs), but another column tiling on rank 0: the blocks would
    # be mixed up; the tag in the flags catches it
    ctx = GemvAllReduce(world, max_n=128, timeout_s=2.0)
    bn = 16 if world.rank == 0 else 32
    cfg = GemvConfig(block_n=bn, block_k=16, num_warps=1, num_stages=1, programs_per_sm=1)
    x, w = _inputs(world, 2, 128, 24, torch.float32, seed=9)
    try:
        ctx(x, w, config=cfg)
        result = "no error"
    except PortableOverlapError as e:
        result = type(e).__name__
    ctx.close()
    return result


def test_ranks_disagreeing_on_the_tiling_are_caught(world2):
    assert world2.run(_disagree_on_tiling, timeout=120) == ["RankMismatchError"] * 2


def _skip_one_call(world, skipper, transport="stores"):
    ctx = GemvAllReduce(world, max_n=64, timeout_s=1.0, transport=transport)
    x, w = _inputs(world, 3, 40, 20, torch.float32, seed=3)
    result = "ok"
    if world.rank != skipper:
        try:
            ctx(x, w)
            result = "no error"
        except PeerTimeoutError as e:
            result = str(e)
    ctx.close()
    return result


@pytest.mark.parametrize("transport", KERNEL_TRANSPORTS)
def test_a_rank_that_skips_a_call_is_named_and_nobody_hangs(world, transport):
    skipper = world.size - 1
    results = world.run(_skip_one_call, skipper, transport, timeout=120)
    for rank, msg in enumerate(results):
        if rank == skipper:
            continue
        assert f"rank {skipper}" in msg and "timed out" in msg and "partials-ready" in msg, msg
        assert f"rank {rank} program" in msg


def _refused_then_a_peer_that_never_came(world, transport):
    """Rank 0 refuses a call (a bad ``out``) that rank 1 never makes, then makes a good call:
    before it, rank 0 waits for rank 1's call counter to count the refused call (rank 1's
    late partials of it would land in this call's buffers), which it never does."""
    ctx = GemvAllReduce(world, max_n=64, timeout_s=1.0, transport=transport)
    x, w = _inputs(world, 2, 40, 16, torch.float32, seed=23)
    found = []
    if world.rank == 0:
        for out in (torch.empty(1, 1), None):
            try:
                ctx(x, w, out=out)
                ctx.synchronize()
                found.append("no error")
            except PortableOverlapError as e:
                found.append(str(e))
            except ValueError as e:
                found.append(type(e).__name__)
    ctx.close()
    return found


@pytest.mark.parametrize("transport", KERNEL_TRANSPORTS)
def test_a_refusing_rank_waits_for_its_peers_call_counters(world2, transport):
    refused, waited = world2.run(_refused_then_a_peer_that_never_came, transport,
                                 timeout=120)[0]
    assert refused == "ValueError", refused
    assert "timed out" in waited and "rank 1" in waited and "call-counter" in waited, waited


def _late_rank(world):
    # rank 1 arrives after rank 0 gave up: rank 0 reports the timeout, and rank 1, which does
    # get rank 0's partials, must not take the never-written broadcast for results
    import time

    ctx = GemvAllReduce(world, max_n=64, timeout_s=0.3)
    x, w = _inputs(world, 2, 40, 16, torch.float32, seed=21)
    if world.rank == 1:
        time.sleep(6.0)
    try:
        ctx(x, w)
        result = "no error"
    except PortableOverlapError as e:
        result = str(e)
    ctx.close()
    return result


def test_a_late_rank_gets_an_error_not_garbage(world2):
    r0, r1 = world2.run(_late_rank, timeout=120)
    assert "timed out" in r0, r0
    assert "gave up" in r1, r1


def _compiled(world):
    ctx = GemvAllReduce(world, max_n=32)
    x, w = _inputs(world, 3, 32, 16, torch.float32, seed=11)

    def f(a):
        return torch.relu(gemv_all_reduce(a * 2, w, ctx)) + 1

    y = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    fake = torch.library.opcheck(torch.ops.portable_overlap.gemv_all_reduce.default,
                                 (x, w, ctx.handle), test_utils=("test_schema", "test_faketensor"))
    ref = torch.relu(gemv_all_reduce_reference(x * 2, w, world.group)) + 1
    ctx.close()
    return rel_err(y, ref), fake


def test_torch_compile_fullgraph_and_fake_impl(world2):
    for err, fake in world2.run(_compiled):
        assert err < 1e-5
        assert all(v == "SUCCESS" for v in fake.values()), fake


def _row_parallel(world, rows):
    torch.manual_seed(0)  # the same full weight on every rank; each keeps its K-slice
    full_w = torch.randn(48, 64)
    lin = RowParallelLinear(64, 48, world, bias=True, dtype=torch.float32)
    k = 64 // world.world_size
    with torch.no_grad():
        lin.weight.copy_(full_w[:, world.rank * k:(world.rank + 1) * k])
        lin.bias.copy_(torch.arange(48.0))
    x_full = torch.randn(rows, 64)
    y = lin(x_full[:, world.rank * k:(world.rank + 1) * k].reshape(1, rows, k))
    ref = x_full.double() @ full_w.double().T + torch.arange(48.0).double()
    lin.ctx.close()
    return rel_err(y.reshape(rows, 48), ref)


@pytest.mark.parametrize("rows", [5, 70], ids=["fused", "fallback"])
def test_row_parallel_linear(world, rows):
    assert all(err < 1e-5 for err in world.run(_row_parallel, rows))


def _solo(world):
    # every rank alone in its own group: no peers, the kernel is a plain GEMV
    import torch.distributed as dist

    from portable_overlap import World

    groups = [dist.new_group([r]) for r in range(world.world_size)]
    solo = World.from_process_group(group=groups[world.rank], backend="cpu")
    ctx = GemvAllReduce(solo, max_n=50)
    x, w = _inputs(world, 4, 50, 21, torch.float32, seed=13)
    y = ctx(x, w)
    ctx.close()
    return solo.world_size, rel_err(y, x.double() @ w.double().T)


def test_world_of_one_rank_is_a_plain_gemv(world2):
    for size, err in world2.run(_solo):
        assert size == 1 and err < 1e-6


def _pattern_transports(world):
    """The pattern's other transports: "sequential" (torch.mm + the group's all_reduce) and
    "auto" (each candidate timed at a shape's first call, the pick kept for later calls)."""
    out = {}
    seq = GemvAllReduce(world, max_n=64, transport="sequential")
    auto = GemvAllReduce(world, max_n=64, transport="auto", iters=2, warmup=1)
    try:
        for i, (M, N, K) in enumerate(((3, 40, 33), (1, 64, 16), (3, 40, 33))):
            x, w = _inputs(world, M, N, K, torch.float32, seed=50 + i)
            ref = gemv_all_reduce_reference(x, w, world.group)
            y = torch.full((M, N), float("nan"))
            out[f"sequential {i}"] = rel_err(seq(x, w, out=y), ref)
            out[f"auto {i}"] = rel_err(auto(x, w), ref)
            out[f"auto choice {i}"] = auto.choice(x, w)
        for dt in (torch.bfloat16, torch.float16):  # the product and its sum in the input dtype
            x, w = _inputs(world, 5, 48, 40, dt, seed=70)
            out[f"sequential {dt}"] = (rel_err(seq(x, w), gemv_all_reduce_reference(
                x, w, world.group)), TOL[dt])
        # a per-call launch configuration runs on the fused transports only
        x, w = _inputs(world, 2, 40, 24, torch.float32, seed=60)
        cfg = GemvConfig(block_n=16, block_k=16, num_warps=1, num_stages=1, programs_per_sm=1)
        out["auto with config"] = rel_err(auto(x, w, config=cfg),
                                          gemv_all_reduce_reference(x, w, world.group))
        out["auto with config choice"] = auto.choice(x, w, config=cfg)
        out["decisions"] = len(auto.decisions)
        try:
            seq(x, w, config=cfg)
            out["sequential with config"] = "no error"
        except ValueError as e:
            out["sequential with config"] = str(e)
    finally:
        seq.close()
        auto.close()
    return out


def test_sequential_and_auto_transports(world):
    for found in world.run(_pattern_transports, timeout=300):
        for key, v in found.items():
            if key.startswith(("sequential ", "auto ")) and isinstance(v, float):
                assert v < 1e-5, (key, v)
            elif isinstance(v, tuple):  # (error, tolerance)
                assert v[0] < v[1], (key, v)
        assert found["auto choice 0"] in GemvAllReduce.TRANSPORTS, found
        assert found["auto choice 2"] == found["auto choice 0"]  # decided once per shape
        assert found["auto with config choice"] in ("stores", "one_shot"), found
        assert found["decisions"] == 3, found
        assert "takes no options" in found["sequential with config"], found


def _grad_on_one_rank(world, transport):
    """Rank 0's x requires grad, rank 1's does not: rank 0 refuses (no backward) and rank 1
    fails the same call at once; before, rank 0 raised alone and rank 1 waited for it until
    its timeout, which broke the context for good."""
    import portable_overlap as po

    r = world.rank
    ctx = GemvAllReduce(world, max_n=16, transport=transport, timeout_s=30.0)
    x, w = _inputs(world, 2, 16, 8, torch.float32, seed=3)
    found = outcomes(ctx, {
        "ctx": lambda: ctx(x.clone().requires_grad_(r == 0), w),
        "function": lambda: po.gemv_all_reduce(x.clone().requires_grad_(r == 0), w, ctx)})
    found["next"] = rel_err(ctx(x, w), gemv_all_reduce_reference(x, w, world.group))
    ctx.close()
    return found


@pytest.mark.parametrize("transport", KERNEL_TRANSPORTS)
def test_a_grad_refusal_on_one_rank_fails_the_call_on_every_rank(world2, transport):
    mine, peer = world2.run(_grad_on_one_rank, transport, timeout=120)
    assert not not_refused_together(mine, peer, ("ctx", "function"), "no backward"), (mine, peer)
    assert mine["next"] < 1e-5 and peer["next"] < 1e-5


def _refusal_then_next_call(world):
    """One-shot: rank 0 refuses call #1 (bad ``out``) and makes call #2 at once; rank 1 makes
    call #1 late, after rank 0's call #2 has set its partials-ready flags (a refused call
    waits for nothing). Rank 1 read that later flag as "call #1 delivered" and returned a sum
    with partials rank 0 never stored, without an error; it must fail call #1 and both ranks
    must agree on call #2."""
    import time

    r = world.rank
    ctx = GemvAllReduce(world, max_n=16, transport="one_shot", timeout_s=20.0)
    g = torch.Generator().manual_seed(r)
    (x1, w1), (x2, w2) = [(torch.randn(2, 8, generator=g), torch.randn(16, 8, generator=g))
                          for _ in range(2)]
    found = {}
    if r == 1:
        time.sleep(1.5)
    try:
        ctx(x1, w1, out=torch.empty(3, 3) if r == 0 else None)
        ctx.synchronize()
        found["call 1"] = "no error"
    except Exception as e:
        found["call 1"] = f"{type(e).__name__}: {e}"
    y = ctx(x2, w2)
    ctx.synchronize()
    ctx.close()
    found["call 2"] = rel_err(y, gemv_all_reduce_reference(x2, w2, world.group))
    return found


def test_one_shot_refusal_is_not_read_as_delivered_by_a_late_peer(world2):
    mine, peer = world2.run(_refusal_then_next_call, timeout=120)
    assert mine["call 1"].startswith("ValueError"), mine
    assert peer["call 1"].startswith("PeerTimeoutError") and "gave up" in peer["call 1"], peer
    assert mine["call 2"] < 1e-5 and peer["call 2"] < 1e-5


def _refusal_overtaken_before_the_read(world, split):
    """One-shot: rank 0 refuses call #1 (bad ``out``) and makes call #2 at once; rank 1 makes
    call #1 and, after its signal, is slow to read the flags (its flag wait sleeps under the
    interpreter), so rank 0's call #2, which waits only for rank 1's signal of call #1, sets
    rank 0's ``ready`` words to call #2 before rank 1 reads them. Read as "call #1 delivered",
    rank 1 would sum partials rank 0 never stored, without an error: it must read the refusal
    (``bcast``) and fail call #1, and both ranks must agree on call #2. Rank 0's wait for its
    peers' call counters before the call after a refusal (``settle_late_stores``) keeps its
    call #2 behind rank 1's call #1 as well: it is left out here, so that the device's own
    guard is what is tested."""
    import time

    from portable_overlap import language as pol

    r = world.rank
    cfg = GemvConfig(block_n=16, block_k=16, num_warps=1, num_stages=1, programs_per_sm=8,
                     split_k=split)
    ctx = GemvAllReduce(world, max_n=16, transport="one_shot", timeout_s=20.0, config=cfg)
    g = torch.Generator().manual_seed(r)
    (x1, w1), (x2, w2) = [(torch.randn(2, 40, generator=g), torch.randn(16, 40, generator=g))
                          for _ in range(2)]
    real_wait = pol.wait_program_peers

    def slow_wait(*args, **kwargs):
        if int(args[4]) == 1:  # (the call)
            time.sleep(2.0)
        return real_wait(*args, **kwargs)

    found = {}
    if r == 1:
        pol.wait_program_peers = slow_wait
    else:
        ctx.impl.settle_late_stores = lambda: None
    try:
        try:
            y = ctx(x1, w1, out=torch.empty(3, 3) if r == 0 else None)
            ctx.synchronize()
            found["call 1"] = rel_err(y, gemv_all_reduce_reference(x1, w1, world.group))
        except Exception as e:
            found["call 1"] = f"{type(e).__name__}: {e}"
        pol.wait_program_peers = real_wait
        y = ctx(x2, w2)
        ctx.synchronize()
        found["call 2"] = rel_err(y, gemv_all_reduce_reference(x2, w2, world.group))
    finally:
        pol.wait_program_peers = real_wait
        ctx.close()
    return found


@pytest.mark.parametrize("split", [1, 2])
def test_one_shot_refusal_overtaken_before_the_read_is_not_read_as_delivered(world2, split):
    mine, peer = world2.run(_refusal_overtaken_before_the_read, split, timeout=120)
    assert mine["call 1"].startswith("ValueError"), mine
    assert isinstance(peer["call 1"], str) and peer["call 1"].startswith("PeerTimeoutError") \
        and "gave up" in peer["call 1"], peer
    assert mine["call 2"] < 1e-5 and peer["call 2"] < 1e-5


def _slow_reader_past_a_refusal(world):
    """One-shot: rank 1 is slow between its flag waits and its sum in call #2 (its ``pol.wait``
    sleeps under the interpreter); meanwhile rank 0 finishes call #2, refuses call #3 (bad
    ``out``) and makes call #4, whose partials go to call #2's half of the buffer. Rank 0's
    refused call waited for nothing, so call #4 overwrote what rank 1 was still summing: rank
    1's call #2 returned a relative error of 0.97, without an error."""
    import time

    from portable_overlap import language as pol

    r = world.rank
    ctx = GemvAllReduce(world, max_n=16, transport="one_shot", timeout_s=20.0)
    ins = [_inputs(world, 2, 16, 8, torch.float32, seed=s) for s in range(4)]
    refs = [gemv_all_reduce_reference(x, w, world.group) for x, w in ins]
    real_wait = pol.wait

    def slow_wait(ctx_, flag, call, peer, tag=-1):
        ok = real_wait(ctx_, flag, call, peer, tag)
        if int(call) == 2:
            time.sleep(1.5)
        return ok

    found = []
    if r == 1:
        pol.wait = slow_wait
    try:
        for i, (x, w) in enumerate(ins):
            try:
                y = ctx(x, w, out=torch.empty(3, 3) if (r == 0 and i == 2) else None)
                ctx.synchronize()
                found.append(rel_err(y, refs[i]))
            except Exception as e:
                found.append(type(e).__name__)
    finally:
        pol.wait = real_wait
        ctx.close()
    return found


def test_one_shot_partials_are_not_overwritten_past_a_refusal(world2):
    mine, peer = world2.run(_slow_reader_past_a_refusal, timeout=120)
    assert mine[2] == "ValueError" and peer[2] == "PeerTimeoutError", (mine, peer)
    for found in (mine, peer):
        assert all(found[i] < 1e-5 for i in (0, 1, 3)), (mine, peer)


def _late_and_refused(world, transport, shapes, late, refused):
    """One call per shape of ``shapes`` (M, N, K) on one context with 16-column blocks and up
    to 4 programs, the scenario of ``testing.faults.late_and_refused`` (a bad ``out`` is the
    refused input)."""
    from portable_overlap.testing.faults import late_and_refused_per_shape

    cfg = GemvConfig(block_n=16, block_k=16, num_warps=1, num_stages=1, programs_per_sm=1)

    def call(ctx, i, shape, bad):
        M, N, K = shape
        x, w = _inputs(world, M, N, K, torch.float32, seed=i)
        out = torch.full((M, N), float("nan"))
        ctx(x, w, out=torch.empty(1, 1) if bad else out)
        return lambda: rel_err(out, gemv_all_reduce_reference(x, w, world.group))

    return late_and_refused_per_shape(
        world, lambda: GemvAllReduce(world, max_n=max(s[1] for s in shapes), config=cfg,
                                     transport=transport, timeout_s=3.0),
        shapes, call, late, refused)


#: per transport, calls whose late partials land in the next call's partials (slots 0 and 1:
#: ranks 0 and 1 store those early in it). Two-shot: rank 3's partials of the failed call
#: (slot 3 of a [4, 1, 64] buffer) are slot 1 of the next call's [4, 2, 64] one, in the blocks
#: ranks 0-2 own. One-shot: the failed call used the first half of the buffer and the next one
#: the second; with [4, 1, 40] partials there, rank 3's late partials of programs 1-3 ([4, 1,
#: 64], slot 3) fall in slot 1 of the next call's half (program 0's partials come before the
#: flag that each call's start waits for: kernel.py).
LATE_SHAPES = {"stores": ((1, 64, 8), (1, 64, 8), (2, 64, 8)),
               "one_shot": ((1, 64, 8), (1, 64, 8), (1, 40, 8))}


@pytest.mark.parametrize("transport", KERNEL_TRANSPORTS)
def test_a_failed_call_leaves_no_late_stores_for_the_next_call(world4, transport):
    """Rank 1 refuses a call that rank 3 makes late: rank 0 fails it at rank 1's flags and
    makes the next call at once, as rank 1 does, both storing their partials into the peers'
    heaps before rank 3 stored its partials of the failed call there, in the places of the
    next call's (``LATE_SHAPES``): every rank must wait for its peers to be done with the
    failed call first."""
    for rank, found in enumerate(world4.run(_late_and_refused, transport,
                                            LATE_SHAPES[transport], (3, 1), (1, (1,)),
                                            timeout=120)):
        assert found[:3] == ["no error", "ValueError" if rank == 1 else "PeerTimeoutError",
                             "no error"], (rank, found)
        assert found[3] < 1e-5, (rank, found)


def _own_k(world, transport):
    """Each rank with a K shard of its own width (``x_r`` [M, K_r], the docstring's contract,
    as a row-parallel weight split unevenly), fresh inputs, poisoned outputs. The fused
    transports' flags used to carry K, so such a call raised RankMismatchError there."""
    ctx = GemvAllReduce(world, max_n=16, transport=transport, timeout_s=30.0)
    errs = []
    try:
        for i, (M, N, K, dtype) in enumerate(((1, 7, 5, torch.float32), (3, 16, 33, torch.bfloat16),
                                              (2, 9, 1, torch.float16))):
            x, w = _inputs(world, M, N, K + 3 * world.rank, dtype, seed=40 + i)
            out = torch.full((M, N), float("nan"), dtype=dtype)
            gemv_all_reduce(x, w, ctx, out)
            ctx.synchronize()
            errs.append(rel_err(out, gemv_all_reduce_reference(x, w, world.group)) / TOL[dtype])
    finally:
        ctx.close()
    return errs


@pytest.mark.parametrize("transport", ["stores", "one_shot", "sequential"])
def test_ranks_may_pass_k_shards_of_their_own_width(world, transport):
    for errs in world.run(_own_k, transport, timeout=120):
        assert all(e < 1 for e in errs), errs


def _empty_k_shard(world, transport, config):
    """Rank 1's K shard is empty (an uneven split of a row-parallel weight that leaves it
    none): it contributes a zero partial, as torch's ``x_r @ w_r.T`` of [M, 0] by [0, N]
    does, on poisoned outputs; then every rank's shard is empty (a zero result); then a
    call with columns everywhere on the same context."""
    ctx = GemvAllReduce(world, max_n=32, transport=transport, timeout_s=30.0,
                        **({"iters": 1, "warmup": 0} if transport == "auto" else {}))
    found = []
    try:
        for i, (M, N, k_of) in enumerate(((3, 20, lambda r: 0 if r == 1 else 5 + r),
                                          (2, 7, lambda r: 0), (4, 32, lambda r: 6))):
            x, w = _inputs(world, M, N, k_of(world.rank), torch.float32, seed=300 + i)
            y = torch.full((M, N), float("nan"))
            kw = {} if config is None else {"config": config}
            gemv_all_reduce(x, w, ctx, y, **kw)
            ctx.synchronize()
            ref = gemv_all_reduce_reference(x, w, world.group)
            found.append("nan" if torch.isnan(y).any()
                         else float((y - ref).abs().max()) if k_of(0) == k_of(1) == 0
                         else rel_err(y, ref))
    except PortableOverlapError as e:
        found.append(f"{type(e).__name__}: {e}")
    except (ValueError, TypeError) as e:
        found.append(f"{type(e).__name__}: {e}")
    finally:
        ctx.close()
    return found


@pytest.mark.parametrize("transport,config", [
    ("stores", None), ("one_shot", None), ("sequential", None), ("auto", None),
    ("one_shot", GemvConfig(block_n=16, block_k=16, num_warps=1, num_stages=1,
                            programs_per_sm=8, split_k=2))],
    ids=["stores", "one_shot", "sequential", "auto", "one_shot-split2"])
def test_a_rank_with_an_empty_k_shard_contributes_a_zero_partial(world2, transport, config):
    """A rank's x_r [M, 0] and w_r [N, 0] (its K shard empty) is a call like any other: its
    partial is zeros, as in torch's math, on every transport; the ranks stay matched (the
    flags' tag holds no K). It used to be refused on that rank alone ("K must be >= 1")."""
    for found in world2.run(_empty_k_shard, transport, config, timeout=300):
        assert len(found) == 3 and all(isinstance(v, float) and v < 1e-5 for v in found), found


def _out_requires_grad(world, transport):
    """Rank 0 passes an ``out`` that requires grad (a leaf the op would write in place, which
    torch refuses: ``mm(out=...)`` raises "functions with out=... arguments don't support
    automatic differentiation"); rank 1 a plain one. Then a good call; then the same ``out``
    under ``torch.no_grad()``, where torch writes it and so does the op."""
    opts = {"iters": 1, "warmup": 0, "candidates": ("sequential",)} if transport == "auto" \
        else {}
    ctx = GemvAllReduce(world, max_n=16, transport=transport, timeout_s=10.0, **opts)
    found = {}
    try:
        x, w = _inputs(world, 2, 16, 8, torch.float32, seed=320)
        found["first"] = rel_err(ctx(x, w), gemv_all_reduce_reference(x, w, world.group))
        out = torch.zeros(2, 16, requires_grad=world.rank == 0)
        try:
            ctx(x, w, out=out)
            found["grad out"] = "no error"
        except (PortableOverlapError, ValueError, TypeError, RuntimeError) as e:
            found["grad out"] = f"{type(e).__name__}: {e}"
        x, w = _inputs(world, 3, 16, 8, torch.float32, seed=321)
        found["then"] = rel_err(ctx(x, w), gemv_all_reduce_reference(x, w, world.group))
        out = torch.full((3, 16), float("nan"), requires_grad=world.rank == 0)
        with torch.no_grad():
            ctx(x, w, out=out)
        found["no_grad"] = rel_err(out.detach(), gemv_all_reduce_reference(x, w, world.group))
    finally:
        ctx.close()
    return found


@pytest.mark.parametrize("transport", ["stores", "one_shot", "auto"])
def test_an_out_that_requires_grad_is_refused_on_every_rank(world2, transport):
    """The fused transports wrote such an ``out`` without a word (a result that carries no
    gradient); ``"auto"``'s decided ``"sequential"`` passed the input checks and raised in
    ``torch.mm`` on that rank only, after the call's agreement, leaving its peer in the
    all-reduce."""
    got = world2.run(_out_requires_grad, transport, timeout=240)
    for rank, found in enumerate(got):
        assert found["first"] < 1e-5 and found["then"] < 1e-5, found
        assert found["no_grad"] < 1e-5, found
        if rank == 0:
            assert found["grad out"].startswith("ValueError") \
                and "requires grad" in found["grad out"], found
        else:
            assert found["grad out"].startswith(("RankMismatchError", "PeerTimeoutError")), found


# -- the one-shot form's K split -----------------------------------------------------------------
def _split_cfg(split, block_n=16, block_k=16):
    # 8 programs per emulated SM: the split's grid (n_blocks x split) must be resident at once
    return GemvConfig(block_n=block_n, block_k=block_k, num_warps=1, num_stages=1,
                      programs_per_sm=8, split_k=split)


#: (M, N, K, split): N not a multiple of the 16-column block, K not a multiple of the 16-wide K
#: step, K shorter than split x 16 (the last slices empty: K 20 in 4 slices of 16 is 16 + 4 +
#: 0 + 0, K 9 in 3 is 9 + 0 + 0), M of 1 and 5, K a multiple of the step in every slice
SPLIT_CASES = [(1, 40, 70, 2), (5, 37, 20, 4), (1, 16, 9, 3), (5, 64, 96, 3), (3, 50, 33, 4)]


def _split_calls(world, dtype, cases):
    """Every case twice back to back on one one-shot context (both halves of its partials),
    fresh inputs each call, outputs poisoned; (rel error / tolerance, output bytes) per call."""
    ctx = GemvAllReduce(world, max_n=64, transport="one_shot", timeout_s=30.0)
    found = []
    try:
        for i, (M, N, K, split) in enumerate(c for c in cases for _ in range(2)):
            x, w = _inputs(world, M, N, K, dtype, seed=200 + i)
            y = torch.full((M, N), float("nan"), dtype=dtype)
            ctx(x, w, out=y, config=_split_cfg(split))
            assert not torch.isnan(y).any(), "output not fully written"
            err = rel_err(y, gemv_all_reduce_reference(x, w, world.group)) / TOL[dtype]
            found.append((err, y.view(torch.uint8).clone()))
    finally:
        ctx.close()
    return found


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_one_shot_k_split_matches_reference_and_is_identical_on_ranks(world, dtype):
    cases = SPLIT_CASES if dtype == torch.float32 else SPLIT_CASES[:3]
    results = world.run(_split_calls, dtype, cases, timeout=600)
    calls = [c for c in cases for _ in range(2)]
    for rank_results in results:
        for (err, _), case in zip(rank_results, calls):
            assert err < 1, (case, err)
    for i, case in enumerate(calls):  # bitwise identical on every rank
        assert all(torch.equal(r[i][1], results[0][i][1]) for r in results), case


def _split_context_config(world):
    """A split given as the context's config (every call), mixed with calls of another split
    and of none, changing shapes each call."""
    ctx = GemvAllReduce(world, max_n=48, transport="one_shot", config=_split_cfg(2, 16, 32))
    worst = 0.0
    try:
        for i, (M, N, K, cfg) in enumerate(((2, 48, 100, None), (1, 30, 64, _split_cfg(4)),
                                            (4, 17, 40, None), (1, 48, 7, _split_cfg(1)),
                                            (3, 33, 50, None))):
            x, w = _inputs(world, M, N, K, torch.float32, seed=300 + i)
            y = ctx(x, w, config=cfg)
            worst = max(worst, rel_err(y, gemv_all_reduce_reference(x, w, world.group)))
    finally:
        ctx.close()
    return worst


def test_one_shot_k_split_as_the_context_config_and_mixed_with_other_splits(world2):
    assert all(worst < 1e-5 for worst in world2.run(_split_context_config, timeout=300))


def _split_refusals(world):
    msgs = {}

    def attempt(name, fn):
        try:
            fn()
            msgs[name] = None
        except ValueError as e:
            msgs[name] = str(e)

    for split in (0, 9):
        attempt(f"split {split}", lambda: _split_cfg(split))
    attempt("stores context", lambda: GemvAllReduce(world, max_n=32, transport="stores",
                                                    config=_split_cfg(2)).close())
    stores = GemvAllReduce(world, max_n=32, transport="stores")
    one_shot = GemvAllReduce(world, max_n=32, transport="one_shot")
    try:
        x, w = _inputs(world, 2, 32, 24, torch.float32, seed=5)
        attempt("stores call", lambda: stores(x, w, config=_split_cfg(2)))
        # 64 x 32 floats per rank's slot: M = 64 at N = 32 leaves room for no split
        xb, wb = _inputs(world, 64, 32, 24, torch.float32, seed=6)
        attempt("room", lambda: one_shot(xb, wb, config=_split_cfg(2)))
        # 2 blocks x 4 slices > 4 emulated SMs x 1 program each
        attempt("grid", lambda: one_shot(x, w, config=dataclasses.replace(
            _split_cfg(4), programs_per_sm=1)))
        # both contexts still work after the refused calls
        ref = gemv_all_reduce_reference(x, w, world.group)
        ok = rel_err(stores(x, w), ref) < 1e-5 and rel_err(one_shot(
            x, w, config=_split_cfg(2)), ref) < 1e-5
    finally:
        stores.close()
        one_shot.close()
    return msgs, ok


def test_bad_k_splits_raise_clear_errors(world2):
    for msgs, still_works in world2.run(_split_refusals, timeout=300):
        assert still_works
        for name, msg in msgs.items():
            assert msg is not None and "split_k" in msg, (name, msg)
        assert "1..8" in msgs["split 0"] and "1..8" in msgs["split 9"]
        assert "one_shot" in msgs["stores context"] and "one_shot" in msgs["stores call"]
        assert "partial" in msgs["room"] and "max_n" in msgs["room"], msgs["room"]
        assert "programs" in msgs["grid"], msgs["grid"]


def test_the_rule_splits_k_for_narrow_n_on_the_one_shot_form_only():
    """``pick_config`` on sm_90 with 132 SMs: narrow N (fewer column blocks than 0.6 of the
    SMs) gets a split of 4 on the one-shot form where its grid and partials fit, else 2,
    whatever K; wide N, the two-shot form, fp32, the interpreter and a full partial slot get
    none."""
    from portable_overlap.ops.gemv_allreduce.config import pick_config

    def pick(m, n, k=8192, dtype=torch.bfloat16, arch="sm_90", room=None):
        return pick_config(m, n, k, dtype, arch, 132, 2, 227 * 1024,
                           64 * 8192 if room is None else room)

    for m, n in ((1, 1024), (8, 1024), (32, 1024), (1, 512)):
        picks = {pick(m, n, k) for k in (512, 1000, 4096, 8192, 28672)}
        assert len(picks) == 1, picks  # not by K
        cfg = picks.pop()
        assert cfg.split_k in (2, 4), (m, n, cfg)
        n_blocks = -(-n // cfg.block_n)
        assert 0.9 * 132 <= n_blocks * cfg.split_k <= 132 * cfg.programs_per_sm, (m, n, cfg)
    for m, n in ((1, 8192), (8, 8192), (1, 3584), (32, 4096), (1, 1536)):
        assert pick(m, n).split_k == 1, (m, n)
    assert pick(1, 1024, room=0).split_k == 1  # the two-shot form
    assert pick(1, 1024, dtype=torch.float32).split_k == 1
    assert pick(1, 1024, arch="cpu").split_k == 1
    assert pick(64, 1024, room=64 * 1024).split_k == 1  # no room for a second slice
    assert pick(32, 1024, room=64 * 1024).split_k == 2
    assert pick(1, 1024).split_k == pick(8, 1024).split_k == 4  # 4 where it fits
    # 72 blocks: 4 slices would need 288 programs, past 2 per SM
    assert pick(8, 1152).split_k == 2


def _disagree_on_split(world):
    """Rank 0 splits K in two, rank 1 does not: the same shapes and column blocks, other grids
    and partial layouts. The flags' tag carries the split; neither rank may return a sum."""
    ctx = GemvAllReduce(world, max_n=32, transport="one_shot", timeout_s=2.0)
    x, w = _inputs(world, 2, 32, 40, torch.float32, seed=9)
    try:
        ctx(x, w, config=_split_cfg(2 if world.rank == 0 else 1))
        ctx.synchronize()
        return "no error"
    except PortableOverlapError as e:
        return type(e).__name__
    finally:
        ctx.close()


def test_ranks_disagreeing_on_the_k_split_are_caught(world2):
    assert world2.run(_disagree_on_split, timeout=120) == ["RankMismatchError"] * 2


def _split_on_one_rank_then_agree(world, splits):
    """A per-call split on one rank only (``splits``: rank 0's, its peers'), then the same call
    on every rank. The split rank's reducers waited for peer words of programs past the peer's
    grid, which no one sets: they timed out, so the disagreement broke the context instead of
    failing that call alone."""
    ctx = GemvAllReduce(world, max_n=48, transport="one_shot", timeout_s=5.0)
    got = []
    try:
        for i in range(2):
            x, w = _inputs(world, 2, 40, 64, torch.float32, seed=20 + i)
            split = splits[0] if world.rank == 0 or i == 1 else splits[1]
            try:
                y = ctx(x, w, config=_split_cfg(split))
                got.append(rel_err(y, gemv_all_reduce_reference(x, w, world.group)))
            except PortableOverlapError as e:
                got.append(type(e).__name__)
        return got
    finally:
        ctx.close()


@pytest.mark.parametrize("splits", [(2, 1), (1, 2), (2, 4)])
def test_ranks_disagreeing_on_the_k_split_leave_the_context_usable(world2, splits):
    for got in world2.run(_split_on_one_rank_then_agree, splits, timeout=120):
        assert got[0] == "RankMismatchError" and got[1] < 1e-5, got


def _one_shot_halves(world, split):
    """Two one-shot calls, the second with fewer partials ([8, 16] then [1, 16], or [2, 16] in
    K slices): the second call's partials go to the other half of ``partial`` and leave the
    first call's where they are, where a slower peer may still be reading them. Halves sized
    by each call's own partials put the second call's half inside the first call's partials."""
    cfg = GemvConfig(block_n=16, block_k=32, num_warps=1, num_stages=1, programs_per_sm=1,
                     split_k=split)
    ctx = GemvAllReduce(world, max_n=16, transport="one_shot", config=cfg)
    try:
        errs, impl = [], ctx.impl
        half = impl._half
        impl.partial.fill_(float("nan"))
        for i, (M, K) in enumerate(((8, 40), (1 if split == 1 else 2, 72))):
            x, w = _inputs(world, M, 16, K, torch.float32, seed=70 + i)
            y = torch.full((M, 16), float("nan"))
            ctx(x, w, out=y)
            ctx.synchronize()
            errs.append(rel_err(y, gemv_all_reduce_reference(x, w, world.group)))
            if i == 0:
                first = impl.partial.clone()
        # the half the first call wrote (the other is still NaN) is left as it was
        used = [h for h in (0, 1) if not first[h * half:(h + 1) * half].isnan().all()]
        kept = len(used) == 1 and torch.allclose(
            impl.partial[used[0] * half:][:half], first[used[0] * half:][:half], rtol=0, atol=0,
            equal_nan=True)
        return errs, kept
    finally:
        ctx.close()


@pytest.mark.parametrize("split", [1, 2])
def test_one_shot_calls_of_fewer_partials_keep_the_last_calls_half(world2, split):
    for errs, kept in world2.run(_one_shot_halves, split, timeout=120):
        assert all(e < TOL[torch.float32] for e in errs), errs
        assert kept


def _one_row_w_narrower_than_x(world):
    """x [2, 8] and a one-row w [1, 8], then the same x with w [1, 5] cut from a [1, 8] tensor
    (row stride 8, contiguous: a one-row tensor is whatever its row stride). The fused
    transports' plans were keyed by x's K and w's row stride, not w's own K: the second call
    reused the first's plan, skipped the check, and read 8 columns of the 5-column w (the 3
    past its end) without an error. Then a good call: the ranks stayed in step."""
    g = torch.Generator().manual_seed(world.rank)
    got = {}
    for transport in KERNEL_TRANSPORTS:
        ctx = GemvAllReduce(world, max_n=8, transport=transport)
        x, w = torch.randn(2, 8, generator=g), torch.randn(1, 8, generator=g)
        ctx(x, w)
        try:
            ctx(x, torch.randn(1, 8, generator=g)[:, :5])
            got[transport] = "no error"
        except ValueError as e:
            got[transport] = str(e)
        w = torch.randn(1, 8, generator=g)
        ref = gemv_all_reduce_reference(x, w, world.group)
        got[f"{transport} after"] = rel_err(ctx(x, w), ref)
        ctx.close()
    return got


def test_a_w_narrower_than_x_is_refused_after_a_planned_call(world2):
    for got in world2.run(_one_row_w_narrower_than_x):
        for transport in KERNEL_TRANSPORTS:
            assert "x has K=8 columns but w has K=5" in got[transport], got
            assert got[f"{transport} after"] < TOL[torch.float32], got


def test_a_split_the_device_cannot_hold_falls_to_the_next_smaller(monkeypatch):
    """Where the rule's split of 4 leaves more programs than stay resident, the plan tries 2
    before running unsplit (it went straight to 1)."""
    from types import SimpleNamespace

    from portable_overlap.ops.gemv_allreduce import api

    rule = GemvConfig(block_n=16, block_k=512, num_warps=4, num_stages=3, programs_per_sm=2,
                      split_k=4)
    monkeypatch.setattr(api, "pick_config", lambda *a: rule)
    tried = []

    def plan_with(x, w, out, cfg):  # a device that holds 128 programs: 64 blocks x 2
        tried.append(cfg.split_k)
        return None if 64 * cfg.split_k > 128 else cfg

    facts = SimpleNamespace(sm_count=132, arch="sm_90", shared_per_program=227 * 1024)
    me = SimpleNamespace(world=SimpleNamespace(facts=facts, world_size=2,
                                               device=torch.device("cpu")),
                         transport="one_shot", max_n=1024, _plan_with=plan_with)
    x, w = torch.randn(1, 64), torch.randn(1024, 64)
    plan = api.GemvAllReduceKernel._plan(me, x, w, None, None)
    assert tried == [4, 2] and plan.split_k == 2, tried


@pytest.mark.parametrize("bad", [dict(num_warps=True), dict(num_stages=1.5),
                                 dict(programs_per_sm=True), dict(split_k=True),
                                 dict(block_n=64.0)])
def test_a_config_field_that_is_no_int_is_refused(bad):
    """True passed every check as 1, and 1.5 the ranges of num_stages and programs_per_sm."""
    with pytest.raises(ValueError, match="GemvConfig: every field must be an int"):
        GemvConfig(**bad)


def test_a_config_of_numpy_ints_is_the_config_of_those_ints():
    """NumPy ints (a sweep's values) are taken in every field, split_k too (it was refused),
    and kept as Python ints: the config equals, hashes and prints as the one of ints."""
    import numpy as np

    fields = dict(block_n=32, block_k=64, num_warps=2, num_stages=3, programs_per_sm=1,
                  split_k=2)
    c = GemvConfig(**{k: np.int64(v) for k, v in fields.items()})
    assert c == GemvConfig(**fields) and repr(c) == repr(GemvConfig(**fields))
    assert all(type(v) is int for v in dataclasses.astuple(c))


def _config_of_another_type(world):
    """A ``config`` that is no GemvConfig (a name, a dict of its fields), per call on rank 1
    only and to the context on every rank: a TypeError naming GemvConfig, where it was an
    AttributeError ("'str' object has no attribute 'split_k'") or "unhashable type:
    'dict'"; the per-call one a refusal its peer hears of, the context usable after."""
    found = {}
    for transport in KERNEL_TRANSPORTS:
        for bad in ("fast", {"block_n": 16}):
            try:
                GemvAllReduce(world, max_n=16, transport=transport, config=bad).close()
                found[f"{transport} context {bad}"] = "no error"
            except (TypeError, ValueError, AttributeError) as e:
                found[f"{transport} context {bad}"] = f"{type(e).__name__}: {e}"
        ctx = GemvAllReduce(world, max_n=16, transport=transport, timeout_s=10.0)
        try:
            for i, bad in enumerate(("fast", {"block_n": 16})):
                x, w = _inputs(world, 2, 16, 8, torch.float32, seed=330 + i)
                try:
                    ctx(x, w, config=bad if world.rank == 1 else None)
                    found[f"{transport} call {bad}"] = "no error"
                except (PortableOverlapError, TypeError, ValueError, AttributeError) as e:
                    found[f"{transport} call {bad}"] = f"{type(e).__name__}: {e}"
            x, w = _inputs(world, 3, 16, 8, torch.float32, seed=339)
            found[f"{transport} then"] = rel_err(ctx(x, w), gemv_all_reduce_reference(
                x, w, world.group))
        finally:
            ctx.close()
    return found


def test_a_config_that_is_no_gemv_config_is_refused_naming_the_type(world2):
    for rank, found in enumerate(world2.run(_config_of_another_type, timeout=240)):
        for case, v in found.items():
            if case.endswith("then"):
                assert v < 1e-5, (case, v)
            elif " context " in case or rank == 1:
                assert v.startswith("TypeError") and "GemvConfig" in v, (case, v)
            else:
                assert "gave up" in v, (case, v)


def _config_none_everywhere(world):
    """``config=None`` (no configuration: what a caller passing ``config=cfg`` with no cfg
    gives) to the context and to each call, on every transport: the fused ones and
    ``"auto"`` take it as not given; ``"sequential"`` refused it as an option it does not
    take ("takes no options; got ['config']"), at construction and per call."""
    found = {}
    for transport in ("stores", "one_shot", "sequential"):
        try:
            ctx = GemvAllReduce(world, max_n=16, transport=transport, config=None)
        except ValueError as e:
            found[transport] = f"ValueError: {e}"
            continue
        try:
            x, w = _inputs(world, 2, 16, 8, torch.float32, seed=340)
            found[transport] = rel_err(gemv_all_reduce(x, w, ctx, config=None),
                                       gemv_all_reduce_reference(x, w, world.group))
        except ValueError as e:
            found[transport] = f"ValueError: {e}"
        finally:
            ctx.close()
    return found


def test_config_none_is_no_option_on_every_transport(world2):
    for found in world2.run(_config_none_everywhere, timeout=240):
        assert all(isinstance(v, float) and v < 1e-5 for v in found.values()), found
