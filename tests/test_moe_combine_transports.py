"""MoE expert GEMM + combine's ``"sequential"`` transport and ``transport="auto"`` on CPU-emulated
ranks, against per-segment matmul + all_to_all_single + weighted top-k sum (the fused
transports: test_moe_combine.py), and the planner's rule for a candidate that cannot be
captured in a CUDA graph."""
import pytest
import torch

from portable_overlap import InvalidInputError
from portable_overlap.ops.moe_combine import (MoeGemmCombine, moe_gemm_combine,
                                              moe_gemm_combine_reference)
from portable_overlap.ops.moe_dispatch import MoeDispatch, moe_dispatch_reference
from portable_overlap.ops.moe_layer import moe_layer
from portable_overlap.ops.planner import _picks
from portable_overlap.testing.compare import rel_err

from test_moe_combine import _route, CASES_K1, CASES_K2, SMALL, TOL

#: "auto" on the emulated ranks: one timed run per candidate (the interpreter is slow)
QUICK = dict(iters=1, warmup=0)


def _inputs(world, S, H, I, El, k, kind, dtype, seed):
    g = torch.Generator().manual_seed(seed + world.rank)
    tokens = torch.randn(S, I, generator=g).to(dtype)
    ids = _route(kind, S, El * world.world_size, k, world.rank, g)
    topk_w = torch.softmax(torch.randn(S, k, generator=g), dim=1)
    w = (torch.randn(El, I, H, generator=g) / I ** 0.5).to(dtype)
    x, counts, slots = moe_dispatch_reference(tokens, ids, El, world.group)
    return x, w, counts, slots, topk_w


def _run_cases(world, transport, cases, dtypes, **options):
    """Each case of test_moe_combine's tables on one context per k, in every dtype, the output
    poisoned first: (case, dtype, rel_err, NaN left)."""
    res = []
    for table in cases:
        S_max = max(max(c[0]) for c in table)
        _, H, _, El, k, _ = table[0]
        ctx = MoeGemmCombine(world, max_tokens=S_max, top_k=k, hidden=H, experts_per_rank=El,
                             transport=transport, config=SMALL, **options)
        try:
            for i, (S_per_rank, _, I, _, _, kind) in enumerate(table):
                S = S_per_rank[world.rank % len(S_per_rank)]
                for dtype in dtypes:
                    x, w, counts, slots, tw = _inputs(world, S, H, I, El, k, kind, dtype, 31 * i)
                    # rows past the dispatch's (a capacity buffer's tail) are not read
                    x = torch.cat([x, torch.full((3, I), float("nan"), dtype=dtype)])
                    slots = torch.cat([slots, torch.full((3,), -5, dtype=torch.int32)])
                    out = torch.full((S, H), float("nan"), dtype=dtype)
                    moe_gemm_combine(x, w, counts, slots, tw, ctx, out=out)
                    ctx.synchronize()
                    ref = moe_gemm_combine_reference(x[:x.shape[0] - 3], w, counts,
                                                     slots[:-3], tw, world.group)
                    res.append((f"{kind} S={S} k={k}", dtype, rel_err(out, ref) if S else 0.0,
                                bool(torch.isnan(out).any())))
            decisions = ctx.decisions
        finally:
            ctx.close()
        res.append(("decisions", None, len(decisions), False))
    return res


def _check(results, transport):
    for res in results:
        bad = [r for r in res if r[0] != "decisions" and (r[3] or not r[2] < TOL[r[1]])]
        assert not bad, bad
        decided = [r[2] for r in res if r[0] == "decisions"]
        # one decision per dtype (R and S are not in the key), none for a named transport
        assert decided == ([3, 3] if transport == "auto" else [0, 0]), decided


def test_sequential_matches_reference(world):
    """Odd H and I, k = 1, 2, ranks of different token counts (one with none), all tokens to
    one expert, a rank whose experts get nothing, every dtype."""
    _check(world.run(_run_cases, "sequential", (CASES_K2, CASES_K1),
                     (torch.float32, torch.float16, torch.bfloat16)), "sequential")


def test_auto_matches_reference_with_one_decision_per_dtype(world2):
    """``"auto"`` between the stores and the sequential path: the first call of each dtype
    times both; later calls (other S, other R, on each rank its own) reuse that decision."""
    _check(world2.run(_run_cases, "auto", (CASES_K2, CASES_K1),
                      (torch.float32, torch.float16, torch.bfloat16),
                      candidates=("stores", "sequential"), **QUICK), "auto")


