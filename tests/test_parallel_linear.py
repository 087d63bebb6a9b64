"""RowParallelLinear's prefill paths (GEMM + AllReduce / ReduceScatter) and the reference paths'
gradients, on 2 CPU-emulated ranks, against the full product computed on one rank."""
import pytest
import torch

from portable_overlap.modules import ColumnParallelLinear, RowParallelLinear

N, K = 24, 32  # out_features, in_features (K split over the ranks)


def _rel(y, ref):
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def _pair(world, reduce, dtype, max_rows):
    """A fused module and a reference one with the same weights: rank r's K-slice of one full
    weight, and one bias (same on every rank)."""
    torch.manual_seed(0)
    full_w, bias = torch.randn(N, K), torch.randn(N)
    k = K // world.world_size
    mods = [RowParallelLinear(K, N, world, bias=True, dtype=dtype, fused=f, reduce=reduce,
                              max_rows=max_rows) for f in (True, False)]
    with torch.no_grad():
        for m in mods:
            m.weight.copy_(full_w[:, world.rank * k:(world.rank + 1) * k])
            m.bias.copy_(bias)
    return mods, full_w, bias


def _prefill(world, reduce, rows_list, dtype):
    W, r = world.world_size, world.rank
    (fused, ref), full_w, bias = _pair(world, reduce, dtype, max(rows_list))
    k = K // W
    out, calls = [], []
    ctx = fused.reduce_ctx.impl  # count the fused calls: the routing is what is under test here
    orig = getattr(ctx, reduce)
    setattr(ctx, reduce, lambda *a, **kw: (calls.append(a[0].shape[0]), orig(*a, **kw))[1])
    try:
        for rows in rows_list:  # one context, row counts changing between calls
            x_full = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
            x = x_full[:, r * k:(r + 1) * k].to(dtype)
            exact = x_full.double() @ full_w.double().T + bias.double()
            if reduce == "reduce_scatter":
                exact = exact[r * rows // W:(r + 1) * rows // W]
            with torch.no_grad():
                y, y_ref = fused(x), ref(x)
            out.append((rows, tuple(y.shape), y.dtype == dtype, _rel(y, exact),
                        _rel(y_ref, exact)))
    finally:
        fused.close()
    return out, calls


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("reduce,rows_list", [
    ("all_reduce", [70, 97, 5, 65]),      # prefill rows (odd too), the decode GEMV path between
    ("reduce_scatter", [6, 70, 2, 98]),   # S must divide by W=2; one row per rank at S=2
], ids=["all_reduce", "reduce_scatter"])
def test_row_parallel_prefill_matches_reference(world2, reduce, rows_list, dtype):
    for res, calls in world2.run(_prefill, reduce, rows_list, dtype):
        # every row count on the GEMM op, except a decode step's (<= 64 rows) with all_reduce
        assert calls == [m for m in rows_list if reduce == "reduce_scatter" or m > 64], calls
        for rows, shape, same_dtype, err, err_ref in res:
            want = (rows // 2 if reduce == "reduce_scatter" else rows, N)
            assert shape == want and same_dtype, (rows, shape)
            assert err < TOL[dtype] and err_ref < TOL[dtype], (rows, err, err_ref)


def _bad(world):
    msgs = []

    def expect(fn):
        try:
            fn()
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))

    W = world.world_size
    rs = RowParallelLinear(K, N, world, dtype=torch.float32, reduce="reduce_scatter", max_rows=8)
    ar = RowParallelLinear(K, N, world, dtype=torch.float32, max_rows=80)
    k = K // W
    with torch.no_grad():
        expect(lambda: rs(torch.randn(7, k)))           # rows not a multiple of W
        expect(lambda: rs(torch.randn(10, k)))          # more than max_rows
        expect(lambda: rs(torch.randn(2, 4, k)))        # not 2-D
        expect(lambda: rs(torch.randn(8, k + 1)))       # wrong K slice
        expect(lambda: ar(torch.randn(81, k)))          # more than max_rows (GEMM path)
        expect(lambda: ar(torch.randn(70, K)))          # the full K instead of the slice
    expect(lambda: RowParallelLinear(K, N, world, reduce="scatter"))
    expect(lambda: RowParallelLinear(K, N, world, reduce="reduce_scatter"))  # no max_rows
    expect(lambda: RowParallelLinear(K, N, world, max_rows=0))
    rs.close()
    ar.close()
    return msgs


def test_row_parallel_bad_input(world2):
    for msgs in world2.run(_bad):
        assert all(m and "RowParallelLinear" in m for m in msgs), msgs


def _grads(world, reduce):
    """With gradients recorded the fused modules take the reference path, whose collectives
    carry gradients: d loss / d (weight slice, input slice) match the full computation's."""
    W, r = world.world_size, world.rank
    S = 66  # above 64 rows: the decode GEMV path (no backward, as before) is not taken
    (lin, _), full_w, bias = _pair(world, reduce, torch.float32, S)
    col = ColumnParallelLinear(K, N * W, world, max_rows=S // W, dtype=torch.float32)
    k = K // W
    g = torch.Generator().manual_seed(5)
    x_full, up = torch.randn(S, K, generator=g), torch.randn(S, N, generator=g)
    w_col = torch.randn(N * W, K, generator=g)
    with torch.no_grad():
        col.weight.copy_(w_col[r * N:(r + 1) * N])
    # row-parallel: loss = sum(y * up) over the rows this rank holds
    x = x_full[:, r * k:(r + 1) * k].clone().requires_grad_()
    rows = slice(r * S // W, (r + 1) * S // W) if reduce == "reduce_scatter" else slice(0, S)
    # (with all_reduce every rank holds the whole loss and differentiates it once, as Megatron)
    (lin(x) * up[rows]).sum().backward()
    gw_exact = up.double().T @ x_full.double()  # d sum(up * (x @ wᵀ)) / dw
    gx_exact = up.double() @ full_w.double()
    errs = [_rel(lin.weight.grad, gw_exact[:, r * k:(r + 1) * k]),
            _rel(x.grad, gx_exact[:, r * k:(r + 1) * k])]
    # column-parallel: this rank's rows in, all rows of its columns out
    xs = x_full[r * S // W:(r + 1) * S // W].clone().requires_grad_()
    (col(xs) * up).sum().backward()
    gx_col_all = torch.zeros(S, K, dtype=torch.float64)
    for q in range(W):  # every rank's columns contribute to every input row's gradient
        gx_col_all += up.double() @ w_col[q * N:(q + 1) * N].double()
    errs += [_rel(col.weight.grad, up.double().T @ x_full.double()),
             _rel(xs.grad, gx_col_all[r * S // W:(r + 1) * S // W])]
    col.close()
    return errs


@pytest.mark.parametrize("reduce", ["all_reduce", "reduce_scatter"])
def test_reference_paths_carry_gradients(world2, reduce):
    for errs in world2.run(_grads, reduce):
        assert all(e < 1e-6 for e in errs), errs
