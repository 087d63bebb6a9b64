"""RowParallelLinear's prefill paths (GEMM + AllReduce / ReduceScatter) and the reference paths'
gradients, on 2 CPU-emulated ranks, against the full product computed on one rank."""
import warnings

import pytest
import torch

from portable_overlap.modules import ColumnParallelLinear, RowParallelLinear
from portable_overlap.modules.linear import REDUCES
from portable_overlap.testing.compare import rel_err
from portable_overlap.testing.faults import construction_outcome

N, K = 24, 32  # out_features, in_features (K split over the ranks)


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
            out.append((rows, tuple(y.shape), y.dtype == dtype, rel_err(y, exact),
                        rel_err(y_ref, exact)))
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


def _column_max_rows(world):
    msgs = []
    for v in (True, 0, -2, None, 2.5):
        try:
            ColumnParallelLinear(K, N * world.world_size, world, max_rows=v,
                                 dtype=torch.float32).close()
            msgs.append(None)
        except (ValueError, TypeError) as e:
            msgs.append(f"{type(e).__name__}: {e}")
    return msgs


def test_column_parallel_max_rows_must_be_an_int_of_at_least_one(world2):
    # True sized the context for one row, None failed in an arithmetic TypeError and 0 in the
    # all-gather context's own check, naming neither the module nor max_rows
    for msgs in world2.run(_column_max_rows):
        assert all(m and m.startswith("ValueError: ColumnParallelLinear: max_rows")
                   for m in msgs), msgs


def _feature_counts(world):
    W, msgs = world.world_size, []
    for make in (lambda i, o: RowParallelLinear(i, o, world, dtype=torch.float32),
                 lambda i, o: ColumnParallelLinear(i, o, world, max_rows=4,
                                                   dtype=torch.float32)):
        for i, o in ((0, N * W), (K * W, 0), (True, N * W), (K * W, -W)):
            try:
                make(i, o).close()
                msgs.append(None)
            except (ValueError, TypeError, ZeroDivisionError) as e:
                msgs.append(f"{type(e).__name__}: {e}")
    return msgs


