"""The MoE dispatch's ``"sequential"`` transport and ``transport="auto"`` on CPU-emulated ranks,
against ``moe_dispatch_reference`` (the fused transports: test_moe_dispatch.py): every dtype,
ranks of different token counts (one with none), buffers poisoned before each call; one
decision per key whatever S; one set of receive buffers under ``"auto"``; the fused dispatch +
gated GEMM and the one-launch layer on ``"auto"``'s stores workspace; and bad input refused on
every rank."""
import pytest
import torch

from portable_overlap import RankMismatchError
from portable_overlap.ops.moe_combine import MoeGemmCombine
from portable_overlap.ops.moe_dispatch import (MoeDispatch, moe_dispatch, moe_dispatch_reference,
                                               moe_dispatch_swiglu,
                                               moe_dispatch_swiglu_reference)
from portable_overlap.ops.moe_layer import moe_layer, moe_layer_reference
from portable_overlap.testing.compare import rel_err

from test_moe_dispatch import _check, route, SMALL

#: "auto" on the emulated ranks: one timed run per candidate (the interpreter is slow)
QUICK = dict(iters=1, warmup=0)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: (S per rank, routing) of consecutive calls on one context: odd counts, a rank with none
CALLS = (((7, 3), "uniform"), ((0, 5), "zipf"), ((6, 6), "one_rank"))


def _calls(world, transport, H=12, El=2, k=2, **options):
    """Each dtype's context, every call of ``CALLS`` (int64 ids, then int32) with the receive
    buffers poisoned first: (rows checked, rows past them left poisoned) per call, and the
    context's decisions per dtype."""
    W, r = world.world_size, world.rank
    out = []
    for d, dtype in enumerate(DTYPES):
        ctx = MoeDispatch(world, max_tokens=8, top_k=k, hidden=H, experts_per_rank=El,
                          dtype=dtype, transport=transport, **options)
        try:
            for i, (S_per_rank, kind) in enumerate(CALLS):
                g = torch.Generator().manual_seed(100 * d + 10 * i + r)
                S = S_per_rank[r % len(S_per_rank)]
                tokens = torch.randn(S, H, generator=g).to(dtype)
                ids = route(kind, S, El * W, k, r, W, g)
                ids = ids.to(torch.int32) if i % 2 else ids
                ctx.recv.fill_(float("nan"))
                ctx.recv_slots.fill_(-7)
                x, counts, slots = moe_dispatch(tokens, ids, ctx)
                ctx.synchronize()
                R = _check(world, x, counts, slots,
                           moe_dispatch_reference(tokens, ids, El, world.group))
                out.append((R, bool(torch.isnan(x[R:]).all() and (slots[R:] == -7).all())))
            out.append(("decisions", len(ctx.decisions)))
        finally:
            ctx.close()
    return out


def test_sequential_matches_reference(world):
    for res in world.run(_calls, "sequential"):
        assert all(left for _, left in res if _ != "decisions"), res
        assert [n for tag, n in res if tag == "decisions"] == [0] * len(DTYPES), res


def test_auto_matches_reference_with_one_decision_per_dtype(world2):
    """The first call of each dtype times both candidates; the later ones (other S on each
    rank, int32 ids) reuse that decision: the key holds neither S nor the ids' length."""
    for res in world2.run(_calls, "auto", **QUICK):
        assert all(left for tag, left in res if tag != "decisions"), res
        # (int64 and int32 ids are two keys)
        assert [n for tag, n in res if tag == "decisions"] == [2] * len(DTYPES), res


def _shared(world):
    """``"auto"``'s candidates fill one set of buffers, the stores workspace's; a context
    whose only candidate is ``"sequential"`` has its own, and no stores workspace. Then the
    buffers the context shows after a call of a candidate with its own."""
    kw = dict(max_tokens=4, top_k=2, hidden=8, experts_per_rank=2, dtype=torch.float32)
    both = MoeDispatch(world, transport="auto", **kw, **QUICK)
    alone = MoeDispatch(world, transport="auto", candidates=("sequential",), **kw, **QUICK)
    try:
        impls = both.planner.impls
        shared = (set(impls) == {"stores", "sequential"},
                  all(getattr(impls["sequential"], n) is getattr(impls["stores"], n)
                      for n in ("recv", "recv_slots", "counts")),
                  both.kernel() is impls["stores"] and both.recv is impls["stores"].recv,
                  alone.kernel() is None and alone.recv.shape == (2 * 4 * 2, 8))

        class Own:  # a candidate with buffers of its own ("shmem", on GPUs)
            recv, recv_slots, counts = torch.zeros(1), torch.zeros(1), torch.zeros(1)

            def __call__(self, tokens, topk_ids):
                return None

        own = Own()
        both._run("shmem", own, {"tokens": None, "topk_ids": None}, None, {})
        return (*shared, all(getattr(both, n) is getattr(own, n)
                             for n in ("recv", "recv_slots", "counts")))
    finally:
        alone.close()
        both.close()


