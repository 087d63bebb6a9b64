"""The experts' gated grouped GEMM (expert_swiglu) and the whole expert-parallel MoE layer on
CPU-emulated ranks: the fused layer (dispatch, gated GEMMs, GEMM + combine, no host sync)
against the torch path with the same weights."""
from types import SimpleNamespace

import pytest
import torch

from portable_overlap.ops.matmul import MatmulConfig
from portable_overlap.ops.moe_experts import expert_swiglu, expert_swiglu_reference
from portable_overlap.testing.compare import rel_err
from portable_overlap.testing.faults import construction_outcome

SMALL = MatmulConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1)
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _swiglu(world, dtype, gather):
    """Odd H and I (edge tiles), empty segments, more rows in x than the counts name (their
    outputs stay poisoned), a non-contiguous x, a single-segment layout; row tiles per source
    or gathered over the sources (tiles mixing sources, a source with none of an expert's
    rows)."""
    errs = []
    for seed, (W, E, H, I, extra) in enumerate(((2, 3, 24, 20, 5), (1, 1, 17, 33, 0),
                                                (4, 2, 16, 16, 9))):
        g = torch.Generator().manual_seed(10 * seed + world.rank)
        counts = torch.randint(0, 9, (W, E), generator=g, dtype=torch.int32)
        counts.view(-1)[0] = 0
        R = int(counts.sum())
        x = torch.randn(R + extra, 2 * H, generator=g)[:, ::2].to(dtype)  # row stride 2H
        wg = (torch.randn(E, H, I, generator=g) / H ** 0.5).to(dtype)
        wu = (torch.randn(E, H, I, generator=g) / H ** 0.5).to(dtype)
        out = torch.full((R + extra, I), float("nan"), dtype=dtype)
        expert_swiglu(x, wg, wu, counts, out, config=SMALL if seed else None, gather=gather)
        ref = expert_swiglu_reference(x, wg, wu, counts)
        assert torch.isnan(out[R:]).all(), "rows past counts.sum() were written"
        errs.append(((out[:R].double() - ref.double()).norm()
                     / ref.double().norm().clamp_min(1e-30)).item() if R else 0.0)
    return errs


