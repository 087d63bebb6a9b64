"""The MoE dispatch with the experts' gated first GEMM fused into it (``moe_dispatch_swiglu``) on
CPU-emulated ranks: against the unfused dispatch + ``expert_swiglu`` on the same context (equal
bit for bit) and against the torch reference, over routings (balanced, Zipf, all tokens to one
rank, experts without rows, a rank without tokens), every dtype, one sender per rank (senders
then compute too) and several; the layer's ``fuse_dispatch`` option; and the faults (bad ids,
a capacity overflow, a skipped call, a rank calling the other form, bad arguments)."""
import pytest
import torch

from portable_overlap import InvalidInputError
from portable_overlap.ops.moe_dispatch import (MoeDispatch, moe_dispatch, moe_dispatch_swiglu,
                                               moe_dispatch_swiglu_reference)
from portable_overlap.ops.moe_experts import expert_swiglu
from portable_overlap.testing import call_while_peers_skip, error_of_one_call
from portable_overlap.testing.routing import route, with_fault

TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _weights(world, El, H, I, dtype, seed=0):
    g = torch.Generator().manual_seed(500 + seed + world.rank)
    return [(torch.randn(El, H, I, generator=g) / H ** 0.5).to(dtype) for _ in range(2)]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _compare(world, dtype, cases, senders, H=24, I=20, El=2, k=2):
    """Each case (S per rank, routing): fresh tokens, poisoned buffers, the fused call, then the
    unfused one on the same context; returns the errors against the reference."""
    W, r = world.world_size, world.rank
    ctx = MoeDispatch(world, max_tokens=max(max(c[0]) for c in cases), top_k=k, hidden=H,
                      experts_per_rank=El, dtype=dtype)
    wg, wu = _weights(world, El, H, I, dtype)
    errs = []
    try:
        for i, (S_per_rank, kind) in enumerate(cases):
            g = torch.Generator().manual_seed(1000 * i + r)
            S = S_per_rank[r % len(S_per_rank)]
            tokens = torch.randn(S, H, generator=g).to(dtype)
            ids = route(kind, S, El * W, k, W, g)
            ctx.recv.fill_(float("nan"))
            h = torch.full((ctx.capacity, I), float("nan"), dtype=dtype)
            got, counts, slots = moe_dispatch_swiglu(tokens, ids, wg, wu, ctx, h,
                                                     senders=senders)
            ctx.synchronize()
            assert got is h
            h_ref, c_ref, s_ref = moe_dispatch_swiglu_reference(tokens, ids, wg, wu, El,
                                                                world.group)
            R = h_ref.shape[0]
            assert torch.equal(counts, c_ref), (counts, c_ref)
            assert torch.equal(slots[:R], s_ref)
            assert torch.isnan(h[R:]).all(), "rows past counts.sum() were written"
            fused = h[:R].clone()
            # the two launches on the same context (the calls alternate on one epoch count)
            x, c2, _ = moe_dispatch(tokens, ids, ctx)
            h2 = expert_swiglu(x, wg, wu, c2, torch.full_like(h, float("nan")),
                               gather=False, split=False)
            ctx.synchronize()
            assert torch.equal(fused, h2[:R]), "fused and unfused differ"
            errs.append(_rel(fused, h_ref) if R else 0.0)
    finally:
        ctx.close()
    return errs