def test_auto_candidates_share_one_set_of_buffers(world2):
    """... and the context's ``recv`` / ``recv_slots`` / ``counts`` are those of the workspace
    that ran the last call (a candidate with its own buffers: ``"shmem"``)."""
    for got in world2.run(_shared):
        assert got == (True, True, True, True, True), got


def _swiglu(world, candidates):
    """``moe_dispatch_swiglu`` on an ``"auto"`` context: on its stores workspace, or, where
    ``"sequential"`` is its only candidate, the dispatch then ``expert_swiglu``."""
    W, r, S, H, I, El, k = world.world_size, world.rank, 5, 16, 8, 2, 2
    ctx = MoeDispatch(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El,
                      dtype=torch.float32, transport="auto", candidates=candidates, **QUICK)
    try:
        g = torch.Generator().manual_seed(7 + r)
        tokens = torch.randn(S, H, generator=g)
        ids = route("uniform", S, El * W, k, r, W, g)
        wg, wu = (torch.randn(El, H, I, generator=g) * 0.3 for _ in range(2))
        h = torch.full((ctx.capacity, I), float("nan"))
        _, counts, slots = moe_dispatch_swiglu(tokens, ids, wg, wu, ctx, out=h, config=SMALL)
        ctx.synchronize()
        hr, cr, sr = moe_dispatch_swiglu_reference(tokens, ids, wg, wu, El, world.group)
        R = hr.shape[0]
        assert torch.equal(counts, cr) and torch.equal(slots[:R], sr)
        return rel_err(h[:R], hr), len(ctx.decisions)
    finally:
        ctx.close()


@pytest.mark.parametrize("candidates", [("stores", "sequential"), ("sequential",)],
                         ids=["stores", "sequential"])
def test_dispatch_swiglu_on_an_auto_context(world2, candidates):
    for err, decided in world2.run(_swiglu, candidates):
        assert err < 1e-5 and decided == 0, (err, decided)  # (no dispatch call was decided)


def _layer(world):
    """The one-launch layer runs on an ``"auto"`` dispatch context's stores workspace; one
    without it is refused with a clear error."""
    W, r, S, H, I, El, k = world.world_size, world.rank, 4, 8, 8, 1, 1
    kw = dict(max_tokens=S, top_k=k, hidden=H, experts_per_rank=El)
    comb = MoeGemmCombine(world, transport="stores", config=SMALL, **kw)
    got = {}
    try:
        g = torch.Generator().manual_seed(3 + r)
        tokens = torch.randn(S, H, generator=g)
        ids = torch.randint(0, El * W, (S, k), generator=g)
        tw = torch.ones(S, k)
        wg, wu = (torch.randn(El, H, I, generator=g) * 0.3 for _ in range(2))
        wd = torch.randn(El, I, H, generator=g) * 0.3
        for name, opts in (("auto", QUICK), ("sequential", {})):
            disp = MoeDispatch(world, dtype=torch.float32, transport=name, **kw, **opts)
            try:
                out = moe_layer(tokens, ids, tw, wg, wu, wd, disp, comb)
                disp.synchronize()
                comb.synchronize()
                ref = moe_layer_reference(tokens, ids, tw, wg, wu, wd, El, world.group)
                got[name] = rel_err(out, ref)
            except ValueError as e:
                got[name] = str(e)
            finally:
                disp.close()
    finally:
        comb.close()
    return got


def test_one_launch_layer_takes_an_auto_dispatch_context(world2):
    for got in world2.run(_layer):
        assert got["auto"] < 1e-5, got
        assert "needs both contexts with transport='stores' or 'auto'" in got["sequential"], got


def _refusals(world):
    """Rank 1 passes more tokens than ``max_tokens`` at a key's first call (nothing decided
    yet): it raises its own error and rank 0 ``RankMismatchError`` in that call; then the
    same at a decided key; the calls after each are right on both ranks."""
    W, r, El, k, H = world.world_size, world.rank, 2, 2, 8
    ctx = MoeDispatch(world, max_tokens=6, top_k=k, hidden=H, experts_per_rank=El,
                      dtype=torch.float32, transport="auto", **QUICK)
    g = torch.Generator().manual_seed(50 + r)
    res = []
    try:
        for bad in (True, False, True, False):
            S = 7 if bad and r == 1 else 5
            tokens = torch.randn(S, H, generator=g)
            ids = route("uniform", S, El * W, k, r, W, g)
            try:
                x, counts, slots = moe_dispatch(tokens, ids, ctx)
                ctx.synchronize()
                _check(world, x, counts, slots,
                       moe_dispatch_reference(tokens, ids, El, world.group))
                res.append("ok")
            except RankMismatchError:
                res.append("mismatch")
            except ValueError as e:
                res.append("refused" if "exceed this context's max_tokens" in str(e) else str(e))
            except Exception as e:  # a decided fused key: the peer's waits end with its refusal
                res.append(type(e).__name__)
        return res, len(ctx.decisions)
    finally:
        ctx.close()