@pytest.mark.parametrize("gather", [False, True], ids=["per_source", "gathered"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=lambda d: str(d)[6:])
def test_expert_swiglu_matches_reference(world2, dtype, gather):
    for errs in world2.run(_swiglu, dtype, gather):
        assert all(e < TOL[dtype] for e in errs), errs


def _swiglu_packing(world):
    """The device's choice of packed experts (``gather=None``): an expert with a few rows from
    each of 4 sources (packing halves its tiles), one whose segments fill their tiles, one
    with a single source; then a packed buffer too small for the first expert (it keeps its
    per-source tiles). Every output row against the reference, poison past the counts."""
    g = torch.Generator().manual_seed(5 + world.rank)
    H, I = 40, 24
    counts = torch.tensor([[5, 16, 0], [6, 16, 0], [4, 16, 5], [5, 16, 0]], dtype=torch.int32)
    R = int(counts.sum())
    x = torch.randn(R + 3, H, generator=g)
    wg, wu = (torch.randn(3, H, I, generator=g) / H ** 0.5 for _ in range(2))
    ref = expert_swiglu_reference(x, wg, wu, counts)
    errs = []
    for m in (4.0, 0.1):  # the second bounds the packed buffer at 16 rows: 20 do not fit
        out = torch.full((R + 3, I), float("nan"))
        expert_swiglu(x, wg, wu, counts, out, config=SMALL, rows_per_segment=m)
        assert torch.isnan(out[R:]).all(), "rows past counts.sum() were written"
        errs.append(((out[:R] - ref).norm() / ref.norm()).item())
    return errs


def test_expert_swiglu_packs_on_the_device(world2):
    from portable_overlap.ops.moe_experts.api import pack_capacity, pack_rows

    assert pack_rows(4, 4, 16) and pack_rows(32, 8, 64) and not pack_rows(64, 8, 64)
    assert not pack_rows(4, 1, 16)  # one source: nothing to pack together
    assert pack_capacity(500, 0.1, 12, 16) == 16 and pack_capacity(10, 4, 12, 16) == 10
    for errs in world2.run(_swiglu_packing):
        assert all(e < 1e-5 for e in errs), errs


def _swiglu_split(world):
    """The last round's tiles cut into ranges of K steps (``split``, the default): layouts whose
    tile count leaves a few tiles for the grid's last round, per source and packed, H a
    multiple of the K block and not (the last range masked). Against the reference; two calls
    give the same bits; the whole-K call differs by rounding only; the counts are left zero;
    poison past the counts stays; a call after the kept buffers are dropped."""
    from portable_overlap.ops.moe_experts.api import free_workspaces, workspace

    g = torch.Generator().manual_seed(21 + world.rank)
    res = []
    # (counts, H, I, programs, gather): 16-row tiles, 16-column blocks, K blocks of 16
    for counts, H, I, programs, gather in (([[37, 0, 12], [5, 30, 1]], 72, 40, 7, False),
                                           ([[3, 4], [5, 2], [6, 1]], 64, 48, 4, True),
                                           ([[61]], 80, 40, 5, False)):
        counts = torch.tensor(counts, dtype=torch.int32)
        R, E = int(counts.sum()), counts.shape[1]
        x = torch.randn(R + 4, H, generator=g)
        wg, wu = (torch.randn(E, H, I, generator=g) / H ** 0.5 for _ in range(2))
        ref = expert_swiglu_reference(x, wg, wu, counts)
        outs = []
        for split in (True, True, False):
            out = torch.full((R + 4, I), float("nan"))
            expert_swiglu(x, wg, wu, counts, out, config=SMALL, programs=programs, gather=gather,
                          split=split)
            assert torch.isnan(out[R:]).all(), "rows past counts.sum() were written"
            outs.append(out[:R])
        res.append(dict(err=((outs[0] - ref).norm() / ref.norm()).item(),
                        same=torch.equal(outs[0], outs[1]),
                        split_ran=not torch.equal(outs[0], outs[2]),
                        vs_whole=(outs[0] - outs[2]).abs().max().item(),
                        counts_zero=not workspace(x.device, "split_counts", programs,
                                                  torch.int32).any()))
    # the kept buffers dropped: the next call makes them again, zeroed counts included
    free_workspaces()
    out = torch.full((R + 4, I), float("nan"))
    expert_swiglu(x, wg, wu, counts, out, config=SMALL, programs=programs, split=True)
    res.append(dict(err=((out[:R] - ref).norm() / ref.norm()).item(), same=True, split_ran=True,
                    vs_whole=0.0, counts_zero=True))
    return res


def test_expert_swiglu_splits_the_last_round(world2):
    for res in world2.run(_swiglu_split):
        for r in res:
            assert r["err"] < 1e-5 and r["same"] and r["counts_zero"], r
            assert r["split_ran"] and r["vs_whole"] < 1e-5, r


def _swiglu_variants(world):
    """The tiles picked on the device (``api.decode_variants``: two launches, one runs): segments
    of a few rows (the light tiles), of many (the heavy ones), one segment only, none. Every
    output row against the reference, poison past the counts."""
    g = torch.Generator().manual_seed(9 + world.rank)
    H, I = 40, 24
    wg, wu = (torch.randn(2, H, I, generator=g) / H ** 0.5 for _ in range(2))
    errs = []
    for counts in (torch.randint(3, 12, (3, 2), generator=g), torch.randint(100, 140, (3, 2),
                                                                             generator=g),
                   torch.tensor([[0, 0], [0, 97], [0, 0]]), torch.zeros(3, 2)):
        counts = counts.to(torch.int32)
        R = int(counts.sum())
        x = torch.randn(R + 5, H, generator=g)
        out = torch.full((R + 5, I), float("nan"))
        expert_swiglu(x, wg, wu, counts, out, rows_per_segment=48)
        assert torch.isnan(out[R:]).all(), "rows past counts.sum() were written"
        ref = expert_swiglu_reference(x, wg, wu, counts)
        errs.append(((out[:R] - ref).norm() / ref.norm()).item() if R else 0.0)
    return errs


def test_expert_swiglu_tiles_picked_on_the_device(world2):
    from portable_overlap.ops.moe_experts.api import CPU_VARIANTS, decode_variants

    facts = SimpleNamespace(warp_size=32)
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert decode_variants(torch.float32, cpu, facts, False, 48) == CPU_VARIANTS
    assert decode_variants(torch.bfloat16, gpu, facts, True, 64) is not None
    assert decode_variants(torch.bfloat16, gpu, facts, True, 32) is None  # packing's sizes
    assert decode_variants(torch.bfloat16, gpu, facts, False, 48) is None  # pointer loads
    assert decode_variants(torch.bfloat16, gpu, SimpleNamespace(warp_size=64), True, 48) is None
    for errs in world2.run(_swiglu_variants):
        assert all(e < 1e-5 for e in errs), errs


def _swiglu_counts_past_x(world):
    """Counts that are not rows of x (more rows than x has, a negative count), per source and
    gathered, split and whole: nothing is computed, out stays poisoned, and the memory past x
    and out (both views of larger buffers, here) is untouched."""
    g = torch.Generator().manual_seed(3 + world.rank)
    H, I, R = 24, 20, 10
    xs = torch.randn(R + 8, H, generator=g)
    wg, wu = (torch.randn(2, H, I, generator=g) / H ** 0.5 for _ in range(2))
    found = []
    for counts in ([[6, 9]], [[12, -2]], [[4, 3], [-40, 2]]):
        counts = torch.tensor(counts, dtype=torch.int32)
        for gather, split in ((False, True), (True, False)):
            outs = torch.full((R + 8, I), float("nan"))
            x, out = xs[:R], outs[:R]
            expert_swiglu(x, wg, wu, counts, out, config=SMALL, gather=gather, split=split)
            found.append(bool(torch.isnan(outs).all()))
    return found


def test_expert_swiglu_counts_that_are_not_rows_of_x(world2):
    for found in world2.run(_swiglu_counts_past_x):
        assert all(found), found


def _swiglu_bad(world):
    x, w, c = torch.randn(6, 8), torch.randn(2, 8, 4), torch.tensor([[3, 3]], dtype=torch.int32)
    msgs = []
    for args, kw in [((x.double(), w, w, c), {}), ((x, w, w[:1], c), {}),
                     ((x, w, w, c.long()), {}), ((x, w, w, c[:, :1]), {}),
                     ((x, w, w, c[:0]), {}),  # no source (a ZeroDivisionError)
                     ((x[:, :4], w, w, c), {}), ((x, w, w, c), {"rows_per_segment": -1}),
                     ((x, w, w, c), {"rows_per_segment": float("nan")}),
                     # rows of out that overlap: stored into the same memory, with no error
                     ((x, w, w, c), {"out": torch.empty(1, 4).expand(6, 4)}),
                     ((x, w, w, c), {"out": torch.empty(16).as_strided((6, 4), (2, 1))})]:
        try:
            expert_swiglu(*args, **kw)
            msgs.append(None)
        except (TypeError, ValueError) as e:
            msgs.append(str(e))
    return msgs


def test_expert_swiglu_bad_input(world2):
    for msgs in world2.run(_swiglu_bad):
        assert all(m and m.startswith("expert_swiglu") for m in msgs), msgs
        assert all("do not overlap" in m for m in msgs[-2:]), msgs[-2:]


def _layer(world, capacity, dedup=None):
    """The fused layer against the torch path (same weights), four calls with different token
    counts per rank (one rank with none in a call); outputs poisoned by fresh tensors."""
    from portable_overlap import ExpertParallelMoE

    H, I, E, k = 24, 20, 2 * world.world_size, 3
    fused = ExpertParallelMoE(world, H, I, E, k, max_tokens=9, dtype=torch.float32,
                              capacity=capacity, dedup=dedup)
    assert fused.dispatch_ctx.dedup == bool(dedup)  # (the rule's pick at these sizes: off)
    ref = ExpertParallelMoE(world, H, I, E, k, max_tokens=9, dtype=torch.float32, fused=False)
    errs = []
    try:
        with torch.no_grad():
            for call in range(4):
                g = torch.Generator().manual_seed(7 * call + world.rank)
                S = (3 + 2 * call + world.rank) % 10 if call != 2 or world.rank else 0
                tokens = torch.randn(S, H, generator=g)
                y = fused(tokens)
                fused.synchronize()
                y_ref = ref(tokens)
                errs.append(((y - y_ref).norm() / y_ref.norm().clamp_min(1e-30)).item()
                            if S else float(y.numel()))
    finally:
        fused.close()
    return errs


@pytest.mark.parametrize("capacity, dedup", [(None, None), (40, None), (None, True)],
                         ids=["default_capacity", "capacity40", "dedup"])
def test_fused_layer_matches_torch_path(world, capacity, dedup):
    for errs in world.run(_layer, capacity, dedup):
        assert all(e < 1e-5 for e in errs), errs


def _bad_tokens(world, fused):
    """Tokens the layer cannot take (a [B, T, H] batch, the wrong width, the wrong dtype), on
    every rank: each raises an error that names the layer, before any collective, and the next
    call is right."""
    from portable_overlap import ExpertParallelMoE

    H = 8
    layer = ExpertParallelMoE(world, H, 8, 2 * world.world_size, 2, max_tokens=6,
                              dtype=torch.float32, fused=fused)
    ref = ExpertParallelMoE(world, H, 8, 2 * world.world_size, 2, max_tokens=6,
                            dtype=torch.float32, fused=False)
    msgs = []
    try:
        with torch.no_grad():
            for t in (torch.randn(2, 3, H), torch.randn(3, H + 1), torch.randn(3, H).double()):
                try:
                    layer(t)
                    msgs.append(None)
                except (TypeError, ValueError) as e:
                    msgs.append(str(e))
            tokens = torch.randn(5, H, generator=torch.Generator().manual_seed(world.rank))
            y = layer(tokens)
            layer.synchronize()
            err = ((y - ref(tokens)).norm() / ref(tokens).norm()).item()
    finally:
        layer.close()
    return msgs, err


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch_path"])
def test_tokens_the_layer_cannot_take_are_refused(world2, fused):
    for msgs, err in world2.run(_bad_tokens, fused):
        assert all(m and m.startswith("ExpertParallelMoE: tokens") for m in msgs), msgs
        assert err < 1e-5, err


def _dedup_refused(world):
    from portable_overlap import ExpertParallelMoE

    msgs = []
    for opts in ({"fuse_dispatch": True}, {"one_launch": True}, {"fused": False}):
        try:
            ExpertParallelMoE(world, 8, 8, 2 * world.world_size, 2, max_tokens=4, dedup=True,
                              **opts)
            msgs.append("no error")
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_dedup_is_refused_by_the_schedules_that_send_a_row_per_expert(world2):
    for msgs in world2.run(_dedup_refused):
        assert all("dedup=True" in m for m in msgs), msgs


def _grads(world, fused, tokens_grad):
    """Backward of the layer (fused or torch forward) against autograd of the dense layer on
    all ranks' tokens and experts: gradients of the tokens, of this rank's experts and of the
    router (summed over the ranks). Token counts differ per rank, one rank has none in the
    second call, and the tokens take no gradient when ``tokens_grad`` is False."""
    from portable_overlap import ExpertParallelMoE
    from portable_overlap.modules.moe_backward import dense_layer_reference

    W, r = world.world_size, world.rank
    H, I, E, k = 12, 10, 2 * W, 2
    layer = ExpertParallelMoE(world, H, I, E, k, max_tokens=7, dtype=torch.float32,
                              fused=fused)
    errs = []
    try:
        for call in range(2):
            g = torch.Generator().manual_seed(31 * call + r)
            S = 0 if call == 1 and r == W - 1 else 3 + (r + call) % 5
            tokens = torch.randn(S, H, generator=g).requires_grad_(tokens_grad)
            dout = torch.randn(S, H, generator=g)
            for p in layer.parameters():
                p.grad = None
            y = layer(tokens)
            if fused:
                layer.synchronize()
            y.backward(dout)
            mine = {"tokens": tokens.detach(), "dout": dout,
                    "dtokens": tokens.grad if tokens_grad else None,
                    **{n: p.detach() for n, p in layer.named_parameters()},
                    **{"d" + n: p.grad for n, p in layer.named_parameters()}}
            every = world.all_gather_object(mine)
            T = torch.cat([m["tokens"] for m in every]).requires_grad_(tokens_grad)
            ws = [torch.cat([m[n] for m in every]).requires_grad_()
                  for n in ("w_gate", "w_up", "w_down")]
            router = mine["router"].clone().requires_grad_()
            out = dense_layer_reference(T, router, *ws, k)
            (out * torch.cat([m["dout"] for m in every])).sum().backward()
            lo = sum(m["tokens"].shape[0] for m in every[:r])
            El = E // W
            pairs = [(mine["d" + n], w.grad[r * El:(r + 1) * El])
                     for n, w in zip(("w_gate", "w_up", "w_down"), ws)]
            pairs.append((sum(m["drouter"] for m in every), router.grad))
            if tokens_grad and S:
                pairs.append((mine["dtokens"], T.grad[lo:lo + S]))
            assert (mine["dtokens"] is None) == (not tokens_grad)
            errs.append(max(((a - b).norm() / b.norm().clamp_min(1e-30)).item()
                            for a, b in pairs))
    finally:
        layer.close()
    return errs


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch_path"])
def test_layer_backward_matches_dense_autograd(world, fused):
    for errs in world.run(_grads, fused, True):
        assert all(e < 1e-4 for e in errs), errs


def test_layer_backward_without_token_gradients(world2):
    for errs in world2.run(_grads, True, False):
        assert all(e < 1e-4 for e in errs), errs


def _second_derivative(world, fused):
    """A gradient penalty through the layer (``create_graph=True``): the backward takes its
    gradients on detached weights, so the penalty's gradient reached the router only and the
    experts' weights got none, with no error. It raises on every rank, before any exchange, and
    a first-order step after it matches the dense layer's."""
    from portable_overlap import ExpertParallelMoE
    from portable_overlap.modules.moe_backward import dense_layer_reference

    H = 8
    layer = ExpertParallelMoE(world, H, 6, 2 * world.world_size, 2, max_tokens=6,
                              dtype=torch.float32, fused=fused)
    g = torch.Generator().manual_seed(world.rank)
    try:
        t = torch.randn(4, H, generator=g).requires_grad_()
        try:
            (gt,) = torch.autograd.grad(layer(t).sum(), t, create_graph=True)
            (gt ** 2).sum().backward()
            msg = f"no error; w_gate.grad is {layer.w_gate.grad}"
        except RuntimeError as e:
            msg = str(e)
        layer.zero_grad(set_to_none=True)
        t = torch.randn(5, H, generator=g)
        y = layer(t)
        y.sum().backward()
        every = world.all_gather_object((t, {n: p.detach() for n, p in layer.named_parameters()}))
        ws = [torch.cat([m[n] for _, m in every]).requires_grad_()
              for n in ("w_gate", "w_up", "w_down")]
        T = torch.cat([x for x, _ in every])
        dense_layer_reference(T, every[0][1]["router"], *ws, 2).sum().backward()
        El = 2
        want = ws[2].grad[world.rank * El:(world.rank + 1) * El]
        err = ((layer.w_down.grad - want).norm() / want.norm()).item()
    finally:
        layer.close()
    return msg, err


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch_path"])
def test_a_second_derivative_raises_on_every_rank(world2, fused):
    for msg, err in world2.run(_second_derivative, fused):
        assert msg.startswith("ExpertParallelMoE: the layer's backward is not differentiable"), \
            msg
        assert err < 1e-5, err


def test_layer_on_eight_ranks(world8):
    """The fused layer against the torch path, and its backward against dense autograd, on 8
    ranks (16 experts, 2 per rank; a rank without tokens in a call)."""
    for errs in world8.run(_layer, None, timeout=540):
        assert all(e < 1e-5 for e in errs), errs
    for errs in world8.run(_grads, True, True, timeout=540):
        assert all(e < 1e-4 for e in errs), errs


def _late_and_refused(world, calls, late, refused):
    """Calls on one pair of contexts (4 tokens per rank, top-1 of one expert per rank, H 8,
    I 8), the scenario of ``testing.faults.late_and_refused`` (a bad ``out`` is the refused
    input): each of ``calls`` is ``(op, e)``, ``op`` ``"layer"`` (``moe_layer``) or
    ``"combine"`` (the staged ``moe_gemm_combine`` on the layer's combine context), every
    token routed to global expert ``e``. The dispatched rows and references are made first:
    they are collective, and would hold the ranks in step."""
    from portable_overlap.ops.moe_combine import (MoeGemmCombine, moe_gemm_combine,
                                                  moe_gemm_combine_reference)
    from portable_overlap.ops.moe_dispatch import MoeDispatch, moe_dispatch_reference
    from portable_overlap.ops.moe_layer import moe_layer, moe_layer_reference
    from portable_overlap.testing.compare import rel_err
    from portable_overlap.testing.faults import late_and_refused

    S, k, H, F = 4, 1, 8, 8  # F: the experts' intermediate width
    dctx = MoeDispatch(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=1,
                       dtype=torch.float32, timeout_s=3.0)
    cctx = MoeGemmCombine(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=1,
                          timeout_s=3.0)
    made = []
    for i, (op, e) in enumerate(calls):
        g = torch.Generator().manual_seed(10 * i + world.rank)
        tokens, tw = torch.randn(S, H, generator=g), torch.rand(S, k, generator=g)
        ids = torch.full((S, k), e)
        wg, wu = torch.randn(1, H, F, generator=g), torch.randn(1, H, F, generator=g)
        wd = torch.randn(1, F, H, generator=g)
        if op == "layer":
            ref = moe_layer_reference(tokens, ids, tw, wg, wu, wd, 1, world.group)
            made.append(lambda out, a=(tokens, ids, tw, wg, wu, wd): moe_layer(
                *a, dctx, cctx, out=out))
        else:
            x, counts, slots = moe_dispatch_reference(torch.randn(S, F, generator=g), ids, 1,
                                                      world.group)
            ref = moe_gemm_combine_reference(x, wd, counts, slots, tw, world.group)
            made.append(lambda out, a=(x, wd, counts, slots, tw): moe_gemm_combine(
                *a, cctx, out=out))
        made[-1] = (made[-1], ref)

    def call(fn, ref):
        def run(bad):
            out = torch.full((S, H), float("nan"))
            with torch.no_grad():
                fn(torch.empty(1, 1) if bad else out)
            return lambda: rel_err(out, ref)
        return run

    class Both:  # late_and_refused synchronizes one context: here both
        def synchronize(self):
            dctx.synchronize()
            cctx.synchronize()

    try:
        return late_and_refused(world, Both(), [call(*m) for m in made], late, refused)
    finally:
        dctx.close()
        cctx.close()


@pytest.mark.parametrize("first", ["layer", "combine"])
def test_a_failed_call_leaves_no_late_rows_for_the_next_call(world4, first):
    """Rank 1 refuses a call that rank 3 makes late, in which every token goes to rank 3's
    expert; then a layer call in which every token goes to rank 0's expert, whose rows go to
    the slots in rank 1's combine buffer where rank 3's rows of the failed call land. Immune
    by design, which this guards: a failed layer call stores no row (no rank stores rows in a
    call whose routing counts did not all arrive, and a refused call's never do), and the
    rows of a failed staged combine call, which do come late, land before any rank stores a
    row of the layer call: the layer's count exchange waits for every rank's counts, which a
    rank sends only after its earlier launches (one stream), the late combine's included."""
    calls = (("layer", 1), (first, 3), ("layer", 0))
    for rank, found in enumerate(world4.run(_late_and_refused, calls, (3, 1), (1, (1,)),
                                            timeout=180)):
        assert found[:3] == ["no error", "ValueError" if rank == 1 else "PeerTimeoutError",
                             "no error"], (rank, found)
        assert found[3] < 1e-5, (rank, found)


def test_a_grown_workspace_keeps_the_buffer_a_graph_may_hold():
    """``expert_swiglu``'s kept buffers: a call that needs more replaces the buffer, at least
    doubled, but keeps the old one alive (a CUDA graph captured with it replays into its
    addresses) until ``free_workspaces``; a call that needs no more gets the same memory."""
    import gc
    import weakref

    from portable_overlap.ops.moe_experts import api

    dev = torch.device("cpu")
    api.free_workspaces(dev)
    try:
        small = api.workspace(dev, "probe", 100, torch.float32)
        held = weakref.ref(small._base if small._base is not None else small)
        ptr = small.data_ptr()
        del small
        assert api.workspace(dev, "probe", 60, torch.float32).data_ptr() == ptr
        grown = api.workspace(dev, "probe", 150, torch.float32)
        assert grown.numel() == 150 and grown.data_ptr() != ptr
        assert grown._base.numel() == 200  # doubled: what is kept stays below what is in use
        gc.collect()
        assert held() is not None, "the replaced buffer was freed"
        api.free_workspaces(dev)
        del grown
        gc.collect()
        assert held() is None, "free_workspaces kept the replaced buffer"
    finally:
        api.free_workspaces(dev)


def _swapped_handles(world):
    """The parts' torch ops given the dispatch and combine handles swapped (or a combine's
    where a dispatch's goes): a ``TypeError`` naming the context each needs, before anything
    runs; then a staged layer call on the same contexts is right."""
    from portable_overlap.ops.moe_combine import MoeGemmCombine
    from portable_overlap.ops.moe_dispatch import MoeDispatch
    from portable_overlap.ops.moe_layer import moe_layer, moe_layer_reference
    from portable_overlap.testing.compare import rel_err

    ops = torch.ops.portable_overlap
    S, k, H, F = 4, 1, 8, 8
    dctx = MoeDispatch(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=1,
                       dtype=torch.float32, timeout_s=5.0)
    cctx = MoeGemmCombine(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=1,
                          timeout_s=5.0)
    g = torch.Generator().manual_seed(world.rank)
    tokens, tw = torch.randn(S, H, generator=g), torch.rand(S, k, generator=g)
    ids = torch.randint(0, world.world_size, (S, k), generator=g)
    wg, wu = torch.randn(1, H, F, generator=g), torch.randn(1, H, F, generator=g)
    wd = torch.randn(1, F, H, generator=g)
    found = {}
    for name, call in (
            ("layer", lambda: ops.moe_layer(tokens, ids, tw, wg, wu, wd, cctx.handle,
                                            dctx.handle)),
            ("dispatch_swiglu", lambda: ops.moe_dispatch_swiglu(tokens, ids, wg, wu,
                                                                cctx.handle))):
        try:
            call()
            found[name] = "no error"
        except TypeError as e:
            found[name] = str(e)
    ref = moe_layer_reference(tokens, ids, tw, wg, wu, wd, 1, world.group)
    err = rel_err(moe_layer(tokens, ids, tw, wg, wu, wd, dctx, cctx), ref)
    dctx.close()
    cctx.close()
    return found, err


def test_the_parts_torch_ops_refuse_swapped_handles(world2):
    for found, err in world2.run(_swapped_handles, timeout=180):
        assert "dispatch_ctx must be a MoeDispatch" in found["layer"], found
        assert "must be a MoeDispatch's" in found["dispatch_swiglu"], found
        assert err < 1e-4, err


def _made_on_two_ranks(world, case):
    """``ExpertParallelMoE`` made with arguments that differ on rank 1, then a good one, which
    needs the ranks still in step: (error type, message, seconds) of the first."""

    from portable_overlap import ExpertParallelMoE

    r, W = world.rank, world.world_size
    kw = dict(max_tokens=4, dtype=torch.float32)
    make = {
        # refused on rank 1 alone: rank 0 went on into the contexts' set-up
        "num_experts": lambda: ExpertParallelMoE(world, 8, 8, 2 * W + r, 2, **kw),
        "top_k": lambda: ExpertParallelMoE(world, 8, 8, 2 * W, 2 + 8 * r, **kw),
        "hidden": lambda: ExpertParallelMoE(world, 8 - 8 * r, 8, 2 * W, 2, **kw),
        # good on each rank, different across them: rank 1 makes no context, or routes by
        # another router (a replicated parameter) with no error
        "fused": lambda: ExpertParallelMoE(world, 8, 8, 2 * W, 2, fused=r == 0, **kw),
        "seed": lambda: ExpertParallelMoE(world, 8, 8, 2 * W, 2, seed=r, fused=False, **kw),
        "one_launch": lambda: ExpertParallelMoE(world, 8, 8, 2 * W, 2, one_launch=r == 1,
                                                **kw),
    }[case]
    out = construction_outcome(make)
    ExpertParallelMoE(world, 8, 8, 2 * W, 2, **kw).close()
    return out


@pytest.mark.parametrize("case,arg", [("num_experts", None), ("top_k", None), ("hidden", None),
                                      ("fused", "fused"), ("seed", "seed"),
                                      ("one_launch", "one_launch")])
def test_layer_arguments_bad_or_different_on_one_rank_raise_on_every_rank(world2, case, arg):
    """An argument refused on rank 1 alone left rank 0 waiting in the contexts' set-up until
    the process group's timeout; arguments that differed hung the same way, or gave the ranks
    different routers with no error. Every rank raises at once."""
    mine, peer = world2.run(_made_on_two_ranks, case, timeout=90)
    assert mine[2] < 30 and peer[2] < 30, (mine, peer)
    if arg is None:
        assert peer[0] == "ValueError" and peer[1].startswith("ExpertParallelMoE: "), peer
        assert mine[0] == "PeerSetupError" and "rank 1 refused to make ExpertParallelMoE" \
            in mine[1], mine
    else:
        for got in (mine, peer):
            assert got[0] == "RankMismatchError" and f"{arg}: rank 0: " in got[1], got
            assert got[1].startswith("ExpertParallelMoE: "), got


def _bad_tokens_on_one_rank(world, schedule, bad="dtype"):
    """Rank 1 passes tokens of the wrong dtype (``bad="dtype"``) or on the meta device
    (``"device"``), rank 0 good ones, then both good ones: (error type, message, seconds) of
    the first call on this rank, and the second call's relative error against the torch
    path."""
    import time

    from portable_overlap import ExpertParallelMoE

    r, W = world.rank, world.world_size
    opts = {"fused": False} if schedule == "torch_path" else (
        {schedule: True} if schedule != "staged" else {})
    layer = ExpertParallelMoE(world, 8, 6, 2 * W, 2, max_tokens=5, dtype=torch.float32, **opts)
    ref = ExpertParallelMoE(world, 8, 6, 2 * W, 2, max_tokens=5, dtype=torch.float32,
                            fused=False)
    g = torch.Generator().manual_seed(40 + r)
    first, second = torch.randn(3, 8, generator=g), torch.randn(4, 8, generator=g)
    try:
        with torch.no_grad():
            t0 = time.monotonic()
            try:
                spoilt = first.double() if bad == "dtype" else first.to("meta")
                layer(spoilt if r == 1 else first)
                out = ("no error", "", 0.0)
            except Exception as e:
                out = (type(e).__name__, str(e), time.monotonic() - t0)
            y = layer(second)
            layer.synchronize()
            y_ref = ref(second)
    finally:
        layer.close()
    return out, ((y - y_ref).norm() / y_ref.norm()).item()


@pytest.mark.parametrize("schedule", ["staged", "fuse_dispatch", "one_launch", "torch_path"])
def test_tokens_refused_on_one_rank_fail_the_call_on_every_rank(world2, schedule):
    """The layer's own check of the tokens failed on rank 1 alone, before the dispatch: rank 0
    waited in it until its timeout (its call then paired with rank 1's next one), and the
    contexts were broken for every later call; on the torch path rank 0 waited in its first
    all-to-all for gloo's timeout (half an hour). The check refuses the call: rank 0 fails the
    same call at once and the next call is right on both."""
    (mine, err0), (peer, err1) = world2.run(_bad_tokens_on_one_rank, schedule, timeout=120)
    assert peer[0] == "TypeError" and peer[1].startswith("ExpertParallelMoE: tokens"), peer
    assert mine[0] == "PeerTimeoutError" and ("rank 1 gave up" in mine[1]
                                              or "rank(s) [1] gave up" in mine[1]), mine
    assert mine[2] < 8.0, mine  # (the contexts' timeout is 10 s)
    assert err0 < 1e-5 and err1 < 1e-5, (err0, err1)


def test_tokens_on_a_device_autocast_does_not_know_fail_the_call_on_every_rank(world2):
    """Meta tokens on rank 1: torch's autocast query raised a bare RuntimeError for them
    before the layer's check, so rank 0 paired the call with rank 1's next one. The check
    names the device and refuses the call on every rank."""
    (mine, err0), (peer, err1) = world2.run(_bad_tokens_on_one_rank, "staged", "device",
                                            timeout=120)
    assert peer[0] == "TypeError" and "meta" in peer[1], peer
    assert mine[0] == "PeerTimeoutError" and "gave up" in mine[1], mine
    assert err0 < 1e-5 and err1 < 1e-5, (err0, err1)


def _converted_and_strided(world):
    """A transposed (non-contiguous) view of the tokens, on the fused layer against the torch
    path; then the fused layer converted with ``.float()`` after it was built for bfloat16:
    the outcome of a call."""
    from portable_overlap import ExpertParallelMoE

    W, r = world.world_size, world.rank
    layer = ExpertParallelMoE(world, 8, 6, 2 * W, 2, max_tokens=5, dtype=torch.float32)
    ref = ExpertParallelMoE(world, 8, 6, 2 * W, 2, max_tokens=5, dtype=torch.float32,
                            fused=False)
    half = ExpertParallelMoE(world, 8, 6, 2 * W, 2, max_tokens=5, dtype=torch.bfloat16)
    tokens = torch.randn(8, 4, generator=torch.Generator().manual_seed(r)).t()
    try:
        with torch.no_grad():
            y = layer(tokens)
            layer.synchronize()
            err = ((y - ref(tokens)).norm() / ref(tokens).norm()).item()
            half.float()
            try:
                half(tokens.contiguous())
                converted = "no error"
            except TypeError as e:
                converted = str(e)
    finally:
        layer.close()
        half.close()
    return err, converted


def test_strided_tokens_and_a_converted_layer(world2):
    """Tokens with strided rows failed in the dispatch's check (the layer's input, as an
    nn.Linear's, may be any view); a fused layer converted with .float() raised the dispatch's
    error about the context's dtype, naming neither the layer nor the conversion."""
    for err, converted in world2.run(_converted_and_strided):
        assert err < 1e-5, err
        assert converted.startswith("ExpertParallelMoE: the layer's parameters are "
                                    "torch.float32") and "build the layer" in converted, converted


def _given_combine_contexts(world):
    """``ExpertParallelMoE(ctx=...)`` with a combine context that cannot serve the layer (another
    top_k, hidden or experts_per_rank, fewer max_tokens, the torch path's transport for the
    one-launch layer, which stores rows itself, or given to the torch path, which never uses
    it): the layer was made without an error and every call then raised in the combine, after
    the dispatch had run (or, with fewer max_tokens, only the calls past them; the torch path
    ignored the context and closed it with the layer). Refused when the layer is made, on
    every rank; a context that fits serves the layer."""
    from portable_overlap import ExpertParallelMoE
    from portable_overlap.ops.moe_combine import MoeGemmCombine

    W = world.world_size
    H, inter, E, k = 8, 6, 2 * W, 2
    good = dict(max_tokens=6, top_k=k, hidden=H, experts_per_rank=2)
    msgs = {}
    for name, change, opts in (("top_k", dict(top_k=3), {}), ("hidden", dict(hidden=12), {}),
                               ("experts_per_rank", dict(experts_per_rank=1), {}),
                               ("max_tokens", dict(max_tokens=3), {"one_launch": True}),
                               ("transport", dict(transport="sequential"),
                                {"one_launch": True}),
                               ("fused", {}, {"fused": False})):
        c = MoeGemmCombine(world, **dict(good, **change))
        try:
            ExpertParallelMoE(world, H, inter, E, k, max_tokens=6, dtype=torch.float32, ctx=c,
                              **opts).close()
            msgs[name] = "no error"
        except ValueError as e:
            msgs[name] = str(e)
        finally:
            c.close()
    c = MoeGemmCombine(world, **dict(good, max_tokens=8))
    layer = ExpertParallelMoE(world, H, inter, E, k, max_tokens=6, dtype=torch.float32, ctx=c)
    ref = ExpertParallelMoE(world, H, inter, E, k, max_tokens=6, dtype=torch.float32,
                            fused=False)
    tokens = torch.randn(6, H, generator=torch.Generator().manual_seed(world.rank))
    with torch.no_grad():
        y = layer(tokens)
        layer.synchronize()
        err = ((y - ref(tokens)).norm() / ref(tokens).norm()).item()
    layer.close()
    # the given context stays the caller's: open after the layer's close, and usable by
    # another layer
    again = ExpertParallelMoE(world, H, inter, E, k, max_tokens=6, dtype=torch.float32, ctx=c)
    with torch.no_grad():
        y = again(tokens)
        again.synchronize()
        err = max(err, ((y - ref(tokens)).norm() / ref(tokens).norm()).item())
    again.close()
    c.close()
    ref.close()
    return msgs, err


def test_a_combine_context_that_cannot_serve_the_layer_is_refused(world2):
    for msgs, err in world2.run(_given_combine_contexts):
        for name, msg in msgs.items():
            assert msg.startswith("ExpertParallelMoE: ctx") and name in msg, (name, msg)
        assert err < 1e-5, err


def _copies(world):
    """``copy.deepcopy`` of a fused layer (a model's EMA copy, ``torch.save(model)``) failed
    with pickle's "cannot pickle '_thread.lock' object"; it raises an error that names the
    layer and the way out, and the torch path's copy computes what the layer does."""
    import copy

    from portable_overlap import ExpertParallelMoE
    from portable_overlap.testing.faults import copy_errors

    H = 8
    msgs = []
    fused = ExpertParallelMoE(world, H, 6, 2 * world.world_size, 2, max_tokens=6,
                              dtype=torch.float32)
    try:
        msgs.append(repr(fused))  # (the layer's sizes, as the other layers print theirs)
        msgs += copy_errors(fused)
    finally:
        fused.close()
    ref = ExpertParallelMoE(world, H, 6, 2 * world.world_size, 2, max_tokens=6,
                            dtype=torch.float32, fused=False)
    # the world is shared by the copy, not copied: what the ops hang on it (the signal
    # transports' process group) cannot be (a lock stands in for it)
    import threading

    world._uncopyable = threading.Lock()
    try:
        twin = copy.deepcopy(ref)
    finally:
        del world._uncopyable
    same_world = twin.world is ref.world
    tokens = torch.randn(5, H, generator=torch.Generator().manual_seed(world.rank))
    with torch.no_grad():
        same = torch.equal(twin(tokens), ref(tokens)) and same_world
    return msgs, same


def test_a_fused_layer_refuses_copies_by_name(world2):
    for (shown, *msgs), same in world2.run(_copies):
        assert shown == ("ExpertParallelMoE(hidden=8, intermediate=6, num_experts=4, top_k=2, "
                         "world=2, schedule=staged)"), shown
        assert all(m.startswith("ExpertParallelMoE: a fused layer cannot be copied")
                   and "load_state_dict" in m for m in msgs), msgs
        assert same


def _dense(tokens, ids, w, wg, wu, wd):
    """out[s] = sum_j w[s, j] * expert_{ids[s, j]}(tokens[s]), in float64, from every expert's
    weights (global ids)."""
    import torch.nn.functional as F

    t = tokens.double()
    out = torch.zeros(t.shape, dtype=torch.float64)
    for s in range(t.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[s, j])
            y = (F.silu(t[s] @ wg[e]) * (t[s] @ wu[e])) @ wd[e]
            out[s] += float(w[s, j]) * y
    return out


def _ops_on_three_ranks(world):
    """The staged ops, the fused dispatch + gated GEMM with the combine, and the one-launch
    layer, on the same contexts in turn, over routings a reviewer tries (every choice on one
    rank's experts, a token choosing one expert twice, every choice on other ranks' experts,
    an expert no rank routes to), int32 and int64 ids, routing weights negative, zero, not
    summing to 1 and of other dtypes (float64, bfloat16) and strides than the tokens', tokens
    with strided rows or a storage offset, token counts that differ per rank (one rank with
    none; one at max_tokens): each output, poisoned before the call, against the dense layer
    in float64. Returns (case, schedule, error)."""
    from portable_overlap.ops.moe_combine import MoeGemmCombine, moe_gemm_combine
    from portable_overlap.ops.moe_dispatch import MoeDispatch, moe_dispatch, moe_dispatch_swiglu
    from portable_overlap.ops.moe_layer import moe_layer

    W, r = world.world_size, world.rank
    El, k, H, inter, max_tokens = 2, 2, 20, 24, 8
    E = El * W
    gw = torch.Generator().manual_seed(77)  # every expert's weights, the same on every rank
    WG, WU = (torch.randn(E, H, inter, generator=gw) / H ** 0.5 for _ in range(2))
    WD = torch.randn(E, inter, H, generator=gw) / inter ** 0.5
    wg, wu, wd = (t[r * El:(r + 1) * El].contiguous() for t in (WG, WU, WD))
    d = MoeDispatch(world, max_tokens=max_tokens, top_k=k, hidden=H, experts_per_rank=El,
                    dtype=torch.float32)
    c = MoeGemmCombine(world, max_tokens=max_tokens, top_k=k, hidden=H, experts_per_rank=El)
    cases = [("one_rank", (6, 4, 8), "rand", "plain", torch.int64),
             ("same_expert_twice", (5, 7, 3), "mixed", "strided", torch.int32),
             ("other_ranks", (5, 0, 7), "float64", "offset", torch.int64),
             ("empty_expert", (8, 8, 8), "bfloat16", "plain", torch.int32)]
    got = []
    try:
        for i, (kind, S_per_rank, wkind, tkind, id_dtype) in enumerate(cases):
            g = torch.Generator().manual_seed(100 * i + r)
            S = S_per_rank[r]
            scores = torch.rand(S, E, generator=g)
            if kind == "one_rank":
                ids = torch.tensor([0, 1]).expand(S, k)
            elif kind == "same_expert_twice":
                ids = torch.randint(0, E, (S, 1), generator=g).expand(S, k)
            elif kind == "other_ranks":
                scores[:, r * El:(r + 1) * El] = -1
                ids = scores.topk(k, 1).indices
            else:
                scores[:, E - 1] = -1
                ids = scores.topk(k, 1).indices
            ids = ids.contiguous().to(id_dtype)
            if tkind == "strided":
                tokens = torch.randn(S, 2 * H, generator=g)[:, :H]
            elif tkind == "offset":
                tokens = torch.randn(S * H + 3, generator=g)[3:].view(S, H)
            else:
                tokens = torch.randn(S, H, generator=g)
            w = torch.rand(k, S, generator=g).t()  # (column-major)
            if wkind == "mixed":
                w = torch.randn(S, k, generator=g) * 2
                w[:1] = 0
            elif wkind != "rand":
                w = w.to(getattr(torch, wkind))
            ref = _dense(tokens, ids, w.double(), *(t.double() for t in (WG, WU, WD)))
            for schedule in ("staged", "fused_dispatch", "one_launch"):
                out = torch.full((S, H), float("nan"))
                if schedule == "one_launch":
                    moe_layer(tokens, ids, w, wg, wu, wd, d, c, out)
                else:
                    if schedule == "staged":
                        x, counts, slots = moe_dispatch(tokens, ids, d)
                        h = expert_swiglu(x, wg, wu, counts)
                    else:
                        h, counts, slots = moe_dispatch_swiglu(tokens, ids, wg, wu, d)
                    moe_gemm_combine(h, wd, counts, slots, w, c, out)
                d.synchronize()
                c.synchronize()
                err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item() \
                    if S else 0.0
                got.append((kind, schedule, err))
    finally:
        d.close()
        c.close()
    return got


def test_ops_on_three_ranks_over_routings(world3):
    for got in world3.run(_ops_on_three_ranks, timeout=300):
        assert all(err < 1e-5 for _, _, err in got), got


def _layer_on_three_ranks(world):
    """``ExpertParallelMoE`` in each schedule against the torch path on 3 ranks (an odd world),
    one expert per rank and top_k = num_experts (every token to every expert), token counts
    that differ per rank (one rank with none), two calls."""
    from portable_overlap import ExpertParallelMoE

    W, r = world.world_size, world.rank
    H, inter = 20, 12
    ref = ExpertParallelMoE(world, H, inter, W, W, max_tokens=6, dtype=torch.float32,
                            fused=False)
    errs = []
    for opts in ({}, {"fuse_dispatch": True}, {"one_launch": True}):
        layer = ExpertParallelMoE(world, H, inter, W, W, max_tokens=6, dtype=torch.float32,
                                  **opts)
        try:
            with torch.no_grad():
                for call in range(2):
                    g = torch.Generator().manual_seed(10 * call + r)
                    S = 0 if (r, call) == (1, 1) else 2 + (r + call) % 5
                    tokens = torch.randn(S, H, generator=g)
                    y = layer(tokens)
                    layer.synchronize()
                    y_ref = ref(tokens)
                    errs.append(((y - y_ref).norm() / y_ref.norm().clamp_min(1e-30)).item()
                                if S else float(y.numel()))
        finally:
            layer.close()
    return errs


def test_layer_schedules_on_three_ranks(world3):
    for errs in world3.run(_layer_on_three_ranks, timeout=300):
        assert all(e < 1e-5 for e in errs), errs


def _backward_with_idle_experts(world, schedule):
    """Every token routed to experts 0 and 1 (rank 0's), one rank without tokens: the
    gradients of the experts that got no rows (ranks 1 and 2) are zeros, rank 0's and the
    tokens' and router's match dense autograd in float64."""
    import torch.nn.functional as F

    from portable_overlap import ExpertParallelMoE

    W, r = world.world_size, world.rank
    H, inter, E, k = 12, 10, 2 * W, 2
    opts = {"fused": False} if schedule == "torch_path" else (
        {schedule: True} if schedule != "staged" else {})
    layer = ExpertParallelMoE(world, H, inter, E, k, max_tokens=6, dtype=torch.float32, **opts)

    def route(t):  # the router's weights of experts 0 and 1, renormalised
        ids = torch.tensor([0, 1]).expand(t.shape[0], k).contiguous()
        w = torch.softmax(t @ layer.router.T, -1).gather(1, ids)
        return w / w.sum(-1, keepdim=True), ids

    layer.route = route
    g = torch.Generator().manual_seed(60 + r)
    S = 0 if r == 1 else 4
    tokens = torch.randn(S, H, generator=g).requires_grad_()
    dout = torch.randn(S, H, generator=g)
    try:
        y = layer(tokens)
        layer.synchronize()
        y.backward(dout)
        mine = {"tokens": tokens.detach(), "dout": dout, "dtokens": tokens.grad,
                **{n: p.detach() for n, p in layer.named_parameters()},
                **{"d" + n: p.grad for n, p in layer.named_parameters()}}
    finally:
        layer.close()
    every = world.all_gather_object(mine)
    T = torch.cat([m["tokens"] for m in every]).double().requires_grad_()
    ws = [torch.cat([m[n] for m in every]).double().requires_grad_()
          for n in ("w_gate", "w_up", "w_down")]
    router = mine["router"].double().requires_grad_()
    ids = torch.tensor([0, 1]).expand(T.shape[0], k)
    w = torch.softmax(T @ router.T, -1).gather(1, ids)
    w = w / w.sum(-1, keepdim=True)
    wg, wu, wd = ws
    out = sum(w[:, j:j + 1] * ((F.silu(T @ wg[j]) * (T @ wu[j])) @ wd[j]) for j in range(k))
    (out * torch.cat([m["dout"] for m in every]).double()).sum().backward()
    lo = sum(m["tokens"].shape[0] for m in every[:r])
    zeros = r != 0 and all(bool((mine["d" + n] == 0).all()) for n in ("w_gate", "w_up", "w_down"))
    pairs = [(mine["d" + n], x.grad[2 * r:2 * r + 2]) for n, x in zip(("w_gate", "w_up",
                                                                       "w_down"), ws)]
    pairs.append((sum(m["drouter"] for m in every), router.grad))
    if S:
        pairs.append((mine["dtokens"], T.grad[lo:lo + S]))
    err = max(((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()
              if b.norm() else a.abs().max().item() for a, b in pairs)
    return zeros, err


@pytest.mark.parametrize("schedule", ["staged", "one_launch", "torch_path"])
def test_backward_gives_zeros_to_experts_without_rows(world3, schedule):
    for r, (zeros, err) in enumerate(world3.run(_backward_with_idle_experts, schedule)):
        assert zeros or r == 0, r
        assert err < 1e-5, (r, err)


def _under_autocast(world):
    """A bfloat16 layer under ``torch.autocast`` given float32 tokens (the residual stream):
    the same bits as the layer given the tokens cast to bfloat16, outside autocast."""
    from portable_overlap import ExpertParallelMoE

    layer = ExpertParallelMoE(world, 32, 16, 4, 2, max_tokens=6, dtype=torch.bfloat16)
    try:
        tokens = torch.randn(6, 32, generator=torch.Generator().manual_seed(3 + world.rank))
        with torch.no_grad():
            want = layer(tokens.to(torch.bfloat16))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got = layer(tokens)
        return got.dtype, bool(torch.equal(got, want))
    finally:
        layer.close()


def test_a_layer_under_autocast_takes_tokens_of_another_dtype(world2):
    for dtype, same in world2.run(_under_autocast):
        assert dtype == torch.bfloat16 and same


def _grad_on_some_ranks(world, schedule):
    """Autograd records a layer call on rank 0 only (rank 1 runs it under ``torch.no_grad()``):
    rank 0's backward would exchange rows with rank 1, which never runs it, and wait for ever.
    The forward raises RankMismatchError on every rank instead, within seconds; the next
    call, under no_grad everywhere, matches the torch path, and a call every rank trains
    runs its backward."""
    import contextlib
    import time

    from portable_overlap import ExpertParallelMoE, PortableOverlapError

    H, I, E, k = 16, 12, 2 * world.world_size, 2
    kw = dict(fused=False) if schedule == "torch_path" else {
        "fuse_dispatch": schedule == "fuse_dispatch", "one_launch": schedule == "one_launch"}
    layer = ExpertParallelMoE(world, H, I, E, k, max_tokens=6, dtype=torch.float32, **kw)
    ref = ExpertParallelMoE(world, H, I, E, k, max_tokens=6, dtype=torch.float32, fused=False)
    found = {}
    try:
        g = torch.Generator().manual_seed(40 + world.rank)
        tokens = torch.randn(5, H, generator=g)
        quiet = torch.no_grad() if world.rank else contextlib.nullcontext()
        t0 = time.monotonic()
        try:
            with quiet:
                y = layer(tokens)
                layer.synchronize()
            found["mixed"] = ("no error", "")
        except PortableOverlapError as e:
            found["mixed"] = (type(e).__name__, str(e))
        found["seconds"] = time.monotonic() - t0
        with torch.no_grad():
            tokens = torch.randn(4, H, generator=g)
            y = layer(tokens)
            layer.synchronize()
            y_ref = ref(tokens)
        found["next"] = ((y - y_ref).norm() / y_ref.norm()).item()
        y = layer(torch.randn(3, H, generator=g))
        y.sum().backward()
        layer.synchronize()
        found["trained"] = bool(layer.w_down.grad is not None and layer.w_down.grad.abs().sum())
    finally:
        layer.close()
    return found


@pytest.mark.parametrize("schedule", ["staged", "fuse_dispatch", "one_launch", "torch_path"])
def test_a_layer_call_recorded_on_some_ranks_raises_in_the_forward(world2, schedule):
    for rank, found in enumerate(world2.run(_grad_on_some_ranks, schedule, timeout=300)):
        kind, msg = found["mixed"]
        assert kind == "RankMismatchError" and ("records_grad=True" in msg
                                                or "autograd records" in msg), (rank, found)
        assert found["seconds"] < 20, (rank, found)
        assert found["next"] < 1e-5, (rank, found)
        assert found["trained"], (rank, found)


def _layer_pair(world, schedule, seed=7):
    """A fused layer in ``schedule`` and the torch path's layer with the same weights."""
    from portable_overlap import ExpertParallelMoE

    kw = dict(max_tokens=6, dtype=torch.float32, seed=seed)
    fused = ExpertParallelMoE(world, 8, 6, 2 * world.world_size, 2, **kw)
    if schedule:
        setattr(fused, schedule, True)
    ref = ExpertParallelMoE(world, 8, 6, 2 * world.world_size, 2, fused=False, **kw)
    return fused, ref


def _column_major_parameters(world, schedule):
    """Every expert weight stored column-major (the same values; what load_state_dict(...,
    assign=True) leaves of such a checkpoint): the layer's error against the torch path."""
    fused, ref = _layer_pair(world, schedule)
    try:
        for name in ("w_gate", "w_up", "w_down"):
            p = getattr(fused, name)
            setattr(fused, name, torch.nn.Parameter(
                p.detach().transpose(1, 2).contiguous().transpose(1, 2)))
        assert not fused.w_gate.is_contiguous()
        tokens = torch.randn(5, 8, generator=torch.Generator().manual_seed(world.rank))
        with torch.no_grad():
            y = fused(tokens)
            fused.synchronize()
            return rel_err(y, ref(tokens))
    finally:
        fused.close()


@pytest.mark.parametrize("schedule", [None, "fuse_dispatch", "one_launch"],
                         ids=["staged", "fuse_dispatch", "one_launch"])
def test_column_major_parameters_work_in_every_schedule(world2, schedule):
    """The fused ops read weight rows: column-major parameters were refused by one schedule
    and taken by another (the staged one took all three, refused w_gate alone), with messages
    that named an op the caller never called. The layer copies them to rows."""
    for err in world2.run(_column_major_parameters, schedule):
        assert err < 1e-5, err


def _refused_between_dispatch_and_combine(world):
    """The staged layer; rank 1's w_up of another dtype, so its expert_swiglu (local, after
    the dispatch) raises: what each rank's call raised and how long it took; then both ranks'
    next call, with rank 1's weight restored, against the torch path."""
    import time

    fused, ref = _layer_pair(world, None)
    try:
        good = fused.w_up.data
        if world.rank == 1:
            fused.w_up.data = good.double()
        tokens = torch.randn(5, 8, generator=torch.Generator().manual_seed(10 + world.rank))
        t0 = time.monotonic()
        try:
            with torch.no_grad():
                fused(tokens)
                fused.synchronize()
            err = None
        except Exception as e:  # noqa: BLE001  (the test reads it)
            err = type(e).__name__
        took = time.monotonic() - t0
        fused.w_up.data = good
        world.barrier()
        tokens = torch.randn(4, 8, generator=torch.Generator().manual_seed(20 + world.rank))
        with torch.no_grad():
            y = fused(tokens)
            fused.synchronize()
            return err, took, rel_err(y, ref(tokens))
    finally:
        fused.close()


def test_a_refusal_between_dispatch_and_combine_fails_the_call_on_every_rank(world2):
    """The staged layer's expert_swiglu runs on each rank alone between the dispatch and the
    combine: raised on one rank, its peers waited in the combine until their timeout, and the
    rank's next combine paired with their call of the failed step, returning the previous
    tokens' rows with no error. The combine's call is refused: every rank fails it at once,
    and the next call is right."""
    (e0, t0, _), (e1, t1, err1) = out = world2.run(_refused_between_dispatch_and_combine)
    assert e1 == "TypeError" and e0 is not None and e0 != "TypeError", out
    assert t0 < 5 and t1 < 5, out
    assert all(o[2] < 1e-5 for o in out), out
