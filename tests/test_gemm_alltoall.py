"""Fused dense GEMM + All-to-All on CPU-emulated ranks against matmul + all_to_all_single."""
import pytest
import torch

from portable_overlap.testing import call_while_peers_skip
from portable_overlap import PeerTimeoutError, PortableOverlapError
from portable_overlap.ops.gemm_alltoall import GemmAllToAll, gemm_all_to_all_reference
from portable_overlap.ops.matmul import MatmulConfig

TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 1e-5}
SMALL = MatmulConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1)


def _cases(world, dtype, shapes, config=None, transport="stores", pieces=4):
    ctx = GemmAllToAll(world, max_elems=max(m * n for m, n, _, _ in shapes), config=config,
                       transport=transport, pieces=pieces)
    errs = []
    try:
        for i, (M, N, K, bt) in enumerate(shapes):
            g = torch.Generator().manual_seed(100 * i + world.rank)
            a = torch.randn(M, K, generator=g).to(dtype)
            b = torch.randn(N, K, generator=g).to(dtype).t() if bt else \
                torch.randn(K, N, generator=g).to(dtype)
            out = torch.full((M, N), float("nan"), dtype=dtype)
            ctx(a, b, out=out)
            assert not torch.isnan(out).any(), f"output not fully written at {(M, N, K)}"
            ref = gemm_all_to_all_reference(a, b, world.group)
            errs.append(((out.double() - ref.double()).norm() / ref.double().norm()).item())
    finally:
        ctx.close()
    return errs


# M splits evenly over 2 and 4 ranks; chunks that are not a multiple of the tile (tiles straddle
# two ranks' chunks), odd N and K, a transposed b, and shapes that change from call to call on
# one context (the receive buffer is reused under a different layout)
SHAPES = [(8, 20, 12, False), (24, 33, 17, True), (4, 5, 40, False), (40, 16, 16, False),
          (12, 50, 9, False)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=lambda d: str(d)[6:])
def test_matches_matmul_plus_all_to_all(world, dtype):
    shapes = [s for s in SHAPES if s[0] % world.size == 0]
    for errs in world.run(_cases, dtype, shapes, SMALL):
        assert all(e < TOL[dtype] for e in errs), errs


def test_default_tiling_and_one_program(world2):
    # the CPU default tiling, then a single program walking every tile
    for errs in world2.run(_cases, torch.float32, [(6, 40, 20, False), (2, 3, 5, True)]):
        assert all(e < 1e-5 for e in errs), errs


# copy-engine transport: pieces that do not divide the chunk, more pieces than rows (empty
# pieces), shape changes between calls on one context, every dtype
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=lambda d: str(d)[6:])
def test_copy_engine_matches_matmul_plus_all_to_all(world, dtype):
    shapes = [s for s in SHAPES if s[0] % world.size == 0] + [(world.size, 7, 5, False)]
    for pieces in (3, 1):
        for errs in world.run(_cases, dtype, shapes, None, "copy_engine", pieces):
            assert all(e < TOL[dtype] for e in errs), (pieces, errs)


def _ce_config(world):
    """A config passed to the copy engines' transport (whose GEMM is torch.matmul) is refused
    on every rank instead of ignored, and the next call is right."""
    import torch.distributed as dist

    ctx = GemmAllToAll(world, max_elems=256, transport="copy_engine", pieces=2)
    g = torch.Generator().manual_seed(world.rank)
    a, b = torch.randn(8, 8, generator=g), torch.randn(8, 16, generator=g)
    try:
        try:
            ctx(a, b, config=SMALL)
            got = "no error"
        except TypeError as e:
            got = str(e)
        out = ctx(a, b)
        ctx.synchronize()
        ref = torch.empty_like(out)
        dist.all_to_all_single(ref, a @ b, group=world.group)
        return got, torch.allclose(out, ref, atol=1e-5)
    finally:
        ctx.close()


def test_copy_engine_refuses_a_config(world2):
    for got, right in world2.run(_ce_config):
        assert "takes no config" in got and right, (got, right)


