"""The fake (shape-only) implementation of every torch.library op of the package (``po.SPECS``
and ``ops.registry.PARTS``) against the op itself, on 2 emulated ranks: under
``torch.compile`` the graph is traced with the fake, and a result whose shape, dtype, device,
storage offset or strides differ from the real one is a silent bug (a view, a ``.view()`` or an
out-of-place op downstream planned for a tensor the op never returns).

For every op, every transport that runs on emulated ranks, every dtype it takes (fp32, fp16,
bf16) and odd shapes (1, primes, M not divisible by the world where the op takes it,
transposed operands): the torch op's result on fresh random inputs, then the same call on
``FakeTensorMode`` tensors; the strides of dimensions longer than 1 must agree (torch's own
check ignores the others). A case the real op refuses (a layout it does not take) is fine, as
the fake cannot see the ranks' agreement. Also: a result is the caller's own tensor, not a
context buffer the next call overwrites (it would change under the caller in a compiled
graph)."""
import pytest
import torch

import portable_overlap as po
from portable_overlap.ops.registry import PARTS, SPECS
from portable_overlap.testing.compare import rel_err
from portable_overlap.testing.layouts import laid_out
from portable_overlap.testing.patterns import GEMM_PATTERNS
from portable_overlap.testing.routing import route

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _meta(t: torch.Tensor) -> tuple:
    strides = tuple(s if n > 1 else None for s, n in zip(t.stride(), t.shape))
    return tuple(t.shape), t.dtype, t.device.type, t.storage_offset(), strides


def _fake(op, args):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        return op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])


