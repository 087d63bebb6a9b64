"""GEMM + ReduceScatter with wave-group counters gating copy-engine transfers
(ops/gemm_signal/copy_engine.py) on CPU-emulated ranks, against torch.matmul + the plain
reduce_scatter: dtypes, odd shapes, every kind of partition, bias and residual, calls back to
back on one context (the consumed flags), shapes changing, and bad input."""
import pytest
import torch

from portable_overlap.ops.gemm_signal import SignalConfig, gemm_reduce_scatter_reference
from portable_overlap import MatmulReduceScatter
from portable_overlap.ops.gemm_signal.copy_engine import GemmReduceScatterCE
from portable_overlap.ops.matmul import MatmulConfig

SMALL = MatmulConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1)
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _cases(world, cases):
    """cases: (dtype, M, N, K, partition or None, epilogue); returns the relative errors."""
    W = world.world_size
    ctx = GemmReduceScatterCE(world, GemmReduceScatterCE.elems_needed(96, 64, W, 16, 16),
                              config=SignalConfig(matmul=SMALL, max_groups=8))
    errs = []
    try:
        for i, (dtype, M, N, K, part, epi) in enumerate(cases):
            g = torch.Generator().manual_seed(100 * i + world.rank)
            a = torch.randn(M, K, generator=g).to(dtype)
            b = torch.randn(K, N, generator=g).to(dtype)
            rows = M // W
            bias = torch.randn(N, generator=g).to(dtype) if epi else None
            res = torch.randn(rows, N, generator=g).to(dtype) if epi else None
            out = torch.full((rows, N), float("nan"), dtype=dtype)
            cfg = SignalConfig(matmul=SMALL, partition=part) if part else None
            ctx.reduce_scatter(a, b, out, bias=bias, residual=res, config=cfg)
            ref = gemm_reduce_scatter_reference(a, b, world.group).double()
            if epi:
                ref = ref + bias.double() + res.double()
            errs.append(((out.double() - ref).norm() / ref.norm()).item())
        ctx.synchronize()
        return errs
    finally:
        ctx.close()


