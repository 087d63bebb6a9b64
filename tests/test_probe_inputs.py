"""Edge inputs of the public ops on 2 CPU-emulated ranks: tiny and prime shapes, outputs that
alias an input, inputs that require grad, routing edge cases. Each result is compared with the
torch reference on a NaN-poisoned output."""
import pytest
import torch

from portable_overlap import GemvAllReduce, gemv_all_reduce_reference
from portable_overlap.testing import not_refused_together
from portable_overlap.testing.compare import rel_err


def _gemv_inputs(world, M, N, K, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + world.rank)
    return torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)


def _outcome(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the probe reports what was raised
        return type(e).__name__, str(e)
    return "ok", ""


def _gemv_edges(world, transport):
    """Tiny / prime shapes (K below a block) against the reference, then the refusals: an out
    aliasing x or w, inputs that require grad; a normal call after them must still work."""
    ctx = GemvAllReduce(world, max_n=32, transport=transport)
    errs, refusals = [], {}
    try:
        for i, (M, N, K) in enumerate([(1, 1, 1), (1, 7, 3), (3, 13, 5), (2, 31, 17)]):
            x, w = _gemv_inputs(world, M, N, K, i)
            y = torch.full((M, N), float("nan"))
            ctx(x, w, out=y)
            errs.append(rel_err(y, gemv_all_reduce_reference(x, w, world.group)))
        x, w = _gemv_inputs(world, 4, 4, 4, 9)
        refusals["out=x"] = _outcome(lambda: ctx(x, w, out=x))
        refusals["out=w"] = _outcome(lambda: ctx(x, w, out=w))
        buf = torch.cat([x.flatten(), torch.zeros(8)])  # out over x's last half and beyond
        refusals["out over x"] = _outcome(lambda: ctx(buf[:16].view(4, 4), w,
                                                      out=buf[8:].view(4, 4)))
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        refusals["grad"] = _outcome(lambda: ctx(xg, wg))
        with torch.no_grad():
            y = ctx(xg, wg)
        errs.append(rel_err(y, gemv_all_reduce_reference(x, w, world.group)))
    finally:
        ctx.close()
    return errs, refusals


@pytest.mark.parametrize("transport", ["stores", "one_shot", "sequential"])
def test_gemv_edges_and_refusals(world2, transport):
    for errs, refusals in world2.run(_gemv_edges, transport):
        assert max(errs) < 1e-5, errs
        # an out that aliases an input: torch.mm(out=x) gave a silently wrong result
        for key in ("out=x", "out=w", "out over x"):
            assert refusals[key][0] == "ValueError" and "shares memory" in refusals[key][1], \
                refusals[key]
        # the context call dropped the graph (fused) or raised autograd's own error (sequential)
        assert refusals["grad"][0] == "RuntimeError" and "no backward" in refusals["grad"][1], \
            refusals["grad"]


def _dispatch_routing(world, transport):
    """Zero tokens on one rank, all tokens to one expert, int32 ids against the reference; a
    negative id on rank 0 only must raise on every rank, and the next call must work."""
    from portable_overlap.ops.moe_dispatch import MoeDispatch, moe_dispatch_reference

    El, k, H, E = 2, 2, 5, 2 * world.world_size
    ctx = MoeDispatch(world, max_tokens=7, top_k=k, hidden=H, experts_per_rank=El,
                      dtype=torch.float32, transport=transport)
    uniform = lambda S, g: torch.rand(S, E, generator=g).topk(k, 1).indices  # noqa: E731
    oks, bad = [], None
    try:
        def one(S, ids_fn, seed):
            g = torch.Generator().manual_seed(seed * 10 + world.rank)
            tok, ids = torch.randn(S, H, generator=g), ids_fn(S, g)
            ctx.recv.fill_(float("nan"))
            x, counts, slots = ctx(tok, ids)
            ctx.synchronize()
            rx, rc, rs = moe_dispatch_reference(tok, ids, El, world.group)
            R = rx.shape[0]
            oks.append(torch.equal(counts, rc) and torch.equal(x[:R], rx)
                       and torch.equal(slots[:R], rs))

        one(0 if world.rank else 3, uniform, 0)
        one(5, lambda S, g: torch.full((S, k), E - 1), 1)
        one(1, lambda S, g: uniform(S, g).int(), 2)
        bad = _outcome(lambda: one(4, lambda S, g: uniform(S, g).index_fill_(
            0, torch.tensor([0]), -1 if world.rank == 0 else 0), 3))
        one(6, uniform, 4)
    finally:
        ctx.close()
    return oks, bad


@pytest.mark.parametrize("transport", ["stores", "sequential"])
def test_dispatch_routing_edges(world2, transport):
    for oks, bad in world2.run(_dispatch_routing, transport):
        assert oks == [True] * 4, oks
        assert bad[0] in ("InvalidInputError", "ValueError") and "expert id" in bad[1], bad


def _combine_edges(world, walk, block_s):
    """Zero tokens on one rank, one token, all rows to one expert, non-contiguous x and w,
    bf16, with the walk and combine tiling given."""
    from portable_overlap.ops.moe_combine import MoeGemmCombine, moe_gemm_combine_reference
    from portable_overlap.ops.moe_combine.api import CombineConfig
    from portable_overlap.ops.moe_dispatch import moe_dispatch_reference

    El, k, H, I, E = 2, 2, 7, 3, 2 * world.world_size
    cc = None if block_s is None else CombineConfig(block_s=block_s, block_h=16, num_warps=1)
    ctx = MoeGemmCombine(world, max_tokens=6, top_k=k, hidden=H, experts_per_rank=El,
                         walk=walk, combine_config=cc)
    uniform = lambda S, g: torch.rand(S, E, generator=g).topk(k, 1).indices  # noqa: E731
    errs = []
    try:
        for i, (S, route, dtype, strided) in enumerate([
                (0 if world.rank else 3, uniform, torch.float32, False),
                (1, uniform, torch.float32, False),
                (5, lambda S, g: torch.full((S, k), 1), torch.float32, False),
                (5, uniform, torch.float32, True), (5, uniform, torch.bfloat16, False)]):
            g = torch.Generator().manual_seed(10 * i + world.rank)
            tok, ids = torch.randn(S, I, generator=g).to(dtype), route(S, g)
            tw = torch.softmax(torch.randn(S, k, generator=g), 1)
            w = torch.randn(El, I, H, generator=g).to(dtype)
            x, counts, slots = moe_dispatch_reference(tok, ids, El, world.group)
            ref = moe_gemm_combine_reference(x, w, counts, slots, tw, world.group)
            if strided:
                x = x.t().contiguous().t()
                w = w.transpose(1, 2).contiguous().transpose(1, 2)
            out = torch.full((S, H), float("nan"), dtype=dtype)
            ctx(x, w, counts, slots, tw, out=out)
            ctx.synchronize()
            errs.append(rel_err(out.float(), ref.float()) if S else 0.0)
    finally:
        ctx.close()
    return errs


@pytest.mark.parametrize("walk,block_s", [("auto", None), ("experts", 1), ("sources", 2)])
def test_combine_edges(world2, walk, block_s):
    for errs in world2.run(_combine_edges, walk, block_s):
        assert max(errs[:4]) < 1e-5 and errs[4] < 1.5e-2, errs


def _moe_grad_refusals(world):
    """The MoE contexts called directly with inputs that require grad: a clear error (as the
    functional ops give), not buffers that silently carry no gradient; under no_grad they run."""
    from portable_overlap.ops.moe_combine import MoeGemmCombine
    from portable_overlap.ops.moe_dispatch import MoeDispatch

    W, El, k, H, I = world.world_size, 2, 2, 16, 8
    disp = MoeDispatch(world, max_tokens=6, top_k=k, hidden=H, experts_per_rank=El,
                       dtype=torch.float32)
    comb = MoeGemmCombine(world, max_tokens=6, top_k=k, hidden=H, experts_per_rank=El)
    found = {}
    try:
        g = torch.Generator().manual_seed(world.rank)
        tokens = torch.randn(5, H, generator=g)
        ids = torch.rand(5, El * W, generator=g).topk(k, -1).indices
        found["dispatch"] = _outcome(lambda: disp(tokens.requires_grad_(), ids))
        tokens.requires_grad_(False)
        x, counts, slots = disp(tokens, ids)
        w = torch.randn(El, I, H, generator=g, requires_grad=True)
        h = torch.randn(x.shape[0], I, generator=g)
        tw = torch.softmax(torch.randn(5, k, generator=g), -1)
        found["combine"] = _outcome(lambda: comb(h, w, counts, slots, tw))
        with torch.no_grad():
            found["combine, no_grad"] = _outcome(lambda: comb(h, w, counts, slots, tw))
        comb.synchronize()
    finally:
        disp.close()
        comb.close()
    return found


def test_moe_contexts_refuse_inputs_that_require_grad(world2):
    for found in world2.run(_moe_grad_refusals):
        for name in ("dispatch", "combine"):
            kind, msg = found[name]
            assert kind == "RuntimeError" and "has no backward" in msg, (name, found[name])
        assert found["combine, no_grad"] == ("ok", ""), found


def _grad_on_one_rank(world):
    """Rank 0's input requires grad, rank 1's does not, for the functional MoE ops and the fused
    dispatch's method: rank 0's refusal reaches rank 1 in the same call (it fails at once, not
    at its timeout), and the contexts serve the next call on both ranks."""
    from portable_overlap.ops.moe_combine import (MoeGemmCombine, moe_gemm_combine,
                                                  moe_gemm_combine_reference)
    from portable_overlap.ops.moe_dispatch import MoeDispatch, moe_dispatch, moe_dispatch_swiglu

    W, El, k, H, I = world.world_size, 2, 2, 16, 8
    disp = MoeDispatch(world, max_tokens=6, top_k=k, hidden=H, experts_per_rank=El,
                       dtype=torch.float32, timeout_s=20.0)
    comb = MoeGemmCombine(world, max_tokens=6, top_k=k, hidden=H, experts_per_rank=El,
                          timeout_s=20.0)
    found = {}
    try:
        g = torch.Generator().manual_seed(world.rank)
        tokens = torch.randn(5, H, generator=g)
        ids = torch.rand(5, El * W, generator=g).topk(k, -1).indices
        wg, wu = torch.randn(El, H, I, generator=g), torch.randn(El, H, I, generator=g)
        w = torch.randn(El, I, H, generator=g)
        tw = torch.softmax(torch.randn(5, k, generator=g), -1)
        mine = world.rank == 0
        t_grad = tokens.clone().requires_grad_(mine)
        calls = {
            "moe_dispatch": lambda: moe_dispatch(t_grad, ids, disp),
            "moe_dispatch_swiglu": lambda: moe_dispatch_swiglu(t_grad, ids, wg, wu, disp),
            "dispatch_swiglu": lambda: disp.dispatch_swiglu(t_grad, ids, wg, wu),
        }
        for name, call in calls.items():
            found[name] = _outcome(lambda: (call(), disp.synchronize()))
        x, counts, slots = moe_dispatch(tokens, ids, disp)
        h = torch.randn(x.shape[0], I, generator=g)
        w_grad = w.clone().requires_grad_(mine)
        found["moe_gemm_combine"] = _outcome(
            lambda: (moe_gemm_combine(h, w_grad, counts, slots, tw, comb), comb.synchronize()))
        out = moe_gemm_combine(h, w, counts, slots, tw, comb)
        comb.synchronize()
        R = int(counts.sum())
        found["next call"] = (_outcome(disp.synchronize), rel_err(
            out, moe_gemm_combine_reference(h[:R], w, counts, slots[:R], tw, world.group)))
    finally:
        disp.close()
        comb.close()
    return found


def test_a_grad_refusal_on_one_rank_fails_the_call_on_every_rank(world2):
    mine, peer = world2.run(_grad_on_one_rank)
    names = ("moe_dispatch", "moe_dispatch_swiglu", "dispatch_swiglu", "moe_gemm_combine")
    assert not not_refused_together(mine, peer, names, "has no backward"), (mine, peer)
    for found in (mine, peer):
        assert found["next call"][0] == ("ok", "") and found["next call"][1] < 1e-5, found