def _ce_skip(world):
    ctx = GemmAllToAll(world, max_elems=256, transport="copy_engine", pieces=2, timeout_s=1.0)
    r = "ok"
    if world.rank == 0:
        try:
            ctx(torch.randn(8, 8), torch.randn(8, 16))
            ctx.synchronize()
            r = "no error"
        except PeerTimeoutError as e:
            r = str(e)
    ctx.close()
    return r


def test_copy_engine_peer_that_skips_a_call_is_named(world2):
    msg = world2.run(_ce_skip, timeout=120)[0]
    assert "rank 1" in msg and "piece-ready" in msg, msg


def _bad(world):
    ctx = GemmAllToAll(world, max_elems=64, config=SMALL)
    msgs = []
    for a, b in [(torch.randn(5, 8), torch.randn(8, 4)),  # M does not split
                 (torch.randn(4, 8), torch.randn(7, 4)),  # K mismatch
                 (torch.randn(4, 8), torch.randn(8, 4).double()),
                 (torch.randn(8, 8), torch.randn(8, 16))]:  # larger than the receive buffer
        try:
            ctx(a, b)
            msgs.append(None)
        except (ValueError, TypeError) as e:
            msgs.append(str(e))
    ctx.close()
    return msgs


def _bad_args(world):
    msgs = []
    for kw in (dict(transport="dma"), dict(transport="copy_engine", pieces=0)):
        try:
            GemmAllToAll(world, max_elems=64, **kw)
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_bad_context_arguments(world2):
    for msgs in world2.run(_bad_args):
        assert "transport" in msgs[0] and "pieces" in msgs[1], msgs


def test_bad_input(world2):
    for msgs in world2.run(_bad):
        assert all(m and m.startswith("matmul_all_to_all") for m in msgs), msgs
        assert "split evenly" in msgs[0] and "max_elems" in msgs[3]


def _mismatch(world):
    ctx = GemmAllToAll(world, max_elems=256, config=SMALL, timeout_s=2.0)
    N = 16 if world.rank == 0 else 32
    try:
        ctx(torch.randn(8, 8), torch.randn(8, N))
        r = "no error"
    except PortableOverlapError as e:
        r = type(e).__name__
    ctx.close()
    return r


def test_ranks_disagreeing_on_n_raise(world2):
    for r in world2.run(_mismatch, timeout=120):
        assert r in ("RankMismatchError", "PeerTimeoutError")


def _skip(world):
    return call_while_peers_skip(
        world, lambda: GemmAllToAll(world, max_elems=256, config=SMALL, timeout_s=1.0),
        lambda ctx: ctx(torch.randn(8, 8), torch.randn(8, 16)))


def test_a_rank_that_skips_a_call_is_named(world2):
    msg = world2.run(_skip, timeout=120)[0]
    assert "rank 1" in msg and "tiles-sent" in msg, msg


def _late_and_refused(world, shapes, late, refused, transport):
    """One call per shape of ``shapes`` (M, N, K) on one context, the scenario of
    ``testing.faults.late_and_refused`` (a bad ``out`` is the refused input)."""
    from portable_overlap.testing.compare import rel_err
    from portable_overlap.testing.faults import late_and_refused_per_shape

    def call(ctx, i, shape, bad):
        M, N, K = shape
        g = torch.Generator().manual_seed(10 * i + world.rank)
        a, b = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g)
        out = torch.full((M, N), float("nan"))
        ctx(a, b, out=torch.empty(1, N) if bad else out)
        return lambda: rel_err(out, gemm_all_to_all_reference(a, b, world.group))

    return late_and_refused_per_shape(
        world, lambda: GemmAllToAll(world, max_elems=max(M * N for M, N, _ in shapes),
                                    config=SMALL, transport=transport, pieces=2, timeout_s=3.0),
        shapes, call, late, refused)


