"""The public ops called the way a reviewer trying to break them would: odd shapes (1, primes,
K past or below a block, no rows), strided, stride-0, offset, misaligned and aliased tensors,
MoE routing and GEMV batch edges, ranks that disagree on a call's shapes, a peer that refuses
a call while this rank still reads the previous one, and jagged data that does not add up.
Each case runs on CPU-emulated ranks against the torch reference (fresh random inputs,
poisoned outputs); a case that must fail checks that every rank raises a clear error and that
the context serves the next call. Tiny shapes: the whole file runs in under a minute on 2
cores."""
import time

import pytest
import torch

import portable_overlap as po
from portable_overlap.ops.embedding_alltoall import EmbeddingAllToAll
from portable_overlap.ops.gemm_signal import SignalConfig
from portable_overlap.ops.matmul import MatmulConfig
from portable_overlap.ops.moe_combine import MoeGemmCombine, moe_gemm_combine
from portable_overlap.ops.moe_dispatch import moe_dispatch_reference
from portable_overlap.ops.moe_experts import expert_swiglu
from portable_overlap.testing.compare import rel_err
from portable_overlap.testing.layouts import LAYOUTS, ODD_GEMMS, laid_out

SMALL = MatmulConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1)


def _error(fn) -> str:
    """The message of the ValueError / TypeError ``fn()`` raises, or "no error"."""
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


# --- an output that aliases an input ----------------------------------------------------------

