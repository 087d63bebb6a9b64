"""Fused MoE expert GEMM + combine on CPU-emulated ranks against per-segment matmul +
all_to_all_single with splits + weighted top-k sum."""
import pytest
import torch

from portable_overlap.testing import call_while_peers_skip
from portable_overlap import InvalidInputError, PeerTimeoutError
from portable_overlap.ops.matmul import MatmulConfig
from portable_overlap.ops.moe_dispatch import moe_dispatch_reference
from portable_overlap.ops.moe_combine import (MoeGemmCombine, moe_gemm_combine,
                                              moe_gemm_combine_reference, validate_routing)

TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 1e-5}
SMALL = MatmulConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1)


def _route(kind, S, E, k, rank, g):
    """top-k expert ids [S, k] (distinct per token) for a routing pattern."""
    if kind == "one_expert":  # every token's first choice is expert 0
        ids = torch.rand(S, E, generator=g).topk(k, dim=1).indices
        ids[:, 0] = 0
        ids[:, 1:] = torch.where(ids[:, 1:] == 0, E - 1, ids[:, 1:])
        return ids
    if kind == "skip_upper":  # the experts of the upper half of the ranks receive nothing
        scores = torch.rand(S, E, generator=g)
        scores[:, E // 2:] = -1
        return scores.topk(k, dim=1).indices
    return torch.rand(S, E, generator=g).topk(k, dim=1).indices


def _cases(world, dtype, cases, config=None, walk="auto", combine_config=None):
    """Each case: (S on rank 0, S on rank 1.., H, I, experts_per_rank, k, routing)."""
    W = world.world_size
    ctx = MoeGemmCombine(world, max_tokens=max(max(c[0]) for c in cases), top_k=cases[0][4],
                         hidden=cases[0][1], experts_per_rank=cases[0][3], config=config,
                         walk=walk, combine_config=combine_config)
    errs = []
    try:
        for i, (S_per_rank, H, I, El, k, kind) in enumerate(cases):
            g = torch.Generator().manual_seed(1000 * i + world.rank)
            S = S_per_rank[world.rank % len(S_per_rank)]
            tokens = torch.randn(S, I, generator=g).to(dtype)
            ids = _route(kind, S, El * W, k, world.rank, g)
            topk_w = torch.softmax(torch.randn(S, k, generator=g), dim=1)
            w = (torch.randn(El, I, H, generator=g) / I ** 0.5).to(dtype)
            x, counts, slots = moe_dispatch_reference(tokens, ids, El, world.group)
            validate_routing(x, counts, slots, S, k, world)
            out = torch.full((S, H), float("nan"), dtype=dtype)
            moe_gemm_combine(x, w, counts, slots, topk_w, ctx, out=out)
            ctx.synchronize()
            assert not torch.isnan(out).any(), f"output not fully written in case {i}"
            ref = moe_gemm_combine_reference(x, w, counts, slots, topk_w, world.group)
            errs.append(((out.double() - ref.double()).norm()
                         / ref.double().norm().clamp_min(1e-30)).item() if S else 0.0)
    finally:
        ctx.close()
    return errs


# H and I odd (edge tiles), k = 1 and k = 3 (on separate contexts), ranks holding different
# token counts (and a rank with no tokens at all), all tokens to one expert, a rank whose
# experts receive nothing, experts without tokens
CASES_K2 = [((6, 9), 20, 12, 2, 2, "uniform"), ((5, 5), 20, 12, 2, 2, "one_expert"),
            ((7, 3), 20, 12, 2, 2, "skip_upper"), ((0, 4), 20, 12, 2, 2, "uniform")]
CASES_K1 = [((9, 4), 33, 17, 1, 1, "uniform")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=lambda d: str(d)[6:])
def test_matches_reference(world, dtype):
    for errs in world.run(_cases, dtype, CASES_K2, SMALL):
        assert all(e < TOL[dtype] for e in errs), errs


@pytest.mark.parametrize("walk", ["sources", "experts"])
def test_both_walks_match_reference(world, walk):
    """The two tile orders of the GEMM (the tests above run the decode-size pick, "experts",
    as their token counts are small): one source's tiles at a time, and every source's tiles
    of one expert together, with several row tiles per source (22 tokens, top-3 of 2 experts
    per rank, 16-row tiles), ranks of different sizes and an expert with no rows."""
    cases = [((22, 13), 20, 12, 2, 3, "uniform"), ((9, 22), 20, 12, 2, 3, "skip_upper")]
    for errs in world.run(_cases, torch.bfloat16, cases, SMALL, walk):
        assert all(e < TOL[torch.bfloat16] for e in errs), errs


def test_weighted_sum_blocks_by_token_count(world2):
    """``block_s=None``: tokens per program of the weighted sum chosen per call (1 for these
    small calls; each choice is a plan of its own), ranks of different sizes, next to a fixed
    block of 8 tokens (more than some ranks hold)."""
    from portable_overlap.ops.moe_combine import CombineConfig

    for cc in (CombineConfig(block_h=16, num_warps=1), CombineConfig(block_s=8, block_h=16,
                                                                      num_warps=1)):
        for errs in world2.run(_cases, torch.float32, CASES_K2, SMALL, "auto", cc):
            assert all(e < 1e-5 for e in errs), (cc, errs)


def test_combine_block_and_config_checks():
    from portable_overlap.ops.moe_combine import CombineConfig
    from portable_overlap.ops.moe_combine.api import combine_block

    assert [combine_block(s, 132) for s in (1, 128, 264, 528, 8192)] == [1, 1, 1, 2, 4]
    for bad in (dict(block_s=3), dict(block_s=0), dict(block_h=8), dict(num_warps=3),
                dict(block_s=True), dict(num_warps=True), dict(num_warps=32), dict(block_h=256.0)):
        with pytest.raises(ValueError, match="block_s"):
            CombineConfig(**bad)


def test_top1_odd_shapes_and_default_tiling(world2):
    for errs in world2.run(_cases, torch.float32, CASES_K1):
        assert all(e < 1e-5 for e in errs), errs
    for errs in world2.run(_cases, torch.float32, [((4, 6), 16, 8, 3, 3, "uniform")], SMALL):
        assert all(e < 1e-5 for e in errs), errs


def _bad_host(world):
    ctx = MoeGemmCombine(world, max_tokens=8, top_k=2, hidden=16, experts_per_rank=2,
                         config=SMALL)
    W = world.world_size
    x, w = torch.randn(6, 8), torch.randn(2, 8, 16)
    counts = torch.tensor([[3, 0]] + [[0, 3]] * (W - 1), dtype=torch.int32)
    slots, tw = torch.arange(6, dtype=torch.int32), torch.rand(4, 2)
    msgs = []
    for args in [(x, w.double(), counts, slots, tw), (x, w[:1], counts, slots, tw),
                 (x, w, counts.long(), slots, tw), (x, w, counts, slots[:5], tw),
                 (x, w, counts, slots, torch.rand(4, 3)), (x, w, counts, slots, torch.rand(9, 2)),
                 (x, w, counts[:1], slots, tw)]:
        try:
            ctx(*args)
            msgs.append(None)
        except (TypeError, ValueError) as e:
            msgs.append(str(e))
    ctx.close()
    return msgs


def _bad_ctx(world):
    from portable_overlap.shmem.providers import ShmemUnavailable
    msgs = []
    for kw, exc in ((dict(transport="nvlink"), ValueError), (dict(transport="shmem"),
                                                              ShmemUnavailable),
                    (dict(top_k=0), ValueError), (dict(walk="diagonal"), ValueError)):
        args = dict(max_tokens=8, top_k=2, hidden=16, experts_per_rank=2)
        args.update(kw)
        try:
            MoeGemmCombine(world, **args)
            msgs.append(None)
        except exc as e:
            msgs.append(str(e))
    return msgs


def test_bad_context_arguments(world2):
    # the device-initiated transport needs NVSHMEM / ROC_SHMEM: a clear error on emulated ranks
    for msgs in world2.run(_bad_ctx):
        assert "transport" in msgs[0] and "cpu" in msgs[1] and "top_k" in msgs[2], msgs
        assert "walk must be one of" in msgs[3], msgs


def test_bad_input_raises_before_launch(world2):
    for msgs in world2.run(_bad_host):
        assert all(m and m.startswith("moe_gemm_combine") for m in msgs), msgs
        assert "max_tokens" in msgs[5] and "counts" in msgs[6]


def _bad_routing(world, fault):
    """One rank's routing data is corrupted on the device; the kernels find it, nobody hangs."""
    ctx = MoeGemmCombine(world, max_tokens=8, top_k=2, hidden=16, experts_per_rank=2,
                         config=SMALL, timeout_s=5.0)
    g = torch.Generator().manual_seed(world.rank)
    S, k = 6, 2
    tokens = torch.randn(S, 8, generator=g)
    ids = torch.rand(S, 2 * world.world_size, generator=g).topk(k, dim=1).indices
    x, counts, slots = moe_dispatch_reference(tokens, ids, 2, world.group)
    if world.rank == 1:
        if fault == "slot":
            slots[0] = 10 ** 6  # far outside the combine buffer
        else:  # one row less than dispatched: a source gets S*k - 1 rows
            nz = counts.flatten().nonzero()[0].item()
            counts.view(-1)[nz] -= 1
            x, slots = x[1:].contiguous(), slots[1:].contiguous()
            counts = counts.contiguous()
    try:
        ctx(x, torch.randn(2, 8, 16, generator=g), counts, slots, torch.rand(S, k, generator=g))
        ctx.synchronize()
        r = "ok"
    except InvalidInputError as e:
        r = "invalid: " + str(e)
    except PeerTimeoutError as e:
        r = "timeout: " + str(e)
    ctx.close()
    return r


@pytest.mark.parametrize("fault", ["slot", "count"])
def test_bad_routing_found_on_device(world2, fault):
    res = world2.run(_bad_routing, fault, timeout=120)
    assert any(r.startswith("invalid") for r in res), res
    if fault == "slot":
        assert "routing slot" in res[1] and "1000000" in res[1], res
    else:
        assert any("row count" in r for r in res), res


def _counts_not_rows(world, fault):
    """Rank 1's counts are not its rows of x (more rows counted than x has, or a negative
    count): its GEMM computes and sends nothing (no read past x or slots) and reports the
    counts, rank 0 misses rank 1's rows and reports that; the next call is right on both."""
    from portable_overlap.testing.compare import rel_err

    S, H, I, El, k = 6, 16, 8, 2, 2
    ctx = MoeGemmCombine(world, max_tokens=8, top_k=k, hidden=H, experts_per_rank=El,
                         config=SMALL, timeout_s=5.0)
    g = torch.Generator().manual_seed(30 + world.rank)
    tokens = torch.randn(S, I, generator=g)
    ids = torch.rand(S, El * world.world_size, generator=g).topk(k, dim=1).indices
    x, counts, slots = moe_dispatch_reference(tokens, ids, El, world.group)
    w = torch.randn(El, I, H, generator=g)
    tw = torch.rand(S, k, generator=g)
    bad = counts.clone()
    if world.rank == 1:
        if fault == "too_many":
            bad[0, 0] += x.shape[0] + 40
        else:
            bad[0, 0], bad[-1, -1] = -3, bad[-1, -1] + 3 + bad[0, 0]
    got = []
    try:
        try:
            ctx(x, w, bad, slots, tw)
            ctx.synchronize()
            got.append("ok")
        except InvalidInputError as e:
            got.append(str(e))
        out = ctx(x, w, counts, slots, tw)
        ctx.synchronize()
        got.append(rel_err(out, moe_gemm_combine_reference(x, w, counts, slots, tw,
                                                           world.group)))
    finally:
        ctx.close()
    return got


@pytest.mark.parametrize("fault", ["too_many", "negative"])
def test_counts_that_are_not_the_rows_of_x(world2, fault):
    (msg0, err0), (msg1, err1) = world2.run(_counts_not_rows, fault, timeout=120)
    assert "routing counts" in msg1 and "nothing was computed" in msg1, msg1
    assert ("[1]: got -3" if fault == "negative" else "[0]: got") in msg1, msg1
    assert "row count" in msg0, msg0
    assert err0 < 1e-5 and err1 < 1e-5, (err0, err1)


def _skip(world):
    return call_while_peers_skip(
        world, lambda: MoeGemmCombine(world, max_tokens=8, top_k=1, hidden=16,
                                      experts_per_rank=1, config=SMALL, timeout_s=1.0),
        lambda ctx: ctx(torch.randn(2, 8), torch.randn(1, 8, 16),
                        torch.tensor([[1], [1]], dtype=torch.int32),
                        torch.tensor([0, 1], dtype=torch.int32), torch.rand(2, 1)))


def test_a_rank_that_skips_a_call_is_named(world2):
    msg = world2.run(_skip, timeout=120)[0]
    assert "rank 1" in msg and "rows-sent" in msg, msg


def _late_combine(world):
    """The last rank routes every token to its own experts, so no other rank stores rows into
    it, and it starts each combine late. The other ranks' next calls must still wait for that
    combine before they overwrite its rows-in counts and rows-sent flags (with equality waits, a
    flag overwritten early was a lost signal: a timeout first seen on 4 GPUs)."""
    import time

    W, r, El, k = world.world_size, world.rank, 1, 1
    ctx = MoeGemmCombine(world, max_tokens=8, top_k=k, hidden=16, experts_per_rank=El,
                         config=SMALL, timeout_s=5.0)
    if r == W - 1:
        orig = ctx.impl._comb_args  # the host step right before the combine launch
        ctx.impl._comb_args = lambda *a: (time.sleep(1.0), orig(*a))[1]
    g = torch.Generator().manual_seed(70 + r)
    S = 6
    ids = (torch.full((S, k), r) if r == W - 1 else torch.randint(0, W, (S, k), generator=g))
    tokens, tw = torch.randn(S, 8, generator=g), torch.rand(S, k, generator=g)
    w = torch.randn(El, 8, 16, generator=g)
    x, counts, slots = moe_dispatch_reference(tokens, ids, El, world.group)
    try:
        outs = [ctx(x, w, counts, slots, tw) for _ in range(3)]
        ctx.synchronize()
        ref = moe_gemm_combine_reference(x, w, counts, slots, tw, world.group)
        return max(((o - ref).norm() / ref.norm()).item() for o in outs)
    finally:
        ctx.close()


def test_a_late_combine_loses_no_signal(world):
    for err in world.run(_late_combine, timeout=240):
        assert err < 1e-5, err


def _corrupt_slots(world, fault, owner):
    """Rank 1 sends rank ``owner`` a row with a corrupted slot: a duplicate of another row's
    slot, a slot in [S*k, max_slots) (inside the combine buffer, outside the owner's S*k slots),
    one past the buffer, or a negative one. Returns (this rank's outcome of that call, the
    relative error of a valid call on fresh inputs that follows on the same context)."""
    from portable_overlap import PortableOverlapError

    W, r, El, k, S, H = world.world_size, world.rank, 2, 2, 6, 16
    ctx = MoeGemmCombine(world, max_tokens=8, top_k=k, hidden=H, experts_per_rank=El,
                         config=SMALL, timeout_s=60.0)

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        ids = torch.rand(S, El * W, generator=g).topk(k, dim=1).indices
        ids[:, 0] = El  # every token's first choice is rank 1's first expert
        tokens, tw = torch.randn(S, 8, generator=g), torch.rand(S, k, generator=g)
        w = torch.randn(El, 8, H, generator=g)
        x, counts, slots = moe_dispatch_reference(tokens, ids, El, world.group)
        return x, w, counts, slots, tw

    try:
        x, w, counts, slots, tw = inputs(50 + r)
        ref = moe_gemm_combine_reference(x, w, counts, slots, tw, world.group)
        bad = slots.clone()
        if r == 1:
            b = int(counts[:owner].sum())  # the first row from source rank `owner`
            assert int(counts[owner].sum()) >= S
            bad[b] = {"duplicate": int(slots[b + 1]), "spare": S * k + 1,
                      "past_buffer": ctx.max_slots, "negative": -1}[fault]
        try:  # the host check (a sync) finds it on every rank
            validate_routing(x, counts, bad, S, k, world)
            host = None
        except ValueError as e:
            host = str(e)
        out = torch.full((S, H), float("nan"))
        try:
            ctx(x, w, counts, bad, tw, out=out)
            ctx.synchronize()
            err = ((out - ref).norm() / ref.norm()).item()
            res = "ok" if err < 1e-5 else f"WRONG output (error {err:.3g}), no error raised"
        except InvalidInputError as e:
            res = "invalid: " + str(e)
        except PortableOverlapError as e:
            res = f"{type(e).__name__}: {e}"
        x, w, counts, slots, tw = inputs(60 + r)  # fresh inputs, poisoned output
        out = torch.full((S, H), float("nan"))
        ctx(x, w, counts, slots, tw, out=out)
        ctx.synchronize()
        ref = moe_gemm_combine_reference(x, w, counts, slots, tw, world.group)
        return host, res, ((out - ref).norm() / ref.norm()).item()
    finally:
        ctx.close()


def _check_corrupt(results, fault, owner):
    for host, res, err in results:
        assert host and "moe_gemm_combine" in host, results  # on every rank
        assert not res.startswith("WRONG"), results  # never a silently wrong output
        assert err < 1e-5, results  # the context serves the next call
    res = [r for _, r, _ in results]
    assert res[owner].startswith("invalid"), res  # the rank that owns the slots
    if fault in ("past_buffer", "negative"):
        # the sender skips the row and says so; the owner misses a row (the count, or the slot)
        assert "routing slot of dispatched row" in res[1], res
        assert "row count" in res[owner] or "no row" in res[owner], res
    else:  # the owner gets S*k rows, but one of its slots got none in this call
        assert "no row" in res[owner], res


@pytest.mark.parametrize("fault", ["duplicate", "spare", "past_buffer", "negative"])
def test_corrupt_slot_raises_on_the_owner(world, fault):
    _check_corrupt(world.run(_corrupt_slots, fault, 0, timeout=300), fault, 0)


@pytest.mark.parametrize("fault", ["duplicate", "spare"])
def test_corrupt_slot_of_own_rows_raises(world2, fault):
    _check_corrupt(world2.run(_corrupt_slots, fault, 1, timeout=300), fault, 1)


def _phases(world):
    """The call's two kernels launched apart (``phases``), after the call that plans them:
    gemm() then combine() on every rank is one more call, and gives the reference."""
    W = world.world_size
    g = torch.Generator().manual_seed(41 + world.rank)
    S, H, I, El, k = 7 + world.rank, 20, 12, 2, 2
    ctx = MoeGemmCombine(world, max_tokens=9, top_k=k, hidden=H, experts_per_rank=El,
                         config=SMALL)
    try:
        tokens = torch.randn(S, I, generator=g)
        ids = _route("uniform", S, El * W, k, world.rank, g)
        topk_w = torch.softmax(torch.randn(S, k, generator=g), dim=1)
        w = torch.randn(El, I, H, generator=g) / I ** 0.5
        x, counts, slots = moe_dispatch_reference(tokens, ids, El, world.group)
        out = torch.full((S, H), float("nan"))
        phases = ctx.phases(x, w, counts, slots, topk_w, out)
        out.fill_(float("nan"))  # poisoned: what follows must write all of it again
        phases["gemm"]()
        phases["combine"]()
        ctx.synchronize()
        ref = moe_gemm_combine_reference(x, w, counts, slots, topk_w, world.group)
        return ((out - ref).norm() / ref.norm()).item(), phases["gemm_kernel"]
    finally:
        ctx.close()


def test_phases_launch_the_two_kernels_apart(world2):
    for err, kernel in world2.run(_phases):
        assert err < TOL[torch.float32], err
        assert kernel is None  # the interpreter compiles nothing to hand out


def test_decode_tiles_fit_the_device():
    """The down GEMM's decode tiles: 4 stages where the shared memory holds them (H200), 3 on a
    164 KiB device (A100), the default tiles on 64-lane wavefronts and for float32."""
    import dataclasses

    from portable_overlap.backends.base import DeviceFacts
    from portable_overlap.ops.matmul.api import tile_config
    from portable_overlap.ops.moe_combine.api import decode_tile

    h200 = DeviceFacts(vendor="nvidia", name="H200", arch="sm_90", sm_count=132, warp_size=32,
                       max_shared_bytes_per_sm=228 * 1024, max_regs_per_sm=65536,
                       max_warps_per_sm=64, tensor_descriptors=True, register_cap=True,
                       max_shared_bytes_per_program=227 * 1024)
    a100 = dataclasses.replace(h200, name="A100", arch="sm_80",
                               max_shared_bytes_per_sm=164 * 1024,
                               max_shared_bytes_per_program=163 * 1024)
    mi300 = dataclasses.replace(h200, vendor="amd", name="MI300X", arch="gfx942", warp_size=64,
                                max_shared_bytes_per_program=64 * 1024)
    assert (decode_tile(torch.bfloat16, h200).block_m, decode_tile(torch.bfloat16, h200)
            .num_stages) == (64, 4)
    assert decode_tile(torch.float16, a100).num_stages == 3
    assert decode_tile(torch.bfloat16, mi300) == tile_config(torch.bfloat16, mi300)
    assert decode_tile(torch.float32, h200) == tile_config(torch.float32, h200)


class _CountingProvider:
    """A SHMEM provider stand-in that records allocations (the library's collective ones)."""

    def __init__(self):
        self.allocated = []

    def symmetric_empty(self, nbytes):
        self.allocated.append(nbytes)
        raise AssertionError("allocated although a peer has no library")


def _library_on_rank0_only(world):
    """Rank 1 has no SHMEM library (torch's backend fixed to another heap, say), rank 0 has
    one: the combine and the embedding op refuse ``"shmem"`` on both ranks, and rank 0
    allocates nothing (its peer would never join the collective allocation)."""
    import portable_overlap.shmem.providers as providers
    from portable_overlap.ops.embedding_alltoall import EmbeddingAllToAll
    from portable_overlap.shmem.providers import ShmemUnavailable

    p = _CountingProvider()

    def lookup(w):
        if w.rank == 1:
            raise ShmemUnavailable("torch's symmetric memory already allocates from 'CUDA'")
        return p

    saved, providers.get_provider = providers.get_provider, lookup
    found = []
    try:
        for make in (lambda: MoeGemmCombine(world, max_tokens=8, top_k=2, hidden=16,
                                            experts_per_rank=2, transport="shmem"),
                     lambda: EmbeddingAllToAll(world, [7, 5, 9, 4], 8, 5, transport="shmem")):
            try:
                make().close()
                found.append(None)
            except ShmemUnavailable as e:
                found.append(str(e))
    finally:
        providers.get_provider = saved
    return found, p.allocated


def test_shmem_refused_on_every_rank_when_one_lacks_the_library(world2):
    for msgs, allocated in world2.run(_library_on_rank0_only):
        assert [m.split(":")[0] for m in msgs] == ["moe_gemm_combine", "embedding_all_to_all"]
        assert all("rank 1: torch's symmetric memory" in m and "rank 0" not in m
                   for m in msgs), msgs
        assert allocated == []


def _late_and_refused(world, experts, late, refused):
    """One call per entry of ``experts`` on one context (4 tokens per rank, top-1, one expert
    per rank), every token of every rank routed to global expert ``experts[i]`` in call i, the
    scenario of ``testing.faults.late_and_refused`` (a bad ``out`` is the refused input). The
    dispatched rows and the references are made first: they are collective, and would hold
    the ranks in step (or wait for a rank whose call raised)."""
    from portable_overlap.testing.compare import rel_err
    from portable_overlap.testing.faults import late_and_refused_per_shape

    S, k, I, H = 4, 1, 8, 16
    inputs = []
    for i, e in enumerate(experts):
        g = torch.Generator().manual_seed(10 * i + world.rank)
        tokens, tw = torch.randn(S, I, generator=g), torch.rand(S, k, generator=g)
        w = torch.randn(1, I, H, generator=g)
        x, counts, slots = moe_dispatch_reference(tokens, torch.full((S, k), e), 1, world.group)
        ref = moe_gemm_combine_reference(x, w, counts, slots, tw, world.group)
        inputs.append((x, w, counts, slots, tw, ref))

    def call(ctx, i, args, bad):
        x, w, counts, slots, tw, ref = args
        out = torch.full((S, H), float("nan"))
        ctx(x, w, counts, slots, tw, out=torch.empty(1, 1) if bad else out)
        return lambda: rel_err(out, ref)

    return late_and_refused_per_shape(
        world, lambda: MoeGemmCombine(world, max_tokens=S, top_k=k, hidden=H,
                                      experts_per_rank=1, config=SMALL, timeout_s=3.0),
        inputs, call, late, refused)


def test_a_failed_call_leaves_no_late_rows_for_the_next_call(world4):
    """Rank 1 refuses a call that rank 3 makes late, in which every token goes to rank 3's
    expert: ranks 0 and 2 fail it at rank 1's flags and make the next call, where every token
    goes to rank 0's expert, at once; rank 0 stores its rows into ranks 1 and 2 (their
    buffers are free: rank 1 refused, rank 2 ended the failed call) before rank 3 stored its
    rows of the failed call there, at the same slots. Every rank must wait for its peers to
    be done with the failed call first (without: a late row's stamp, of the failed call,
    fails the next call as a routing slot with no row)."""
    for rank, found in enumerate(world4.run(_late_and_refused, (1, 3, 0), (3, 1), (1, (1,)),
                                            timeout=120)):
        assert found[:3] == ["no error", "ValueError" if rank == 1 else "PeerTimeoutError",
                             "no error"], (rank, found)
        assert found[3] < 1e-5, (rank, found)