def _n_tiles(M, N, W):
    return W * -(-(M // W) // 16) * -(-N // 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_reference(world, dtype):
    cases = [(dtype, 64, 48, 40, None, False), (dtype, 96, 37, 23, None, True),
             (dtype, 32, 64, 16, None, False)]
    for errs in world.run(_cases, cases):
        assert all(e < TOL[dtype] for e in errs), errs


def _partition_cases(world):
    W = world.world_size
    n = _n_tiles(64, 48, W)  # 4*3 tiles per rank's block
    parts = [(n,), (W,) * (n // W), (n - 2 * W, W, W), (W, n - W)]
    return _cases(world, [(torch.float32, 64, 48, 40, p, False) for p in parts]
                  + [(torch.float32, 64, 48, 40, None, True)] * 3)  # back to back


def test_every_partition_and_back_to_back(world):
    for errs in world.run(_partition_cases):
        assert len(errs) == 7 and all(e < 1e-5 for e in errs), errs


def _bad(world):
    W = world.world_size
    msgs = []
    for make in (lambda: GemmReduceScatterCE(world, 0),
                 lambda: GemmReduceScatterCE(world, 10, config=SignalConfig(partition="tune"))):
        try:
            make()
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    ctx = GemmReduceScatterCE(world, GemmReduceScatterCE.elems_needed(32, 32, W, 16, 16),
                              config=SignalConfig(matmul=SMALL))
    try:
        a, b = torch.randn(32, 8), torch.randn(8, 32)
        staged = ctx.sig.stage_raw.numel()
        for call in (lambda: ctx.reduce_scatter(a[:W * 8 + 1], b),  # M % W
                     lambda: ctx.reduce_scatter(torch.randn(64, 8), torch.randn(8, 64)),  # room
                     lambda: ctx.reduce_scatter(a, b, bias=torch.randn(31)),
                     lambda: ctx.reduce_scatter(a, b, config=SignalConfig(partition="tune")),
                     lambda: ctx.reduce_scatter(a, b.double())):
            try:
                call()
                msgs.append(None)
            except (ValueError, TypeError) as e:
                msgs.append(str(e))
        # a refused call leaves no staging grown for it
        kept = ctx.sig.stage_raw.numel() == staged
        # the context still works after refused calls
        out = ctx.reduce_scatter(a, b)
        ref = gemm_reduce_scatter_reference(a, b, world.group)
        ok = torch.allclose(out, ref, rtol=1e-5, atol=1e-4) and kept
        return msgs, ok
    finally:
        ctx.close()


def test_bad_input(world2):
    for msgs, ok in world2.run(_bad):
        assert all(msgs) and ok, msgs
        assert "max_elems" in msgs[0] and "tune" in msgs[1] and "split evenly" in msgs[2]
        assert "receive room" in msgs[3] and "bias" in msgs[4] and "tune" in msgs[5]


def _uneven_k(world):
    """Each rank's K shard its own width: rel. errors of two calls."""
    W = world.world_size
    ctx = GemmReduceScatterCE(world, GemmReduceScatterCE.elems_needed(32, 40, W, 16, 16),
                              config=SignalConfig(matmul=SMALL))
    errs = []
    try:
        for i in range(2):
            g = torch.Generator().manual_seed(31 * i + world.rank)
            K = 16 + 8 * world.rank
            a, b = torch.randn(32, K, generator=g), torch.randn(K, 40, generator=g)
            out = ctx.reduce_scatter(a, b)
            ref = gemm_reduce_scatter_reference(a, b, world.group).double()
            errs.append(((out.double() - ref).norm() / ref.norm()).item())
        return errs
    finally:
        ctx.close()


def test_k_shards_of_different_widths(world2):
    """The flags' tags hold M, N, dtype and the groups, not K: uneven K shards run (they were
    refused as a mismatch)."""
    for errs in world2.run(_uneven_k):
        assert len(errs) == 2 and all(e < 1e-5 for e in errs), errs


def _tilings_differ(world):
    """Named ``signal_copy_engine``: two configs whose tiles differ only in their order
    (``group_m`` 2 and 1: the same counts, the same tags without the tiling), each planned on
    every rank, then a call with one on rank 0 and the other on rank 1 (both keys planned: no
    agreement), then a matched call. Returns each call's relative error or error name."""
    W = world.world_size

    def config(group_m):
        return SignalConfig(matmul=MatmulConfig(block_m=16, block_n=16, block_k=16,
                                                group_m=group_m, num_warps=1, num_stages=1))

    ctx = MatmulReduceScatter(world, 64, 32, transport="signal_copy_engine", timeout_s=10)
    got = []
    try:
        for i, (mine, peer) in enumerate(((2, 2), (1, 1), (2, 1), (2, 2))):
            g = torch.Generator().manual_seed(10 * i + world.rank)
            a, b = torch.randn(64, 8, generator=g), torch.randn(8, 32, generator=g)
            try:
                y = ctx(a, b, out=torch.full((64 // W, 32), float("nan")),
                        config=config(peer if world.rank == 1 else mine))
            except Exception as e:
                got.append(type(e).__name__)
                continue
            ref = gemm_reduce_scatter_reference(a, b, world.group).double()
            got.append(((y.double() - ref).norm() / ref.norm()).item())
        return got
    finally:
        ctx.close()


def test_tilings_that_differ_across_ranks_raise(world2):
    """The flags' tag holds the tiling: ranks whose calls ran plans of other tilings with equal
    tile counts summed mismatched tiles without an error (relative errors 0.73)."""
    for got in world2.run(_tilings_differ, timeout=120):
        assert got[2] == "RankMismatchError", got
        assert all(not isinstance(e, str) and e < 1e-5 for e in got[:2] + got[3:]), got


def _library_op(world):
    ctx = MatmulReduceScatter(world, 32, 32, transport="signal_copy_engine",
                              config=SignalConfig(matmul=SMALL))
    try:
        g = torch.Generator().manual_seed(7 + world.rank)
        a, b = torch.randn(32, 24, generator=g), torch.randn(24, 32, generator=g)
        bias = torch.randn(32, generator=g)
        got = torch.ops.portable_overlap.matmul_reduce_scatter(a, b, ctx.handle, bias, None)
        ref = gemm_reduce_scatter_reference(a, b, world.group) + bias
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as mode:
            fa, fb = mode.from_tensor(a), mode.from_tensor(b)
            fake = torch.ops.portable_overlap.matmul_reduce_scatter(fa, fb, ctx.handle)
        return torch.allclose(got, ref, rtol=1e-5, atol=1e-4), tuple(fake.shape)
    finally:
        ctx.close()


def test_library_op_and_fake(world2):
    for ok, shape in world2.run(_library_op):
        assert ok and shape == (16, 32)


def _late_and_refused(world, shapes, late, refused):
    """One call per shape of ``shapes`` (M, N, K) on one context, the scenario of
    ``testing.faults.late_and_refused`` (a bad ``out`` is the refused input), the late call's
    copies into the refusing rank landing last (``testing.faults.copies_last``). The
    next call's waits end 2 s or more after it began: a timeout of 10 s keeps a loaded machine
    from failing it (a call that fails does so at once, whatever the timeout)."""
    from portable_overlap.testing.compare import rel_err
    from portable_overlap.testing.faults import late_and_refused_per_shape

    W, r = world.world_size, world.rank

    def call(ctx, i, shape, bad):
        M, N, K = shape
        g = torch.Generator().manual_seed(10 * i + r)
        a, b = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g)
        out = torch.full((M // W, N), float("nan"))
        ctx.reduce_scatter(a, b, torch.empty(1, N) if bad else out)
        return lambda: rel_err(out, gemm_reduce_scatter_reference(a, b, world.group))

    return late_and_refused_per_shape(
        world, lambda: GemmReduceScatterCE(
            world, max(GemmReduceScatterCE.elems_needed(M, N, W, 16, 16) for M, N, _ in shapes),
            config=SignalConfig(matmul=SMALL, max_groups=8), timeout_s=10.0),
        shapes, call, late, refused, links_of=lambda ctx: ctx._links)


def test_a_failed_call_leaves_no_late_stores_for_the_next_call(world4):
    """Rank 1 refuses a call that rank 3 makes late, and rank 3's copies into rank 1 land last
    (``copies_last``: the copy engine may still be moving them when rank 0 is done with the
    call). Both shapes are planned in the calls before (a first plan is a host collective, on
    which no rank would run ahead). Ranks 0 and 2 wait for each of rank 3's groups into them
    before they release the call, but rank 1's refusal frees its receive buffer at once. The
    next call has 3 tiles per rank's block instead of 2, so rank 3's late region of the
    refused call (tiles 6-7 of rank 1's buffer) lies inside rank 2's region of the next call
    (tiles 6-8): every rank that failed the call waits for each peer's word that all its puts
    of it landed (``late_stores_guard``), given only after the side stream's copies (a
    relative error of 0.58 on rank 1 without either)."""
    shapes = ((64, 48, 8), (64, 32, 8), (64, 32, 8), (64, 48, 8))
    for rank, found in enumerate(world4.run(_late_and_refused, shapes, (3, 2), (1, (2,)),
                                            timeout=120)):
        assert found[:4] == ["no error"] * 2 + [
            "ValueError" if rank == 1 else "PeerTimeoutError", "no error"], (rank, found)
        assert found[4] < 1e-5, (rank, found)