# odd H and I, ranks with different token counts (one with none), every choice on one rank,
# experts without rows
CASES = [((13, 6), "uniform"), ((9, 9), "zipf"), ((7, 11), "one_rank"), ((0, 5), "first_expert")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
def test_matches_unfused_and_reference(world, dtype):
    for errs in world.run(_compare, dtype, CASES, None, timeout=300):
        assert all(e < TOL[dtype] for e in errs), errs


@pytest.mark.parametrize("senders", [1, 3], ids=["one_sender", "three_senders"])
def test_float32_and_sender_counts(world, senders):
    """One sender per rank (it also computes the peers' tiles) and three (compute programs
    only: under the interpreter senders take no tiles then)."""
    for errs in world.run(_compare, torch.float32, CASES, senders, timeout=300):
        assert all(e < TOL[torch.float32] for e in errs), errs


def test_wide_top_k_and_one_expert_per_rank(world2):
    world2.run(_compare, torch.float32, [((6, 7), "uniform"), ((6, 7), "zipf")], 2, H=16, I=48,
               El=5, k=7)
    world2.run(_compare, torch.float32, [((9, 4), "uniform")], 1, H=33, I=17, El=1, k=1)


def _layer(world):
    """``ExpertParallelMoE(fuse_dispatch=True)`` against the two launches and the torch path
    (same weights), three calls with different token counts (a rank with none in one)."""
    from portable_overlap import ExpertParallelMoE

    H, I, E, k = 24, 20, 2 * world.world_size, 3
    fused = ExpertParallelMoE(world, H, I, E, k, max_tokens=9, dtype=torch.float32,
                              fuse_dispatch=True)
    staged = ExpertParallelMoE(world, H, I, E, k, max_tokens=9, dtype=torch.float32)
    ref = ExpertParallelMoE(world, H, I, E, k, max_tokens=9, dtype=torch.float32, fused=False)
    errs = []
    try:
        with torch.no_grad():
            for call in range(3):
                g = torch.Generator().manual_seed(7 * call + world.rank)
                S = (3 + 2 * call + world.rank) % 10 if call != 1 or world.rank else 0
                tokens = torch.randn(S, H, generator=g)
                y = fused(tokens)
                fused.synchronize()
                y_staged = staged(tokens)
                staged.synchronize()
                y_ref = ref(tokens)  # (collective: every rank, whatever its S)
                # (recorded, not asserted here: a rank that raised would leave its peers in
                # the next collective). Not bit for bit: the staged gated GEMM packs experts
                # (an expert's rows of all sources in its tiles, ``pack_rows``), where the
                # fused launch keeps a tile per source
                errs.append(max(_rel(y, y_ref), _rel(y, y_staged)) if S
                            else float(y.numel()))
        try:
            ExpertParallelMoE(world, H, I, E, k, max_tokens=9, fused=False, fuse_dispatch=True)
            raise AssertionError("fuse_dispatch without fused was accepted")
        except ValueError as e:
            assert "fuse_dispatch" in str(e)
    finally:
        fused.close()
        staged.close()
    return errs


def test_layer_with_fused_dispatch(world):
    for errs in world.run(_layer, timeout=300):
        assert all(e < 1e-5 for e in errs), errs


def test_layer_with_fused_dispatch_on_eight_ranks(world8):
    """Eight ranks, 16 experts: the fused launch's sender passes and source waits with more
    peers than the 2/4-rank cases (a rank without tokens in one call)."""
    for errs in world8.run(_layer, timeout=540):
        assert all(e < 1e-5 for e in errs), errs


def _faults(world, fault):
    """Rank 1 passes an expert id out of range, or every rank's tokens go to rank 0 past its
    capacity: every rank raises for that call, the overflowing rank's counts are zeros and its
    h is left as it was, and the context serves the next call correctly."""
    W, r, El, k, S, H, I = world.world_size, world.rank, 2, 2, 6, 8, 12
    ctx = MoeDispatch(world, max_tokens=8, top_k=k, hidden=H, experts_per_rank=El,
                      dtype=torch.float32, capacity=W * S * k - 1, timeout_s=30.0)
    wg, wu = _weights(world, El, H, I, torch.float32)
    h = torch.full((ctx.capacity, I), float("nan"))
    try:
        g = torch.Generator().manual_seed(90 + r)
        tokens = torch.randn(S, H, generator=g)
        ids = route("uniform", S, El * W, k, W, g)
        ids = with_fault(ids, fault, r, El * W)
        try:
            moe_dispatch_swiglu(tokens, ids, wg, wu, ctx, h)
            ctx.synchronize()
            res = "ok"
        except InvalidInputError as e:
            res = "invalid: " + str(e)
        if fault == "capacity" and r == 0:
            assert int(ctx.counts.sum()) == 0 and torch.isnan(h).all()
        g = torch.Generator().manual_seed(95 + r)
        tokens = torch.randn(S, H, generator=g)
        ids = route("uniform", S, El * W, k, W, g)
        got, counts, slots = moe_dispatch_swiglu(tokens, ids, wg, wu, ctx, h)
        ctx.synchronize()
        h_ref, c_ref, s_ref = moe_dispatch_swiglu_reference(tokens, ids, wg, wu, El,
                                                            world.group)
        R = h_ref.shape[0]
        assert torch.equal(counts, c_ref) and torch.equal(slots[:R], s_ref)
        assert _rel(got[:R], h_ref) < 1e-5
        return res
    finally:
        ctx.close()


@pytest.mark.parametrize("fault", ["id", "negative", "capacity"])
def test_bad_routing_raises_on_every_rank(world2, fault):
    res = world2.run(_faults, fault, timeout=200)
    assert all(r.startswith("invalid") for r in res), res
    if fault == "capacity":
        assert all("capacity" in r and "[0]" in r for r in res), res
    else:
        assert "expert id" in res[1], res


def test_capacity_overflow_on_four_ranks(world4):
    res = world4.run(_faults, "capacity", timeout=300)
    assert all(r.startswith("invalid") and "capacity" in r for r in res), res


def _skip(world):
    wg, wu = _weights(world, 1, 8, 4, torch.float32)
    return call_while_peers_skip(
        world, lambda: MoeDispatch(world, max_tokens=4, top_k=1, hidden=8, experts_per_rank=1,
                                   dtype=torch.float32, timeout_s=1.0),
        lambda ctx: moe_dispatch_swiglu(torch.randn(2, 8), torch.tensor([[0], [1]]), wg, wu,
                                        ctx))


def test_a_rank_that_skips_a_call_is_named(world2):
    msg = world2.run(_skip, timeout=120)[0]
    assert "rank 1" in msg and "routing-counts" in msg, msg


def _mixed(world):
    """Rank 0 calls the fused form while the others call the plain dispatch: every rank
    raises for that call instead of pairing rows with another kernel's flags."""
    wg, wu = _weights(world, 2, 8, 4, torch.float32)

    def call(ctx):
        g = torch.Generator().manual_seed(world.rank)
        tokens = torch.randn(5, 8, generator=g)
        ids = route("uniform", 5, 2 * world.world_size, 2, world.world_size, g)
        if world.rank == 0:
            return moe_dispatch_swiglu(tokens, ids, wg, wu, ctx)
        return moe_dispatch(tokens, ids, ctx)

    return error_of_one_call(
        lambda: MoeDispatch(world, max_tokens=8, top_k=2, hidden=8, experts_per_rank=2,
                            dtype=torch.float32, timeout_s=30.0), call)


def test_a_rank_calling_the_other_form_is_caught(world2):
    assert world2.run(_mixed, timeout=200) == ["RankMismatchError"] * 2


def _bad_args(world):
    W = world.world_size
    ctx = MoeDispatch(world, max_tokens=8, top_k=2, hidden=16, experts_per_rank=2,
                      dtype=torch.float32)
    wg, wu = _weights(world, 2, 16, 8, torch.float32)
    t, ids = torch.randn(6, 16), torch.randint(0, 2 * W, (6, 2))
    h = torch.empty(ctx.capacity, 8)
    both = torch.randn(ctx.capacity, 16)  # tokens in its first rows, out in its first columns
    msgs = []
    for args, kw in [((t, ids, wg.double(), wu.double()), {}), ((t, ids, wg[:1], wu[:1]), {}),
                     ((both[:6], ids, wg, wu, both[:, :8]), {}),
                     ((t, ids, wg, wu[:, :, :4]), {}), ((t, ids, wg, wu), {"senders": 0}),
                     ((t, ids, wg, wu, h[:5]), {}), ((t[:, :8], ids, wg, wu), {}),
                     ((t, ids, wg, wu), {"rows_per_segment": -1.0}),
                     ((t, ids, wg.transpose(1, 2).contiguous().transpose(1, 2),
                       wu.transpose(1, 2).contiguous().transpose(1, 2)), {}),
                     # an out whose rows overlap (each stored into the same memory)
                     ((t, ids, wg, wu, torch.empty(1, 8).expand(ctx.capacity, 8)), {})]:
        try:
            moe_dispatch_swiglu(*args[:4], ctx, *args[4:], **kw)
            msgs.append(None)
        except (TypeError, ValueError) as e:
            msgs.append(str(e))
    try:
        moe_dispatch_swiglu(t, ids, wg, wu, object())
        msgs.append(None)
    except TypeError as e:
        msgs.append(str(e))
    # after the refused calls the ranks are still in step
    g = torch.Generator().manual_seed(world.rank)
    tokens = torch.randn(5, 16, generator=g)
    ids = route("uniform", 5, 2 * W, 2, W, g)
    got, counts, _ = moe_dispatch_swiglu(tokens, ids, wg, wu, ctx, h)
    ctx.synchronize()
    h_ref = moe_dispatch_swiglu_reference(tokens, ids, wg, wu, 2, world.group)[0]
    assert _rel(got[:h_ref.shape[0]], h_ref) < 1e-5
    ctx.close()
    return msgs


def test_bad_arguments_raise_before_launch(world2):
    for msgs in world2.run(_bad_args, timeout=200):
        assert all(m and m.split(":")[0] in ("moe_dispatch_swiglu", "expert_swiglu",
                                             "moe_dispatch") for m in msgs), msgs


def _sequential(world):
    W, r = world.world_size, world.rank
    ctx = MoeDispatch(world, max_tokens=8, top_k=2, hidden=16, experts_per_rank=2,
                      dtype=torch.float32, transport="sequential")
    wg, wu = _weights(world, 2, 16, 12, torch.float32)
    try:
        g = torch.Generator().manual_seed(5 + r)
        tokens = torch.randn(7, 16, generator=g)
        ids = route("zipf", 7, 2 * W, 2, W, g)
        h, counts, slots = moe_dispatch_swiglu(tokens, ids, wg, wu, ctx)
        h_ref, c_ref, s_ref = moe_dispatch_swiglu_reference(tokens, ids, wg, wu, 2,
                                                            world.group)
        R = h_ref.shape[0]
        assert torch.equal(counts, c_ref) and torch.equal(slots[:R], s_ref)
        return _rel(h[:R], h_ref)
    finally:
        ctx.close()


def test_sequential_transport(world2):
    assert all(e < 1e-5 for e in world2.run(_sequential))