def _leaves(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes (NaN == NaN: a buffer's unused rows may hold any bits)."""
    return t.reshape(-1).view(torch.uint8) if t.is_floating_point() else t


def _case(name, op, args, again=None) -> tuple:
    """``(name, outcome)``: ``"refused"`` (the real op raised ValueError / TypeError: nothing
    ran on any rank), ``"ok"``, or what differs. ``again``: the arguments of a second real call
    (fresh inputs), after which the first call's results must be unchanged."""
    try:
        real = _leaves(op(*args))
    except (ValueError, TypeError):
        return name, "refused"
    kept = [t.clone() for t in real]
    fake = _leaves(_fake(op, args))
    if len(fake) != len(real):
        return name, f"{len(real)} results, the fake {len(fake)}"
    for i, (r, f) in enumerate(zip(real, fake)):
        if _meta(r) != _meta(f):
            return name, f"result {i}: real {_meta(r)}, fake {_meta(f)}"
    if again is not None:
        op(*again)
        for i, (r, k) in enumerate(zip(real, kept)):
            if not torch.equal(_bits(r), _bits(k)):
                return name, f"result {i} changed at the next call (a context buffer)"
    return name, "ok"


def _over_contexts(world, op, transports, make, cases, name, args) -> list:
    """``_case`` of every case on a context of every transport (``make(transport)``, one
    context at a time): ``name(case)`` names it, ``args(ctx, case, seed)`` makes a call's
    arguments; each case runs twice, with fresh inputs the second time."""
    r = world.rank
    found = []
    for transport in transports:
        ctx = make(transport)
        try:
            for i, case in enumerate(cases):
                found.append(_case(f"{transport} {name(case)}", op, args(ctx, case, 10 * i + r),
                                   args(ctx, case, 10 * i + r + 5)))
                ctx.synchronize()
        finally:
            ctx.close()
    return found


def _gemm_pattern(world, op_name):
    W, r = world.world_size, world.rank
    make, _, rows_of = GEMM_PATTERNS[op_name]
    op = getattr(torch.ops.portable_overlap, op_name).default
    # (M, N, K, dtype, layouts, bias, residual): M one row per rank, primes, a transposed a
    # and a transposed weight (b = weight.t()), a K shard of each rank's own width in the
    # reductions (the all-to-all's ranks share K); the all-reduce also at M not divisible by W
    own_k = r if op_name != "matmul_all_to_all" else 0
    cases = [(W, 1, 1, torch.float32, {}, True, True),
             (3 * W, 7, 5, torch.float16, {"a": "transposed"}, True, False),
             (2 * W, 13, 3 + own_k, torch.bfloat16, {"b": "transposed"}, False, True)]
    if op_name == "matmul_all_reduce":
        cases.append((W + 1, 3, 2, torch.float32, {}, True, True))

    def args(ctx, case, seed):
        M, N, K, dt, how, has_bias, has_res = case
        g = torch.Generator().manual_seed(seed)
        a = laid_out((M, K), how.get("a"), dtype=dt, gen=g)
        b = laid_out((K, N), how.get("b"), dtype=dt, gen=g)
        bias = laid_out((1, N), dtype=dt, gen=g)[0] if has_bias else None
        res = laid_out((rows_of(M, W), N), dtype=dt, gen=g) if has_res else None
        return (a, b, ctx.handle, bias, res)

    return _over_contexts(
        world, op, make.available(world),
        lambda t: make(world, 4 * W, 16, transport=t, timeout_s=30.0), cases,
        lambda c: f"{c[0]}x{c[1]}x{c[2]} {c[3]} {c[4]}", args)


def _all_gather_matmul(world):
    op = torch.ops.portable_overlap.all_gather_matmul.default
    cases = [((1, 1, 1), torch.float32, {}), ((3, 7, 5), torch.float16, {"b": "transposed"}),
             ((2, 13, 3), torch.bfloat16, {"a": "transposed"})]

    def args(ctx, case, seed):
        (m, N, K), dt, how = case
        g = torch.Generator().manual_seed(seed)
        return (laid_out((m, K), how.get("a"), dtype=dt, gen=g),
                laid_out((K, N), how.get("b"), dtype=dt, gen=g), ctx.handle)

    return _over_contexts(
        world, op, po.AllGatherMatmul.available(world),
        lambda t: po.AllGatherMatmul(world, 64, transport=t, timeout_s=30.0), cases,
        lambda c: f"{c[0][0]}x{c[0][1]}x{c[0][2]} {c[1]} {c[2]}", args)


def _gemv_all_reduce(world):
    r = world.rank
    op = torch.ops.portable_overlap.gemv_all_reduce.default
    cases = [((1, 1, 1), torch.float32), ((3, 7, 5 + r), torch.float16),
             ((2, 13, 3), torch.bfloat16)]

    def args(ctx, case, seed):
        (M, N, K), dt = case
        g = torch.Generator().manual_seed(seed)
        return (laid_out((M, K), dtype=dt, gen=g), laid_out((N, K), dtype=dt, gen=g),
                ctx.handle)

    return _over_contexts(
        world, op, po.GemvAllReduce.available(world),
        lambda t: po.GemvAllReduce(world, max_n=16, transport=t, timeout_s=30.0), cases,
        lambda c: f"{c[0][0]}x{c[0][1]}x{c[0][2]} {c[1]}", args)


def _embedding_all_to_all(world):
    W = world.world_size
    op = torch.ops.portable_overlap.embedding_all_to_all.default
    rows, D, B = [7, 5, 3], 5, 3
    cases = [(torch.float32, "sum", True), (torch.float16, "mean", False),
             (torch.bfloat16, "sum", False)]
    splits = [1 + q % 2 for q in range(W)]  # uneven, one sample on some ranks
    return _over_contexts(
        world, op, ("stores", "sequential"),  # ("shmem" needs a SHMEM library)
        lambda t: po.EmbeddingAllToAll(world, rows, D, B, transport=t, timeout_s=30.0), cases,
        lambda c: f"{c[0]} {c[1]} weighted={c[2]}",
        lambda ctx, case, seed: _embedding_args(ctx, case, seed, splits, D))


def _embedding_args(ctx, case, seed, splits, D) -> tuple:
    """The arguments of an ``embedding_all_to_all`` call on ``ctx`` (fresh random inputs)."""
    dt, pooling, weighted = case
    g = torch.Generator().manual_seed(seed)
    n = sum(splits)
    weight = torch.randn(ctx.weight_rows, D, generator=g).to(dt)
    lengths = torch.randint(0, 3, (ctx.n_loc * n,), generator=g)
    idx = [torch.randint(0, ctx.plan.table_rows[t],
                         (int(lengths[j * n:(j + 1) * n].sum()),), generator=g)
           for j, t in enumerate(ctx.local_tables)]
    indices = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64)
    psw = torch.rand(indices.numel(), generator=g).to(dt) if weighted else None
    return (weight, lengths, indices, psw, splits, pooling, ctx.handle)


def _embedding_all_to_all_backward(world):
    W = world.world_size
    op = torch.ops.portable_overlap.embedding_all_to_all_backward.default
    rows, D = [7, 5, 3], 5
    cases = [(torch.float32, "sum", True), (torch.float16, "mean", False),
             (torch.bfloat16, "sum", False)]
    splits = [1 + q % 2 for q in range(W)]

    def args(ctx, case, seed):
        dt, pooling, weighted = case
        weight, lengths, indices, psw, _, _, _ = _embedding_args(ctx, case, seed, splits, D)
        g = torch.Generator().manual_seed(seed + 1)
        grad = torch.randn(ctx.output_shape(splits), generator=g).to(dt)
        return (grad, weight, lengths, indices, psw, splits, pooling, weighted, ctx.handle)

    return _over_contexts(
        world, op, ("stores", "sequential"),
        lambda t: po.EmbeddingAllToAll(world, rows, D, 2, transport=t, timeout_s=30.0), cases,
        lambda c: f"{c[0]} {c[1]} weighted={c[2]}", args)


_EL, _K, _H, _I, _S = 2, 2, 12, 7, 5  # experts per rank, top-k, hidden, intermediate, tokens


def _routing(world, g, S):
    return route("uniform", S, _EL * world.world_size, _K, world.world_size, g)


def _moe_dispatch(world):
    r = world.rank
    op = torch.ops.portable_overlap.moe_dispatch.default
    found = []
    for transport in ("stores", "sequential"):
        for dt in DTYPES:
            ctx = po.MoeDispatch(world, max_tokens=_S, top_k=_K, hidden=_H,
                                 experts_per_rank=_EL, dtype=dt, transport=transport,
                                 timeout_s=30.0)
            try:
                def args(seed, S=_S - r):  # a token count of each rank's own
                    g = torch.Generator().manual_seed(seed)
                    return (torch.randn(S, _H, generator=g).to(dt), _routing(world, g, S),
                            ctx.handle)

                found.append(_case(f"{transport} {dt}", op, args(r), args(r + 5)))
                ctx.synchronize()
            finally:
                ctx.close()
    return found


def _combine_args(world, ctx, dt, seed, S):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randn(S, _H, generator=g).to(dt)
    x, counts, slots = po.moe_dispatch_reference(tokens, _routing(world, g, S), _EL,
                                                 world.group)
    h = torch.randn(x.shape[0], _I, generator=g).to(dt)
    w = torch.randn(_EL, _I, _H, generator=g).to(dt)
    weights = torch.softmax(torch.randn(S, _K, generator=g), 1).to(dt)
    return (h, w, counts, slots, weights, ctx.handle)


def _moe_gemm_combine(world):
    r = world.rank
    op = torch.ops.portable_overlap.moe_gemm_combine.default
    found = []
    for transport in ("stores", "sequential"):
        ctx = po.MoeGemmCombine(world, max_tokens=_S, top_k=_K, hidden=_H, experts_per_rank=_EL,
                                transport=transport, timeout_s=30.0)
        try:
            for dt in DTYPES:
                found.append(_case(f"{transport} {dt}", op,
                                   _combine_args(world, ctx, dt, r, _S - r),
                                   _combine_args(world, ctx, dt, r + 5, _S - r)))
                ctx.synchronize()
        finally:
            ctx.close()
    return found


def _weights(g, dt):
    wg, wu = (torch.randn(_EL, _H, _I, generator=g).to(dt) for _ in range(2))
    return wg, wu, torch.randn(_EL, _I, _H, generator=g).to(dt)


def _expert_swiglu(world):
    r = world.rank
    op = torch.ops.portable_overlap.expert_swiglu.default
    counts = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32)
    found = []
    for dt in DTYPES:
        for how in ({}, {"x": "padded_rows"}):
            def args(seed):
                g = torch.Generator().manual_seed(seed)
                wg, wu, _ = _weights(g, dt)
                return (laid_out((11, _H), how.get("x"), dtype=dt, gen=g), wg, wu, counts, None)

            found.append(_case(f"{dt} {how}", op, args(r), args(r + 5)))
    return found