def _bad_counts(world, fault):
    """Rank 1's counts are not its rows (negative, or more than x has): every rank raises in
    that call, and the next call is right."""
    S, H, I, El, k = 5, 12, 8, 2, 2
    ctx = MoeGemmCombine(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El,
                         transport="sequential")
    got = []
    try:
        x, w, counts, slots, tw = _inputs(world, S, H, I, El, k, "uniform", torch.float32, 5)
        bad = counts.clone()
        if world.rank == 1:
            bad[0, 0] = -1 if fault == "negative" else bad[0, 0] + x.shape[0] + 1
        try:
            ctx(x, w, bad, slots, tw)
            got.append("no error")
        except ValueError as e:
            got.append(str(e))
        out = ctx(x, w, counts, slots, tw)
        ctx.synchronize()
        got.append(rel_err(out, moe_gemm_combine_reference(x, w, counts, slots, tw,
                                                           world.group)))
    finally:
        ctx.close()
    return got


@pytest.mark.parametrize("fault", ["negative", "too_many"])
def test_sequential_refuses_counts_that_are_not_the_rows_on_every_rank(world, fault):
    for msg, err in world.run(_bad_counts, fault):
        assert "routing counts of rank(s) [1]" in msg, msg
        assert err < 1e-5, err


def _refused_input(world):
    """Rank 1 refuses its input (more tokens than max_tokens, or an out of the wrong shape)
    before the sizes exchange: it raises ValueError, its peers PeerTimeoutError in that same
    call instead of waiting in the exchange, and the next call is right on every rank."""
    from portable_overlap import PeerTimeoutError

    S, H, I, El, k = 5, 12, 8, 2, 2
    ctx = MoeGemmCombine(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El,
                         transport="sequential")
    got = []
    try:
        x, w, counts, slots, tw = _inputs(world, S, H, I, El, k, "uniform", torch.float32, 7)
        for bad in ("too_many_tokens", "out"):
            args, out = (x, w, counts, slots, tw), None
            if world.rank == 1 and bad == "too_many_tokens":
                args = (x, w, counts, slots, torch.cat([tw, tw[:2]]))
            if world.rank == 1 and bad == "out":
                out = torch.empty(S + 1, H)
            try:
                ctx(*args, out=out)
                got.append("no error")
            except (ValueError, PeerTimeoutError) as e:
                got.append(type(e).__name__)
        out = ctx(x, w, counts, slots, tw)
        ctx.synchronize()
        got.append(rel_err(out, moe_gemm_combine_reference(x, w, counts, slots, tw,
                                                           world.group)))
    finally:
        ctx.close()
    return got


def test_sequential_input_refused_on_one_rank_fails_its_peers(world):
    for rank, (a, b, err) in enumerate(world.run(_refused_input, timeout=120)):
        want = "ValueError" if rank == 1 else "PeerTimeoutError"
        assert (a, b) == (want, want), (rank, a, b)
        assert err < 1e-5, err


def _bad_slots(world, fault):
    """Rank 0 sends the second of its own rows back to itself with a slot outside its slots
    (or onto the first row's slot): its tokens of the slots left without exactly one row are
    NaN and its next synchronize raises, its peer's do not; the next call is right."""
    S, H, I, El, k = 6, 12, 8, 2, 2
    ctx = MoeGemmCombine(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El,
                         transport="sequential")
    found = {}
    try:
        x, w, counts, slots, tw = _inputs(world, S, H, I, El, k, "uniform", torch.float32, 9)
        bad = slots.clone()
        if world.rank == 0:
            assert int(counts[0].sum()) >= 2  # (the rows 0 and 1 are rank 0's own)
            bad[1] = S * k + 3 if fault == "outside" else bad[0]
        out = ctx(x, w, counts, bad, tw)
        try:
            ctx.synchronize()
            found["error"] = None
        except InvalidInputError as e:
            found["error"] = str(e)
        found["nan tokens"] = int(torch.isnan(out).any(1).sum())
        out = ctx(x, w, counts, slots, tw)
        ctx.synchronize()
        ref = moe_gemm_combine_reference(x, w, counts, slots, tw, world.group)
        found["next"] = rel_err(out, ref)
    finally:
        ctx.close()
    return found


