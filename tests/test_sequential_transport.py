"""The ``"sequential"`` transport of the GEMM patterns (ops/sequential.py) on emulated ranks:
the same results as each pattern's default fused transport and its reference, the same errors
for bad input, its own error for options it does not take."""
import pytest
import torch

import portable_overlap as po
from portable_overlap.ops.gemm_signal import SignalConfig
from portable_overlap.testing.compare import rel_err
from portable_overlap.testing.patterns import GEMM_PATTERNS as PATTERNS, pattern_inputs


def _against_default(world, dtype):
    W, r = world.world_size, world.rank
    out = []
    for name, (make, ref_fn, rows) in PATTERNS.items():
        fn = getattr(po, name)
        for M, N, K in ((6 * W, 10, 7), (2 * W, 33, 5)):  # sizes off every tile
            g = torch.Generator().manual_seed(100 * r + M + N)
            a, b, bias, res = pattern_inputs(g, M, N, K, rows(M, W), dtype)
            seq = make(world, M, N, transport="sequential")
            fused = make(world, M, N)
            try:
                y = torch.full((rows(M, W), N), float("nan"), dtype=dtype)  # poisoned
                got = fn(a, b, seq, y, bias=bias, residual=res)
                want = fn(a, b, fused, bias=bias, residual=res)
                fused.synchronize()
                ref = ref_fn(a, b, world.group, bias, res)
                out.append((name, M, N, got is y, rel_err(y, ref), rel_err(want, ref),
                            rel_err(y, want)))
            finally:
                seq.close()
                fused.close()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sequential_matches_the_fused_transport(world, dtype):
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for results in world.run(_against_default, dtype):
        assert len(results) == 2 * len(PATTERNS)
        for name, M, N, into_out, err, err_fused, diff in results:
            assert into_out, name
            assert err < tol and err_fused < tol and diff < tol, (name, M, N, err, err_fused,
                                                                  diff)


def _errors(world):
    W = world.world_size
    M, N, K = 4 * W, 8, 6
    a, b = torch.randn(M, K), torch.randn(K, N)
    cases = {
        "shapes": lambda ctx, fn: fn(a, torch.randn(K + 1, N), ctx),
        "dtype": lambda ctx, fn: fn(a, b.double(), ctx),
        "too big": lambda ctx, fn: fn(torch.randn(2 * M, K), b, ctx),
        "out": lambda ctx, fn: fn(a, b, ctx, torch.empty(1, N)),
        "bias": lambda ctx, fn: fn(a, b, ctx, bias=torch.randn(N + 1)),
    }
    found = {}
    for name, (make, _, _) in PATTERNS.items():
        fn = getattr(po, name)
        for transport in (make.TRANSPORTS[0], "sequential"):
            ctx = make(world, M, N, transport=transport)
            try:
                for case, call in cases.items():
                    try:
                        call(ctx, fn)
                        found[(name, transport, case)] = "no error"
                    except (TypeError, ValueError) as e:
                        found[(name, transport, case)] = type(e).__name__
                # still usable after the refusals
                found[(name, transport, "after")] = bool(torch.isfinite(fn(a, b, ctx)).all())
            finally:
                ctx.close()
        ctx = make(world, M, N, transport="sequential")
        try:
            fn(a, b, ctx, config=SignalConfig())  # (None is an option not given)
            found[(name, "options")] = "no error"
        except ValueError as e:
            found[(name, "options")] = str(e)
        finally:
            ctx.close()
        try:
            make(world, M, N, transport="sequential", pieces=2)
            found[(name, "ctx options")] = "no error"
        except ValueError as e:
            found[(name, "ctx options")] = str(e)
    return found


def test_sequential_refuses_what_the_fused_transport_refuses(world2):
    for found in world2.run(_errors, timeout=300):
        for name, (make, _, _) in PATTERNS.items():
            for case in ("shapes", "dtype", "too big", "out", "bias"):
                fused = found[(name, make.TRANSPORTS[0], case)]
                assert fused != "no error", (name, case)
                assert found[(name, "sequential", case)] == fused, (name, case, found)
            assert found[(name, "sequential", "after")] is True
            assert "'sequential' transport takes no options" in found[(name, "options")]
            assert "'sequential' transport takes no options" in found[(name, "ctx options")]