def _moe_dispatch_swiglu(world):
    r = world.rank
    op = torch.ops.portable_overlap.moe_dispatch_swiglu.default
    found = []
    for transport in ("stores", "sequential"):
        for dt in DTYPES:
            ctx = po.MoeDispatch(world, max_tokens=_S, top_k=_K, hidden=_H,
                                 experts_per_rank=_EL, dtype=dt, transport=transport,
                                 timeout_s=30.0)
            try:
                def args(seed, S=_S - r):
                    g = torch.Generator().manual_seed(seed)
                    wg, wu, _ = _weights(g, dt)
                    return (torch.randn(S, _H, generator=g).to(dt), _routing(world, g, S), wg, wu,
                            ctx.swiglu_workspace().handle, None, None)

                found.append(_case(f"{transport} {dt}", op, args(r), args(r + 5)))
                ctx.synchronize()
            finally:
                ctx.close()
    return found


def _moe_layer(world):
    r = world.rank
    op = torch.ops.portable_overlap.moe_layer.default
    found = []
    for dt in DTYPES:
        d = po.MoeDispatch(world, max_tokens=_S, top_k=_K, hidden=_H, experts_per_rank=_EL,
                           dtype=dt, timeout_s=30.0)
        c = po.MoeGemmCombine(world, max_tokens=_S, top_k=_K, hidden=_H, experts_per_rank=_EL,
                              timeout_s=30.0)
        try:
            def args(seed, S=_S - r):
                g = torch.Generator().manual_seed(seed)
                wg, wu, wd = _weights(g, dt)
                weights = torch.softmax(torch.randn(S, _K, generator=g), 1).to(dt)
                return (torch.randn(S, _H, generator=g).to(dt), _routing(world, g, S), weights,
                        wg, wu, wd, d.kernel().handle, c.kernel().handle, None, None)

            found.append(_case(f"{dt}", op, args(r), args(r + 5)))
            d.synchronize()
            c.synchronize()
        finally:
            d.close()
            c.close()
    return found


