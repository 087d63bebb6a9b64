"""GEMM + ReduceScatter / AllReduce over copy engines on CPU-emulated ranks, against matmul +
reduce_scatter_tensor / all_reduce."""
import pytest
import torch

from portable_overlap.testing import call_while_peers_skip
from portable_overlap.ops.matmul_reduce import (MatmulAllReduce, MatmulReduce,
                                                MatmulReduceScatter, matmul_all_reduce,
                                                matmul_all_reduce_reference,
                                                matmul_reduce_scatter,
                                                matmul_reduce_scatter_reference)

TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 1e-5}
REF = {"reduce_scatter": matmul_reduce_scatter_reference,
       "all_reduce": matmul_all_reduce_reference}


def _cases(world, dtype, shapes, pieces, put_lanes=1):
    """Both modes on every shape, on one context (shapes change between calls); each rank's K
    shard has its own width (a_q @ b_q need only agree on M and N)."""
    W = world.world_size
    ctx = MatmulReduce(world, max_elems=max(MatmulReduce.elems_needed(M, N, W)
                                            for M, N, _ in shapes), pieces=pieces,
                       put_lanes=put_lanes)
    errs = []
    try:
        for i, (M, N, K) in enumerate(shapes):
            k_r = K + world.rank  # uneven K shards
            g = torch.Generator().manual_seed(100 * i + world.rank)
            a = torch.randn(M, k_r, generator=g).to(dtype)
            b = torch.randn(N, k_r, generator=g).to(dtype).t()  # a transposed weight view
            for mode, ref_fn in REF.items():
                if mode == "reduce_scatter" and M % W:
                    continue
                ref = ref_fn(a, b, world.group)
                out = torch.full(ref.shape, float("nan"), dtype=dtype)
                getattr(ctx, mode)(a, b, out)
                ctx.synchronize()
                assert not torch.isnan(out).any(), (mode, M, N, K)
                errs.append((mode, (M, N, K), ((out.double() - ref.double()).norm()
                                               / ref.double().norm()).item()))
    finally:
        ctx.close()
    return errs


# row blocks that do not split into the pieces (empty pieces), odd M (all_reduce only), odd N, K
SHAPES = [(8, 7, 3), (12, 16, 5), (5, 9, 4), (4, 1, 17), (24, 3, 2)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=lambda d: str(d)[6:])
def test_both_modes_match_the_collectives(world, dtype):
    for errs in world.run(_cases, dtype, SHAPES, 3):
        assert len(errs) >= 2 * len(SHAPES) - 2, errs
        bad = [e for e in errs if not e[2] < TOL[dtype]]
        assert not bad, bad


def test_one_and_many_pieces(world2):
    for pieces in (1, 5):
        for errs in world2.run(_cases, torch.float32, SHAPES[:2], pieces):
            assert all(e[2] < 1e-5 for e in errs), (pieces, errs)