def _aliased_outputs(world):
    """Every op given an ``out`` that shares memory with one of its inputs. Before the check,
    these returned wrong numbers without an error (relative errors 0.3 to 18): the copy-engine
    GEMM + AllReduce stages the peers' partials in ``out``, the GEMM + All-to-All adds the
    residual into ``out`` after the product landed there, a persistent GEMV / grouped GEMM
    stores result tiles while other tiles still read the operand rows, the combine reads a
    token's weights while storing its rows."""
    g = torch.Generator().manual_seed(world.rank)
    R = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    msgs = {}
    ar = po.MatmulAllReduce(world, 16, 16, transport="copy_engine")
    a, b, res = R(6, 9), R(9, 9), R(6, 9)
    msgs["all_reduce out=residual"] = _error(lambda: ar(a, b, None, res, out=res))
    msgs["all_reduce out=a"] = _error(lambda: ar(a, b, out=a))
    y = ar(a, b, None, res)  # the ranks are still in step
    ok = rel_err(y, po.matmul_all_reduce_reference(a, b, world.group) + res) < 1e-5
    ar.close()
    rs = po.MatmulReduceScatter(world, 16, 16, transport="copy_engine")
    res = R(6 // world.world_size, 9)
    msgs["reduce_scatter out=residual"] = _error(lambda: rs(a, b, None, res, out=res))
    rs.close()
    for transport in ("stores", "copy_engine"):
        a2a = po.MatmulAllToAll(world, 16, 16, transport=transport)
        res = R(6, 9)
        msgs[f"all_to_all {transport} out=residual"] = _error(
            lambda: a2a(a, b, None, res, out=res))
        msgs[f"all_to_all {transport} out=a[rows]"] = _error(lambda: a2a(a, b, out=a))
        a2a.close()
    for transport in ("stores", "sequential"):
        gemv = po.GemvAllReduce(world, max_n=40, transport=transport)
        x, w = R(4, 40), R(40, 40)
        msgs[f"gemv {transport} out=x"] = _error(lambda: gemv(x, w, out=x))
        msgs[f"gemv {transport} out=w[rows]"] = _error(lambda: gemv(R(4, 40), w, out=w[:4]))
        gemv.close()
    # the MoE combine: out [S, H] over the storage of topk_weights [S, k]
    El, k, H, I, S = 2, 2, 12, 12, 6
    comb = MoeGemmCombine(world, max_tokens=8, top_k=k, hidden=H, experts_per_rank=El,
                          config=SMALL)
    ids = torch.rand(S, El * world.world_size, generator=g).topk(k, 1).indices
    x, counts, slots = moe_dispatch_reference(R(S, I), ids, El, world.group)
    store = R(S * H)
    tw = store[:S * k].view(S, k).copy_(torch.softmax(R(S, k), 1))
    msgs["moe_gemm_combine out=topk_weights"] = _error(
        lambda: moe_gemm_combine(x, R(El, I, H), counts, slots, tw, comb,
                                 out=store.view(S, H)))
    comb.close()
    # the gated expert GEMM (a local op): h written over the rows of x it reads
    xs = R(8, 16)
    msgs["expert_swiglu out=x"] = _error(
        lambda: expert_swiglu(xs, R(2, 16, 16), R(2, 16, 16),
                              torch.tensor([[4, 0]] * world.world_size, dtype=torch.int32)[:1],
                              out=xs))
    return msgs, ok


def test_output_aliasing_an_input_is_refused(world2):
    for msgs, still_in_step in world2.run(_aliased_outputs):
        assert still_in_step
        for case, msg in msgs.items():
            assert msg.startswith("ValueError") and "shares memory with the input" in msg, \
                (case, msg)


# --- a peer refuses the next call while this rank still reads the previous one ----------------

def _refusal_overtakes_a_slow_reader(world):
    """Rank 1 finishes a GEMM + AllReduce call and refuses the next one (bad input) at once; rank
    0 reads rank 1's last flags of the first call only later (its waits are held back on the
    host). The refusal writes all of rank 1's flag words for the next call, over the first
    call's: rank 0 used to take them for a failure of the first call ("rank 1 gave up on call
    #1", PeerTimeoutError) though rank 1 had delivered it and returned its result; seen by
    chance on emulated ranks, made certain here by the delay."""
    r = world.rank
    ctx = po.MatmulAllReduce(world, 8, 8, transport="copy_engine", timeout_s=10.0)
    links, pieces = ctx.impl._links, ctx.impl.pieces
    wait_ready = links.wait_ready
    if r == 0:
        def late(q, slot, tag):  # the reduced pieces (slots P..2P-1) are read 1 s late
            if slot >= pieces:
                time.sleep(1.0)
            wait_ready(q, slot, tag)
        links.wait_ready = late
    g = torch.Generator().manual_seed(r)
    a, b = torch.randn(4, 3, generator=g), torch.randn(3, 5, generator=g)
    # the reference first: a collective between the two calls would hold rank 1 back
    ref = po.matmul_all_reduce_reference(a, b, world.group)
    try:
        first = rel_err(ctx(a, b), ref)
    except po.PortableOverlapError as e:
        first = f"{type(e).__name__}: {e}"
    # no output columns (N = 0): refused everywhere
    refused = _error(lambda: ctx(torch.randn(4, 3), torch.randn(3, 0)))
    links.wait_ready = wait_ready
    after = rel_err(ctx(a, b), ref)
    ctx.close()
    return first, refused, after


def test_a_refused_call_does_not_fail_the_call_a_peer_still_reads(world2):
    for first, refused, after in world2.run(_refusal_overtakes_a_slow_reader, timeout=120):
        assert isinstance(first, float) and first < 1e-5, first
        assert refused.startswith("ValueError") and "N must be >= 1" in refused, refused
        assert after < 1e-5


# --- jagged data that does not add up, unchecked ----------------------------------------------

def _unchecked_lengths(world):
    """``validate=False`` (and graph capture) skip the host's data check. Lengths that overrun
    the indices made the kernel read past their end: here the word past the end holds an index
    far outside every table, which the kernel used to read (InvalidInputError, or on a GPU an
    arbitrary word). Now a negative length counts as 0 and the bags end at the last index: the
    result is the reference's on those lengths."""
    from portable_overlap.ops.embedding_alltoall import embedding_all_to_all_reference

    r, D, splits = world.rank, 5, [2, 3]
    ctx = EmbeddingAllToAll(world, [7, 5, 9, 4], D, max_local_batch=4, block_b=2)
    g = torch.Generator().manual_seed(30 + r)
    B = sum(splits)
    weight = torch.randn(ctx.weight_rows, D, generator=g)
    results = {}
    for case in ("overrun", "negative"):
        lengths = torch.randint(1, 3, (ctx.n_loc * B,), generator=g)
        idx = [torch.randint(0, ctx.plan.table_rows[t], (int(lengths[j * B:(j + 1) * B].sum()),),
                             generator=g) for j, t in enumerate(ctx.local_tables)]
        store = torch.cat(idx + [torch.tensor([10 ** 6])])  # the word past the end
        indices = store[:-1]
        if case == "overrun":
            lengths[-1] += 3
        else:
            lengths[1] = -1
            lengths[2] += 1
        # the lengths the op now stands by: negative ones 0, bags ending at the last index
        offs = torch.cat([torch.zeros(1, dtype=torch.int64),
                          lengths.clamp(min=0).cumsum(0).clamp(max=indices.numel())])
        ref = embedding_all_to_all_reference(weight, offs.diff(), indices, None, ctx.plan, r,
                                             splits, "sum", world.group)
        out = torch.full(ctx.output_shape(splits), float("nan"))
        try:
            ctx(weight, lengths, indices, batch_splits=splits, out=out, validate=False)
            results[case] = rel_err(out, ref)
        except po.PortableOverlapError as e:
            results[case] = f"{type(e).__name__}: {e}"
    ctx.close()
    return results


def test_unchecked_lengths_never_read_past_the_indices(world2):
    for results in world2.run(_unchecked_lengths):
        for case, err in results.items():
            assert isinstance(err, float) and err < 1e-5, (case, err)


# --- misaligned epilogue operands -------------------------------------------------------------

def _misaligned_epilogue(world):
    """A residual (or out) one element past a 16-byte boundary, after a call with aligned ones.
    On GPUs the compiled kernels assume what the JIT specialized them on, 16-byte alignment of
    every pointer included: a launch planned for an aligned residual must not be reused for a
    misaligned one (vector loads at a misaligned address: wrong data or a device fault). The
    plans are keyed by it; checked here by the plans made (the interpreter itself does not
    care) and by the results."""
    g = torch.Generator().manual_seed(world.rank)
    W = world.world_size
    a, b = torch.randn(4, 6, generator=g), torch.randn(6, 5, generator=g)
    store = torch.randn(4 * 5 + 1, generator=g)
    out = {}
    for transport, rows in (("stores", 4), ("signal_copy_engine", 4 // W)):
        cls = po.MatmulAllReduce if transport == "stores" else po.MatmulReduceScatter
        ctx = cls(world, 8, 8, transport=transport)
        aligned = store[:rows * 5].view(rows, 5)
        shifted = store[1:rows * 5 + 1].view(rows, 5)  # 4 bytes past the aligned one
        ref = {"stores": po.matmul_all_reduce_reference,
               "signal_copy_engine": po.matmul_reduce_scatter_reference}[transport](
                   a, b, world.group)
        errs = []
        for res in (aligned, shifted):
            errs.append(rel_err(ctx(a, b, None, res), ref + res))
        plans = ctx.impl._plans if transport == "stores" else ctx.impl._reduce
        out[transport] = (max(errs), len(plans))
        ctx.close()
    return out


def test_misaligned_epilogue_operands_get_their_own_launch(world2):
    for out in world2.run(_misaligned_epilogue):
        for transport, (err, plans) in out.items():
            assert err < 1e-5, (transport, err)
            assert plans == 2, (transport, plans)


# --- odd shapes and strides: right results, or a clear error on every rank --------------------

def test_laid_out_makes_the_layouts_it_names():
    """The layouts the odd-shape cases (and tests/gpu/check_layouts.py) rely on."""
    g = torch.Generator().manual_seed(0)
    got = {how: laid_out((5, 6), how, dtype=torch.float16, gen=g) for how in LAYOUTS}
    assert all(t.shape == (5, 6) and t.dtype == torch.float16 for t in got.values())
    assert got["contiguous"].is_contiguous()
    assert got["transposed"].stride() == (1, 5)
    assert got["every_other_column"].stride() == (12, 2)
    assert got["stride_0"].stride() == (0, 1)
    assert got["offset"].is_contiguous() and got["offset"].storage_offset() == 1
    assert got["padded_rows"].stride() == (14, 1)
    assert all(bool(t.abs().sum() > 0) for t in got.values())  # random values, not zeros
    try:
        laid_out((2, 2), "diagonal")
        raise AssertionError("an unknown layout was accepted")
    except ValueError as e:
        assert "how must be one of" in str(e)


def _odd_shapes(world):
    W = world.world_size
    g = torch.Generator().manual_seed(7 + world.rank)
    errs = {}
    for op, transport in (("all_reduce", "stores"), ("all_reduce", "copy_engine"),
                          ("reduce_scatter", "stores"), ("all_to_all", "stores"),
                          ("all_gather", "stores"), ("all_gather", "copy_engine")):
        if op == "all_gather":
            ctx = po.AllGatherMatmul(world, 512, transport=transport)
        else:
            cls = {"all_reduce": po.MatmulAllReduce, "reduce_scatter": po.MatmulReduceScatter,
                   "all_to_all": po.MatmulAllToAll}[op]
            ctx = cls(world, 16, 128, transport=transport)
        for name, (M, N, K), how in ODD_GEMMS:
            if op == "all_gather" and ("a" in how or "res" in how):
                continue  # a shard is copied whole (contiguous), there is no residual
            a = laid_out((M, K), how.get("a"), gen=g)
            b = laid_out((K, N), how.get("b"), gen=g)
            rows = {"reduce_scatter": M // W, "all_gather": W * M}.get(op, M)
            res = None if op == "all_gather" else laid_out((rows, N), how.get("res"), gen=g)
            out = torch.full((rows, N), float("nan"))
            if op == "all_gather":
                ref = po.all_gather_matmul_reference(a, b, world.group)
                ctx(a, b, out=out)
            else:
                ref = getattr(po, f"matmul_{op}_reference")(a, b, world.group) + res
                ctx(a, b, None, res, out=out)
            errs[f"{op} {transport} {name}"] = rel_err(out, ref)
        # no rows at all: an empty result (the stores AllGather refuses it on every rank),
        # and the ranks stay in step (the context is closed after a call with rows above)
        errs[f"{op} {transport} M=0"] = _error(
            lambda: tuple(ctx(torch.randn(0, 4), torch.randn(4, 5)).shape))
        ctx.close()
    return errs


def test_odd_shapes_and_strides_match_the_reference(world2):
    for errs in world2.run(_odd_shapes, timeout=300):
        for case, err in errs.items():
            if case == "all_gather stores M=0":
                assert err.startswith("ValueError") and "0 rows" in err, (case, err)
            elif case.endswith("M=0"):
                assert err == "no error", (case, err)
            else:
                assert err < 1e-5, (case, err)


def _gemv_edges(world):
    g = torch.Generator().manual_seed(world.rank)
    out = {}
    for transport in ("stores", "one_shot"):
        ctx = po.GemvAllReduce(world, max_n=40, transport=transport)
        for M, N, K in ((1, 1, 1), (64, 13, 7), (3, 40, 97)):  # the largest M the op takes
            x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
            y = torch.full((M, N), float("nan"))
            ctx(x, w, out=y)
            out[f"{transport} {M}x{N}x{K}"] = rel_err(y, po.gemv_all_reduce_reference(
                x, w, world.group))
        w = torch.randn(5, 7, generator=g)
        out[f"{transport} M=65"] = _error(lambda: ctx(torch.randn(65, 7), w))
        out[f"{transport} M=0"] = _error(lambda: tuple(ctx(torch.randn(0, 7), w).shape))
        out[f"{transport} int"] = _error(lambda: ctx(torch.ones(2, 7, dtype=torch.int32),
                                                     w.int()))
        ctx.close()
    return out


def test_gemv_edges(world2):
    for out in world2.run(_gemv_edges):
        for case, got in out.items():
            if "65" in case:
                assert got.startswith("ValueError") and "0..64, got 65" in got, got
            elif "M=0" in case:
                assert got == "no error", got
            elif case.endswith("int"):
                assert got.startswith("TypeError") and "dtype" in got, got
            else:
                assert got < 1e-5, (case, got)


def _moe_edges(world):
    """Routing a reviewer would try: no tokens anywhere, a token choosing one expert twice,
    every token to one expert, ids out of range or of an int type the op does not take, a NaN
    routing weight (which must stay in its own token)."""
    W, r = world.world_size, world.rank
    El, k, H = 2, 2, 12
    disp = po.MoeDispatch(world, max_tokens=8, top_k=k, hidden=H, experts_per_rank=El,
                          dtype=torch.float32)
    g = torch.Generator().manual_seed(r)
    got = {}
    for name, ids in (("no tokens", torch.zeros(0, k, dtype=torch.int64)),
                      ("one expert twice", torch.tensor([[1, 1]] * 4)),
                      ("all to expert 0", torch.tensor([[0, 1]] * 6))):
        tokens = torch.randn(ids.shape[0], H, generator=g)
        disp.recv.fill_(float("nan"))
        x, counts, slots = disp(tokens, ids)
        disp.synchronize()
        xr, cr, sr = moe_dispatch_reference(tokens, ids, El, world.group)
        n = xr.shape[0]
        got[name] = bool(torch.equal(counts, cr) and torch.equal(slots[:n], sr)
                         and torch.equal(x[:n], xr))
    for name, ids in (("id == experts", torch.tensor([[0, El * W]] * 3)),
                      ("negative id", torch.tensor([[-1, 0]] * 3))):
        try:
            disp(torch.randn(3, H), ids)
            disp.synchronize()
            got[name] = "no error"
        except po.InvalidInputError as e:
            got[name] = f"InvalidInputError: {e}"
    got["int16 ids"] = _error(lambda: disp(torch.randn(3, H), torch.zeros(3, k, dtype=torch.int16)))
    disp.close()
    comb = MoeGemmCombine(world, max_tokens=8, top_k=k, hidden=H, experts_per_rank=El,
                          config=SMALL)
    S, I = 5, 8
    ids = torch.rand(S, El * W, generator=g).topk(k, 1).indices
    x, counts, slots = moe_dispatch_reference(torch.randn(S, I, generator=g), ids, El,
                                              world.group)
    w = torch.randn(El, I, H, generator=g)
    tw = torch.softmax(torch.randn(S, k, generator=g), 1)
    tw[2, 1] = float("nan")
    y = moe_gemm_combine(x, w, counts, slots, tw, comb)
    comb.synchronize()
    ref = po.moe_gemm_combine_reference(x, w, counts, slots, tw, world.group)
    keep = torch.arange(S) != 2
    got["nan weight stays in its token"] = bool(torch.isnan(y[2]).all()) and \
        rel_err(y[keep], ref[keep]) < 1e-5
    comb.close()
    return got


def test_moe_routing_edges(world2):
    for got in world2.run(_moe_edges):
        for case in ("no tokens", "one expert twice", "all to expert 0",
                     "nan weight stays in its token"):
            assert got[case] is True, (case, got[case])
        for case in ("id == experts", "negative id"):
            assert got[case].startswith("InvalidInputError") and "expert id" in got[case], \
                got[case]
        assert got["int16 ids"].startswith("ValueError") and "int32/int64" in got["int16 ids"]


def _grad_into_an_op_without_backward(world):
    ctx = po.MatmulAllToAll(world, 8, 8)
    a = torch.randn(4, 3, requires_grad=True)
    try:
        po.matmul_all_to_all(a, torch.randn(3, 5), ctx)
        msg = "no error"
    except RuntimeError as e:
        msg = str(e)
    with torch.no_grad():
        y = po.matmul_all_to_all(a, torch.ones(3, 5), ctx)
    ctx.close()
    return msg, y.requires_grad


def test_an_input_that_requires_grad_is_not_dropped_silently(world2):
    for msg, requires_grad in world2.run(_grad_into_an_op_without_backward):
        assert "has no backward" in msg and "no_grad" in msg, msg
        assert not requires_grad


def _grad_into_options_and_out(world):
    """A trainable RMSNorm weight passed as ``rms_weight`` (its gradient would be lost) and an
    ``out`` that requires grad (torch refuses it for its own out= ops; here the copy-engine call
    raised in torch.matmul(out=) after its first launch and broke the context on every rank):
    both refused on every rank before anything runs, and the context serves the next call."""
    g = torch.Generator().manual_seed(world.rank)
    a, b = torch.randn(4, 3, generator=g), torch.randn(3, 5, generator=g)
    got = {}
    sig = po.MatmulAllReduce(world, 8, 8, transport="signal_collective")
    try:
        po.matmul_all_reduce(a, b, sig, rms_weight=torch.ones(5, requires_grad=True), eps=1e-6)
        got["rms_weight"] = "no error"
    except RuntimeError as e:
        got["rms_weight"] = str(e)
    sig.close()
    ar = po.MatmulAllReduce(world, 8, 8, transport="copy_engine")
    got["out"] = _error(lambda: po.matmul_all_reduce(
        a, b, ar, out=torch.empty(4, 5, requires_grad=True)))
    y = po.matmul_all_reduce(a, b, ar)  # not broken: the ranks are still in step
    got["next call ok"] = rel_err(y, po.matmul_all_reduce_reference(a, b, world.group)) < 1e-5
    with torch.no_grad():  # as torch's out= ops: fine where autograd records nothing
        out = torch.empty(4, 5, requires_grad=True)
        po.matmul_all_reduce(a, b, ar, out=out)
        got["no_grad out ok"] = rel_err(out, y) < 1e-6
    ar.close()
    return got


def test_options_and_out_that_require_grad_are_refused(world2):
    for got in world2.run(_grad_into_options_and_out):
        assert got["rms_weight"].startswith("matmul_all_reduce has no backward") \
            and "no_grad" in got["rms_weight"], got["rms_weight"]
        assert got["out"].startswith("ValueError: matmul_all_reduce has no backward") \
            and "out requires grad" in got["out"], got["out"]
        assert got["next call ok"] and got["no_grad out ok"], got


def test_out_that_requires_grad_or_overlaps_itself_is_refused_by_the_shared_check():
    """``output_tensor``, which every op's out= goes through: an out whose rows overlap (an
    expanded tensor, stride(0) < N) and one that requires grad in grad mode."""
    from portable_overlap.ops.context import output_tensor
    a = torch.randn(4, 3)
    overlapping = _error(lambda: output_tensor("op", torch.empty(1, 3).expand(4, 3), (4, 3), a))
    assert "op: out must be a contiguous" in overlapping and "(0, 1)" in overlapping, overlapping
    grad = _error(lambda: output_tensor("op", torch.empty(4, 3, requires_grad=True), (4, 3), a,
                                        name="normed"))
    assert grad.startswith("ValueError: op has no backward, and normed requires grad"), grad
    with torch.no_grad():
        out = torch.empty(4, 3, requires_grad=True)
        assert output_tensor("op", out, (4, 3), a) is out


# --- ranks that disagree on the shapes of one call ----------------------------------------------

def _disagree(world):
    """Rank 0 calls with 4 rows, rank 1 with 6: every rank raises for that call, naming the op
    the user called (the copy-engine GEMM + AllReduce named its workspace, "matmul_reduce"),
    and the next call with agreeing shapes is right."""
    r = world.rank
    g = torch.Generator().manual_seed(r)
    got = {}
    for name, ctx in (("matmul_all_reduce", po.MatmulAllReduce(world, 8, 8,
                                                                transport="copy_engine")),
                      ("matmul_all_to_all", po.MatmulAllToAll(world, 8, 8)),
                      ("gemv_all_reduce", po.GemvAllReduce(world, 8))):
        b = torch.randn(3, 5, generator=g)
        w = b.t().contiguous() if name == "gemv_all_reduce" else b
        try:
            ctx(torch.randn(4 if r == 0 else 6, 3, generator=g), w)
            first = "no error"
        except po.PortableOverlapError as e:
            first = f"{type(e).__name__}: {e}"
        a = torch.randn(4, 3, generator=g)
        ref = {"matmul_all_reduce": po.matmul_all_reduce_reference,
               "matmul_all_to_all": po.matmul_all_to_all_reference,
               "gemv_all_reduce": po.gemv_all_reduce_reference}[name](a, w, world.group)
        got[name] = (first, rel_err(ctx(a, w), ref))
        ctx.close()
    return got


def test_ranks_that_disagree_on_shapes_raise_on_every_rank(world2):
    for got in world2.run(_disagree, timeout=120):
        for name, (first, after) in got.items():
            assert first.startswith(f"RankMismatchError: {name}: ranks 0 and 1 called it"), first
            assert after < 1e-5, (name, after)


# --- which rank's bias an All-to-All adds -------------------------------------------------------

def _all_to_all_bias(world):
    """Each rank passes its own bias: every transport adds the receiving rank's bias to all the
    rows it received, after the exchange (the documented contract)."""
    g = torch.Generator().manual_seed(world.rank)
    a, b = torch.randn(4, 3, generator=g), torch.randn(3, 5, generator=g)
    bias = torch.full((5,), 100.0 * (world.rank + 1))
    exchanged = po.matmul_all_to_all_reference(a, b, world.group)
    errs = {}
    for transport in ("stores", "copy_engine", "signal_collective", "sequential"):
        ctx = po.MatmulAllToAll(world, 8, 8, transport=transport)
        errs[transport] = rel_err(po.matmul_all_to_all(a, b, ctx, bias=bias), exchanged + bias)
        ctx.close()
    return errs


def test_all_to_all_adds_the_receiving_ranks_bias(world2):
    for errs in world2.run(_all_to_all_bias):
        assert all(e < 1e-5 for e in errs.values()), errs


def _k_per_rank_then_agreeing(world):
    """A reduction's K shards may differ between ranks. A call where they do (rank 0 K=5,
    rank 1 K=29), then one with K=5 on both: the signal transports cached their call plans by
    K too, so rank 0 reused its plan while rank 1 made a new one and waited alone in the
    plan's host check of the ranks (a hang until gloo's half-hour timeout)."""
    r = world.rank
    g = torch.Generator().manual_seed(r)
    errs = {}
    for name, ctx, ref in (
            ("all_reduce signal_collective",
             po.MatmulAllReduce(world, 8, 8, transport="signal_collective"),
             po.matmul_all_reduce_reference),
            ("reduce_scatter signal_copy_engine",
             po.MatmulReduceScatter(world, 8, 8, transport="signal_copy_engine"),
             po.matmul_reduce_scatter_reference)):
        for K in (5 if r == 0 else 29, 5, 29 if r == 0 else 5):
            a, b = torch.randn(4, K, generator=g), torch.randn(K, 7, generator=g)
            errs[f"{name} K={K}"] = rel_err(ctx(a, b), ref(a, b, world.group))
        ctx.close()
    return errs


def test_reduction_k_per_rank_keeps_the_signal_transports_in_step(world2):
    for errs in world2.run(_k_per_rank_then_agreeing, timeout=120):
        assert all(e < 1e-5 for e in errs.values()), errs


def _signal_inputs(i: int, q: int) -> tuple:
    """Rank q's ``a`` [4, 5] and ``b`` [5, 7] of call i (fresh, and the same on every rank that
    asks for them: each rank builds its peers' to make the reference)."""
    g = torch.Generator().manual_seed(100 * i + q)
    return torch.randn(4, 5, generator=g), torch.randn(5, 7, generator=g)


def _signal_collective_refused_on_one_rank(world):
    """``transport="auto"`` decided for ``signal_collective``, then a call rank 0 refuses on
    the host (an empty ``a``) while rank 1 calls as usual, then a good call. The transport's
    data moves only in matched collectives: without the agreement before each call rank 1's
    collectives of the refused call paired with rank 0's next call's (rank 1 returned a wrong
    result without an error, rank 0's next call too, relative errors 0.8-0.9)."""
    r, W = world.rank, world.world_size

    out = []
    for cls, want_of in ((po.MatmulAllReduce, lambda y, i: y),
                         (po.MatmulReduceScatter, lambda y, i: y.chunk(W)[r])):
        ctx = cls(world, 8, 8, transport="auto", candidates=("signal_collective",), iters=1,
                  warmup=0, timeout_s=20)
        for i in range(3):
            a, b = _signal_inputs(i, r)
            if i == 1 and r == 0:
                a = a[:, :0]
            try:
                y = ctx(a, b)
            except Exception as e:
                out.append((cls.__name__, i, type(e).__name__))
                continue
            want = want_of(sum(x @ w for x, w in (_signal_inputs(i, q) for q in range(W))), i)
            out.append((cls.__name__, i, rel_err(y, want)))
        ctx.close()
    return out


def _named_signal_refused_on_one_rank(world):
    """The named signal transports (``PatternContext.AGREED``), three calls each, rank 0
    refusing one on the host (an empty ``a``) while its peers call as usual: the first call of
    the shape, or a later one. Named ``signal_collective`` without an agreement paired the
    peers' collectives of a refused call with rank 0's next call's (a wrong result without an
    error on both); named ``signal_copy_engine`` refusing a shape's first call left the peers
    in that call's host check of the plan, paired with rank 0's next call, which then timed
    out and broke the context. Rank 0's ``a`` is empty (K = 0), or a vector at a planned
    shape."""
    r, W = world.rank, world.world_size

    out = []
    for cls, transport, want_of in (
            (po.MatmulAllReduce, "signal_collective", lambda y: y),
            (po.MatmulReduceScatter, "signal_collective", lambda y: y.chunk(W)[r]),
            (po.MatmulReduceScatter, "signal_copy_engine", lambda y: y.chunk(W)[r])):
        # (a vector ``a`` has no sizes to key a plan by: refused as a call of a planned shape)
        bad = (("empty", 0), ("empty", 1)) + ((("vector", 1),) if "copy" in transport else ())
        for how, refused in bad:
            ctx = cls(world, 8, 8, transport=transport, timeout_s=20)
            for i in range(3):
                a, b = _signal_inputs(i, r)
                if i == refused and r == 0:
                    a = a[:, :0] if how == "empty" else a[0]
                try:
                    y = ctx(a, b)
                except Exception as e:  # (a peer's error names the refused call itself)
                    named = ("[4, 0]" if how == "empty" else "a [5]") in str(e)
                    out.append((transport, refused, i, type(e).__name__ + " naming it" * named))
                    continue
                want = want_of(sum(x @ w for x, w in (_signal_inputs(i, q) for q in range(W))))
                out.append((transport, refused, i, rel_err(y, want)))
            ctx.close()
    return out


def test_named_signal_transports_refused_on_one_rank_raise_on_every_rank(world2):
    for r, got in enumerate(world2.run(_named_signal_refused_on_one_rank, timeout=300)):
        for transport, refused, i, res in got:
            if i == refused:  # refused on rank 0: raised on every rank, nothing returned
                assert isinstance(res, str), (r, transport, refused, got)
                if res.startswith("RankMismatchError"):  # the peers' error, from the agreement
                    assert res.endswith("naming it"), (r, transport, refused, got)
            else:
                assert not isinstance(res, str) and res < 1e-5, (r, transport, refused, got)


def test_auto_signal_collective_refused_on_one_rank_raises_on_every_rank(world2):
    for r, got in enumerate(world2.run(_signal_collective_refused_on_one_rank, timeout=300)):
        for name, i, res in got:
            if i == 1:  # refused on rank 0: raised on every rank, nothing returned
                assert isinstance(res, str), (r, name, got)
            else:
                assert not isinstance(res, str) and res < 1e-5, (r, name, got)


def _named_signal_option_not_taken_on_one_rank(world):
    """Rank 0 passes a per-call option its named transport does not take (``pieces=``, a
    ``config`` of another type) at a planned shape while its peers call as usual. Keyed by that
    option, rank 0's call was new there and waited in an agreement its peers never joined (a
    planned ``signal_copy_engine`` call agrees with no one): both sides timed out and the
    context broke. ``choice`` of a named transport is that transport, also before its first
    call."""
    r, W = world.rank, world.world_size

    out = []
    for transport in ("signal_copy_engine", "signal_collective"):
        ctx = po.MatmulReduceScatter(world, 8, 8, transport=transport, timeout_s=20)
        out.append(ctx.choice(*_signal_inputs(0, r)))
        for i, bad in enumerate((None, {"pieces": 2}, None, {"config": SMALL}, None)):
            a, b = _signal_inputs(i, r)
            try:
                y = ctx(a, b, **(bad if bad is not None and r == 0 else {}))
            except Exception as e:
                out.append((transport, i, type(e).__name__))
                continue
            want = sum(x @ w for x, w in (_signal_inputs(i, q) for q in range(W))).chunk(W)[r]
            out.append((transport, i, rel_err(y, want)))
        ctx.close()
    return out


def test_named_signal_option_not_taken_on_one_rank_raises_on_every_rank(world2):
    for r, got in enumerate(world2.run(_named_signal_option_not_taken_on_one_rank,
                                       timeout=300)):
        assert got[0] == "signal_copy_engine" and got[6] == "signal_collective", got
        for transport, i, res in got[1:6] + got[7:]:
            if i in (1, 3):  # refused on rank 0: raised on every rank, nothing returned
                assert isinstance(res, str), (r, got)
            else:
                assert not isinstance(res, str) and res < 1e-5, (r, got)


def _signal_configs_differ_across_ranks(world):
    """Per-call ``config``s that differ across ranks, on each new shape's first call, then one
    config on every rank: at N = 40 rank 1's config plans other wave groups, at N = 9 it asks
    for ``partition="tune"``. Without the configs in the call's agreement, the first call
    passed it and the ranks kept decisions of different keys: the next call with one config
    everywhere raised a mismatch (named ``signal_collective``: at every later call) or hung in
    the plan's host check (named ``signal_copy_engine``); the tuning rank's collectives met
    its peer's call (``signal_collective`` named or under ``"auto"``: a hang)."""
    r, W = world.rank, world.world_size

    def config(partition=None):
        return SignalConfig(matmul=SMALL, partition=partition)

    out = []
    for transport, options in (("signal_collective", {}), ("signal_copy_engine", {}),
                               ("auto", {"candidates": ("signal_collective",
                                                        "signal_copy_engine"),
                                         "iters": 1, "warmup": 0})):
        ctx = po.MatmulReduceScatter(world, 8, 64, transport=transport, timeout_s=20,
                                     **options)
        # (N = 40: 6 tiles of 16 x 16 in 2 row blocks; N = 9: 2)
        for i, (N, mine, peer) in enumerate(((40, config((4, 2)), config((2, 4))),
                                             (40, config((4, 2)), config((4, 2))),
                                             (9, config(), config("tune")),
                                             (9, config(), config()))):
            g = torch.Generator().manual_seed(10 * i + r)
            a, b = torch.randn(4, 5, generator=g), torch.randn(5, N, generator=g)
            try:
                y = ctx(a, b, out=torch.full((4 // W, N), float("nan")),
                        config=peer if r == 1 else mine)
            except Exception as e:
                out.append((transport, i, type(e).__name__))
                continue
            out.append((transport, i, rel_err(y, po.matmul_reduce_scatter_reference(
                a, b, world.group))))
        ctx.close()
    return out


def test_signal_configs_that_differ_across_ranks_raise_on_every_rank(world2):
    for r, got in enumerate(world2.run(_signal_configs_differ_across_ranks, timeout=300)):
        for transport, i, res in got:
            if i in (0, 2):  # rank 1's config differs: raised on every rank, nothing ran
                assert isinstance(res, str), (r, got)
            else:
                assert not isinstance(res, str) and res < 1e-5, (r, got)


# --- a K that changes while a's strides do not ------------------------------------------------

def _k_changes_under_fixed_strides(world):
    """Calls of one [M, N] with K = 32, then 20, then 7, ``a`` transposed or stride 0: its
    strides ((1, M), (0, 1)) do not change with K. The signal transports keyed their compiled
    GEMM by the plan (not keyed by K) and the strides, so the K = 20 call ran the launch made for
    K = 32, whose K loop is unmasked (EVEN_K): it read past the end of ``a`` and ``b`` and
    returned garbage (relative errors 1e35 to inf) without an error."""
    g = torch.Generator().manual_seed(world.rank)
    errs = {}
    for name, ctx, ref in (
            ("all_reduce signal_collective",
             po.MatmulAllReduce(world, 8, 8, transport="signal_collective"),
             po.matmul_all_reduce_reference),
            ("reduce_scatter signal_copy_engine",
             po.MatmulReduceScatter(world, 8, 8, transport="signal_copy_engine"),
             po.matmul_reduce_scatter_reference)):
        for how in ("transposed", "stride_0"):
            for K in (32, 20, 7):
                a = laid_out((4, K), how, gen=g)
                b = torch.randn(K, 8, generator=g)
                errs[f"{name} {how} K={K}"] = rel_err(ctx(a, b), ref(a, b, world.group))
        ctx.close()
    return errs


def test_signal_transports_replan_when_k_changes_under_fixed_strides(world2):
    for errs in world2.run(_k_changes_under_fixed_strides, timeout=120):
        assert all(e < 1e-5 for e in errs.values()), errs


def test_context_sizes_must_be_ints_not_bools():
    """A context's bounds are ints >= 1: ``True`` is an int to Python and would size a context
    for one row; every context refuses it (and 0, a float, a numpy int) before it allocates
    anything (the checks run before the world is used)."""
    import numpy as np

    for bad in (True, 0, 2.0, np.int64(4)):
        for make in (lambda v: po.MatmulReduceScatter(None, v, 8),
                     lambda v: po.MatmulAllReduce(None, 8, v),
                     lambda v: po.GemvAllReduce(None, v),
                     lambda v: po.AllGatherMatmul(None, v),
                     lambda v: MoeGemmCombine(None, max_tokens=v, top_k=1, hidden=8,
                                              experts_per_rank=1)):
            with pytest.raises(ValueError, match="must be an int >= 1"):
                make(bad)


def _piece_counts(world):
    """Each copy-engine transport's ``pieces`` given as a float or a bool: a float count was
    taken by the context and failed in the call with a TypeError naming no argument ("slice
    indices must be integers"), ``True`` ran as one piece; both are refused when the context
    is made, naming the argument, and a context with an int count serves a call."""
    made = {"all_reduce": lambda p: po.MatmulAllReduce(world, 8, 8, transport="copy_engine",
                                                       pieces=p),
            "all_gather": lambda p: po.AllGatherMatmul(world, 64, transport="copy_engine",
                                                       pieces=p),
            "all_to_all": lambda p: po.MatmulAllToAll(world, 8, 8, transport="copy_engine",
                                                      pieces=p)}
    got = {}
    for name, make in made.items():
        for bad in (2.0, 2.5, True):
            got[f"{name} {bad!r}"] = _error(lambda: make(bad))
    g = torch.Generator().manual_seed(world.rank)
    a, b = torch.randn(4, 3, generator=g), torch.randn(3, 5, generator=g)
    ctx = made["all_reduce"](2)
    ok = rel_err(ctx(a, b), po.matmul_all_reduce_reference(a, b, world.group)) < 1e-5
    ctx.close()
    return got, ok


def test_piece_counts_must_be_ints(world2):
    for got, ok in world2.run(_piece_counts):
        assert ok
        for case, msg in got.items():
            assert msg.startswith("ValueError") and "pieces must be an int in [1, " in msg, \
                (case, msg)


def _untaken_option_on_one_rank(world):
    """A named transport given a per-call option it does not take, on rank 0 only: rank 0
    raises a ValueError naming the option, its peers raise in the same call, and the next call
    (fresh inputs) is right on every rank. The transport's own method raised on rank 0 alone
    before: the peer's call paired with rank 0's next call and returned that call's data with
    no error, and the peer's next call timed out."""
    r = world.rank
    g = torch.Generator().manual_seed(r)
    got = {}
    for name, ctx, kw in (
            ("all_reduce stores config", po.MatmulAllReduce(world, 8, 8, transport="stores",
                                                            timeout_s=5), {"config": SMALL}),
            ("reduce_scatter copy_engine pieces",
             po.MatmulReduceScatter(world, 8, 8, transport="copy_engine", timeout_s=5),
             {"pieces": 2}),
            ("all_to_all stores SignalConfig",
             po.MatmulAllToAll(world, 8, 8, transport="stores", timeout_s=5),
             {"config": SignalConfig()})):
        ref = {"all_reduce": po.matmul_all_reduce_reference,
               "reduce_scatter": po.matmul_reduce_scatter_reference,
               "all_to_all": po.matmul_all_to_all_reference}[name.split()[0]]
        try:
            ctx(torch.randn(4, 3, generator=g), torch.randn(3, 5, generator=g),
                **(kw if r == 0 else {}))
            first = "no error"
        except (ValueError, po.PortableOverlapError) as e:
            first = f"{type(e).__name__}: {e}"
        a, b = torch.randn(4, 3, generator=g), torch.randn(3, 5, generator=g)
        try:
            second = rel_err(ctx(a, b), ref(a, b, world.group))
        except po.PortableOverlapError as e:
            second = f"{type(e).__name__}: {e}"
        got[name] = (first, second)
        ctx.close()
    return got


def test_an_option_a_named_transport_does_not_take_raises_on_every_rank(world2):
    for rank, got in enumerate(world2.run(_untaken_option_on_one_rank)):
        for name, (first, second) in got.items():
            assert isinstance(second, float) and second < 1e-5, (rank, name, second)
            if rank == 0:
                want = ("must be MatmulConfig, got SignalConfig" if "SignalConfig" in name
                        else "transport takes no per-call option")
                assert first.startswith("ValueError: matmul_") and want in first, (name, first)
            else:
                assert "rank 0 gave up on call #1" in first, (name, first)