CHECKS = {"matmul_reduce_scatter": _gemm_pattern, "matmul_all_reduce": _gemm_pattern,
          "matmul_all_to_all": _gemm_pattern, "all_gather_matmul": _all_gather_matmul,
          "gemv_all_reduce": _gemv_all_reduce, "embedding_all_to_all": _embedding_all_to_all,
          "embedding_all_to_all_backward": _embedding_all_to_all_backward,
          "moe_dispatch": _moe_dispatch, "moe_gemm_combine": _moe_gemm_combine,
          "expert_swiglu": _expert_swiglu, "moe_dispatch_swiglu": _moe_dispatch_swiglu,
          "moe_layer": _moe_layer}


def test_every_op_has_a_check():
    assert set(CHECKS) == set(SPECS) | set(PARTS)


def _run(world, name):
    check = CHECKS[name]
    return check(world, name) if check is _gemm_pattern else check(world)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_fake_matches_the_real_op(world2, name):
    for rank, found in enumerate(world2.run(_run, name, timeout=240)):
        bad = [(case, what) for case, what in found if what not in ("ok", "refused")]
        assert not bad, (rank, bad)
        # the odd shapes are for the op to compute, not to refuse: most cases ran
        assert sum(what == "ok" for _, what in found) >= len(found) * 2 // 3, (rank, found)


def _another_ops_handle(world):
    """The torch ops given the handle of another op's context: the real op and the fake each
    raise ``TypeError`` naming the context it needs. The real op used to run the other op
    (``matmul_reduce_scatter`` with a ``MatmulAllReduce``'s handle returned the [M, N]
    all-reduce where its fake says [M / W, N]; ``matmul_all_to_all`` an all-reduce), a wrong
    result without an error."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = torch.ops.portable_overlap
    a, b = torch.randn(4, 3), torch.randn(3, 5)
    ar = po.MatmulAllReduce(world, 8, 8, transport="stores")
    rs = po.MatmulReduceScatter(world, 8, 8, transport="stores")
    found = {}
    for name, call in (("reduce_scatter", lambda x, y: ops.matmul_reduce_scatter(x, y, ar.handle)),
                       ("all_reduce", lambda x, y: ops.matmul_all_reduce(x, y, rs.handle)),
                       ("all_to_all", lambda x, y: ops.matmul_all_to_all(x, y, ar.handle))):
        for how in ("real", "fake"):
            try:
                if how == "real":
                    call(a, b)
                else:
                    with FakeTensorMode() as mode:
                        call(mode.from_tensor(a), mode.from_tensor(b))
                found[f"{name} {how}"] = "no error"
            except TypeError as e:
                found[f"{name} {how}"] = str(e)
    # the ranks are still in step: nothing ran
    ok = rel_err(ops.matmul_all_reduce(a, b, ar.handle),
                 po.matmul_all_reduce_reference(a, b, world.group)) < 1e-5
    ar.close()
    rs.close()
    return found, ok


def test_a_torch_op_refuses_another_ops_context(world2):
    for found, ok in world2.run(_another_ops_handle):
        assert ok
        for case, msg in found.items():
            assert "ctx must be a Matmul" in msg, (case, msg)