@pytest.mark.parametrize("fault", ["outside", "duplicate"])
def test_sequential_reports_slots_that_are_not_one_per_row(world2, fault):
    res = world2.run(_bad_slots, fault)
    assert res[1]["error"] is None and res[1]["nan tokens"] == 0, res
    msg = res[0]["error"]
    if fault == "outside":  # its own slot left empty
        assert "1 rows came back with a slot outside" in msg, msg
        assert "1 slots got no row or more than one" in msg and res[0]["nan tokens"] == 1, res
    else:  # one slot doubled, one left empty: one token or two
        assert "0 rows came back with a slot outside" in msg, msg
        assert "2 slots got no row or more than one" in msg, msg
        assert res[0]["nan tokens"] in (1, 2), res
    assert all(f["next"] < 1e-5 for f in res), res


def _layer_contexts(world):
    """The one-launch layer runs on the combine context's "stores" workspace: named, or
    "auto"'s; a sequential combine context is refused with a clear error."""
    S, H, I, El, k = 4, 8, 8, 1, 1
    disp = MoeDispatch(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El,
                       dtype=torch.float32)
    got = {}
    try:
        g = torch.Generator().manual_seed(3 + world.rank)
        tokens = torch.randn(S, H, generator=g)
        ids = torch.randint(0, El * world.world_size, (S, k), generator=g)
        tw = torch.ones(S, k)
        wg, wu = (torch.randn(El, H, I, generator=g) * 0.3 for _ in range(2))
        wd = torch.randn(El, I, H, generator=g) * 0.3
        for transport in ("auto", "sequential"):
            comb = MoeGemmCombine(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El,
                                  transport=transport, config=SMALL, **(
                                      dict(candidates=("stores", "sequential"), **QUICK)
                                      if transport == "auto" else {}))
            try:
                out = moe_layer(tokens, ids, tw, wg, wu, wd, disp, comb)
                disp.synchronize()
                comb.synchronize()
                got[transport] = bool(torch.isfinite(out).all())
            except ValueError as e:
                got[transport] = str(e)
            finally:
                comb.close()
    finally:
        disp.close()
    return got


def test_one_launch_layer_takes_an_auto_combine_context(world2):
    for got in world2.run(_layer_contexts):
        assert got["auto"] is True, got
        assert "needs both contexts with transport='stores'" in got["sequential"], got


def test_picks_of_a_candidate_that_cannot_be_captured():
    """``planner._picks``: where the plain calls' pick reads data on the host, the calls under
    capture run the fastest capturable candidate; replays timed give their own pick; with no
    capturable candidate the plain pick stands."""
    plain = {"stores": 1.0, "sequential": 0.5}
    got = _picks({False: plain}, (False,), {"stores"})
    assert got["transport"] == "sequential" and got["captured"]["transport"] == "stores", got
    assert got["captured"]["ms"] == {"stores": 1.0}, got
    got = _picks({False: plain, True: {"stores": 0.9}}, (False, True), {"stores"})
    assert got["transport"] == "sequential" and got["captured"]["transport"] == "stores", got
    got = _picks({False: {"sequential": 0.5}, True: {}}, (False, True), set())
    assert got == {"transport": "sequential", "ms": {"sequential": 0.5}}, got
    got = _picks({False: {"stores": 1.0, "sequential": 1.02}}, (False,), {"stores"})
    # "sequential" within 3 % is kept for plain calls; capture still needs "stores"
    assert got["transport"] == "sequential" and got["captured"]["transport"] == "stores", got
    got = _picks({False: {"stores": 0.5, "sequential": 1.0}}, (False,), {"stores"})
    assert got == {"transport": "stores", "ms": {"stores": 0.5, "sequential": 1.0}}, got


def _mismatched_sizes(world):
    try:
        MoeGemmCombine(world, max_tokens=4, top_k=2, hidden=8 + world.rank, experts_per_rank=1,
                       transport="sequential").close()
        return "no error"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def test_ranks_that_disagree_on_the_sizes_raise_on_every_rank(world2):
    """The sequential transport has no heap to size, so the context checks its sizes itself."""
    for msg in world2.run(_mismatched_sizes):
        assert msg.startswith("RankMismatchError: ranks disagree on moe_gemm_combine context "
                              "arguments"), msg
