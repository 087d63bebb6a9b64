"""Calls with no rows (an empty micro-batch on every rank, normal in serving) through every
public op and module on CPU-emulated ranks: each returns the result torch's reference gives (a
[0, N] product, [.., 0, out] from the linear layers, an empty embedding output, no tokens out
of the MoE layer), or, on the two transports that cannot run one, a clear ValueError on every
rank; a call with rows on one rank and none on another raises on every rank; the context
serves the next call; K = 0 gives torch's zeros to the K-split patterns' collective
(AllGather + GEMM refuses it), N = 0 is refused with an error naming it; autograd and the
fake implementations see the empty shapes too."""
import pytest
import torch

import portable_overlap as po
from portable_overlap.ops.registry import SPECS
from portable_overlap.testing.compare import rel_err

K, N = 8, 6
#: the GEMM patterns' contexts, by op
GEMMS = {"matmul_reduce_scatter": po.MatmulReduceScatter, "matmul_all_reduce": po.MatmulAllReduce,
         "matmul_all_to_all": po.MatmulAllToAll}
#: the transports that refuse an empty call (ValueError on every rank; the others serve it)
REFUSING = {("all_gather_matmul", "stores"), ("matmul_reduce_scatter", "signal_copy_engine")}
#: named transports that make no agreement (docs/reliability.md: the plain path's cost is the
#: collective library's alone): a rank with no rows returns from its all-reduce of no bytes
#: while its peers wait in theirs, as with any call whose sizes differ across the ranks
UNAGREED = {("gemv_all_reduce", "sequential")}


def _contexts(world, ops=None, timeout_s=5):
    """(op, transport, context) of every op's every transport that runs on emulated ranks."""
    for op, cls in GEMMS.items():
        for t in cls.TRANSPORTS:
            if t != "torch_fused" and (ops is None or op in ops):
                yield op, t, cls(world, 16, 16, transport=t, timeout_s=timeout_s)
    for t in po.AllGatherMatmul.TRANSPORTS:
        if t != "torch_fused" and (ops is None or "all_gather_matmul" in ops):
            yield "all_gather_matmul", t, po.AllGatherMatmul(world, 256, transport=t,
                                                             timeout_s=timeout_s)
    for t in po.GemvAllReduce.TRANSPORTS:
        if t != "torch_fused" and (ops is None or "gemv_all_reduce" in ops):
            yield "gemv_all_reduce", t, po.GemvAllReduce(world, 16, transport=t,
                                                         timeout_s=timeout_s)


def _call(op, ctx, M, gen, out=None, ref=True):
    """One call of ``op`` on ``M`` rows and its reference result (None without ``ref``: the
    reference's own collectives would not match where the ranks' shapes differ)."""
    a = torch.randn(M, K + ctx.rank, generator=gen)  # each rank's K shard its own (not AG)
    if op == "all_gather_matmul":
        a = torch.randn(M, K, generator=gen)
        b = torch.randn(K, N, generator=gen)
        return ctx(a, b, out=out), ref and po.all_gather_matmul_reference(a, b, ctx.world.group)
    if op == "gemv_all_reduce":
        w = torch.randn(N, a.shape[1], generator=gen)
        return ctx(a, w, out), ref and po.gemv_all_reduce_reference(a, w, ctx.world.group)
    b = torch.randn(a.shape[1], N, generator=gen)
    bias = torch.randn(N, generator=gen)
    y = ctx(a, b, bias, out=out)
    return y, ref and getattr(po, f"{op}_reference")(a, b, ctx.world.group) + bias