def test_auto_refuses_bad_input_on_every_rank(world2):
    (r0, n0), (r1, n1) = world2.run(_refusals, timeout=120)
    assert r1 == ["refused", "ok", "refused", "ok"], r1
    assert r0[0] == "mismatch" and r0[1] == "ok" and r0[3] == "ok", r0
    assert r0[2] != "ok", r0  # (how depends on the pick: the agreement or the fused waits)
    assert n0 == n1 == 1


def _options(world):
    kw = dict(max_tokens=4, top_k=2, hidden=8, experts_per_rank=2, dtype=torch.float32)
    errors = []
    for bad in (dict(transport="sequential", dedup=True), dict(transport="shmem", dedup=True),
                dict(transport="auto", options={"stores": {"dedup": True}}),
                dict(transport="stores", candidates=("stores",)),
                dict(transport="auto", candidates=("copy_engine",))):
        try:
            MoeDispatch(world, **kw, **bad).close()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    ctx = MoeDispatch(world, **dict(kw, max_tokens=64), transport="auto", dedup=True)
    try:
        return errors, (ctx.dedup, ctx.kernel().dedup)
    finally:
        ctx.close()


def test_options_and_dedup_under_auto(world2):
    for errors, dedup in world2.run(_options):
        assert all(errors), errors
        assert "dedup=True is an option of transport='stores'" in errors[0], errors
        assert "takes no options of its own" in errors[2], errors
        assert "are options of transport='auto'" in errors[3] \
            or "is an option of transport='auto'" in errors[3], errors
        assert "candidates must be" in errors[4], errors
        assert dedup == (True, True), dedup


def _torch_op(world):
    """``torch.ops.portable_overlap.moe_dispatch`` with an ``"auto"`` context's handle: copies
    of the buffers, equal to the reference."""
    W, r, S, H, El, k = world.world_size, world.rank, 5, 8, 2, 2
    ctx = MoeDispatch(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El,
                      dtype=torch.float32, transport="auto", **QUICK)
    try:
        g = torch.Generator().manual_seed(11 + r)
        tokens = torch.randn(S, H, generator=g)
        ids = route("zipf", S, El * W, k, r, W, g)
        x, counts, slots = torch.ops.portable_overlap.moe_dispatch(tokens, ids, ctx.handle)
        ctx.synchronize()
        _check(world, x, counts, slots, moe_dispatch_reference(tokens, ids, El, world.group))
        return x.data_ptr() != ctx.recv.data_ptr()
    finally:
        ctx.close()


def test_torch_op_on_an_auto_context(world2):
    assert world2.run(_torch_op) == [True, True]


def _overflow(world):
    """All of every rank's rows routed to rank 0, past its capacity, at a key's first call:
    every candidate fails on some rank, so every rank raises in that call (nothing is
    decided, and no rank returns rows past its buffer); the next call, within capacity, is
    right and decides the key."""
    W, r, S, H, El, k = world.world_size, world.rank, 6, 8, 2, 2
    ctx = MoeDispatch(world, max_tokens=8, top_k=k, hidden=H, experts_per_rank=El,
                      dtype=torch.float32, capacity=W * S * k - 1, transport="auto", **QUICK)
    g = torch.Generator().manual_seed(70 + r)
    res = []
    try:
        tokens = torch.randn(S, H, generator=g)
        try:
            moe_dispatch(tokens, torch.tensor([[0, 1]] * S), ctx)
            ctx.synchronize()
            res.append("no error")
        except Exception as e:
            res.append("capacity" in str(e))
        res.append(len(ctx.decisions))
        ids = route("uniform", S, El * W, k, r, W, g)
        x, counts, slots = moe_dispatch(tokens, ids, ctx)
        ctx.synchronize()
        _check(world, x, counts, slots, moe_dispatch_reference(tokens, ids, El, world.group))
        res.append(len(ctx.decisions))
        return res
    finally:
        ctx.close()


def test_auto_capacity_overflow_raises_on_every_rank(world2):
    for res in world2.run(_overflow, timeout=120):
        assert res == [True, 0, 1], res