def _contexts_of_another_op(world):
    """Each layer given a context of another op in ``ctx`` / ``reduce_ctx``; then a layer
    given the right ones serves a prefill and a decode call (the ranks stayed in step)."""
    import portable_overlap as po

    W, msgs = world.world_size, []
    rs, ar = po.MatmulReduceScatter(world, 128, N), po.MatmulAllReduce(world, 128, N)
    gemv = po.GemvAllReduce(world, N)
    for make in (lambda: RowParallelLinear(K, N, world, reduce_ctx=rs),
                 lambda: RowParallelLinear(K, N, world, reduce="reduce_scatter", reduce_ctx=ar),
                 lambda: RowParallelLinear(K, N, world, ctx=ar),
                 lambda: ColumnParallelLinear(K, N * W, world, max_rows=8, ctx=gemv)):
        try:
            make().close()
            msgs.append(None)
        except (ValueError, TypeError) as e:
            msgs.append(f"{type(e).__name__}: {e}")
    lin = RowParallelLinear(K, N, world, ctx=gemv, reduce_ctx=ar, dtype=torch.float32)
    g = torch.Generator().manual_seed(world.rank)
    with torch.no_grad():
        ok = all(tuple(lin(torch.randn(rows, K // W, generator=g)).shape) == (rows, N)
                 for rows in (70, 3))
    for c in (lin, rs, ar, gemv):
        c.close()
    return msgs, ok


def test_a_context_of_another_op_is_refused_when_the_layer_is_made(world2):
    """They were taken, and failed at the first call of the path using them (a prefill after
    any number of decode steps)."""
    want = ["reduce_ctx must be a MatmulAllReduce (reduce='all_reduce') or None, got "
            "MatmulReduceScatter",
            "reduce_ctx must be a MatmulReduceScatter (reduce='reduce_scatter') or None, got "
            "MatmulAllReduce",
            "ctx must be a GemvAllReduce or None, got MatmulAllReduce",
            "ctx must be an AllGatherMatmul or None, got GemvAllReduce"]
    for msgs, ok in world2.run(_contexts_of_another_op):
        assert ok
        for msg, w in zip(msgs, want):
            assert msg is not None and msg.startswith("TypeError: ") and w in msg, (msg, w)


def test_parallel_linear_feature_counts_must_be_ints_of_at_least_one(world2):
    """0 features failed in the weights' initialisation with a ZeroDivisionError."""
    for msgs in world2.run(_feature_counts):
        assert all(m and m.startswith("ValueError: ") and "ParallelLinear: " in m
                   and "_features must be an int >= 1" in m for m in msgs), msgs


def test_row_parallel_bad_input(world2):
    for msgs in world2.run(_bad):
        assert all(m and "RowParallelLinear" in m for m in msgs), msgs


def _bad_on_one_rank(world, bad="dtype"):
    """Rank 1 passes each module an input of the wrong dtype (``bad="dtype"``) or on the wrong
    device (``"device"``: meta), rank 0 a good one: (module, error type, message, seconds) per
    call on this rank, then the relative error of a good call on every module after it. The
    contexts wait 60 s for a peer."""
    import time

    from portable_overlap import (AllGatherMatmul, GemvAllReduce, MatmulAllReduce,
                                  MatmulReduceScatter)

    W, r = world.world_size, world.rank
    k = K // W
    ctxs = [GemvAllReduce(world, max_n=N, timeout_s=60.0),
            MatmulAllReduce(world, 80, N, timeout_s=60.0),
            MatmulReduceScatter(world, 8, N, timeout_s=60.0),
            AllGatherMatmul(world, max_shard_elems=8 * K, timeout_s=60.0)]
    mods = {
        "row, decode": RowParallelLinear(K, N, world, dtype=torch.float32, ctx=ctxs[0]),
        "row, prefill": RowParallelLinear(K, N, world, dtype=torch.float32, reduce_ctx=ctxs[1]),
        "row, reduce_scatter": RowParallelLinear(K, N, world, dtype=torch.float32,
                                                 reduce="reduce_scatter", reduce_ctx=ctxs[2]),
        "column": ColumnParallelLinear(K, N * W, world, max_rows=8, dtype=torch.float32,
                                       ctx=ctxs[3]),
    }
    g = torch.Generator().manual_seed(11)
    inputs = {"row, decode": torch.randn(3, k, generator=g),
              "row, prefill": torch.randn(70, k, generator=g),
              "row, reduce_scatter": torch.randn(8, k, generator=g),
              "column": torch.randn(4, K, generator=g)}
    found = {}
    with torch.no_grad():
        for name, m in mods.items():
            x = inputs[name]
            if r == 1:
                x = x.double() if bad == "dtype" else x.to("meta")
            t0 = time.monotonic()
            try:
                m(x)
                found[name] = ("no error", "", 0.0)
            except Exception as e:
                found[name] = (type(e).__name__, str(e), time.monotonic() - t0)
        ref = {name: RowParallelLinear(K, N, world, dtype=torch.float32, fused=False,
                                       reduce=m.reduce) if name.startswith("row") else
               ColumnParallelLinear(K, N * W, world, max_rows=8, dtype=torch.float32,
                                    fused=False) for name, m in mods.items()}
        for name, m in mods.items():
            ref[name].weight.copy_(m.weight)
            found[name + " next"] = rel_err(m(inputs[name]), ref[name](inputs[name]))
    for m in (*mods.values(), *ref.values(), *ctxs):
        m.close()
    return found


def test_a_module_check_failing_on_one_rank_fails_the_call_on_every_rank(world2):
    """A module's own input check that fails on one rank refuses the fused op's call there:
    the peer fails the same call at once ("rank 1 gave up") instead of waiting out its 60 s,
    which would break the context, and the next call works on every rank."""
    mine, peer = world2.run(_bad_on_one_rank, timeout=300)
    for name in ("row, decode", "row, prefill", "row, reduce_scatter", "column"):
        assert peer[name][0] == "TypeError" and "dtype" in peer[name][1], peer[name]
        assert mine[name][0] == "PeerTimeoutError" and "gave up" in mine[name][1], mine[name]
        assert mine[name][2] < 30.0, mine[name]
        assert mine[name + " next"] < 1e-5 and peer[name + " next"] < 1e-5, (mine, peer)


def test_an_input_on_a_device_autocast_does_not_know_fails_the_call_on_every_rank(world2):
    """A meta input: torch's autocast query raised a bare RuntimeError for it before the
    module's own check, so no refusal reached the peer, which then paired the call with this
    rank's next one. The module's check names the device, and the peer fails the call at once."""
    mine, peer = world2.run(_bad_on_one_rank, "device", timeout=300)
    for name in ("row, decode", "row, prefill", "row, reduce_scatter", "column"):
        assert peer[name][0] == "ValueError" and "meta" in peer[name][1], peer[name]
        assert mine[name][0] == "PeerTimeoutError" and "gave up" in mine[name][1], mine[name]
        assert mine[name][2] < 30.0, mine[name]
        assert mine[name + " next"] < 1e-5 and peer[name + " next"] < 1e-5, (mine, peer)


def _bad_on_one_rank_auto(world):
    """The same with ``transport="auto"`` contexts: rank 1's bad input at the key's first call
    (undecided: the agreement) and again once the key is decided (the decided transport's
    refusal). (error type, message, seconds) on this rank, then a good call's rel. error."""
    import time

    from portable_overlap import GemvAllReduce

    W, r = world.world_size, world.rank
    k = K // W
    ctx = GemvAllReduce(world, max_n=N, transport="auto", iters=1, warmup=0, timeout_s=60.0)
    mod = RowParallelLinear(K, N, world, dtype=torch.float32, ctx=ctx)
    ref = RowParallelLinear(K, N, world, dtype=torch.float32, fused=False)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(4 + r))
    found = {}
    with torch.no_grad():
        ref.weight.copy_(mod.weight)
        for name in ("undecided", "decided"):
            if name == "decided":
                mod(x)  # decides the key on every rank
            t0 = time.monotonic()
            try:
                mod(x.double() if r == 1 else x)
                found[name] = ("no error", "", 0.0)
            except Exception as e:
                found[name] = (type(e).__name__, str(e), time.monotonic() - t0)
        found["next"] = rel_err(mod(x), ref(x))
    for m in (mod, ref, ctx):
        m.close()
    return found


def test_a_module_check_failing_on_one_rank_under_auto(world2):
    mine, peer = world2.run(_bad_on_one_rank_auto, timeout=300)
    for name in ("undecided", "decided"):
        assert peer[name][0] == "TypeError", peer[name]
        assert mine[name][0] != "no error" and mine[name][2] < 30.0, mine[name]
        # the decided transport's refusal (bounded waits), or the agreement's (unbounded)
        assert (mine[name][0] == "PeerTimeoutError" and "gave up" in mine[name][1]) or \
            (mine[name][0] == "RankMismatchError" and "rank 1 refused" in mine[name][1]), mine
    assert mine["next"] < 1e-5 and peer["next"] < 1e-5, (mine, peer)


def _factory_defaults(world):
    """dtype / device as nn.Linear's factory arguments: None is torch's default dtype and the
    world's device."""
    out = {}
    old = torch.get_default_dtype()
    try:
        for default in (torch.float32, torch.float16):
            torch.set_default_dtype(default)
            row = RowParallelLinear(K, N, world, bias=True, fused=False)
            col = ColumnParallelLinear(K, N * world.world_size, world, max_rows=4, bias=True,
                                       fused=False)
            out[str(default)] = [(str(p.dtype), str(p.device)) for m in (row, col)
                                 for p in m.parameters()]
        torch.set_default_dtype(torch.float64)  # no fused kernel: refused, unless fused=False
        out["float64"] = []
        for make in (lambda **kw: RowParallelLinear(K, N, world, **kw),
                     lambda **kw: ColumnParallelLinear(K, N * world.world_size, world,
                                                       max_rows=4, **kw)):
            try:
                make().close()
                out["float64"].append(None)
            except TypeError as e:
                out["float64"].append(str(e))
            out["float64"].append(str(make(fused=False).weight.dtype))
    finally:
        torch.set_default_dtype(old)
    row = RowParallelLinear(K, N, world, device="cpu", fused=False)
    out["device=cpu"] = str(row.weight.device)
    try:
        RowParallelLinear(K, N, world, device="meta")
        out["device=meta"] = None
    except ValueError as e:
        out["device=meta"] = str(e)
    return out


def test_dtype_and_device_follow_torch(world2):
    for out in world2.run(_factory_defaults):
        assert set(out["torch.float32"]) == {("torch.float32", "cpu")}, out
        assert set(out["torch.float16"]) == {("torch.float16", "cpu")}, out
        row_err, row_ref, col_err, col_ref = out["float64"]
        assert row_err.startswith("RowParallelLinear:") and "float64" in row_err, row_err
        assert col_err.startswith("ColumnParallelLinear:") and "float64" in col_err, col_err
        assert row_ref == col_ref == "torch.float64"
        assert out["device=cpu"] == "cpu"
        assert out["device=meta"].startswith("RowParallelLinear:"), out["device=meta"]


def _module_errors(world):
    """Errors of module calls: (what was called, exception type, message)."""
    from portable_overlap import MatmulAllReduce

    W = world.world_size
    k = K // W
    small = MatmulAllReduce(world, 1, N)  # (a layer without max_rows cannot judge its rows)
    mods = {
        "row": RowParallelLinear(K, N, world, dtype=torch.float32),
        "row, small reduce_ctx": RowParallelLinear(K, N, world, dtype=torch.float32,
                                                   reduce_ctx=small),
        "col": ColumnParallelLinear(K, N * W, world, max_rows=4, dtype=torch.float32),
    }
    calls = [("row", torch.randn(3, k, dtype=torch.float64)),  # not the layer's dtype
             ("row, small reduce_ctx", torch.randn(70, k)),  # more than its receive room
             ("col", torch.randn(3, K, dtype=torch.bfloat16))]
    out = []
    with torch.no_grad():
        for name, x in calls:
            try:
                mods[name](x)
                out.append((name, list(x.shape), None, None))
            except Exception as e:
                out.append((name, list(x.shape), type(e).__name__, str(e)))
    for m in (*mods.values(), small):
        m.close()
    return out


def test_module_errors_name_the_module_and_input(world2):
    """An error raised by a module call says which module and what input, also when the op
    under it refused the call."""
    for out in world2.run(_module_errors):
        for name, shape, kind, msg in out:
            cls = "RowParallelLinear" if name.startswith("row") else "ColumnParallelLinear"
            assert kind in ("TypeError", "ValueError"), (name, kind, msg)
            assert msg.startswith(f"{cls}: input {shape}"), (name, msg)
        assert "matmul_all_reduce" in out[1][3] and "max_m" in out[1][3], out[1]


def _contexts_too_small(world):
    """Layers given a context smaller than their largest call: what their construction raised
    on this rank (and whether the layer given one large enough serves a call)."""
    from portable_overlap import (AllGatherMatmul, GemvAllReduce, MatmulAllReduce,
                                  MatmulReduceScatter)

    W = world.world_size
    ctxs = [GemvAllReduce(world, max_n=N - 1), MatmulAllReduce(world, 80, N - 1),
            MatmulAllReduce(world, 66, N), MatmulReduceScatter(world, 66, N),
            AllGatherMatmul(world, max_shard_elems=4 * K - 1)]
    makes = {
        "row ctx max_n": lambda: RowParallelLinear(K, N, world, ctx=ctxs[0]),
        "row reduce_ctx max_n": lambda: RowParallelLinear(K, N, world, max_rows=80,
                                                          reduce_ctx=ctxs[1]),
        "row reduce_ctx max_m": lambda: RowParallelLinear(K, N, world, max_rows=80,
                                                          reduce_ctx=ctxs[2]),
        "row reduce_scatter max_m": lambda: RowParallelLinear(
            K, N, world, reduce="reduce_scatter", max_rows=80, reduce_ctx=ctxs[3]),
        "col max_shard_elems": lambda: ColumnParallelLinear(K, N * W, world, max_rows=4,
                                                            ctx=ctxs[4]),
    }
    out = {name: construction_outcome(make) for name, make in makes.items()}
    fits = RowParallelLinear(K, N, world, max_rows=66, reduce_ctx=ctxs[2], dtype=torch.float32)
    out["fits"] = tuple(fits(torch.randn(66, K // W)).shape)
    fits.close()
    for c in ctxs:
        c.close()
    return out


def test_a_context_too_small_for_the_layer_is_refused_when_the_layer_is_made(world2):
    """Not at the first call of the path that uses it (a prefill after any number of decode
    steps), on every rank."""
    for out in world2.run(_contexts_too_small):
        assert out.pop("fits") == (66, N)
        for name, (kind, msg, _) in out.items():
            attr = name.split()[-1]
            assert kind == "ValueError" and f"has {attr}=" in msg and "largest call" in msg, \
                (name, kind, msg)


def _counting(module, name, calls):
    """Count the calls of ``module.name`` (a fused op) in ``calls``; returns the undo."""
    orig = getattr(module, name)
    setattr(module, name, lambda *a, **kw: (calls.append(name), orig(*a, **kw))[1])
    return lambda: setattr(module, name, orig)


def _count_fused_ops(calls: list) -> list:
    """Count the fused ops the layers call in ``calls``; returns the undos."""
    import portable_overlap.modules.linear as linear
    import portable_overlap.ops.allgather_gemm as allgather_gemm

    names = ("gemv_all_reduce", "matmul_all_reduce", "matmul_reduce_scatter")
    return [*(_counting(linear, n, calls) for n in names),
            _counting(allgather_gemm, "all_gather_matmul", calls)]


def _column_and_data(world, S, fused, seed):
    """A column-parallel layer (``N`` columns per rank, fp32) with rank r's block of a full
    weight ``w_col``, and the full input ``x_full`` [S, K] and output weights ``up`` [S, N]."""
    W, r = world.world_size, world.rank
    col = ColumnParallelLinear(K, N * W, world, max_rows=S // W, dtype=torch.float32,
                               fused=fused)
    g = torch.Generator().manual_seed(seed)
    x_full, up = torch.randn(S, K, generator=g), torch.randn(S, N, generator=g)
    w_col = torch.randn(N * W, K, generator=g)
    with torch.no_grad():
        col.weight.copy_(w_col[r * N:(r + 1) * N])
    return col, x_full, up, w_col


def _grads(world, reduce, S, fused):
    """With gradients recorded, d loss / d (weight slice, input slice) match the full
    computation's, on the fused paths (which must be taken) and on the reference paths.
    Returns the relative errors and the fused ops called."""
    W, r = world.world_size, world.rank
    calls = []
    undo = _count_fused_ops(calls)
    try:
        pair, full_w, bias = _pair(world, reduce, torch.float32, S)
        lin = pair[0] if fused else pair[1]
        col, x_full, up, w_col = _column_and_data(world, S, fused, 5)
        k = K // W
        # row-parallel: loss = sum(y * up) over the rows this rank holds
        x = x_full[:, r * k:(r + 1) * k].clone().requires_grad_()
        rows = slice(r * S // W, (r + 1) * S // W) if reduce == "reduce_scatter" else slice(0, S)
        # (with all_reduce every rank holds the whole loss and differentiates it once, as Megatron)
        (lin(x) * up[rows]).sum().backward()
        gw_exact = up.double().T @ x_full.double()  # d sum(up * (x @ wᵀ)) / dw
        gx_exact = up.double() @ full_w.double()
        errs = [rel_err(lin.weight.grad, gw_exact[:, r * k:(r + 1) * k]),
                rel_err(x.grad, gx_exact[:, r * k:(r + 1) * k]),
                # the replicated bias is in every row of the (global) loss: the same on
                # every rank with either reduce
                rel_err(lin.bias.grad, up.double().sum(0))]
        # column-parallel: this rank's rows in, all rows of its columns out
        xs = x_full[r * S // W:(r + 1) * S // W].clone().requires_grad_()
        (col(xs) * up).sum().backward()
        gx_col_all = torch.zeros(S, K, dtype=torch.float64)
        for q in range(W):  # every rank's columns contribute to every input row's gradient
            gx_col_all += up.double() @ w_col[q * N:(q + 1) * N].double()
        errs += [rel_err(col.weight.grad, up.double().T @ x_full.double()),
                 rel_err(xs.grad, gx_col_all[r * S // W:(r + 1) * S // W])]
        for m in (*pair, col):
            m.close()
    finally:
        for u in undo:
            u()
    return errs, calls


@pytest.mark.parametrize("reduce,S,op", [
    ("all_reduce", 6, "gemv_all_reduce"),  # a decode step: the fused GEMV
    ("all_reduce", 66, "matmul_all_reduce"),  # prefill rows: the fused GEMM
    ("reduce_scatter", 66, "matmul_reduce_scatter"),
])
def test_fused_paths_carry_gradients(world2, reduce, S, op):
    """The fused ops run while autograd records, and their backward is the row- / column-
    parallel one."""
    for errs, calls in world2.run(_grads, reduce, S, True):
        assert calls == [op, "all_gather_matmul"], calls
        assert all(e < 1e-5 for e in errs), errs


def _grads_warned(world, reduce, S, fused):
    """:func:`_grads`, and the warnings it raised."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        errs, calls = _grads(world, reduce, S, fused)
    return errs, calls, [str(w.message)[:200] for w in seen]


@pytest.mark.parametrize("reduce", ["all_reduce", "reduce_scatter"])
def test_reference_paths_carry_gradients(world2, reduce):
    """Without a warning: the all-reduce under autograd is a Function with its gradient, not
    the bare in-place collective, which torch records with no formula (deprecated)."""
    for errs, calls, warned in world2.run(_grads_warned, reduce, 66, False):
        assert calls == [] and all(e < 1e-6 for e in errs), (calls, errs)
        assert not [w for w in warned if "autograd" in w], warned


def _strided_weight(world):
    """The weight set to this rank's slice of a full matrix, a view that is not contiguous:
    the decode rows (the GEMV op) and the prefill rows (the GEMM op) against the product."""
    W, r = world.world_size, world.rank
    k = K // W
    full_w = torch.randn(N, K, generator=torch.Generator().manual_seed(3))
    lin = RowParallelLinear(K, N, world, max_rows=80)
    lin.weight = torch.nn.Parameter(full_w[:, r * k:(r + 1) * k])
    errs = []
    try:
        for rows in (5, 70, 1):
            x_full = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
            y = lin(x_full[:, r * k:(r + 1) * k])
            errs.append((rows, lin.weight.is_contiguous(), rel_err(y, x_full @ full_w.T)))
    finally:
        lin.close()
    return errs


def test_a_weight_view_that_is_not_contiguous_serves_decode_and_prefill(world2):
    """As ``nn.Linear`` takes any weight strides: the decode path's GEMV refused such a weight
    (naming the input) where the prefill path took it."""
    for errs in world2.run(_strided_weight):
        assert [e[:2] for e in errs] == [(5, False), (70, False), (1, False)], errs
        assert all(e[2] < 1e-5 for e in errs), errs


def _made_on_two_ranks(world, case):
    """A layer made with arguments that differ on rank 1 (``case``), then a good one, which
    needs the ranks still in step: (error type, message, seconds) of the first on this rank."""

    W, r = world.world_size, world.rank
    f32 = dict(dtype=torch.float32)
    make = {
        # refused on rank 1 alone (its own check): rank 0 went on into the contexts' set-up
        "row in_features": lambda: RowParallelLinear(K + r, N, world, **f32),
        "column out_features": lambda: ColumnParallelLinear(K, N * W + r, world, max_rows=4,
                                                            **f32),
        "column max_rows": lambda: ColumnParallelLinear(K, N * W, world, max_rows=4 - 4 * r,
                                                        **f32),
        # good on each rank, different across them: rank 1 makes no context, or another one
        "row fused": lambda: RowParallelLinear(K, N, world, fused=r == 0, **f32),
        "row reduce": lambda: RowParallelLinear(K, N, world, max_rows=8,
                                                reduce=REDUCES[r % 2], **f32),
        "row in_features, reference": lambda: RowParallelLinear(K * (1 + r), N, world,
                                                                fused=False, **f32),
        "column bias": lambda: ColumnParallelLinear(K, N * W, world, max_rows=4, bias=r == 1,
                                                    **f32),
    }[case]
    out = construction_outcome(make)
    RowParallelLinear(K, N, world, **f32).close()
    return out


@pytest.mark.parametrize("case,arg", [
    ("row in_features", None), ("column out_features", None), ("column max_rows", None),
    ("row fused", "fused"), ("row reduce", "reduce"),
    ("row in_features, reference", "in_features"), ("column bias", "bias")])
def test_layer_arguments_bad_or_different_on_one_rank_raise_on_every_rank(world2, case, arg):
    """A layer's own argument check that failed on rank 1 alone left rank 0 waiting in the
    contexts' set-up until the process group's timeout; arguments that differed made one rank
    wait for a context its peer never made, or made layers of different shapes with no error.
    Every rank raises at once: the refusing rank its ValueError, its peer PeerSetupError; on
    arguments that differ, RankMismatchError naming them, on every rank."""
    mine, peer = world2.run(_made_on_two_ranks, case, timeout=90)
    cls = "RowParallelLinear" if case.startswith("row") else "ColumnParallelLinear"
    assert mine[2] < 30 and peer[2] < 30, (mine, peer)
    if arg is None:
        assert peer[0] == "ValueError" and peer[1].startswith(cls), peer
        assert mine[0] == "PeerSetupError" and f"rank 1 refused to make {cls}" in mine[1], mine
    else:
        for got in (mine, peer):
            assert got[0] == "RankMismatchError" and got[1].startswith(cls), got
            assert f"{arg}: rank 0: " in got[1], got


def _under_autocast(world, reduce, S):
    """fp32 layers under ``torch.autocast`` (bfloat16) given bfloat16 input, as the layer before
    them hands it over: the fused op runs in bfloat16 on the cast operands, the output is
    bfloat16 as ``nn.Linear``'s is there, and the fp32 parameters get fp32 gradients."""
    W, r = world.world_size, world.rank
    calls = []
    undo = _count_fused_ops(calls)
    try:
        (lin, plain), full_w, bias = _pair(world, reduce, torch.float32, S)
        col, x_full, up, w_col = _column_and_data(world, S, True, 7)
        k = K // W
        bf = torch.bfloat16
        x = x_full[:, r * k:(r + 1) * k].to(bf).requires_grad_()
        xs = x_full[r * S // W:(r + 1) * S // W].to(bf).requires_grad_()
        rows = slice(r * S // W, (r + 1) * S // W) if reduce == "reduce_scatter" else slice(0, S)
        with torch.autocast("cpu", dtype=bf):
            y, yc = lin(x), col(xs)
        dtypes = (y.dtype, yc.dtype)
        (y.float() * up[rows]).sum().backward()
        (yc.float() * up).sum().backward()
        xb, wb = x_full.to(bf).double(), full_w.to(bf).double()
        errs = [rel_err(y, (xb @ wb.T + bias.to(bf).double())[rows]),
                rel_err(lin.weight.grad, up.double().T @ xb[:, r * k:(r + 1) * k]),
                rel_err(x.grad, up.double() @ wb[:, r * k:(r + 1) * k]),
                rel_err(yc, xb @ w_col[r * N:(r + 1) * N].to(bf).double().T),
                rel_err(col.weight.grad, up.double().T @ xb)]
        grads = (lin.weight.grad.dtype, lin.bias.grad.dtype, col.weight.grad.dtype, x.grad.dtype)
        for m in (lin, plain, col):
            m.close()
    finally:
        for u in undo:
            u()
    return dtypes, grads, errs, calls


@pytest.mark.parametrize("reduce,S,op", [
    ("all_reduce", 6, "gemv_all_reduce"),
    ("all_reduce", 66, "matmul_all_reduce"),
    ("reduce_scatter", 66, "matmul_reduce_scatter"),
])
def test_fp32_layers_under_autocast_compute_in_its_dtype(world2, reduce, S, op):
    f32, bf = torch.float32, torch.bfloat16
    for dtypes, grads, errs, calls in world2.run(_under_autocast, reduce, S):
        assert calls == [op, "all_gather_matmul"], calls
        assert dtypes == (bf, bf) and grads == (f32, f32, f32, bf), (dtypes, grads)
        assert all(e < 2e-2 for e in errs), errs


def _recorded_on_one_rank(world, module, transport):
    """A layer call autograd records on rank 0 only (rank 1 under ``torch.no_grad()``): its
    backward's collective (ColumnParallelLinear: the input gradient's reduce-scatter;
    RowParallelLinear(reduce="reduce_scatter"): the output gradient's all-gather) would run on
    rank 0 alone and wait for ever. The forward raises RankMismatchError on every rank
    instead; the next call (no_grad everywhere) is right, and a call every rank trains runs
    its backward. ``"auto"``: at the key's first call (the agreement) and once decided."""
    import contextlib
    import time

    from portable_overlap import AllGatherMatmul, MatmulReduceScatter, PortableOverlapError

    W, r = world.world_size, world.rank
    kw = dict(transport=transport.split(",")[0], timeout_s=30.0)
    if kw["transport"] == "auto":
        kw.update(candidates=("stores", "sequential"), iters=1, warmup=0)
    g = torch.Generator().manual_seed(8 + r)
    if module == "column":
        ctx = AllGatherMatmul(world, max_shard_elems=4 * K, **kw)
        mod = ColumnParallelLinear(K, N, world, max_rows=4, dtype=torch.float32, ctx=ctx)
        ref = ColumnParallelLinear(K, N, world, max_rows=4, dtype=torch.float32, fused=False)
        x = torch.randn(4, K, generator=g)
    else:
        ctx = MatmulReduceScatter(world, 4 * W, N, **kw)
        mod = RowParallelLinear(K, N, world, dtype=torch.float32, reduce="reduce_scatter",
                                max_rows=4 * W, reduce_ctx=ctx)
        ref = RowParallelLinear(K, N, world, dtype=torch.float32, reduce="reduce_scatter",
                                fused=False)
        x = torch.randn(4 * W, K // W, generator=g)
    with torch.no_grad():
        ref.weight.copy_(mod.weight)
    found = {}
    try:
        if transport == "auto, decided":
            mod(x).sum().backward()  # every rank records: the key decided
        quiet = torch.no_grad() if r else contextlib.nullcontext()
        t0 = time.monotonic()
        try:
            with quiet:
                mod(x)
                ctx.synchronize()
            found["mixed"] = "no error"
        except PortableOverlapError as e:
            found["mixed"] = f"{type(e).__name__}: {e}"
        found["seconds"] = time.monotonic() - t0
        with torch.no_grad():
            found["next"] = rel_err(mod(x), ref(x))
        mod.weight.grad = None
        mod(x).sum().backward()
        found["trained"] = bool(mod.weight.grad is not None and mod.weight.grad.abs().sum())
    finally:
        for m in (mod, ref, ctx):
            m.close()
    return found


@pytest.mark.parametrize("module", ["column", "row_reduce_scatter"])
@pytest.mark.parametrize("transport", ["stores", "copy_engine", "sequential", "auto",
                                       "auto, decided"])
def test_a_layer_call_recorded_on_some_ranks_raises_in_the_forward(world2, module, transport):
    for rank, found in enumerate(world2.run(_recorded_on_one_rank, module, transport,
                                            timeout=300)):
        assert found["mixed"].startswith("RankMismatchError") and \
            "records_grad" in found["mixed"], (rank, found)
        assert found["seconds"] < 25, (rank, found)
        assert found["next"] < 1e-5 and found["trained"], (rank, found)


def _copies(world):
    """``copy.deepcopy`` and ``pickle`` of each layer: a fused one raises a ``TypeError`` that
    names it and the way out (pickle stopped at a context's lock, naming neither); the
    reference path's copy computes what the layer does."""
    import copy

    from portable_overlap import ShardedEmbeddingBagCollection
    from portable_overlap.testing.faults import copy_errors

    W = world.world_size
    g = torch.Generator().manual_seed(7 + world.rank)

    def make(cls, fused):
        if cls is ShardedEmbeddingBagCollection:
            return cls(world, [5, 6], 4, max_local_batch=2, fused=fused)
        if cls is ColumnParallelLinear:
            return cls(K, N * W, world, max_rows=4, dtype=torch.float32, fused=fused)
        return cls(K, N, world, dtype=torch.float32, fused=fused)

    def inputs(cls, layer):
        if cls is ShardedEmbeddingBagCollection:  # this rank's tables, the global batch of 2W
            n = len(layer.local_tables)
            return (torch.full((n * 2 * W,), 2, dtype=torch.int64),
                    torch.randint(0, 5, (n * 2 * W * 2,), generator=g))
        return (torch.randn(3, K if cls is ColumnParallelLinear else K // W, generator=g),)

    found = {}
    for cls in (RowParallelLinear, ColumnParallelLinear, ShardedEmbeddingBagCollection):
        fused = make(cls, True)
        try:
            msgs = copy_errors(fused)
        finally:
            fused.close()
        plain = make(cls, False)
        twin = copy.deepcopy(plain)
        args = inputs(cls, plain)
        with torch.no_grad():
            same = torch.equal(twin(*args), plain(*args))
        found[cls.__name__] = (msgs, same)
    return found


def test_a_fused_layer_refuses_copies_by_name(world2):
    for found in world2.run(_copies, timeout=240):
        for name, (msgs, same) in found.items():
            assert all(m.startswith(f"{name}: a fused layer cannot be copied")
                       and "load_state_dict" in m for m in msgs), (name, msgs)
            assert same, name


def _rows_on_both_sides_of_the_gemv(world):
    """Rank 0 calls the layer with 3 rows (GEMV + AllReduce, which waits 30 s for a peer),
    rank 1 with 70 (the GEMM op, which waits 2 s) and then with 3: rank 1's second call pairs
    with rank 0's first in the GEMV op, a call of another step. (error type, message) per call
    on this rank."""
    from portable_overlap import GemvAllReduce, MatmulAllReduce

    W, r = world.world_size, world.rank
    ctx = GemvAllReduce(world, max_n=N, timeout_s=30.0)
    reduce_ctx = MatmulAllReduce(world, 80, N, timeout_s=2.0)
    mod = RowParallelLinear(K, N, world, dtype=torch.float32, ctx=ctx, reduce_ctx=reduce_ctx)
    g = torch.Generator().manual_seed(3 + r)
    calls = [3] if r == 0 else [70, 3]
    found = []
    with torch.no_grad():
        for rows in calls:
            try:
                mod(torch.randn(rows, K // W, generator=g))
                found.append(("no error", ""))
            except Exception as e:
                found.append((type(e).__name__, str(e)))
    for c in (mod, ctx, reduce_ctx):
        c.close()
    return found


def test_a_call_pairing_with_a_peers_call_of_another_step_raises(world2):
    """The layer picks its op by each rank's own rows: rank 0's GEMV call waited while rank 1's
    GEMM call gave up, and rank 1's next call, in the GEMV op, returned the sum of rank 0's
    first step and its own second on both ranks, with no error. The ops' flags carry each
    layer's count of op changes (1 on rank 0, 2 for rank 1's second call): both raise
    ``RankMismatchError`` naming it."""
    mine, peer = world2.run(_rows_on_both_sides_of_the_gemv, timeout=300)
    assert mine[0][0] == "RankMismatchError" and "op_changes" in mine[0][1], mine
    assert peer[0][0] == "PeerTimeoutError", peer
    assert peer[1][0] == "RankMismatchError" and "op_changes" in peer[1][1], peer


def _second_derivative(world, module, fused):
    """``module`` ("column", "row_rs", "row_ar") with ``create_graph=True``: the first
    derivative (relative error against float64) and what a second derivative through it does
    on this rank. Their backwards run collectives autograd cannot differentiate: the second
    derivative came out wrong with no error (0.5-0.7 off), or raised or hung on some ranks."""
    W, r = world.world_size, world.rank
    S = 12
    if module == "column":
        lin, x_full, _, w = _column_and_data(world, S, fused, 7)
        x = x_full[r * S // W:(r + 1) * S // W].clone().requires_grad_()
        rows = slice(r * S // W, (r + 1) * S // W)
        full_w = w
    else:
        reduce = "reduce_scatter" if module == "row_rs" else "all_reduce"
        pair, full_w, _ = _pair(world, reduce, torch.float32, S)
        lin = pair[0] if fused else pair[1]
        g = torch.Generator().manual_seed(7)
        x_full = torch.randn(S, K, generator=g)
        k = K // W
        x = x_full[:, r * k:(r + 1) * k].clone().requires_grad_()
        rows = slice(r * k, (r + 1) * k)
    try:
        gx, = torch.autograd.grad(lin(x).pow(2).sum(), x, create_graph=True)
        X, Wd = x_full.double().requires_grad_(), full_w.double()
        if module == "column":
            y_ref = X @ Wd.T
        else:
            y_ref = X @ Wd.T + (lin.bias.double() if lin.bias is not None else 0)
        # the loss of the whole output: the sum of every rank's rows (reduce-scatter) or
        # columns (column-parallel), or the replicated sum each rank differentiates once
        # (all-reduce, Megatron's convention)
        GX, = torch.autograd.grad(y_ref.pow(2).sum(), X)
        err = rel_err(gx, GX[rows] if module == "column" else GX[:, rows])
        try:
            gx.pow(3).sum().backward()
            second = "ran"
        except RuntimeError as e:
            second = str(e)
        return err, second
    finally:
        for m in ((lin,) if module == "column" else pair):
            m.close()


@pytest.mark.parametrize("module,fused", [("column", True), ("column", False),
                                          ("row_rs", True), ("row_rs", False),
                                          ("row_ar", True)])
def test_a_second_derivative_through_a_layer_raises_on_every_rank(world2, module, fused):
    for err, second in world2.run(_second_derivative, module, fused, timeout=180):
        assert err < 1e-5, err  # the first derivative, taken with create_graph=True
        assert "once_differentiable" in second, second


def _shard_state_dicts(world):
    """A layer's state dict loaded on another rank, or into the other kind of layer of the
    same weight shape (row-parallel [12, 16 / 2], column-parallel [24 / 2, 8]): the weight has
    this layer's shape and loaded as another shard, with no error. (message or "loaded", the
    weight unchanged) for each case, on this rank."""
    r = world.rank
    row = RowParallelLinear(16, 12, world, dtype=torch.float32, max_rows=8, fused=False)
    col = ColumnParallelLinear(8, 24, world, dtype=torch.float32, max_rows=8, fused=False)
    try:
        assert row.weight.shape == col.weight.shape == (12, 8)
        mine = {k: v.clone() for k, v in row.state_dict().items()}
        theirs = world.all_gather_object(mine)[1 - r]
        found = {}
        for case, layer, sd in (("own", row, mine), ("peer's", row, theirs),
                                ("other kind", col, mine),
                                ("hand-made", row, {k: torch.randn_like(v)
                                                    for k, v in mine.items()
                                                    if k != "_extra_state"})):
            before = layer.weight.detach().clone()
            try:
                layer.load_state_dict(sd)
                found[case] = ("loaded", torch.equal(layer.weight.detach(), sd["weight"]))
            except ValueError as e:
                found[case] = (str(e), torch.equal(layer.weight.detach(), before))
        return found
    finally:
        row.close()
        col.close()


def test_a_state_dict_of_another_shard_is_refused(world2):
    for r, found in enumerate(world2.run(_shard_state_dicts)):
        assert found["own"] == ("loaded", True) and found["hand-made"] == ("loaded", True), found
        msg, kept = found["peer's"]
        assert kept and f"rank {1 - r} there, {r} here" in msg, found
        msg, kept = found["other kind"]
        assert kept and "layer 'RowParallelLinear' there, 'ColumnParallelLinear' here" in msg, \
            found