def _rows_out(op, M, W):
    return {"matmul_reduce_scatter": M // W, "all_gather_matmul": W * M}.get(op, M)


def _outcome(fn):
    try:
        return fn()
    except (po.PortableOverlapError, ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"


def _empty_everywhere(world, ops):
    W = world.world_size
    gen = torch.Generator().manual_seed(3 + world.rank)
    got = {}
    for op, t, ctx in _contexts(world, ops):
        try:
            for given_out in (False, True):
                out = torch.full((0, N), float("nan")) if given_out else None

                def empty():
                    y, ref = _call(op, ctx, 0, gen, out)
                    return (tuple(y.shape), tuple(ref.shape), y.dtype == ref.dtype,
                            out is None or y is out)
                got[f"{op} {t} out={given_out}"] = _outcome(empty)
            # the ranks are still in step: a call with rows after the empty ones
            M = 2 * W
            out = torch.full((_rows_out(op, M, W), N), float("nan"))
            y, ref = _call(op, ctx, M, gen, out)
            got[f"{op} {t} then"] = rel_err(y, ref)
        finally:
            ctx.close()
    return got


def _check_empty(results, W):
    for got in results:
        for case, v in got.items():
            op, t = case.split()[:2]
            if case.endswith("then"):
                assert v < 1e-5, (case, v)
            elif (op, t) in REFUSING:
                assert v.startswith("ValueError") and "0 rows" in v, (case, v)
            else:
                want = (0, N)
                assert v == (want, want, True, True), (case, v)


def test_no_rows_on_every_rank_gives_an_empty_result(world2):
    _check_empty(world2.run(_empty_everywhere, None, timeout=600), 2)


def test_no_rows_on_four_ranks(world4):
    _check_empty(world4.run(_empty_everywhere, ("matmul_reduce_scatter", "gemv_all_reduce"),
                            timeout=600), 4)


def _rows_on_one_rank(world):
    """Rank 0 calls with no rows, the others with rows: every rank raises in that call."""
    W = world.world_size
    gen = torch.Generator().manual_seed(11 + world.rank)
    got = {}
    # (no wait here ends at the timeout: a longer one costs nothing and keeps a peer slowed
    # by a loaded machine from breaking the context, which the next call would then meet)
    for op, t, ctx in _contexts(world, timeout_s=20):
        if (op, t) in UNAGREED:
            ctx.close()
            continue
        try:
            M = 0 if world.rank == 0 else 2 * W
            got[f"{op} {t}"] = _outcome(lambda: _call(op, ctx, M, gen, ref=False)[0].shape)
            y, ref = _call(op, ctx, 2 * W, gen)
            got[f"{op} {t} then"] = rel_err(y, ref)
        finally:
            ctx.close()
    return got


def test_no_rows_on_one_rank_raises_on_every_rank(world2):
    for got in world2.run(_rows_on_one_rank, timeout=600):
        for case, v in got.items():
            if case.endswith("then"):
                assert v < 1e-5, (case, v)
            else:
                assert isinstance(v, str) and ("RankMismatchError" in v or "gave up" in v
                                               or "0 rows" in v), (case, v)


def _no_columns(world):
    """K = 0 (an empty K shard) through the K-split GEMM patterns: torch's ``[M, 0] @ [0, N]``
    is zeros, so a rank with no K columns adds nothing to the reduction (its peers' K shards
    still do), and a GEMM + All-to-All sends zero rows. Every rank with K = 0, then one rank
    only, on every transport, the outputs poisoned first. AllGather + GEMM keeps refusing it
    (its K is matched across the ranks); N = 0 is refused on every op."""
    W, r = world.world_size, world.rank
    gen = torch.Generator().manual_seed(17 + r)
    got = {}
    for op, t, ctx in _contexts(world, (*GEMMS, "all_gather_matmul")):
        try:
            ref_of = getattr(po, f"{op}_reference", None)
            rows = _rows_out(op, 2 * W, W)
            for who in ("every rank", "rank 0"):
                if op == "all_gather_matmul":
                    break
                k = 0 if who == "every rank" or r == 0 else K
                a = torch.randn(2 * W, k, generator=gen)
                b = torch.randn(k, N, generator=gen)
                bias = torch.randn(N, generator=gen)
                out = torch.full((rows, N), float("nan"))
                y = _outcome(lambda: ctx(a, b, bias, out=out))
                ref = ref_of(a if k else torch.zeros(2 * W, 1),
                             b if k else torch.zeros(1, N), world.group) + bias
                got[f"{op} {t} K=0 on {who}"] = rel_err(y, ref) if y is out else y
            if op == "all_gather_matmul":
                got[f"{op} {t} K=0"] = _outcome(
                    lambda: ctx(torch.randn(4, 0), torch.randn(0, N)))
            got[f"{op} {t} N=0"] = _outcome(lambda: ctx(torch.randn(4, K), torch.randn(K, 0)))
            y, ref = _call(op, ctx, 2 * W, gen)
            got[f"{op} {t} then"] = rel_err(y, ref)
        finally:
            ctx.close()
    return got


def _check_no_columns(results):
    for got in results:
        for case, v in got.items():
            if case.endswith("then") or " on " in case:
                assert isinstance(v, float) and v < 1e-5, (case, v)
            else:
                dim = case.split()[-1][0]
                assert v.startswith("ValueError") and f"{dim} must be >= 1" in v, (case, v)


def test_no_columns_gives_the_collective_of_zeros(world2):
    _check_no_columns(world2.run(_no_columns, timeout=900))


def test_no_columns_on_three_ranks(world3):
    _check_no_columns(world3.run(_no_columns, timeout=900))


# --- the modules -------------------------------------------------------------------------------

def _linear_layers(world):
    """Each layer's fused module against the reference one (fused=False, same weights) on no
    rows, forward and backward, then on rows."""
    W = world.world_size
    IN, OUT = 4 * W, 3 * W
    torch.manual_seed(0)
    got = {}
    layers = {
        "row all_reduce": lambda f: po.RowParallelLinear(IN, OUT, world, bias=True, fused=f,
                                                         dtype=torch.float32, max_rows=128),
        "row reduce_scatter": lambda f: po.RowParallelLinear(
            IN, OUT, world, bias=True, fused=f, dtype=torch.float32, reduce="reduce_scatter",
            max_rows=16),
        "column": lambda f: po.ColumnParallelLinear(IN, OUT, world, bias=True, fused=f,
                                                    dtype=torch.float32, max_rows=16)}
    for name, make in layers.items():
        fused, ref = make(True), make(False)
        with torch.no_grad():
            ref.weight.copy_(torch.randn_like(ref.weight))
            ref.bias.copy_(torch.randn_like(ref.bias))
            fused.weight.copy_(ref.weight)
            fused.bias.copy_(ref.bias)
        cols = fused.weight.shape[1]
        shapes = [(0, cols), (2 * W, cols)]
        if name == "row all_reduce":
            shapes[1:1] = [(3, 0, cols)]  # a batch of empty sequences
        try:
            for shape in shapes:
                x = torch.randn(*shape, generator=torch.Generator().manual_seed(world.rank))
                xs = [x.clone().requires_grad_(True) for _ in range(2)]
                ys = [m(v) for m, v in zip((fused, ref), xs)]
                for y in ys:
                    y.sum().backward()
                got[f"{name} {list(shape)}"] = (
                    tuple(ys[0].shape), tuple(ys[1].shape), rel_err(ys[0], ys[1]),
                    tuple(xs[0].grad.shape) == tuple(x.shape),
                    rel_err(xs[0].grad, xs[1].grad),
                    rel_err(fused.weight.grad, ref.weight.grad),
                    rel_err(fused.bias.grad, ref.bias.grad))
                for m in (fused, ref):
                    m.zero_grad()
        finally:
            fused.close()
    return got


def test_linear_layers_take_no_rows_forward_and_backward(world2):
    for got in world2.run(_linear_layers, timeout=600):
        for case, (shape, ref_shape, err, grad_shape, *grad_errs) in got.items():
            assert shape == ref_shape and grad_shape, (case, shape, ref_shape)
            if "[0," in case or ", 0," in case:
                assert 0 in shape, (case, shape)
            assert err < 1e-5 and all(e < 1e-5 for e in grad_errs), (case, err, grad_errs)


def _embedding_no_bags(world):
    """A global batch of 0 bags (every rank's lengths empty), with and without a gradient,
    then one with bags on the same context."""
    from test_embedding_alltoall import _input, ROWS

    from portable_overlap.ops.embedding_alltoall import (EmbeddingAllToAll,
                                                         embedding_all_to_all,
                                                         embedding_all_to_all_reference)

    W = world.world_size
    gen = torch.Generator().manual_seed(5 + world.rank)
    got = {}
    for t in ("stores", "sequential"):
        ctx = EmbeddingAllToAll(world, ROWS, 8, max_local_batch=3, transport=t, timeout_s=5)
        try:
            for splits in ([0] * W, [2] * W):
                weight, lengths, indices, _ = _input(ctx, splits, gen, torch.float32, False)
                out = torch.full(ctx.output_shape(splits), float("nan"))
                ctx(weight, lengths, indices, batch_splits=splits, out=out)
                ref = embedding_all_to_all_reference(weight, lengths, indices, None, ctx.plan,
                                                     world.rank, splits, "sum", world.group)
                got[f"{t} {splits}"] = (tuple(out.shape), tuple(ref.shape),
                                        rel_err(out, ref) if ref.numel() else 0.0)
            weight, lengths, indices, _ = _input(ctx, [0] * W, gen, torch.float32, False)
            weight.requires_grad_(True)
            y = embedding_all_to_all(weight, lengths, indices, ctx, batch_splits=[0] * W)
            y.sum().backward()
            got[f"{t} backward"] = (tuple(y.shape), tuple(weight.grad.shape),
                                    float(weight.grad.abs().sum()))
        finally:
            ctx.close()
    return got


def test_embedding_with_no_bags(world2):
    for got in world2.run(_embedding_no_bags, timeout=600):
        for case, v in got.items():
            if case.endswith("backward"):
                shape, grad_shape, grad_sum = v
                assert shape[0] == 0 and grad_shape[0] > 0 and grad_sum == 0.0, (case, v)
                continue
            shape, ref_shape, err = v
            assert shape == ref_shape and err < 1e-5, (case, v)
            if "[0," in case:
                assert shape[0] == 0, (case, shape)


def _moe_no_tokens(world, fused, train):
    """The MoE layer with no tokens on every rank, then with tokens; with ``train`` the
    backward too."""
    H = 8
    layer = po.ExpertParallelMoE(world, H, 12, 2 * world.world_size, 2, max_tokens=8,
                                 dtype=torch.float32, fused=fused)
    got = {}
    try:
        for S in (0, 5):
            x = torch.randn(S, H, generator=torch.Generator().manual_seed(world.rank),
                            requires_grad=train)
            with torch.set_grad_enabled(train):
                y = layer(x)
                if train:
                    y.sum().backward()
            got[S] = (tuple(y.shape), bool(torch.isfinite(y).all()),
                      None if not train else tuple(x.grad.shape),
                      None if not train else bool(torch.isfinite(layer.w_down.grad).all()))
            layer.zero_grad()
    finally:
        layer.close()
    return got


@pytest.mark.parametrize("fused,train", [(True, False), (True, True), (False, True)],
                         ids=["fused", "fused_backward", "torch_backward"])
def test_moe_layer_with_no_tokens(world2, fused, train):
    for got in world2.run(_moe_no_tokens, fused, train, timeout=600):
        for S, (shape, finite, grad_shape, w_finite) in got.items():
            assert shape == (S, 8) and finite, (S, shape)
            if train:
                assert grad_shape == (S, 8) and w_finite, (S, grad_shape, w_finite)


# --- torch.compile's fake implementations --------------------------------------------------------

def _fakes(world):
    from torch._subclasses.fake_tensor import FakeTensorMode

    got = {}
    W = world.world_size
    for op, t, ctx in _contexts(world, ("matmul_reduce_scatter", "all_gather_matmul",
                                        "gemv_all_reduce", "matmul_all_to_all")):
        if t != "sequential":
            ctx.close()
            continue
        try:
            a = torch.randn(0, K)
            b = torch.randn(N, K) if op == "gemv_all_reduce" else torch.randn(K, N)
            real = SPECS[op].op(a, b, ctx.handle)
            with FakeTensorMode() as mode:
                fake = SPECS[op].op(mode.from_tensor(a), mode.from_tensor(b), ctx.handle)
            got[op] = (tuple(real.shape), tuple(fake.shape), _rows_out(op, 0, W))
        finally:
            ctx.close()
    return got


def test_fake_implementations_of_no_rows(world2):
    for got in world2.run(_fakes):
        assert len(got) == 4, got
        for op, (real, fake, rows) in got.items():
            assert real == fake == (rows, N), (op, real, fake)