@pytest.mark.parametrize("transport", ["stores", "copy_engine"])
def test_a_failed_call_leaves_no_late_stores_for_the_next_call(world4, transport):
    """Rank 1 refuses a call that rank 3 makes late: rank 0 fails it at rank 1's flags and
    starts the next call, storing its rows into rank 1's receive buffer (rank 1's refusal
    freed it at once) before rank 3 stored its rows of the failed call there. The next call's
    chunks are 4 times longer, so rank 3's late rows (elements 9-11 of the receive buffer)
    land inside rank 0's rows of it: every rank must wait for its peers to be done with the
    failed call first (a relative error of 0.26 on rank 1 without, with stores). With the copy
    engine rank 1 copies rank 0's rows out as they land, which under the interpreter comes
    before rank 3 wakes, so there the test passes without the wait too; on GPUs the late puts
    can land in between."""
    shapes = ((4, 3, 4), (4, 3, 4), (16, 3, 4))
    for rank, found in enumerate(world4.run(_late_and_refused, shapes, (3, 1), (1, (1,)),
                                            transport, timeout=120)):
        assert found[:3] == ["no error", "ValueError" if rank == 1 else "PeerTimeoutError",
                             "no error"], (rank, found)
        assert found[3] < 1e-5, (rank, found)


def _own_warps(world, block_n):
    """Each rank compiles the tiles with warps and stages of its own (as ranks whose operands
    differ in descriptors do); ``block_n`` per rank: the tiling itself."""
    cfg = MatmulConfig(block_m=16, block_n=block_n[world.rank], block_k=16, group_m=2,
                       num_warps=1 + world.rank, num_stages=1 + world.rank)
    try:
        return _cases(world, torch.float32, [(8, 20, 12, False), (24, 33, 17, True)], cfg)
    except PortableOverlapError as e:
        return type(e).__name__


def test_ranks_agree_on_the_tiling_not_the_warps(world2):
    for errs in world2.run(_own_warps, (16, 16)):
        assert all(e < TOL[torch.float32] for e in errs), errs
    for r in world2.run(_own_warps, (16, 32), timeout=120):
        assert r == "RankMismatchError", r


def _own_k(world, transport):
    """Three calls of ``matmul_all_to_all`` on one context, each rank with a K of its own (K is
    local to each rank's GEMM; only the [M, N] products are exchanged): outputs poisoned with
    NaN, relative error against the torch reference, or the error's type."""
    import portable_overlap as po
    from portable_overlap.testing.compare import rel_err

    W, r = world.world_size, world.rank
    ctx = po.MatmulAllToAll(world, 4 * W, 12, transport=transport, timeout_s=20.0)
    found = []
    try:
        # a second shape, then the first one again (its plan reused), K different each time
        for i, (M, N, K) in enumerate(((4 * W, 12, 8 + 5 * r), (2 * W, 9, 13 - 4 * r),
                                       (4 * W, 12, 8 + 5 * r))):
            g = torch.Generator().manual_seed(50 * i + r)
            a, b = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g)
            out = torch.full((M, N), float("nan"))
            try:
                po.matmul_all_to_all(a, b, ctx, out)
                ctx.synchronize()
                found.append(rel_err(out, gemm_all_to_all_reference(a, b, world.group)))
            except PortableOverlapError as e:
                found.append(type(e).__name__)
        # "auto": no candidate failed its timing (a fused one refusing the call is not a pick)
        found += [(d["transport"], d.get("failed")) for d in ctx.decisions.values()
                  if d.get("failed")]
    finally:
        ctx.close()
    return found


@pytest.mark.parametrize("transport", ["sequential", "copy_engine", "stores", "auto"])
def test_each_rank_has_its_own_k(world2, transport):
    """K is each rank's own (a_r [M, K_r] @ b_r [K_r, N]; only the products move): every
    transport and ``"auto"`` accept ranks whose K differs and compute the reference."""
    for found in world2.run(_own_k, transport, timeout=300):
        assert all(isinstance(e, float) and e < 1e-5 for e in found), (transport, found)
