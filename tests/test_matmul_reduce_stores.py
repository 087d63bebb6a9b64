"""GEMM + ReduceScatter / AllReduce over SM stores into the owner's heap (the ``"stores"``
transport, ops/matmul_reduce/kernel.py) on emulated ranks, against the sum of every rank's
product in float64 (rounded where the op rounds)."""
import pytest
import torch
import torch.distributed as dist

import portable_overlap as po
from portable_overlap.testing import (call_while_peers_skip, error_of_one_call,
                                      not_refused_together, outcomes)
from portable_overlap.ops.matmul import MatmulConfig
from portable_overlap.testing.compare import rel_err

# bf16: a 1-ulp difference in one of the 3 elements of the smallest case is 1 % of its norm
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _truth(a, b, group, mode, bias, residual):
    """In float64, rounded where the op rounds: each peer's partial to the input dtype (what
    travels), the all-reduced sum once more before bias and residual (what every rank gets)."""
    c = (a.double() @ b.double()).to(a.dtype).double()
    dist.all_reduce(c, group=group)
    if mode == "reduce_scatter":
        W, r = dist.get_world_size(group), dist.get_rank(group)
        c = c[c.shape[0] // W * r: c.shape[0] // W * (r + 1)]
    else:
        c = c.to(a.dtype).double()
    if bias is not None:
        c = c + bias.double()
    if residual is not None:
        c = c + residual.double()
    return c


def _cases(world, dtype, mode, extra):
    """Every shape twice on one context (the second call waits for the peers to release the
    buffers the first filled), each rank with a K of its own, outputs poisoned."""
    W, r = world.world_size, world.rank
    shapes = _shapes(mode, W)
    make = po.MatmulReduceScatter if mode == "reduce_scatter" else po.MatmulAllReduce
    fn = po.matmul_reduce_scatter if mode == "reduce_scatter" else po.matmul_all_reduce
    ctx = make(world, max(s[0] for s in shapes), max(s[1] for s in shapes), transport="stores")
    found = []
    try:
        for i, (M, N, K) in enumerate(shapes):
            for rep in range(2):
                g = torch.Generator().manual_seed(1000 * i + 10 * rep + r)
                a = torch.randn(M, K + r, generator=g).to(dtype)
                b = torch.randn(K + r, N, generator=g).to(dtype)
                rows = M // W if mode == "reduce_scatter" else M
                bias = torch.randn(N, generator=g).to(dtype) if extra else None
                res = torch.randn(rows, N, generator=g).to(dtype) if extra else None
                out = torch.full((rows, N), float("nan"), dtype=dtype)
                got = fn(a, b, ctx, out, bias=bias, residual=res)
                ctx.synchronize()
                found.append(((M, N, K), got is out,
                              rel_err(out, _truth(a, b, world.group, mode, bias, res))))
    finally:
        ctx.close()
    return found


def _shapes(mode, W):
    # rows per rank on and off the interpreter's 16-row tiles, N and K off every tile; the
    # all-reduce also at M not divisible by W and M < W (ranks with empty blocks)
    shapes = [(16 * W, 16, 16), (2 * W, 7, 3), (5 * W, 33, 20)]
    return shapes + ([(5, 9, 4), (1, 3, 5)] if mode == "all_reduce" else [])


@pytest.mark.parametrize("mode", ["reduce_scatter", "all_reduce"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=lambda d: str(d)[6:])
def test_stores_match_the_sum_of_products(world, dtype, mode):
    extra = dtype != torch.float16  # bias and residual in two of the three dtypes
    for found in world.run(_cases, dtype, mode, extra):
        bad = [f for f in found if not (f[1] and f[2] < TOL[dtype])]
        assert not bad, bad


def _bad(world):
    W = world.world_size
    M, N, K = 4 * W, 8, 6
    msgs = []
    for make, fn in ((po.MatmulReduceScatter, po.matmul_reduce_scatter),
                     (po.MatmulAllReduce, po.matmul_all_reduce)):
        ctx = make(world, M, N, transport="stores")
        a, b = torch.randn(M, K), torch.randn(K, N)
        for call in (lambda: fn(a, torch.randn(K + 1, N), ctx),
                     lambda: fn(a, b.double(), ctx),
                     lambda: fn(torch.randn(2 * M, K), b, ctx),  # more rows than max_m
                     lambda: fn(a, torch.randn(K, N + 1), ctx),  # more columns than max_n
                     lambda: fn(a, b, ctx, torch.empty(1, N)),
                     lambda: fn(a, b, ctx, bias=torch.randn(N + 1)),
                     lambda: fn(a, b, ctx, residual=torch.randn(1, N))):
            try:
                call()
                msgs.append(None)
            except (ValueError, TypeError) as e:
                msgs.append(str(e))
        if make is po.MatmulReduceScatter:  # rows must split evenly over the ranks
            try:
                fn(torch.randn(M - 1, K), b, ctx)
                msgs.append(None)
            except ValueError as e:
                msgs.append(str(e))
        # the refused calls left the ranks in step: a good call still works
        y = fn(a, b, ctx)
        ctx.synchronize()
        want = _truth(a, b, world.group, "reduce_scatter" if make is po.MatmulReduceScatter
                      else "all_reduce", None, None)
        msgs.append(None if rel_err(y, want) < 1e-5 else "wrong after refusals")
        ctx.close()
        try:
            make(world, M, N, transport="stores", config="big")
            msgs.append(None)
        except TypeError as e:
            msgs.append(str(e))
    return msgs


def test_stores_bad_input(world2):
    for msgs in world2.run(_bad):
        good = [m for m in msgs if m is None]
        assert len(good) == 2, msgs  # the good call after the refusals, per pattern
        assert all(m.startswith(("matmul_reduce_scatter", "matmul_all_reduce"))
                   for m in msgs if m is not None), msgs


def _skip(world, mode):
    make = po.MatmulReduceScatter if mode == "reduce_scatter" else po.MatmulAllReduce
    M, N, K = 2 * world.world_size, 8, 4
    return call_while_peers_skip(
        world, lambda: make(world, M, N, transport="stores", timeout_s=1.0),
        lambda ctx: ctx(torch.randn(M, K), torch.randn(K, N)))


@pytest.mark.parametrize("mode", ["reduce_scatter", "all_reduce"])
def test_a_rank_that_skips_a_call_is_named(world2, mode):
    msg = world2.run(_skip, mode, timeout=120)[0]
    assert "rank 1" in msg and "partials-sent" in msg, msg


def _other_n(world):
    N = 8 if world.rank == 0 else 9  # the ranks' tiles would land in the wrong places
    return error_of_one_call(
        lambda: po.MatmulReduceScatter(world, 4, 16, transport="stores", timeout_s=2.0),
        lambda ctx: ctx(torch.randn(4, 3), torch.randn(3, N)))


def test_ranks_called_with_other_shapes_raise(world2):
    for r in world2.run(_other_n, timeout=120):
        assert r in ("RankMismatchError", "PeerTimeoutError"), r


def _grad(world, mode):
    """An input that requires grad on rank 0 only, through the context and the function: rank
    0 refuses (the op has no backward), rank 1 fails the same call at once (not at its
    timeout), and the context serves the next call. Before, the context itself returned a
    result with no gradient without an error."""
    r = world.rank
    make = po.MatmulReduceScatter if mode == "reduce_scatter" else po.MatmulAllReduce
    fn = po.matmul_reduce_scatter if mode == "reduce_scatter" else po.matmul_all_reduce
    ctx = make(world, 8, 8, transport="stores", timeout_s=30.0)
    g = torch.Generator().manual_seed(r)
    a, b = torch.randn(4, 3, generator=g), torch.randn(3, 5, generator=g)
    bias = torch.randn(5, generator=g)
    found = outcomes(ctx, {
        "ctx": lambda: ctx(a.clone().requires_grad_(r == 0), b),
        "function, bias": lambda: fn(a, b, ctx, bias=bias.clone().requires_grad_(r == 0))})
    found["next"] = rel_err(ctx(a, b), _truth(a, b, world.group, mode, None, None))
    ctx.close()
    return found


@pytest.mark.parametrize("mode", ["reduce_scatter", "all_reduce"])
def test_an_input_that_requires_grad_is_refused_on_every_rank(world2, mode):
    mine, peer = world2.run(_grad, mode, timeout=120)
    assert not not_refused_together(mine, peer, ("ctx", "function, bias"), "no backward"), \
        (mine, peer)
    assert mine["next"] < 1e-5 and peer["next"] < 1e-5


def _late_and_refused(world, mode, shapes, late, refused):
    """One call per shape of ``shapes`` (M, N, K) on one context, the scenario of
    ``testing.faults.late_and_refused`` (a bad ``out`` is the refused input)."""
    from portable_overlap.ops.matmul_reduce import (matmul_all_reduce_reference,
                                                    matmul_reduce_scatter_reference)
    from portable_overlap.testing.faults import late_and_refused_per_shape

    W, r = world.world_size, world.rank
    make, ref = ((po.MatmulReduceScatter, matmul_reduce_scatter_reference)
                 if mode == "reduce_scatter" else (po.MatmulAllReduce, matmul_all_reduce_reference))

    def call(ctx, i, shape, bad):
        M, N, K = shape
        g = torch.Generator().manual_seed(10 * i + r)
        a, b = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g)
        out = torch.full((M // W if mode == "reduce_scatter" else M, N), float("nan"))
        ctx(a, b, out=torch.empty(1, N) if bad else out)
        return lambda: rel_err(out, ref(a, b, world.group))

    return late_and_refused_per_shape(
        world, lambda: make(world, max(s[0] for s in shapes), max(s[1] for s in shapes),
                            transport="stores", timeout_s=3.0),
        shapes, call, late, refused)


@pytest.mark.parametrize("mode", ["reduce_scatter", "all_reduce"])
def test_a_failed_call_leaves_no_late_stores_for_the_next_call(world4, mode):
    """Rank 1 refuses a call that rank 3 makes late: the others fail it at rank 1's flags before
    rank 3's partials of it arrived, and rank 3 still stores them. The next call has other
    shapes, so those late partials would land inside its partials: every rank must wait for
    its peers to be done with the failed call first (a relative error of 0.15-0.32 without)."""
    shapes = ((8, 5, 8), (16, 3, 16), (20, 7, 16))
    for rank, found in enumerate(world4.run(_late_and_refused, mode, shapes, (3, 1), (1, (1,)),
                                            timeout=120)):
        assert found[:3] == ["no error", "ValueError" if rank == 1 else "PeerTimeoutError",
                             "no error"], (rank, found)
        assert found[3] < 1e-5, (rank, found)


def _own_warps(world, mode, block_n):
    """Each rank compiles the tiles with warps and stages of its own (as ranks whose operands
    differ in descriptors do); ``block_n`` per rank: the tiling itself."""
    W, r = world.world_size, world.rank
    cfg = MatmulConfig(block_m=16, block_n=block_n[r], block_k=16, group_m=2,
                       num_warps=1 + r, num_stages=1 + r)
    make = po.MatmulReduceScatter if mode == "reduce_scatter" else po.MatmulAllReduce
    try:
        ctx = make(world, 8 * W, 40, transport="stores", config=cfg, timeout_s=5.0)
    except po.PortableOverlapError as e:
        return type(e).__name__
    try:
        g = torch.Generator().manual_seed(r)
        a, b = torch.randn(8 * W, 24 + r, generator=g), torch.randn(24 + r, 40, generator=g)
        return rel_err(ctx(a, b), _truth(a, b, world.group, mode, None, None))
    finally:
        ctx.close()


@pytest.mark.parametrize("mode", ["reduce_scatter", "all_reduce"])
def test_ranks_agree_on_the_tiling_not_the_warps(world2, mode):
    for err in world2.run(_own_warps, mode, (16, 16)):
        assert err < TOL[torch.float32], err
    for r in world2.run(_own_warps, mode, (16, 32), timeout=120):
        assert r == "RankMismatchError", r


def test_tile_parts_keep_every_program_busy_once():
    """The split rule (stores.tile_parts), from the shapes alone: parts that keep W x tiles x
    parts within the programs, at most MAX_PARTS, none for tiles past 64 x 128, and no more
    than the receive buffer holds."""
    from portable_overlap.ops.matmul_reduce.stores import MAX_PARTS, tile_parts

    small, mid = MatmulConfig(64, 128, 64), MatmulConfig(128, 128, 64)
    room = 132 * 64 * 128
    # 2 ranks, 128 x 3584: 28 tiles of 64 x 128 per block, 56 in all -> 2 per tile
    assert tile_parts(2, 128, 3584, small, 132, room) == 2
    # a world of one, 64 x 1024: 8 tiles -> capped
    assert tile_parts(1, 64, 1024, small, 132, room) == MAX_PARTS
    # 4 ranks, 256 x 8192 in 64 x 128 tiles: 4 x 1 x 64 tiles fill the grid
    assert tile_parts(4, 256, 8192, small, 132, room) == 1
    # 128 x 128 tiles and the full tile stay whole
    assert tile_parts(1, 128, 1024, mid, 132, room) == 1
    assert tile_parts(1, 64, 1024, MatmulConfig(), 132, room) == 1
    # a receive buffer with room for 3 ranges of the peers' float32 partials, not 8
    assert tile_parts(1, 64, 1024, small, 132, 3 * 64 * 1024) == 3


def _forced_parts(parts):
    """``stores.tile_parts`` forced to ``parts`` in this rank's process (as where the device
    has many programs for few tiles); returns the rule to put back."""
    from portable_overlap.ops.matmul_reduce import stores

    rule = stores.tile_parts
    stores.tile_parts = lambda *_: parts
    return rule


def _put_back(rule):
    from portable_overlap.ops.matmul_reduce import stores

    stores.tile_parts = rule


def _split(world, dtype, mode, parts):
    """Every tile cut into ``parts`` K ranges, each rank with a K of its own (one with fewer
    K steps than parts: empty ranges), every shape three times (the tiles' counts are left
    zeroed for the next call), bias and residual, outputs poisoned."""
    W, r = world.world_size, world.rank
    rule = _forced_parts(parts)
    # (M, N, K): 16-row blocks of the interpreter's tiles; with 4 programs, tiles x parts <= 4;
    # the all-reduce also at M not divisible by W and M < W (ranks with empty blocks)
    shapes = [(16 * W, 16, 40), (2 * W, 7, 5), (16 * W, 20 if parts == 2 else 9, 33)]
    if mode == "all_reduce":
        shapes += [(5, 9, 20), (1, 3, 5)]
    make = po.MatmulReduceScatter if mode == "reduce_scatter" else po.MatmulAllReduce
    fn = po.matmul_reduce_scatter if mode == "reduce_scatter" else po.matmul_all_reduce
    ctx = make(world, 16 * W, 20, transport="stores")
    found = []
    try:
        for i, (M, N, K) in enumerate(shapes):
            rows = M // W if mode == "reduce_scatter" else M
            for rep in range(3):
                g = torch.Generator().manual_seed(100 * i + 10 * rep + r)
                a = torch.randn(M, K + 3 * r, generator=g).to(dtype)
                b = torch.randn(K + 3 * r, N, generator=g).to(dtype)
                bias = torch.randn(N, generator=g).to(dtype)
                res = torch.randn(rows, N, generator=g).to(dtype)
                out = torch.full((rows, N), float("nan"), dtype=dtype)
                fn(a, b, ctx, out, bias=bias, residual=res)
                ctx.synchronize()
                found.append(((M, N, K), rel_err(out, _truth(a, b, world.group, mode, bias,
                                                             res))))
        split = {p.parts for p in ctx.workspace("stores")._plans.values()}
    finally:
        _put_back(rule)
        ctx.close()
    return found, split


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("mode", ["reduce_scatter", "all_reduce"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=lambda d: str(d)[6:])
def test_split_tiles_match_the_sum_of_products(world, dtype, mode, parts):
    for found, split in world.run(_split, dtype, mode, parts):
        assert split == {parts}, split
        bad = [f for f in found if not f[1] < TOL[dtype]]
        assert not bad, bad


def _split_refused(world, mode):
    """Split tiles in 2 ranges; rank 1 refuses the second call (an ``out`` of another shape),
    so its peers give up on that call in every program, their own tiles' ranges uncomputed.
    The counts must still be whole for the calls after it."""
    W, r = world.world_size, world.rank
    rule = _forced_parts(2)
    make = po.MatmulReduceScatter if mode == "reduce_scatter" else po.MatmulAllReduce
    ctx = make(world, 16 * W, 20, transport="stores", timeout_s=5.0)
    M, N = 16 * W, 20
    rows = M // W if mode == "reduce_scatter" else M
    found = []
    try:
        for i, bad in enumerate((False, r == 1, False, False)):
            g = torch.Generator().manual_seed(10 * i + r)
            a, b = torch.randn(M, 24 + r, generator=g), torch.randn(24 + r, N, generator=g)
            out = torch.full((rows, N), float("nan"))
            try:
                ctx(a, b, out=torch.empty(1, N) if bad else out)
                ctx.synchronize()
                found.append(rel_err(out, _truth(a, b, world.group, mode, None, None)))
            except (ValueError, po.PortableOverlapError) as e:
                found.append(type(e).__name__)
    finally:
        _put_back(rule)
        ctx.close()
    return found


@pytest.mark.parametrize("mode", ["reduce_scatter", "all_reduce"])
def test_a_refused_split_call_leaves_the_counts_whole(world, mode):
    for rank, found in enumerate(world.run(_split_refused, mode, timeout=120)):
        assert isinstance(found[1], str), (rank, found)  # every rank fails the refused call
        assert all(isinstance(e, float) and e < TOL[torch.float32]
                   for e in (found[0], found[2], found[3])), (rank, found)


def _split_attack(world):
    """One ReduceScatter and one AllReduce context, calls alternating between them and between
    split and whole tiles (the rule forced by N: 16 columns whole, an odd N in 3 ranges, an
    even one in 2), K changing at every call and differing across ranks: K = 1 on every rank
    (fewer K steps than ranges), K off the 16-wide K block, one rank with 40 steps where
    another has 2; M of one row per rank, N = 1, M < W and M not divisible by W (AllReduce),
    bias and residual on and off. Fresh inputs, outputs poisoned."""
    from portable_overlap.ops.matmul_reduce import stores

    W, r = world.world_size, world.rank
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    calls = [  # (mode, M, N, K of each rank, dtype, bias, residual)
        ("reduce_scatter", W, 1, [1] * W, f32, True, True),
        ("all_reduce", 1, 1, [1] * W, f32, True, True),
        ("reduce_scatter", 2 * W, 16, [20 + q for q in range(W)], bf16, False, True),
        ("all_reduce", W + 1, 7, [1 + 5 * q for q in range(W)], bf16, True, False),
        ("reduce_scatter", W, 3, [3, 40, 2, 17][:W], f16, False, True),
        ("all_reduce", 2 * W, 16, [33] * W, f16, True, True),
        ("all_reduce", 3, 2, [2, 5, 1, 9][:W], f32, False, False),
        ("reduce_scatter", 2 * W, 5, [17 - q for q in range(W)], f32, True, False),
    ]
    rule = stores.tile_parts
    stores.tile_parts = lambda W_, M, N, *_: 1 if N == 16 else 3 if N % 2 else 2
    ctxs = {mode: make(world, 2 * W, 16, transport="stores", timeout_s=30.0)
            for mode, make in (("reduce_scatter", po.MatmulReduceScatter),
                               ("all_reduce", po.MatmulAllReduce))}
    found = []
    try:
        for i, (mode, M, N, Ks, dtype, has_bias, has_res) in enumerate(calls):
            g = torch.Generator().manual_seed(100 * i + r)
            a = torch.randn(M, Ks[r], generator=g).to(dtype)
            b = torch.randn(Ks[r], N, generator=g).to(dtype)
            rows = M // W if mode == "reduce_scatter" else M
            bias = torch.randn(N, generator=g).to(dtype) if has_bias else None
            res = torch.randn(rows, N, generator=g).to(dtype) if has_res else None
            out = torch.full((rows, N), float("nan"), dtype=dtype)
            fn = po.matmul_reduce_scatter if mode == "reduce_scatter" else po.matmul_all_reduce
            fn(a, b, ctxs[mode], out, bias=bias, residual=res)
            ctxs[mode].synchronize()
            found.append(((mode, M, N, Ks[r], str(dtype)),
                          rel_err(out, _truth(a, b, world.group, mode, bias, res)) / TOL[dtype]))
        parts = {p.parts for c in ctxs.values() for p in c.workspace("stores")._plans.values()}
    finally:
        stores.tile_parts = rule
        for c in ctxs.values():
            c.close()
    return found, parts


def test_split_tiles_under_odd_shapes_and_alternating_calls(world):
    for found, parts in world.run(_split_attack, timeout=300):
        assert parts == {1, 2, 3}, parts
        bad = [f for f in found if not f[1] < 1]
        assert not bad, bad


def _rows_differ(world, mode, rows0):
    """Rank 0 calls with ``rows0`` rows (0: none), its peers with 64 x W: with no rows rank
    0's grid is smaller (one program), so the peers' programs past it wait for flags no
    program of rank 0 sets. The peers' program 0 flags say why, so every rank raises a
    mismatch at once (well inside the 30 s timeout), twice, and the next matched call is
    right: the context stays in step."""
    import time

    W, r = world.world_size, world.rank
    make = po.MatmulReduceScatter if mode == "reduce_scatter" else po.MatmulAllReduce
    cfg = MatmulConfig(block_m=16, block_n=16, block_k=16, group_m=1, num_warps=1,
                       num_stages=1)
    ctx = make(world, 64 * W, 32, transport="stores", config=cfg, timeout_s=30.0)
    got = []
    try:
        for i in range(2):
            g = torch.Generator().manual_seed(10 * i + r)
            M = rows0 if r == 0 else 64 * W
            a, b = torch.randn(M, 8, generator=g), torch.randn(8, 32, generator=g)
            t0 = time.monotonic()
            try:
                ctx(a, b)
                ctx.synchronize()
                got.append("no error")
            except po.PortableOverlapError as e:
                got.append((type(e).__name__, time.monotonic() - t0))
        got.append([p.programs for p in ctx.workspace("stores")._plans.values()])
        g = torch.Generator().manual_seed(99 + r)
        a, b = torch.randn(4 * W, 8, generator=g), torch.randn(8, 32, generator=g)
        got.append(rel_err(ctx(a, b), _truth(a, b, world.group, mode, None, None)))
        return got
    finally:
        ctx.close()


@pytest.mark.parametrize("rows0", [0, 6], ids=["no-rows", "fewer-rows"])
@pytest.mark.parametrize("mode", ["reduce_scatter", "all_reduce"])
def test_ranks_with_other_rows_and_grids_raise_a_mismatch_at_once(world2, mode, rows0):
    found = world2.run(_rows_differ, mode, rows0, timeout=300)
    if rows0 == 0:  # one program against the device's (fewer rows: split tiles fill the grid)
        assert found[0][2][0] < found[1][2][0], found
    for rank, got in enumerate(found):
        for kind, seconds in got[:2]:
            assert kind == "RankMismatchError" and seconds < 20, (rank, got)
        assert got[3] < TOL[torch.float32], (rank, got)
