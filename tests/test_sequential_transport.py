"""The ``"sequential"`` transport of the GEMM patterns (ops/sequential.py) on emulated ranks:
the same results as each pattern's default fused transport and its reference, the same errors
for bad input, its own error for options it does not take."""
import pytest
import torch

import portable_overlap as po
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
            fn(a, b, ctx, config=None)
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
