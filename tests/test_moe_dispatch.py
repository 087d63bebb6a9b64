"""Device-initiated MoE dispatch on CPU-emulated ranks against the all_to_all_single reference:
routings (balanced, Zipf, all tokens to one rank, experts and ranks with no rows, ranks with no
tokens), every dtype, int32 / int64 ids, repeated calls on changing routing, the combine fed by
the dispatch's own buffers, and the faults (bad ids, capacity overflow, a skipped call, bad
arguments)."""
import pytest
import torch
import triton
import triton.language as tl

from portable_overlap import InvalidInputError, PeerTimeoutError
from portable_overlap.ops.matmul import MatmulConfig
from portable_overlap.ops.moe_combine import MoeGemmCombine, moe_gemm_combine_reference
from portable_overlap.ops.moe_dispatch import MoeDispatch, moe_dispatch, moe_dispatch_reference
from portable_overlap.shmem import SymmetricHeap
from portable_overlap.shmem.device import peer_ptr
from portable_overlap.shmem.heap import heap_bytes
from portable_overlap.shmem.providers import ShmemUnavailable
from portable_overlap.testing import call_while_peers_skip
from portable_overlap.testing.routing import with_fault

SMALL = MatmulConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1)


def route(kind, S, E_total, k, rank, W, g):
    """top-k expert ids [S, k] (distinct per token) for a routing pattern."""
    scores = torch.rand(S, E_total, generator=g)
    if kind == "zipf":  # expert popularity ~ 1 / rank^1.2
        scores = scores * (1.0 / torch.arange(1, E_total + 1).float() ** 1.2)
    elif kind == "one_rank":  # every token's experts on the last rank (k <= its experts)
        scores[:, : E_total - E_total // W] = -1
    elif kind == "first_expert":  # every token's first choice is expert 0; experts left empty
        scores[:, 0] = 2
        scores[:, 1: E_total // 2] = -1
    return scores.topk(k, dim=1).indices


def _check(world, x, counts, slots, ref):
    """The dispatch's (x, counts, slots) against the reference's: same counts, and the first
    counts.sum() rows and slots equal (row order is the reference's exactly)."""
    xr, cr, sr = ref
    R = xr.shape[0]
    assert torch.equal(counts, cr), (counts, cr)
    assert torch.equal(slots[:R], sr), (slots[:R], sr)
    assert torch.equal(x[:R], xr)
    return R


def _cases(world, dtype, cases, id_dtype=torch.int64, capacity=None, dedup=None):
    """Each case: (S per rank, H, experts_per_rank, k, routing), one context for all of them;
    the receive buffers are poisoned before each call."""
    W, r = world.world_size, world.rank
    _, H, El, k, _ = cases[0]
    ctx = MoeDispatch(world, max_tokens=max(max(c[0]) for c in cases), top_k=k, hidden=H,
                      experts_per_rank=El, dtype=dtype, capacity=capacity, dedup=dedup)
    assert ctx.dedup == (dedup if dedup is not None else ctx.dedup)
    rows = []
    try:
        for i, (S_per_rank, _, _, _, kind) in enumerate(cases):
            g = torch.Generator().manual_seed(1000 * i + r)
            S = S_per_rank[r % len(S_per_rank)]
            tokens = torch.randn(S, H, generator=g).to(dtype)
            ids = route(kind, S, El * W, k, r, W, g).to(id_dtype)
            ctx.recv.fill_(float("nan") if dtype.is_floating_point else -1)
            ctx.recv_slots.fill_(-7)
            if ctx.dedup:
                ctx.kernel().rows_once.fill_(float("nan") if dtype.is_floating_point else -1)
            x, counts, slots = moe_dispatch(tokens, ids, ctx)
            ctx.synchronize()
            rows.append(_check(world, x, counts, slots,
                               moe_dispatch_reference(tokens, ids, El, world.group)))
    finally:
        ctx.close()
    return rows


# odd H, ranks holding different token counts (one with none), a token's choices spread over
# ranks, every choice on one rank, experts without rows
CASES = [((13, 6), 20, 2, 2, "uniform"), ((9, 9), 20, 2, 2, "zipf"),
         ((7, 11), 20, 2, 2, "one_rank"), ((0, 5), 20, 2, 2, "first_expert"),
         ((17, 3), 20, 2, 2, "uniform")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=lambda d: str(d)[6:])
def test_matches_reference(world, dtype):
    for rows in world.run(_cases, dtype, CASES):
        assert len(rows) == len(CASES)


def test_int32_ids_top1_and_wide_top_k(world2):
    world2.run(_cases, torch.float32, [((9, 4), 33, 1, 1, "uniform"), ((5, 8), 33, 1, 1, "zipf")],
               torch.int32)
    world2.run(_cases, torch.float32, [((6, 7), 8, 5, 7, "uniform"), ((6, 7), 8, 5, 7, "zipf")])


def test_capacity_that_fits_exactly(world2):
    # every rank receives at most S*k*W rows; a capacity of the largest actual total is enough
    world2.run(_cases, torch.float32, [((8, 8), 16, 2, 2, "uniform")], capacity=32)


def _then_combine(world):
    """dispatch -> the combine, on the dispatch's own buffers (x of `capacity` rows, of which
    the first counts.sum() are this call's), three calls with new routing each."""
    W, r, H, I, El, k = world.world_size, world.rank, 12, 8, 2, 2
    disp = MoeDispatch(world, max_tokens=10, top_k=k, hidden=I, experts_per_rank=El,
                       dtype=torch.float32)
    comb = MoeGemmCombine(world, max_tokens=10, top_k=k, hidden=H, experts_per_rank=El,
                          config=SMALL)
    errs = []
    try:
        for call in range(3):
            g = torch.Generator().manual_seed(31 * call + r)
            S = 4 + (r + call) % 5
            tokens = torch.randn(S, I, generator=g)
            ids = route("uniform" if call % 2 else "zipf", S, El * W, k, r, W, g)
            w = torch.randn(El, I, H, generator=g) / I ** 0.5
            tw = torch.softmax(torch.randn(S, k, generator=g), dim=1)
            x, counts, slots = moe_dispatch(tokens, ids, disp)
            out = torch.full((S, H), float("nan"))
            comb(x, w, counts, slots, tw, out=out)
            comb.synchronize()
            disp.synchronize()
            xr, cr, sr = moe_dispatch_reference(tokens, ids, El, world.group)
            ref = moe_gemm_combine_reference(xr, w, cr, sr, tw, world.group)
            errs.append(((out - ref).norm() / ref.norm()).item())
    finally:
        comb.close()
        disp.close()
    return errs


def test_feeds_the_combine(world):
    for errs in world.run(_then_combine):
        assert all(e < 1e-5 for e in errs), errs


def _sequential(world):
    W, r = world.world_size, world.rank
    ctx = MoeDispatch(world, max_tokens=8, top_k=2, hidden=16, experts_per_rank=2,
                      dtype=torch.float32, transport="sequential")
    try:
        g = torch.Generator().manual_seed(5 + r)
        tokens = torch.randn(7, 16, generator=g)
        ids = route("zipf", 7, 2 * W, 2, r, W, g)
        x, counts, slots = moe_dispatch(tokens, ids, ctx)
        return _check(world, x, counts, slots,
                      moe_dispatch_reference(tokens, ids, 2, world.group))
    finally:
        ctx.close()


def test_sequential_transport(world2):
    world2.run(_sequential)


def _sequential_refusal(world):
    """The "sequential" transport, rank 0 alone refusing a call (more tokens than max_tokens,
    then inputs that require grad): rank 1 raises for the same call instead of pairing it with
    rank 0's next call (or waiting in the counts exchange), and the next call is right
    on both ranks."""
    from portable_overlap import PeerTimeoutError

    W, El, k, H = world.world_size, 2, 2, 8
    ctx = MoeDispatch(world, max_tokens=6, top_k=k, hidden=H, experts_per_rank=El,
                      dtype=torch.float32, transport="sequential")
    g = torch.Generator().manual_seed(world.rank)
    res = []
    try:
        for S, grad in ((7 if world.rank == 0 else 4, False), (4, world.rank == 0)):
            tokens = torch.randn(S, H, generator=g).requires_grad_(grad)
            ids = torch.rand(S, El * W, generator=g).topk(k, 1).indices
            try:
                moe_dispatch(tokens, ids, ctx)
                res.append("ok")
            except (ValueError, RuntimeError) as e:
                res.append(type(e).__name__ if isinstance(e, PeerTimeoutError) else "refused")
        tokens = torch.randn(5, H, generator=g)
        ids = torch.rand(5, El * W, generator=g).topk(k, 1).indices
        x, counts, slots = moe_dispatch(tokens, ids, ctx)
        _check(world, x, counts, slots, moe_dispatch_reference(tokens, ids, El, world.group))
        return res
    finally:
        ctx.close()


def test_sequential_transport_refusal_on_one_rank(world2):
    assert world2.run(_sequential_refusal, timeout=60) == [["refused"] * 2,
                                                           ["PeerTimeoutError"] * 2]


def _bad_ids(world, fault, dedup=None):
    """Rank 1 passes an expert id out of range (or routes past a rank's capacity); every rank
    raises for that call, and the context serves the next call correctly."""
    W, r, El, k, S, H = world.world_size, world.rank, 2, 2, 6, 8
    ctx = MoeDispatch(world, max_tokens=8, top_k=k, hidden=H, experts_per_rank=El,
                      dtype=torch.float32, capacity=W * S * k - 1, timeout_s=30.0, dedup=dedup)
    try:
        g = torch.Generator().manual_seed(90 + r)
        tokens = torch.randn(S, H, generator=g)
        ids = route("uniform", S, El * W, k, r, W, g)
        ids = with_fault(ids, fault, r, El * W)
        try:
            x, counts, slots = moe_dispatch(tokens, ids, ctx)
            ctx.synchronize()
            res = "ok"
        except InvalidInputError as e:
            res = "invalid: " + str(e)
        g = torch.Generator().manual_seed(95 + r)
        tokens = torch.randn(S, H, generator=g)
        ids = route("uniform", S, El * W, k, r, W, g)
        x, counts, slots = moe_dispatch(tokens, ids, ctx)
        ctx.synchronize()
        _check(world, x, counts, slots, moe_dispatch_reference(tokens, ids, El, world.group))
        return res
    finally:
        ctx.close()


@pytest.mark.parametrize("fault, dedup", [("id", None), ("negative", None), ("capacity", None),
                                          ("id", True), ("capacity", True)])
def test_bad_routing_raises_on_every_rank(world2, fault, dedup):
    res = world2.run(_bad_ids, fault, dedup, timeout=200)
    assert all(r.startswith("invalid") for r in res), res
    if fault == "capacity":
        assert all("capacity" in r and "[0]" in r for r in res), res
    else:
        assert "expert id" in res[1], res


def _overflow_counts(world):
    """On an overflow the receiving rank's counts are zeros (no row past its buffer is ever
    named), so a combine launched before the error is seen reads nothing out of bounds."""
    ctx = MoeDispatch(world, max_tokens=8, top_k=1, hidden=8, experts_per_rank=1,
                      dtype=torch.float32, capacity=8)
    try:
        ids = torch.zeros(8, 1, dtype=torch.int64)  # W * 8 rows for rank 0
        try:  # (the interpreter raises with the call, a GPU at the next check)
            moe_dispatch(torch.randn(8, 8), ids, ctx)
            ctx.synchronize()
        except InvalidInputError:
            pass
        return ctx.counts.clone()
    finally:
        ctx.close()


def test_overflowing_rank_reports_zero_counts(world2):
    counts = world2.run(_overflow_counts)
    assert int(counts[0].sum()) == 0 and int(counts[1].sum()) == 0, counts


def _sequential_overflow_then_combine(world):
    """The "sequential" dispatch feeding the combine, three calls; in the second every token
    goes to rank 0's expert, past its capacity. Every rank raises in that dispatch call (so
    none goes on to the combine alone, where its peers never come), and the next call, within
    capacity, is right on both contexts."""
    r, S, H, I, El, k = world.rank, 4, 8, 8, 1, 1
    disp = MoeDispatch(world, max_tokens=S, top_k=k, hidden=I, experts_per_rank=El,
                       dtype=torch.float32, transport="sequential", capacity=S + 1)
    comb = MoeGemmCombine(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El,
                          config=SMALL, timeout_s=3.0)
    res = []
    try:
        for call in range(3):
            g = torch.Generator().manual_seed(31 * call + r)
            tokens = torch.randn(S, I, generator=g)
            ids = torch.full((S, k), 0 if call == 1 else r)
            w = torch.randn(El, I, H, generator=g) / I ** 0.5
            tw = torch.rand(S, k, generator=g)
            xr, cr, sr = moe_dispatch_reference(tokens, ids, El, world.group)
            ref = moe_gemm_combine_reference(xr, w, cr, sr, tw, world.group)
            try:
                x, counts, slots = moe_dispatch(tokens, ids, disp)
                out = comb(x, w, counts, slots, tw)
                comb.synchronize()
                res.append(((out - ref).norm() / ref.norm()).item())
            except Exception as e:
                res.append(type(e).__name__ + (": capacity" if "capacity" in str(e) else ""))
    finally:
        comb.close()
        disp.close()
    return res


def test_sequential_capacity_overflow_raises_on_every_rank(world2):
    for res in world2.run(_sequential_overflow_then_combine, timeout=120):
        assert res[1] == "InvalidInputError: capacity", res
        assert res[0] < 1e-5 and res[2] < 1e-5, res


def _bad_host(world):
    ctx = MoeDispatch(world, max_tokens=8, top_k=2, hidden=16, experts_per_rank=2,
                      dtype=torch.float32)
    t, ids = torch.randn(6, 16), torch.randint(0, 2 * world.world_size, (6, 2))
    msgs = []
    for args in [(t.double(), ids), (t[:, :8], ids), (t, ids.float()), (t, ids[:5]),
                 (t, ids[:, :1]), (torch.randn(9, 16), torch.zeros(9, 2, dtype=torch.int64)),
                 (t.t().contiguous().t(), ids), (t, ids.t().contiguous().t())]:
        try:
            ctx(*args)
            msgs.append(None)
        except (TypeError, ValueError) as e:
            msgs.append(str(e))
    # after the refused calls the ranks are still in step
    g = torch.Generator().manual_seed(world.rank)
    tokens = torch.randn(5, 16, generator=g)
    ids = route("uniform", 5, 2 * world.world_size, 2, world.rank, world.world_size, g)
    x, counts, slots = ctx(tokens, ids)
    ctx.synchronize()
    _check(world, x, counts, slots, moe_dispatch_reference(tokens, ids, 2, world.group))
    ctx.close()
    return msgs


def test_bad_input_raises_before_launch(world2):
    for msgs in world2.run(_bad_host):
        assert all(m and m.startswith("moe_dispatch") for m in msgs), msgs
        assert "max_tokens" in msgs[5] and "contiguous" in msgs[6], msgs


def _one_strided_token(world):
    """A single token whose row is a strided view ([1, H], column stride 2): refused on every
    rank before anything is launched (the kernels read a row with unit stride), and the next
    call is right."""
    ctx = MoeDispatch(world, max_tokens=4, top_k=2, hidden=16, experts_per_rank=2,
                      dtype=torch.float32)
    g = torch.Generator().manual_seed(world.rank)
    ids = torch.rand(1, 2 * world.world_size, generator=g).topk(2, 1).indices
    try:
        try:
            ctx(torch.randn(1, 32, generator=g)[:, ::2], ids)
            ctx.synchronize()
            msg = None
        except ValueError as e:
            msg = str(e)
        tokens = torch.randn(1, 16, generator=g)
        x, counts, slots = ctx(tokens, ids)
        ctx.synchronize()
        _check(world, x, counts, slots, moe_dispatch_reference(tokens, ids, 2, world.group))
        return msg
    finally:
        ctx.close()


def test_a_single_strided_token_is_refused(world2):
    for msg in world2.run(_one_strided_token):
        assert msg and msg.startswith("moe_dispatch") and "contiguous rows" in msg, msg


def _bad_ctx(world):
    msgs = []
    for kw in (dict(transport="nvlink"), dict(top_k=0), dict(capacity=0),
               dict(experts_per_rank=4096), dict(dtype=torch.int8)):
        args = dict(max_tokens=8, top_k=2, hidden=16, experts_per_rank=2)
        args.update(kw)
        try:
            MoeDispatch(world, **args)
            msgs.append(None)
        except (TypeError, ValueError) as e:
            msgs.append(str(e))
    return msgs


def test_bad_context_arguments(world2):
    for msgs in world2.run(_bad_ctx):
        assert all(msgs), msgs
        assert "transport" in msgs[0] and "top_k" in msgs[1] and "capacity" in msgs[2]
        assert "experts" in msgs[3] and "dtype" in msgs[4]


def _skip(world):
    return call_while_peers_skip(
        world, lambda: MoeDispatch(world, max_tokens=4, top_k=1, hidden=8, experts_per_rank=1,
                                   dtype=torch.float32, timeout_s=1.0),
        lambda ctx: ctx(torch.randn(2, 8), torch.tensor([[0], [1]])))


def test_a_rank_that_skips_a_call_is_named(world2):
    msg = world2.run(_skip, timeout=120)[0]
    assert "rank 1" in msg and "routing-counts" in msg, msg


def _late_consumer(world):
    """The last rank reads its received rows late (a slow consumer); the other ranks' next
    calls must wait for it before storing into its buffer again: each call's rows are checked
    right after it, on every rank."""
    import time

    W, r, El, k = world.world_size, world.rank, 1, 1
    ctx = MoeDispatch(world, max_tokens=6, top_k=k, hidden=8, experts_per_rank=El,
                      dtype=torch.float32, timeout_s=10.0)
    try:
        for call in range(3):
            g = torch.Generator().manual_seed(7 * call + r)
            tokens = torch.randn(6, 8, generator=g)
            ids = torch.full((6, 1), W - 1)  # everything to the last rank
            x, counts, slots = moe_dispatch(tokens, ids, ctx)
            if r == W - 1:
                time.sleep(0.5)
            _check(world, x, counts, slots, moe_dispatch_reference(tokens, ids, El, world.group))
        ctx.synchronize()
    finally:
        ctx.close()


def test_a_late_consumer_loses_no_rows(world):
    world.run(_late_consumer, timeout=200)


def _torch_op(world):
    W, r = world.world_size, world.rank
    ctx = MoeDispatch(world, max_tokens=8, top_k=2, hidden=16, experts_per_rank=2,
                      dtype=torch.float32)
    try:
        g = torch.Generator().manual_seed(3 + r)
        tokens = torch.randn(6, 16, generator=g)
        ids = route("uniform", 6, 2 * W, 2, r, W, g)
        x, counts, slots = torch.ops.portable_overlap.moe_dispatch(tokens, ids, ctx.handle)
        _check(world, x, counts, slots, moe_dispatch_reference(tokens, ids, 2, world.group))
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode() as mode:
            ft, fi = mode.from_tensor(tokens), mode.from_tensor(ids)
            fx, fc, fs = torch.ops.portable_overlap.moe_dispatch(ft, fi, ctx.handle)
        return tuple(fx.shape), tuple(fc.shape), fc.dtype, tuple(fs.shape), ctx.capacity
    finally:
        ctx.close()


def test_torch_op_and_fake(world2):
    for fx, fc, dt, fs, cap in world2.run(_torch_op):
        assert fx == (cap, 16) and fc == (2, 2) and dt == torch.int32 and fs == (cap,)


# -- the "shmem" transport ------------------------------------------------------------------------
# No SHMEM library runs on the CPU: the refusals are checked as they are, the kernel body over a
# stand-in provider whose symmetric memory is a heap of the emulated ranks' shared memory (one
# address names every rank's copy through its table of bases, as the library's symmetric
# addresses do) and whose put copies through that table.

_SYM_BASES = 0  # the stand-in's table of bases (an address) and this rank, read by its put
_SYM_RANK = 0


@triton.jit
def _stand_in_put(dst, src, n, peer):
    """The library's put: ``n`` elements from local ``src`` to ``peer``'s copy of ``dst``."""
    bases = tl.cast(_SYM_BASES, tl.int64).to(tl.pointer_type(tl.int64))
    d = peer_ptr(dst, bases, _SYM_RANK, peer)
    for c in range(0, n, 32):
        offs = c + tl.arange(0, 32)
        tl.store(d + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _stand_in_flush():
    """The stand-in's copies are done when they return."""
    pass


class _StandInShmem:
    """A SHMEM provider on emulated ranks (see above); records what the context asked of it."""

    def __init__(self, world):
        self.world, self.heaps, self.wrapped = world, [], []

    def symmetric_empty(self, nbytes):
        global _SYM_BASES, _SYM_RANK
        heap = SymmetricHeap(self.world, heap_bytes([((nbytes,), torch.uint8)]))
        self.heaps.append(heap)
        _SYM_BASES, _SYM_RANK = heap.bases.data_ptr(), self.world.rank
        return heap.alloc((nbytes,), torch.uint8)

    def wrap(self, kernel):
        self.wrapped.append(kernel.fn.__name__)
        return kernel


def _with_provider(world, lookup, fn):
    """``fn()`` on this rank with the provider lookup replaced by ``lookup`` and the put
    kernel's library calls by the stand-in's; the stand-in's memory freed afterwards."""
    import portable_overlap.ops.moe_dispatch.kernel as kernel
    import portable_overlap.shmem.providers as providers

    saved = providers.get_provider, kernel.shmem_put, kernel.shmem_flush
    providers.get_provider, kernel.shmem_put, kernel.shmem_flush = (lookup, _stand_in_put,
                                                                    _stand_in_flush)
    try:
        return fn()
    finally:
        providers.get_provider, kernel.shmem_put, kernel.shmem_flush = saved


def _shmem(world, case):
    """The shmem dispatch over the stand-in library: ``case`` "cases" (the results against the
    reference), "faults" (a bad id, a capacity overflow: raised on every rank, then a right
    call) or "swiglu" (the fused dispatch + GEMM refused, then a right call)."""
    p = _StandInShmem(world)

    def run():
        W, r = world.world_size, world.rank
        if case == "cases":
            ctx = MoeDispatch(world, max_tokens=17, top_k=2, hidden=20, experts_per_rank=2,
                              dtype=torch.bfloat16, transport="shmem")
        else:
            ctx = MoeDispatch(world, max_tokens=8, top_k=2, hidden=8, experts_per_rank=2,
                              dtype=torch.float32, capacity=W * 6 * 2 - 1, transport="shmem",
                              timeout_s=30.0)
        out = {}
        try:
            # the receive buffers are the library's, the flags the heap's (of the named
            # transport's workspace, ctx.impl)
            ws = ctx.impl
            out["recv in heap"] = [_in_heap(ws, t) for t in (ctx.recv, ctx.recv_slots)]
            out["flags in heap"] = [_in_heap(ws, t) for t in (ws.sent, ws.count_flag)]
            if case == "cases":
                for i, (S_per_rank, H, El, k, kind) in enumerate(CASES):
                    g = torch.Generator().manual_seed(1000 * i + r)
                    S = S_per_rank[r % len(S_per_rank)]
                    tokens = torch.randn(S, H, generator=g).to(torch.bfloat16)
                    ids = route(kind, S, El * W, k, r, W, g)
                    ctx.recv.fill_(float("nan"))
                    ctx.recv_slots.fill_(-7)
                    x, counts, slots = moe_dispatch(tokens, ids, ctx)
                    ctx.synchronize()
                    out[kind, i] = _check(world, x, counts, slots,
                                          moe_dispatch_reference(tokens, ids, El, world.group))
            else:
                g = torch.Generator().manual_seed(90 + r)
                tokens = torch.randn(6, 8, generator=g)
                faults = {"id": route("uniform", 6, 2 * W, 2, r, W, g),
                          "capacity": torch.tensor([[0, 1]] * 6)}  # all rows to rank 0
                if r == 1:
                    faults["id"][3, 1] = 2 * W + 5
                if case == "swiglu":
                    faults = {"swiglu": faults["id"].clone()}
                    faults["swiglu"][3, 1] = 0
                for name, ids in faults.items():
                    try:
                        if name == "swiglu":
                            ctx.dispatch_swiglu(tokens, ids, torch.randn(2, 8, 4),
                                                torch.randn(2, 8, 4))
                        else:
                            moe_dispatch(tokens, ids, ctx)
                        ctx.synchronize()
                        out[name] = "no error"
                    except (InvalidInputError, ValueError) as e:
                        out[name] = f"{type(e).__name__}: {e}"
                    # the next call is right
                    ids = route("zipf", 6, 2 * W, 2, r, W, g)
                    x, counts, slots = moe_dispatch(tokens, ids, ctx)
                    ctx.synchronize()
                    out[name, "next"] = _check(world, x, counts, slots,
                                               moe_dispatch_reference(tokens, ids, 2,
                                                                      world.group))
        finally:
            ctx.close()
        return out

    try:
        out = _with_provider(world, lambda w: p, run)
    except Exception as e:  # told as text: its tensors may be views of the stand-in's memory
        out = {"raised": f"{type(e).__name__}: {e}"}
    finally:
        for heap in p.heaps:
            heap.close()
    out["wrapped"] = p.wrapped
    return out


def _in_heap(ctx, t):
    try:
        ctx.heap.offset_of(t)
        return True
    except ValueError:
        return False


def test_shmem_transport_matches_the_reference(world):
    """Every routing of CASES (ranks with different token counts, one with none, every choice
    on one rank, experts without rows) through the put kernel over the stand-in library."""
    for out in world.run(_shmem, "cases", timeout=300):
        assert "raised" not in out, out
        assert out.pop("recv in heap") == [False, False]
        assert out.pop("flags in heap") == [True, True]
        assert out.pop("wrapped") == ["dispatch_put_kernel"]
        assert len(out) == len(CASES)


def test_shmem_transport_faults_raise_on_every_rank(world2):
    for out in world2.run(_shmem, "faults", timeout=300):
        assert "raised" not in out, out
        assert out["id"].startswith("InvalidInputError") and "expert id" in out["id"], out
        assert "capacity" in out["capacity"] and "[0]" in out["capacity"], out


def test_shmem_transport_refuses_the_fused_dispatch_swiglu(world2):
    for out in world2.run(_shmem, "swiglu", timeout=300):
        assert "raised" not in out, out
        assert out["swiglu"].startswith("ValueError") and "'stores'" in out["swiglu"], out


def _no_library(world):
    """Without a library (the CPU backend as it is), and with it on rank 0 only: what each
    rank raised, and what rank 0's stand-in allocated."""
    p = _StandInShmem(world)
    args = dict(max_tokens=8, top_k=2, hidden=16, experts_per_rank=2, transport="shmem")
    found = []

    def lookup(w):
        if w.rank == 1:
            raise ShmemUnavailable("NVSHMEM unavailable: a stand-in reason")
        return p

    for make in (lambda: MoeDispatch(world, **args),
                 lambda: _with_provider(world, lookup, lambda: MoeDispatch(world, **args))):
        try:
            make().close()
            found.append(None)
        except ShmemUnavailable as e:
            found.append(str(e))
    return found, p.heaps


def test_shmem_transport_without_a_library_raises_on_every_rank_before_allocating(world2):
    for (cpu, half), heaps in world2.run(_no_library):
        assert cpu and cpu.startswith("moe_dispatch") and "'cpu'" in cpu, cpu
        assert "rank 0" in cpu and "rank 1" in cpu and "transport='stores'" in cpu, cpu
        assert half and "rank 1: NVSHMEM unavailable: a stand-in reason" in half, half
        assert "rank 0" not in half, half
        assert heaps == []  # rank 0 allocated nothing: no rank waits in the library


def _one_rank(world):
    p = _StandInShmem(world)
    try:
        _with_provider(world, lambda w: p, lambda: MoeDispatch(
            world, max_tokens=8, top_k=2, hidden=16, experts_per_rank=2, transport="shmem"))
        return None, p.heaps
    except ShmemUnavailable as e:
        return str(e), p.heaps


@pytest.mark.emulated(ranks=1)
def test_shmem_transport_on_one_rank_says_why(monkeypatch):
    """torch's rendezvous of the library's memory refuses a world of one (as Workspace)."""
    from portable_overlap.testing import run_on_ranks

    monkeypatch.delenv("RANK", raising=False)
    [(err, heaps)] = run_on_ranks(_one_rank, ranks=1)
    assert err and "a world of one rank" in err and heaps == [], err


def _late_and_refused(world, sizes, late, refused, dedup=None):
    """One call per token count of ``sizes`` on one context (top-2 of 2 experts per rank, H
    8), the scenario of ``testing.faults.late_and_refused`` (tokens of the wrong width are the
    refused input). The references are made first: they are collective, and would hold the
    ranks in step."""
    from portable_overlap.testing.faults import late_and_refused_per_shape

    W, H, El, k = world.world_size, 8, 2, 2
    inputs = []
    for i, S in enumerate(sizes):
        g = torch.Generator().manual_seed(10 * i + world.rank)
        tokens = torch.randn(S, H, generator=g)
        ids = route("uniform", S, El * W, k, world.rank, W, g)
        inputs.append((tokens, ids, moe_dispatch_reference(tokens, ids, El, world.group)))

    def call(ctx, i, args, bad):
        tokens, ids, ref = args
        x, counts, slots = moe_dispatch(tokens[:, 1:] if bad else tokens, ids, ctx)

        def error():
            R = _check(world, x, counts, slots, ref)
            return 0.0 if R == ref[0].shape[0] else float("nan")
        return error

    return late_and_refused_per_shape(
        world, lambda: MoeDispatch(world, max_tokens=max(sizes), top_k=k, hidden=H,
                                   experts_per_rank=El, dtype=torch.float32, timeout_s=3.0,
                                   dedup=dedup),
        inputs, call, late, refused)


@pytest.mark.parametrize("dedup", [None, True], ids=["default", "dedup"])
def test_a_failed_call_leaves_no_late_rows_for_the_next_call(world4, dedup):
    """Rank 1 refuses a call that rank 3 makes late, then every rank dispatches more tokens
    (other places in the receive buffers). Immune by design, which this guards: a rank stores
    rows only in a call whose routing counts arrived from every rank (the exchange's ``ctl[3]
    = epoch``), and a refused call's never do, so rank 3 stores no row of the failed call."""
    for rank, found in enumerate(world4.run(_late_and_refused, (3, 3, 5), (3, 1), (1, (1,)),
                                            dedup, timeout=120)):
        assert found[:3] == ["no error", "ValueError" if rank == 1 else "PeerTimeoutError",
                             "no error"], (rank, found)
        assert found[3] == 0.0, (rank, found)


# -- dedup: a token sent once per peer rank ------------------------------------------------
# top-3 of 4 experts per rank: tokens reach a rank with several of their experts; a k that does
# not divide the slot block, Zipf routing and every choice on one rank, odd H, a rank with no
# tokens
DEDUP_CASES = [((13, 6), 20, 4, 3, "uniform"), ((9, 9), 20, 4, 3, "zipf"),
               ((7, 11), 20, 4, 3, "one_rank"), ((0, 5), 20, 4, 3, "first_expert")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda d: str(d)[6:])
def test_dedup_matches_reference(world, dtype):
    for rows in world.run(_cases, dtype, DEDUP_CASES, dedup=True):
        assert len(rows) == len(DEDUP_CASES)


# more slot blocks than the scatter has programs (16-slot blocks and 4 programs on the CPU
# backend), with k that does not divide a block: tokens whose choices straddle two blocks sent
# by different programs, among them a block a program takes before the program of the
# block before it runs (the interpreter runs a rank's programs in order)
DEDUP_STRADDLE_CASES = [((40, 33), 12, 4, 3, "uniform"), ((37, 40), 12, 4, 3, "zipf"),
                        ((40, 29), 12, 4, 3, "uniform")]


def test_dedup_tokens_straddling_blocks_of_two_programs(world):
    """A row copied on the receiving side for a token's later slots must have been written by
    a program that side waited for: a token is sent once per slot block it spans."""
    for rows in world.run(_cases, torch.float32, DEDUP_STRADDLE_CASES, dedup=True):
        assert len(rows) == len(DEDUP_STRADDLE_CASES)
    world.run(_cases, torch.float32, [((20, 17), 12, 3, 5, "uniform"),
                                      ((19, 20), 12, 3, 5, "zipf")], dedup=True)


def _rows_sent_once(world):
    """Each peer's tokens land in this rank's ``rows_once`` once each (the rows there that were
    written), fewer than the rows routed here, and the call still matches the reference."""
    import torch.distributed as dist

    W, r, S, H, El, k = world.world_size, world.rank, 12, 8, 4, 3
    ctx = MoeDispatch(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El,
                      dtype=torch.float32, dedup=True)
    try:
        g = torch.Generator().manual_seed(40 + r)
        tokens = torch.randn(S, H, generator=g)
        ids = route("uniform", S, El * W, k, r, W, g)
        ctx.kernel().rows_once.fill_(float("nan"))
        x, counts, slots = moe_dispatch(tokens, ids, ctx)
        ctx.synchronize()
        _check(world, x, counts, slots, moe_dispatch_reference(tokens, ids, El, world.group))
        every = [torch.empty_like(ids) for _ in range(W)]
        dist.all_gather(every, ids, group=world.group)
        found = []
        for q in range(W):
            if q == r:
                continue
            reached = ((every[q] // El) == r).any(dim=1)  # q's tokens with an expert here
            written = ~ctx.kernel().rows_once[q - (q > r)].isnan().any(dim=1)
            routed = int(((every[q] // El) == r).sum())
            found.append((torch.equal(written, reached), int(reached.sum()), routed))
        return found
    finally:
        ctx.close()


def test_dedup_sends_each_token_once_per_rank(world):
    for found in world.run(_rows_sent_once):
        assert all(same and sent <= routed for same, sent, routed in found), found
        assert sum(f[1] for f in found) < sum(f[2] for f in found), found


def test_default_dedup_rule():
    """On where a token reaches a rank with several rows and a full call saves megabytes over
    the links (the DeepSeek-like and Mixtral-like prefill layouts on 2 ranks, DeepSeek-V3's 256
    experts on 8), off at decode sizes, on one rank, and where tokens reach a rank once."""
    from portable_overlap.ops.moe_dispatch.api import default_dedup, rows_per_rank_reached

    assert rows_per_rank_reached(2, 8, 8) == pytest.approx(4.0, rel=1e-3)
    assert rows_per_rank_reached(8, 1, 1) == 1.0
    assert default_dedup(2, 8, 8, 8192, 7168 * 2) and default_dedup(2, 4, 2, 8192, 4096 * 2)
    assert default_dedup(8, 32, 8, 4096, 7168 * 2)
    assert not default_dedup(2, 8, 8, 128, 7168 * 2)  # 5.5 MB saved per call
    assert not default_dedup(1, 8, 8, 8192, 7168 * 2)
    assert not default_dedup(8, 1, 2, 8192, 7168 * 2)  # one expert per rank: nothing to merge


def _chosen_dedup(world, **kw):
    ctx = MoeDispatch(world, dtype=torch.float32, **kw)
    try:
        return ctx.dedup, hasattr(ctx.kernel(), "rows_once")
    finally:
        ctx.close()


def test_dedup_default_and_refusals(world2):
    big = dict(max_tokens=4096, top_k=4, hidden=1024, experts_per_rank=4)  # 12 MB saved
    assert world2.run(_chosen_dedup, **big) == [(True, True)] * 2
    assert world2.run(_chosen_dedup, **dict(big, max_tokens=64)) == [(False, False)] * 2
    # a capacity below the once-rows' buffer (W - 1) * max_tokens: off unless asked for
    assert world2.run(_chosen_dedup, **dict(big, capacity=4000)) == [(False, False)] * 2
    assert world2.run(_chosen_dedup, **dict(big, capacity=4000, dedup=True)) == [(True, True)] * 2
    assert world2.run(_chosen_dedup, **dict(big, dedup=False)) == [(False, False)] * 2
    for bad in (dict(dedup=True, transport="sequential"), dict(dedup=1)):
        msgs = world2.run(_refused, **dict(big, **bad))
        assert all("dedup" in m for m in msgs), msgs


def _refused(world, **kw):
    try:
        MoeDispatch(world, dtype=torch.float32, **kw).close()
    except ValueError as e:
        return str(e)
    return "no error"


def _dedup_strided_int32(world):
    """dedup with int32 ids and tokens whose rows are a wider tensor's (row stride H + 5)."""
    W, r, S, H, El, k = world.world_size, world.rank, 9, 12, 3, 4
    ctx = MoeDispatch(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El,
                      dtype=torch.float16, dedup=True)
    try:
        g = torch.Generator().manual_seed(60 + r)
        tokens = torch.randn(S, H + 5, generator=g).half()[:, :H]
        ids = route("zipf", S, El * W, k, r, W, g).to(torch.int32)
        ctx.recv.fill_(float("nan"))
        x, counts, slots = moe_dispatch(tokens, ids, ctx)
        ctx.synchronize()
        return _check(world, x, counts, slots, moe_dispatch_reference(tokens, ids, El,
                                                                      world.group))
    finally:
        ctx.close()


def test_dedup_with_int32_ids_and_strided_tokens(world2):
    assert all(R > 0 for R in world2.run(_dedup_strided_int32))


def _received_rows_fed_back(world, transport, form):
    """The rows of a call (``x``, a view of the context's receive buffer) passed back as the
    next call's tokens, on one rank only, or its slots as the next call's ids: the call
    overwrites that buffer while it reads them (a peer's rows landed on rank 1's tokens before
    rank 1 sent them, which returned wrong rows with no error under ``"stores"``). Refused on
    that rank before anything is launched, the peers fail the same call, and the next call
    (with a copy) is right on every rank."""
    from portable_overlap.ops.moe_dispatch import moe_dispatch_swiglu
    from portable_overlap.ops.moe_layer import moe_layer

    W, r = world.world_size, world.rank
    El, k, H, inter = 2, 2, 20, 16
    d = MoeDispatch(world, max_tokens=8, top_k=k, hidden=H, experts_per_rank=El,
                    dtype=torch.float32, transport=transport)
    c = MoeGemmCombine(world, max_tokens=8, top_k=k, hidden=H, experts_per_rank=El)
    g = torch.Generator().manual_seed(40 + r)
    wg, wu = (torch.randn(El, H, inter, generator=g) for _ in range(2))
    wd = torch.randn(El, inter, H, generator=g)

    def call(tokens, ids):
        if form == "dispatch":
            return moe_dispatch(tokens, ids, d)
        if form == "dispatch_swiglu":
            return moe_dispatch_swiglu(tokens, ids, wg, wu, d)
        return moe_layer(tokens, ids, torch.rand(tokens.shape[0], k), wg, wu, wd, d, c)

    try:
        tokens = torch.randn(6, H, generator=g)
        ids = torch.rand(6, El * W, generator=g).topk(k, 1).indices
        x, counts, slots = moe_dispatch(tokens, ids, d)
        d.synchronize()
        n = 5
        ids2 = torch.rand(n, El * W, generator=g).topk(k, 1).indices
        msgs = []
        for bad in ("tokens", "topk_ids"):
            t2, i2 = x[:n], ids2
            if bad == "topk_ids":
                t2, i2 = x[:n].clone(), d.recv_slots[:n * k].view(n, k)
            if r != 1:
                t2, i2 = t2.clone(), i2.clone()
            try:
                call(t2, i2)
                d.synchronize()
                c.synchronize()
                msgs.append("no error")
            except (ValueError, PeerTimeoutError) as e:
                msgs.append(f"{type(e).__name__}: {e}")
        tokens = x[:n].clone()
        x2, counts2, slots2 = moe_dispatch(tokens, ids2, d)
        d.synchronize()
        _check(world, x2, counts2, slots2, moe_dispatch_reference(tokens, ids2, El, world.group))
        return msgs
    finally:
        d.close()
        c.close()


@pytest.mark.parametrize("transport, form", [("stores", "dispatch"), ("sequential", "dispatch"),
                                             ("stores", "dispatch_swiglu"),
                                             ("stores", "moe_layer")])
def test_received_rows_fed_back_as_the_next_calls_input_are_refused(world2, transport, form):
    for r, msgs in enumerate(world2.run(_received_rows_fed_back, transport, form)):
        for bad, msg in zip(("tokens", "topk_ids"), msgs):
            if r == 1:
                assert msg.startswith("ValueError") and f"{bad} share memory" in msg \
                    and "receive buffers" in msg, msg
            else:
                assert msg.startswith("PeerTimeoutError") and "gave up" in msg, msg


def _records_grad_on_one_rank(world, transport, decided):
    """``records_grad`` set on rank 0 only (a layer call autograd records there and not on the
    other ranks): RankMismatchError on every rank, at once, for every transport and for
    ``"auto"`` whether the call's key is new (the agreement finds it) or decided (the picked
    transport's call does); the next call matches the reference."""
    import time

    from portable_overlap import MoeDispatch, PortableOverlapError

    kw = dict(transport=transport)
    if transport == "auto":
        kw.update(candidates=("stores", "sequential"), iters=1, warmup=0)
    ctx = MoeDispatch(world, max_tokens=6, top_k=2, hidden=16, experts_per_rank=2,
                      dtype=torch.float32, timeout_s=10.0, **kw)
    g = torch.Generator().manual_seed(3 + world.rank)
    found = []

    def call(records):
        tokens = torch.randn(5, 16, generator=g)
        ids = torch.randint(0, 2 * world.world_size, (5, 2), generator=g)
        ctx.records_grad = records
        try:
            x, counts, slots = moe_dispatch(tokens, ids, ctx)
            ctx.synchronize()
            xr, _, sr = moe_dispatch_reference(tokens, ids, 2, world.group)
            R = xr.shape[0]
            return "right" if torch.equal(x[:R], xr) and torch.equal(slots[:R], sr) else "wrong"
        except PortableOverlapError as e:
            return f"{type(e).__name__}: {e}"
        finally:
            ctx.records_grad = False

    try:
        if decided:
            found.append(call(True))  # every rank records: a plain call
        t0 = time.monotonic()
        found.append(call(world.rank == 0))
        found.append(time.monotonic() - t0)
        found.append(call(False))
    finally:
        ctx.close()
    return found


@pytest.mark.parametrize("transport, decided", [("stores", False), ("sequential", False),
                                                ("auto", False), ("auto", True)])
def test_ranks_that_differ_in_recording_gradients_raise_on_every_rank(
        world2, transport, decided):
    for rank, found in enumerate(world2.run(_records_grad_on_one_rank, transport, decided)):
        *first, mixed, seconds, after = found
        assert first in ([], ["right"]), (rank, found)
        assert mixed.startswith("RankMismatchError") and (
            "records_grad" in mixed or "autograd records" in mixed), (rank, found)
        assert seconds < 10 and after == "right", (rank, found)