def _unmatched_calls(world):
    """Named ``"sequential"`` on every GEMM pattern: a call whose operands differ across ranks
    in shape but not in bytes (the collective cannot tell them apart), and a call one rank
    refuses (a bad ``out``), each between matched calls into NaN-poisoned outputs."""
    import time

    W, r = world.world_size, world.rank
    found = {}
    names = [*PATTERNS, "all_gather_matmul"]
    for name in names:
        fn = getattr(po, name)
        ag = name == "all_gather_matmul"
        ctx = (po.AllGatherMatmul(world, 64, transport="sequential") if ag
               else PATTERNS[name][0](world, 64, 64, transport="sequential"))
        g = torch.Generator().manual_seed(10 + r)

        def matched(label):
            M, N, K = (3, 5, 4) if ag else (2 * W, 5, 3 + r)  # a reduction's K may differ
            a = torch.randn(M, K, generator=g)
            b = (torch.randn(K, N, generator=torch.Generator().manual_seed(1)) if ag
                 else torch.randn(K, N, generator=g))
            ref = (po.all_gather_matmul_reference(a, b, world.group) if ag
                   else PATTERNS[name][1](a, b, world.group))
            y = torch.full(tuple(ref.shape), float("nan"))
            got = fn(a, b, ctx, y)
            found[(name, label)] = (got is y, rel_err(y, ref))

        def unmatched(label, a, b, out=None):
            t0 = time.monotonic()
            try:
                fn(a, b, ctx, out)
                found[(name, label)] = ("no error", "", 0.0)
            except Exception as e:
                found[(name, label)] = (type(e).__name__, str(e), time.monotonic() - t0)

        try:
            matched("first")
            # rank 0: [2, 6] (AllGather + GEMM's shard) or a [4, 6] product; rank 1: [3, 4] or
            # [6, 4]: as many elements, other shapes
            if ag:
                m, K = (2, 6) if r == 0 else (3, 4)
                unmatched("same bytes", torch.randn(m, K), torch.randn(K, 5))
            else:
                M, N = (2 * W, 3 * W) if r == 0 else (3 * W, 2 * W)
                unmatched("same bytes", torch.randn(M, 3), torch.randn(3, N))
            matched("after same bytes")
            M = 3 if ag else 2 * W
            bad = torch.empty(1, 1) if r == W - 1 else None
            unmatched("refused", torch.randn(M, 4), torch.randn(4, 5), bad)
            matched("after refused")
        finally:
            ctx.close()
    return found


def test_named_sequential_calls_that_do_not_match_raise_on_every_rank(world2):
    """Before, the ranks returned wrong results with no error where the shapes differed with
    the same bytes, and a rank's refusal left its peer in gloo until the process group's
    timeout."""
    for r, found in enumerate(world2.run(_unmatched_calls, timeout=180)):
        for name in [*PATTERNS, "all_gather_matmul"]:
            for label in ("first", "after same bytes", "after refused"):
                assert found[(name, label)][0] is True, (r, name, label, found[(name, label)])
                assert found[(name, label)][1] < 1e-5, (r, name, label, found[(name, label)])
            kind, msg, seconds = found[(name, "same bytes")]
            assert kind == "RankMismatchError" and seconds < 30, (r, name, kind, msg)
            assert "rank 0: " in msg and "rank 1: " in msg, msg  # each rank's call, named
            kind, msg, seconds = found[(name, "refused")]
            assert seconds < 30, (r, name, kind, msg)
            if r == 1:
                assert kind == "ValueError" and "out must be" in msg, (r, name, kind, msg)
            else:
                assert kind == "RankMismatchError" and "rank 1 refused this call" in msg, msg


def _sequential_into_out(world):
    """The GEMM patterns' named ``"sequential"``: the result lands in the ``out`` given (the
    product or the collective writes it there), bit for bit the reference's in the input dtype,
    with and without bias and residual."""
    from portable_overlap.ops.gemm_signal.reference import (gemm_all_reduce_reference,
                                                            gemm_all_to_all_signal_reference,
                                                            gemm_reduce_scatter_reference)

    W = world.world_size
    M, N, K = 4 * W, 6, 5
    refs = {"matmul_all_reduce": (gemm_all_reduce_reference, M),
            "matmul_reduce_scatter": (gemm_reduce_scatter_reference, M // W),
            "matmul_all_to_all": (gemm_all_to_all_signal_reference, M)}
    g = torch.Generator().manual_seed(5 + world.rank)
    got = []
    for op, (ref_fn, rows) in refs.items():
        ctx = {"matmul_all_reduce": po.MatmulAllReduce, "matmul_reduce_scatter":
               po.MatmulReduceScatter, "matmul_all_to_all": po.MatmulAllToAll}[op](
                   world, M, N, transport="sequential")
        try:
            for extra in (False, True):
                a = torch.randn(M, K, generator=g).to(torch.bfloat16)
                b = torch.randn(K, N, generator=g).to(torch.bfloat16)
                bias = torch.randn(N, generator=g).to(torch.bfloat16) if extra else None
                res = torch.randn(rows, N, generator=g).to(torch.bfloat16) if extra else None
                out = torch.full((rows, N), float("nan"), dtype=torch.bfloat16)
                copies = []
                real = torch.Tensor.copy_
                # the all-reduce's product and sum land in out: nothing is copied there
                torch.Tensor.copy_ = lambda t, *a_, **k_: (copies.append(t.shape),
                                                           real(t, *a_, **k_))[1]
                try:
                    y = ctx(a, b, bias, residual=res, out=out)
                finally:
                    torch.Tensor.copy_ = real
                if op == "matmul_all_reduce" and not extra:
                    got.append((op, "copies", copies == [], True))
                ref = ref_fn(a, b, world.group, bias, res, accumulate_fp32=False)
                got.append((op, extra, y is out, bool(torch.equal(out, ref))))
        finally:
            ctx.close()
    return got


def test_named_sequential_writes_the_reference_into_out(world2):
    for got in world2.run(_sequential_into_out):
        assert got and all(same and eq for *_, same, eq in got), got