def _functions_and_bad(world):
    W = world.world_size
    ctx = MatmulReduce(world, max_elems=64)
    a, b = torch.randn(4, 6), torch.randn(6, 5)
    rs, ar = MatmulReduceScatter(world, 4, 5), MatmulAllReduce(world, 4, 5)
    errs = [((matmul_reduce_scatter(a, b, rs) - matmul_reduce_scatter_reference(a, b,
             world.group)).norm()).item(),
            ((matmul_all_reduce(a, b, ar) - matmul_all_reduce_reference(a, b,
             world.group)).norm()).item()]
    rs.close()
    ar.close()
    msgs = []
    for mode, args in (("all_reduce", (torch.randn(13, 6), b)),  # more than max_elems
                       ("all_reduce", (a, torch.randn(7, 5))),  # K mismatch
                       ("all_reduce", (a, b.double())),
                       ("reduce_scatter", (torch.randn(2 * W + 1, 6), b)),  # M % W
                       ("all_reduce", (a, b, torch.empty(5, 4))),  # bad out shape
                       ("reduce_scatter", (a, b, torch.empty(5, 4 // W).t()))):
        try:
            getattr(ctx, mode)(*args)
            msgs.append(None)
        except (ValueError, TypeError) as e:
            msgs.append(str(e))
    for kw in ({"pieces": 0}, {"pieces": 129}, {"put_lanes": 0}):
        try:
            MatmulReduce(world, 64, **kw)
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    ctx.close()
    return errs, msgs


def test_functions_and_bad_input(world2):
    for errs, msgs in world2.run(_functions_and_bad):
        assert max(errs) < 1e-4, errs
        assert all(m and m.startswith("matmul_") for m in msgs), msgs


def _skip(world):
    return call_while_peers_skip(
        world, lambda: MatmulReduce(world, max_elems=64, timeout_s=1.0),
        lambda ctx: ctx.reduce_scatter(torch.randn(4, 8), torch.randn(8, 5)))


def test_a_rank_that_skips_a_call_is_named(world2):
    msg = world2.run(_skip, timeout=120)[0]
    assert "rank 1" in msg and "piece-ready" in msg, msg


def _mismatch(world):
    ctx = MatmulReduce(world, max_elems=64, timeout_s=2.0)
    M = 4 if world.rank == 0 else 6  # the ranks disagree on M
    try:
        ctx.all_reduce(torch.randn(M, 3), torch.randn(3, 5))
        ctx.synchronize()
        r = "no error"
    except Exception as e:
        r = f"{type(e).__name__}: {e}"
    ctx.close()
    return r


def test_ranks_called_with_other_shapes_raise(world2):
    for msg in world2.run(_mismatch, timeout=120):
        assert msg.startswith("RankMismatchError: matmul_reduce: ranks 0 and 1 called it"), msg
        assert "rank 0: all_reduce, M=4, N=5" in msg and "rank 1: all_reduce, M=6, N=5" in msg
        assert "they differ in: M" in msg, msg


def _room(world):
    """An all_reduce whose M does not divide by W needs W*ceil(M/W)*N elements, more than M*N:
    a context sized M*N refuses the call on every rank before any launch, with the size to use;
    one sized with elems_needed computes it."""
    W = world.world_size
    M, N = 2 * W + 1, 9
    g = torch.Generator().manual_seed(5 + world.rank)
    a, b = torch.randn(M, 4, generator=g), torch.randn(4, N, generator=g)
    ctx = MatmulReduce(world, max_elems=M * N, timeout_s=2.0)
    try:
        ctx.all_reduce(a, b)
        msg = None
    except ValueError as e:
        msg = str(e)
    ctx.close()
    ctx = MatmulReduce(world, max_elems=MatmulReduce.elems_needed(M, N, W), timeout_s=5.0)
    out = ctx.all_reduce(a, b)
    ctx.synchronize()
    err = ((out - matmul_all_reduce_reference(a, b, world.group)).norm()).item()
    ctx.close()
    return msg, err


def test_receive_room_is_checked(world):
    for msg, err in world.run(_room, timeout=180):
        assert msg and "elems_needed" in msg, msg
        assert err < 1e-4, err


def test_one_put_lane_per_peer(world):
    """W-1 put lanes (one stream per peer; clamped to the peer count, so 1 on 2 ranks)."""
    for errs in world.run(_cases, torch.float32, SHAPES[:3], 2, 8):
        assert all(e[2] < 1e-5 for e in errs), errs


def _late_and_refused(world, mode, shapes, late, refused):
    """One call per shape of ``shapes`` (M, N, K) on one copy-engine context, the scenario of
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
        out = torch.full((M // W if mode == "reduce_scatter" else M, N), float("nan"))
        getattr(ctx, mode)(a, b, out=torch.empty(1, N) if bad else out)
        return lambda: rel_err(out, REF[mode](a, b, world.group))

    return late_and_refused_per_shape(
        world, lambda: MatmulReduce(world, max(MatmulReduce.elems_needed(M, N, W)
                                               for M, N, _ in shapes), pieces=2, timeout_s=10.0),
        shapes, call, late, refused, links_of=lambda ctx: ctx._links)


@pytest.mark.parametrize("mode", ["reduce_scatter", "all_reduce"])
def test_a_failed_call_leaves_no_late_stores_for_the_next_call(world4, mode):
    """Rank 1 refuses a call that rank 3 makes late, and rank 3's copies into rank 1 land last
    (``copies_last``: its copy engine serves that lane after the others, as a GPU's may, one
    copy at a time). Ranks 0 and 2 wait for each of rank 3's pieces into them before they
    release the call, but rank 1's refusal frees its receive buffer at once, so ranks 0 and
    2's partials of the next call land in rank 1's buffer before rank 3's late partials of
    the refused call do, and with these shapes those land inside them (elements 30-39 and
    70-79 against rank 0's 0-13 and 56-76, rank 2's 28-41 and 98-118). Every rank that
    failed the call waits for each peer's word that all its puts of it landed
    (``late_stores_guard``), and a rank gives that word only after every put lane's copies
    (relative errors of 0.39 on rank 1 with reduce_scatter, 0.19 on every rank with
    all_reduce, without either)."""
    shapes = ((8, 5, 8), (16, 5, 16), (20, 7, 16))
    for rank, found in enumerate(world4.run(_late_and_refused, mode, shapes, (3, 1), (1, (1,)),
                                            timeout=120)):
        assert found[:3] == ["no error", "ValueError" if rank == 1 else "PeerTimeoutError",
                             "no error"], (rank, found)
        assert found[3] < 1e-5, (rank, found)
