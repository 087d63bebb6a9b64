"""Fused embedding pooling + All-to-All on CPU-emulated ranks against F.embedding_bag per table +
all_to_all_single. Tiny shapes, many cases per emulated-world call (the CI machine has 2 cores)."""
import pytest
import torch

from portable_overlap import InvalidInputError, PortableOverlapError
from portable_overlap.ops.embedding_alltoall import (EmbeddingAllToAll, embedding_all_to_all,
                                                     embedding_all_to_all_reference)
from portable_overlap.testing.compare import rel_err
from portable_overlap.testing.faults import construction_outcome

TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 1e-5}
ROWS = [7, 5, 9, 4, 6, 3]


def _input(ctx, splits, gen, dtype, weighted, idx_dtype=torch.int64, max_len=3, hole=None,
           oob=False):
    """This rank's packed tables and jagged features of its tables for the global batch:
    random lengths in 0..max_len (empty bags included); sample ``hole`` has no index in any
    table on any rank."""
    B = sum(splits)
    weight = torch.randn(ctx.weight_rows, ctx.dim, generator=gen).to(dtype)
    lengths = torch.randint(0, max_len + 1, (ctx.n_loc * B,), generator=gen)
    if hole is not None:
        lengths.view(ctx.n_loc, B)[:, hole] = 0
    idx = [torch.randint(0, ctx.plan.table_rows[t], (int(lengths[j * B:(j + 1) * B].sum()),),
                         generator=gen) for j, t in enumerate(ctx.local_tables)]
    indices = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64)
    if oob and indices.numel():
        indices[-1] = ctx.plan.table_rows[ctx.local_tables[-1]]  # one past the last row
    psw = torch.rand(indices.numel(), generator=gen) + 0.5 if weighted else None
    return weight, lengths.to(idx_dtype), indices.to(idx_dtype), psw


def _one(world, ctx, splits, dtype, pooling, weighted, grad, gen, idx_dtype=torch.int64,
         hole=None):
    weight, lengths, indices, psw = _input(ctx, splits, gen, dtype, weighted, idx_dtype,
                                           hole=hole)
    out = torch.full(ctx.output_shape(splits), float("nan"), dtype=dtype)
    ctx(weight, lengths, indices, psw, batch_splits=splits, pooling=pooling, out=out)
    ref = embedding_all_to_all_reference(weight, lengths, indices, psw, ctx.plan, world.rank,
                                         splits, pooling, world.group)
    name = f"{str(dtype)[6:]} {pooling} w={weighted} splits={splits}"
    res = [(name, rel_err(out, ref), TOL[dtype], bool(torch.isnan(out).any()))]
    if hole is not None and out.shape[0] and splits[0] > hole and world.rank == 0:
        res.append((name + " empty sample", out[hole].abs().max().item(), 0.0, False))
    if grad:
        g = torch.randn(out.shape, generator=gen).to(dtype)
        w1 = weight.clone().requires_grad_()
        p1 = psw.clone().requires_grad_() if weighted else None
        y = embedding_all_to_all(w1, lengths, indices, ctx, p1, batch_splits=splits,
                                 pooling=pooling)
        (y.float() * g.float()).sum().backward()
        w2 = weight.clone().requires_grad_()
        p2 = psw.clone().requires_grad_() if weighted else None
        r = embedding_all_to_all_reference(w2, lengths, indices, p2, ctx.plan, world.rank,
                                           splits, pooling, world.group)
        (r.float() * g.float()).sum().backward()
        res.append((name + " fwd(op)", rel_err(y.detach(), r.detach()), TOL[dtype], False))
        res.append((name + " grad weight", rel_err(w1.grad, w2.grad), TOL[dtype], False))
        # the context called directly records the call too (the tables train the same way)
        w3 = weight.clone().requires_grad_()
        y3 = ctx(w3, lengths, indices, psw, batch_splits=splits, pooling=pooling)
        (y3.float() * g.float()).sum().backward()
        res.append((name + " grad weight (ctx call)", rel_err(w3.grad, w2.grad), TOL[dtype],
                    False))
        if weighted:
            res.append((name + " grad psw", rel_err(p1.grad, p2.grad), 5 * TOL[dtype], False))
    return res


def _cases(world, full):
    """``full``: every dtype × pooling × weights on 2 ranks; at 4 ranks a subset (time)."""
    W = world.world_size
    gen = torch.Generator().manual_seed(10 + world.rank)
    uneven = [[3, 5], [1, 4, 0, 3]][W // 4]  # a rank with no samples at 4
    even = [4] * W
    res = []
    # one context, many calls: dtypes, pooling and splits change call to call (recv reused);
    # 4 bags per tile: a rank's samples span full and partial tiles
    ctx = EmbeddingAllToAll(world, ROWS, 8, max_local_batch=5, block_b=4)
    try:
        combos = [(torch.float32, "sum", False, True), (torch.float32, "mean", False, True),
                  (torch.float32, "sum", True, True), (torch.float16, "sum", True, False),
                  (torch.bfloat16, "mean", False, True)]
        if full:
            combos += [(torch.float16, "mean", False, True), (torch.float16, "sum", False, False),
                       (torch.bfloat16, "sum", True, True)]
        for dtype, pooling, weighted, grad in combos:
            res += _one(world, ctx, uneven, dtype, pooling, weighted, grad=grad, gen=gen,
                        idx_dtype=torch.int32 if weighted else torch.int64, hole=1)
        # the default split (lengths.numel() / n_loc, evenly over the ranks)
        weight, lengths, indices, _ = _input(ctx, even, gen, torch.float32, False)
        out = ctx(weight, lengths, indices)
        ref = embedding_all_to_all_reference(weight, lengths, indices, None, ctx.plan, world.rank,
                                             even, "sum", world.group)
        res.append(("default split", rel_err(out, ref), 1e-5, False))
    finally:
        ctx.close()
    if full:  # D not a power of two, default tile, every table on rank 0 (the others hold none)
        ctx = EmbeddingAllToAll(world, ROWS[:3], 12, max_local_batch=6, table_ranks=[0, 0, 0])
        try:
            res += _one(world, ctx, uneven, torch.float32, "mean", False, grad=True, gen=gen)
        finally:
            ctx.close()
    return res


def test_matches_embedding_bag_plus_all_to_all(world):
    for res in world.run(_cases, world.size == 2):
        bad = [r for r in res if r[3] or not r[1] <= r[2]]
        assert not bad, bad
        assert len(res) > 10


def _bad(world):
    ctx = EmbeddingAllToAll(world, ROWS, 8, max_local_batch=5, block_b=2)
    gen = torch.Generator().manual_seed(3)
    splits = [3, 5]
    w, lengths, idx, psw = _input(ctx, splits, gen, torch.float32, True)
    B = 8
    _, _, idx_oob, _ = _input(ctx, splits, torch.Generator().manual_seed(3), torch.float32,
                              True, oob=True)
    calls = {
        "out of range": lambda: ctx(w, lengths, idx_oob, batch_splits=splits),
        "negative index": lambda: ctx(w, lengths, idx - idx.max() - 1, batch_splits=splits),
        "lengths sum": lambda: ctx(w, lengths, idx[:-1], batch_splits=splits),
        "lengths numel": lambda: ctx(w, lengths[:-1], idx, batch_splits=splits),
        "weight shape": lambda: ctx(w[:-1], lengths, idx, batch_splits=splits),
        "weight dtype": lambda: ctx(w.double(), lengths, idx, batch_splits=splits),
        "index dtype": lambda: ctx(w, lengths, idx.float(), batch_splits=splits),
        "2-D lengths": lambda: ctx(w, lengths.view(-1, B), idx, batch_splits=splits),
        "mean + weights": lambda: ctx(w, lengths, idx, psw, batch_splits=splits,
                                      pooling="mean"),
        "psw numel": lambda: ctx(w, lengths, idx, psw[:-1], batch_splits=splits),
        "pooling": lambda: ctx(w, lengths, idx, batch_splits=splits, pooling="max"),
        "splits too big": lambda: ctx(w, lengths.repeat(2), idx.repeat(2),
                                      batch_splits=[10, 6]),
        "splits count": lambda: ctx(w, lengths, idx, batch_splits=[8]),
        "uneven default": lambda: ctx(w, lengths[:ctx.n_loc * 7], idx),
        "out shape": lambda: ctx(w, lengths, idx, batch_splits=splits,
                                 out=torch.empty(2, 48)),
        # out= with weights that require grad: refused on rank 0, while rank 1's call (no
        # out=) goes through the differentiable op and hears of the refusal
        "out + grad": lambda: ctx(w.clone().requires_grad_(), lengths, idx, batch_splits=splits,
                                  out=torch.empty(splits[0], 48) if world.rank == 0 else None),
    }
    calls["transport"] = lambda: EmbeddingAllToAll(world, ROWS, 8, 5, transport="dma")
    msgs = {}
    for name, call in calls.items():
        try:
            call()
            msgs[name] = None
        except (ValueError, TypeError, PortableOverlapError) as e:  # (a peer's refusal)
            msgs[name] = str(e)
    # the torch.library op's fake implementation (torch.compile tracing): shape only, no launch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = torch.ops.portable_overlap.embedding_all_to_all(
            mode.from_tensor(w), mode.from_tensor(lengths), mode.from_tensor(idx), None, splits,
            "sum", ctx.handle)
    msgs["fake shape"] = None if tuple(fake.shape) == (splits[world.rank], 48) \
        else f"embedding_all_to_all fake shape {tuple(fake.shape)}"
    # the context is still in step with its peers after refusing all of that
    out = ctx(w, lengths, idx, psw, batch_splits=splits)
    ref = embedding_all_to_all_reference(w, lengths, idx, psw, ctx.plan, world.rank, splits,
                                         "sum", world.group)
    ctx.close()
    return msgs, rel_err(out, ref)


def test_bad_input_raises_before_launch(world2):
    for msgs, err in world2.run(_bad):
        assert msgs.pop("fake shape") is None
        missing = [k for k, m in msgs.items() if not (m and m.startswith("embedding_all_to_all"))]
        assert not missing, (missing, msgs)
        assert "out of range" in msgs["out of range"] and "sum to" in msgs["lengths sum"]
        assert err < 1e-5


def _no_shmem(world):
    from portable_overlap.shmem.providers import ShmemUnavailable
    try:
        EmbeddingAllToAll(world, ROWS, 8, 5, transport="shmem")
    except ShmemUnavailable as e:
        return str(e)
    return None


def test_device_initiated_transport_needs_a_shmem_library(world2):
    # NVSHMEM / ROC_SHMEM exist on GPUs only: a clear error on emulated ranks, on every rank
    for msg in world2.run(_no_shmem):
        assert msg and "cpu" in msg, msg


def _mismatch(world):
    ctx = EmbeddingAllToAll(world, ROWS, 8, max_local_batch=6, block_b=2, timeout_s=2.0)
    splits = [3, 5] if world.rank == 0 else [4, 4]  # ranks disagree on the batch split
    w, lengths, idx, _ = _input(ctx, splits, torch.Generator().manual_seed(world.rank),
                                torch.float32, False)
    try:
        ctx(w, lengths, idx, batch_splits=splits)
        r = "no error"
    except PortableOverlapError as e:
        r = type(e).__name__
    ctx.close()
    return r


def test_ranks_disagreeing_on_batch_splits_raise(world2):
    for r in world2.run(_mismatch, timeout=120):
        assert r in ("RankMismatchError", "PeerTimeoutError"), r


def test_plan_and_module_shapes():
    from portable_overlap.ops.embedding_alltoall import ShardingPlan

    p = ShardingPlan.make([100, 10, 50, 40, 5], 4, 2)
    assert sorted(p.tables_of(0) + p.tables_of(1)) == list(range(5))
    assert abs(p.weight_rows(0) - p.weight_rows(1)) <= 100
    assert p.row_offsets(p.table_ranks[0])[0] == 0
    with pytest.raises(ValueError):
        ShardingPlan.make([3, 4], 4, 2, table_ranks=[0, 2])


@pytest.mark.parametrize("args, name", [
    (([7.9, 5], 4, 2, None), "table_rows"), (([True, 5], 4, 2, None), "table_rows"),
    (([7, 5], 4.5, 2, None), "dim"), (([7, 5], 4, 2, [0.7, 1.2]), "table_ranks")])
def test_plan_refuses_sizes_that_are_not_integers(args, name):
    """Floats and bools are refused, not rounded (7.9 rows were a table of 7); NumPy and tensor
    integers are taken."""
    import numpy as np

    from portable_overlap.ops.embedding_alltoall import ShardingPlan

    with pytest.raises(ValueError, match=f"{name} must be .*integer.*not rounded"):
        ShardingPlan.make(*args)
    p = ShardingPlan.make(np.array([7, 5]), np.int64(4), 2, table_ranks=torch.tensor([1, 0]))
    assert (p.table_rows, p.table_ranks, p.dim) == ((7, 5), (1, 0), 4)
    assert all(type(v) is int for v in (*p.table_rows, *p.table_ranks, p.dim))


def _bad_index_unvalidated(world, value):
    """With validate=False rank 1 passes one index outside its table (``value``: "num_rows", one
    past the last row, or -1): first in a bag of a peer's samples (local table 0, sample 0),
    then in one of its own samples (its last local table, last sample). Per case: (this rank's
    outcome, the relative error of a valid call that follows on the same context)."""
    ctx = EmbeddingAllToAll(world, ROWS, 8, max_local_batch=5, block_b=2, timeout_s=20.0)
    splits, B = [3, 5], 8
    gen = torch.Generator().manual_seed(30 + world.rank)
    res = []
    try:
        for where in ("peer's sample", "own sample"):
            w, lengths, idx, _ = _input(ctx, splits, gen, torch.float32, False)
            # the bag of the bad index and the table it reads
            j, s = (0, 0) if where == "peer's sample" else (ctx.n_loc - 1, B - 1)
            lengths.view(ctx.n_loc, B)[j, s] += 1  # one more index in that bag: the bad one
            pos = int(lengths[:j * B + s + 1].sum()) - 1
            v = ctx.plan.table_rows[ctx.local_tables[j]] if value == "num_rows" else -1
            if world.rank != 1:  # only rank 1's data is bad
                v = 0
            bad = torch.cat([idx[:pos], torch.tensor([v]), idx[pos:]])
            try:
                ctx(w, lengths, bad, batch_splits=splits, validate=False)
                r = "ok"
            except InvalidInputError as e:
                r = "invalid: " + str(e)
            except PortableOverlapError as e:
                r = f"{type(e).__name__}: {e}"
            w, lengths, idx, psw = _input(ctx, splits, gen, torch.float32, True)
            out = torch.full(ctx.output_shape(splits), float("nan"))
            ctx(w, lengths, idx, psw, batch_splits=splits, out=out, validate=False)
            ref = embedding_all_to_all_reference(w, lengths, idx, psw, ctx.plan, world.rank,
                                                 splits, "sum", world.group)
            res.append((where, r, rel_err(out, ref), v))
    finally:
        ctx.close()
    return res


@pytest.mark.parametrize("value", ["num_rows", "-1"])
def test_index_out_of_range_found_on_device_without_validation(world2, value):
    # the rank reads nothing outside its table, raises, its peers do not hang, and the context
    # serves the next call
    results = world2.run(_bad_index_unvalidated, value, timeout=180)
    for (where, r1, err1, v), (_, r0, err0, _) in zip(results[1], results[0]):
        assert r1.startswith("invalid") and "embedding index" in r1, (where, results)
        assert f"got {v}" in r1, (where, results)
        if where == "peer's sample":  # the pooled vector it would have sent is not valid
            assert "gave up" in r0, (where, results)
        else:  # what rank 0 receives is not affected
            assert r0 == "ok", (where, results)
        assert err0 < 1e-5 and err1 < 1e-5, (where, results)


def _int32_unvalidated(world):
    """int32 lengths and indices (TorchRec's usual dtype) with the host data check skipped
    (``validate=False``, the path graph capture takes), on each transport, forward and
    backward, against the reference: (case, relative error)."""
    res = []
    gen = torch.Generator().manual_seed(40 + world.rank)
    splits = [3, 5]
    for transport in ("stores", "sequential"):
        ctx = EmbeddingAllToAll(world, ROWS, 8, max_local_batch=5, transport=transport)
        try:
            w, lengths, idx, psw = _input(ctx, splits, gen, torch.float32, True, torch.int32)
            assert lengths.dtype == idx.dtype == torch.int32
            out = ctx(w, lengths, idx, psw, batch_splits=splits, validate=False)
            ref = embedding_all_to_all_reference(w, lengths, idx, psw, ctx.plan, world.rank,
                                                 splits, "sum", world.group)
            res.append((transport, rel_err(out, ref)))
            ctx.validate = False
            w1 = w.clone().requires_grad_()
            y = embedding_all_to_all(w1, lengths, idx, ctx, psw, batch_splits=splits)
            y.sum().backward()
            w2 = w.clone().requires_grad_()
            embedding_all_to_all_reference(w2, lengths, idx, psw, ctx.plan, world.rank,
                                           splits, "sum", world.group).sum().backward()
            res.append((transport + " grad", rel_err(w1.grad, w2.grad)))
        finally:
            ctx.close()
    return res


def _lengths_off_the_indices_unvalidated(world):
    """``validate=False`` with lengths that do not add up to the indices' count: three indices
    past the last bag (the forward pools the bags as if they were not there), then lengths
    that ask for more indices than there are. The backward bagged the indices with
    ``repeat_interleave(lengths, output_size=n)``, which raised on the CPU (on a GPU: a
    device-side assert). Returns (forward error, weight gradient error, per-index weights'
    gradient error, the extra indices' gradient) for the first, and whether the second's
    gradient is finite and left the rows of other tables alone."""
    res = []
    gen = torch.Generator().manual_seed(70 + world.rank)
    splits = [3, 2]
    for transport in ("stores", "sequential"):
        ctx = EmbeddingAllToAll(world, ROWS, 8, max_local_batch=5, transport=transport)
        ctx.validate = False
        try:
            w, lengths, idx, psw = _input(ctx, splits, gen, torch.float32, True)
            extra = torch.zeros(3, dtype=idx.dtype)  # row 0 of the first local table
            grads = []
            for i, p in ((torch.cat([idx, extra]), torch.cat([psw, torch.ones(3)])), (idx, psw)):
                w1, p1 = w.clone().requires_grad_(), p.clone().requires_grad_()
                y = embedding_all_to_all(w1, lengths, i, ctx, p1, batch_splits=splits)
                dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
                (y * dy).sum().backward()
                grads.append((y.detach(), w1.grad, p1.grad))
            (y, gw, gp), (y_ref, gw_ref, gp_ref) = grads
            res.append((transport, rel_err(y, y_ref), rel_err(gw, gw_ref),
                        rel_err(gp[:idx.numel()], gp_ref), gp[idx.numel():].abs().max().item()))
            long = lengths.clone()
            long[-1] += 5  # the last bag runs 5 past the indices
            w1 = w.clone().requires_grad_()
            embedding_all_to_all(w1, long, idx, ctx, psw, batch_splits=splits).sum().backward()
            res.append((transport + " long", bool(torch.isfinite(w1.grad).all())))
        finally:
            ctx.close()
    return res


def test_unvalidated_lengths_off_the_indices_count_never_fault_the_backward(world2):
    for res in world2.run(_lengths_off_the_indices_unvalidated, timeout=180):
        for case in res:
            if case[0].endswith("long"):
                assert case[1], res
            else:
                _, err_y, err_gw, err_gp, extra_gp = case
                assert max(err_y, err_gw, err_gp) < 1e-5 and extra_gp == 0.0, res


def test_int32_lengths_without_validation(world2):
    for res in world2.run(_int32_unvalidated, timeout=180):
        assert len(res) == 4 and all(err < 1e-5 for _, err in res), res


def _wrapping_lengths(world):
    """int64 lengths whose sum wraps to the number of indices (four of 2**62, then 3 for 3
    indices), with and without the host's data check, on each transport; then a valid call on
    the same context. Per case: (outcome, relative error of the valid call)."""
    res = []
    gen = torch.Generator().manual_seed(50 + world.rank)
    splits, B = [2, 2], 4
    for transport in ("stores", "sequential"):
        ctx = EmbeddingAllToAll(world, ROWS, 8, max_local_batch=4, block_b=2,
                                transport=transport, timeout_s=20.0)
        try:
            for validate in (True, False):
                w = torch.randn(ctx.weight_rows, 8, generator=gen)
                lengths = torch.zeros(ctx.n_loc * B, dtype=torch.int64)
                lengths[:4] = 2 ** 62
                lengths[4] = 3
                idx = torch.zeros(3, dtype=torch.int64)
                try:
                    ctx(w, lengths, idx, batch_splits=splits, validate=validate)
                    ctx.synchronize()
                    r = "ok"
                except (ValueError, PortableOverlapError) as e:
                    r = f"{type(e).__name__}: {e}"
                w, lengths, idx, psw = _input(ctx, splits, gen, torch.float32, True)
                out = torch.full(ctx.output_shape(splits), float("nan"))
                ctx(w, lengths, idx, psw, batch_splits=splits, out=out)
                ref = embedding_all_to_all_reference(w, lengths, idx, psw, ctx.plan,
                                                     world.rank, splits, "sum", world.group)
                res.append((transport, validate, r, rel_err(out, ref)))
        finally:
            ctx.close()
    return res


def test_lengths_whose_sum_wraps_are_refused_or_read_nothing_past_indices(world2):
    # the sum of four int64 lengths of 2**62 wraps to 0: checked, it matched the indices'
    # count and the kernels read 2**62 indices on (both ranks died of a segfault); unchecked,
    # the offsets went negative
    for res in world2.run(_wrapping_lengths, timeout=240):
        for transport, validate, r, err in res:
            if validate:
                assert r.startswith("ValueError") and "exceeds the 3 indices" in r, res
            assert err < 1e-5, res


def _module_default_split(world):
    """``ShardedEmbeddingBagCollection`` on both paths with no ``batch_splits``: (case, path,
    outcome) per call, and the relative error of the reference path against the fused one for
    a batch that splits evenly."""
    from portable_overlap.modules.embedding import ShardedEmbeddingBagCollection

    def features(m, B):
        n_loc = len(m.local_tables)
        lengths = torch.randint(0, 3, (n_loc * B,), generator=gen)
        idx = [torch.randint(0, m.plan.table_rows[t], (int(lengths[j * B:(j + 1) * B].sum()),),
                             generator=gen) for j, t in enumerate(m.local_tables)]
        return lengths, torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64)

    def outcome(m, lengths, idx):
        try:
            m(lengths, idx)
            return "ok"
        except (ValueError, PortableOverlapError) as e:
            return f"{type(e).__name__}: {e}"

    gen = torch.Generator().manual_seed(50 + world.rank)
    res, errs = [], []
    for table_ranks in (None, [0] * len(ROWS)):
        mods = [ShardedEmbeddingBagCollection(world, ROWS, 8, max_local_batch=5,
                                              table_ranks=table_ranks, fused=f)
                for f in (True, False)]
        try:
            for B in (3, 4):  # 3 does not split over 2 ranks
                if table_ranks is None and B == 4:
                    lengths, idx = features(mods[0], B)
                    ys = [m(lengths, idx) for m in mods]
                    errs.append(rel_err(ys[1], ys[0]))
                    continue
                lengths, idx = features(mods[0], B)
                for m in mods:
                    res.append((f"table_ranks={table_ranks} B={B}", m.fused,
                                outcome(m, lengths, idx)))
        finally:
            for m in mods:
                m.close()
    return res, errs


def test_module_default_split_refused_on_both_paths(world2):
    """An uneven global batch, or a rank without tables, refused on every rank by the reference
    path (before its all-to-all) as by the fused one, instead of dropping samples or sending
    mismatched sizes."""
    for res, errs in world2.run(_module_default_split, timeout=180):
        assert len(res) == 6 and errs and all(e < 1e-5 for e in errs), (res, errs)
        for case, fused, r in res:
            if not fused or "holds no tables" in r or "splits evenly" in r:
                assert "pass batch_splits" in r, (case, fused, r)
                continue
            # the fused path's peers of the rank that refused hear of the refusal
            assert r != "ok", (case, fused, r)


def test_measured_tiles_are_per_weight_element_size():
    """The tile defaults are keyed by D and the bytes per weight element (fp16 rows are half
    the bytes: twice the bags per tile measured faster); other devices and D fall back to
    ~4096 accumulator elements per program."""
    from portable_overlap.ops.embedding_alltoall.fused import default_block_b, default_num_warps

    assert (default_block_b(64, "sm_90", 2), default_num_warps(64, "sm_90", 2)) == (64, 8)
    assert (default_block_b(64, "sm_90", 4), default_num_warps(64, "sm_90", 4)) == (32, 4)
    assert default_block_b(92, "sm_90", 2) == 32  # D = 92 is tiled as 128
    assert default_block_b(256, "sm_90", 2) == 2 * default_block_b(256, "sm_90", 4)
    assert (default_block_b(64, "gfx942", 2), default_num_warps(64, "gfx942", 2)) == (64, 4)
    assert default_block_b(512, "sm_90", 4) == 8


def _late_and_refused(world, calls, late, refused):
    """One call per (dtype, batch splits) of ``calls`` on one context of 4 tables of dimension
    8, table t on rank ``(t + 1) % 4``, the scenario of ``testing.faults.late_and_refused`` (a
    bad ``out`` is the refused input)."""
    from portable_overlap.testing.faults import late_and_refused

    ctx = EmbeddingAllToAll(world, [5, 6, 7, 8], 8, max_local_batch=4, table_ranks=[1, 2, 3, 0],
                            block_b=4, timeout_s=3.0)

    def call(i, dtype, splits):
        def run(bad):
            gen = torch.Generator().manual_seed(10 * i + world.rank)
            weight, lengths, indices, _ = _input(ctx, splits, gen, dtype, False)
            out = torch.full(ctx.output_shape(splits), float("nan"), dtype=dtype)
            ctx(weight, lengths, indices, batch_splits=splits,
                out=torch.empty(1, 1, dtype=dtype) if bad else out)
            return lambda: rel_err(out, embedding_all_to_all_reference(
                weight, lengths, indices, None, ctx.plan, world.rank, splits, "sum",
                world.group))
        return run

    try:
        return late_and_refused(world, ctx, [call(i, *c) for i, c in enumerate(calls)], late,
                                refused)
    finally:
        ctx.close()


def test_a_failed_call_leaves_no_late_stores_for_the_next_call(world4):
    """Rank 1 refuses a call that rank 3 makes late: rank 0 fails it at rank 1's flags and
    makes the next call at once, as rank 1 does, which stores its vectors into rank 0's
    receive buffer before rank 3 stored its vectors of the failed call there. The receive
    buffer's layout moves with the dtype only (a row per sample, the tables' columns in
    order): the failed call is float32 and the next float16, so rank 3's late vectors of
    table 2 in sample 0 (bytes 64-95) land on table 0's (rank 1's) in sample 1 of the next
    call. Every rank must wait for its peers to be done with the failed call first."""
    calls = ((torch.float32, (2, 2, 2, 2)), (torch.float32, (2, 2, 2, 2)),
             (torch.float16, (4, 4, 4, 4)))
    for rank, found in enumerate(world4.run(_late_and_refused, calls, (3, 1), (1, (1,)),
                                            timeout=120)):
        assert found[:3] == ["no error", "ValueError" if rank == 1 else "PeerTimeoutError",
                             "no error"], (rank, found)
        assert found[3] < TOL[torch.float16], (rank, found)


def _module_made_on_two_ranks(world, case):
    """``ShardedEmbeddingBagCollection`` made with arguments that differ on rank 1, then a good
    one, which needs the ranks still in step: (error type, message, seconds) of the first."""

    from portable_overlap.modules import ShardedEmbeddingBagCollection

    r = world.rank
    kw = dict(max_local_batch=4)
    make = {
        # refused on rank 1 alone: rank 0 went on into the context's set-up
        "table_ranks": lambda: ShardedEmbeddingBagCollection(world, [5, 6], 4,
                                                             table_ranks=[0, 1 + r], **kw),
        "pooling": lambda: ShardedEmbeddingBagCollection(world, [5, 6], 4,
                                                         pooling="max" if r else "sum", **kw),
        # float64 made the layer, and then every call refused it
        "dtype": lambda: ShardedEmbeddingBagCollection(
            world, [5, 6], 4, dtype=torch.float64 if r else torch.float32, **kw),
        # good on each rank, different across them: rank 1 makes no context; the tables'
        # values or the pooling differ with no error on the reference path
        "fused": lambda: ShardedEmbeddingBagCollection(world, [5, 6], 4, fused=r == 0, **kw),
        "seed": lambda: ShardedEmbeddingBagCollection(world, [5, 6], 4, seed=r, fused=False,
                                                      **kw),
        "pooling, reference": lambda: ShardedEmbeddingBagCollection(
            world, [5, 6], 4, pooling=("sum", "mean")[r], fused=False, **kw),
    }[case]
    out = construction_outcome(make)
    ShardedEmbeddingBagCollection(world, [5, 6], 4, **kw).close()
    return out


@pytest.mark.parametrize("case,arg", [("table_ranks", None), ("pooling", None), ("dtype", None),
                                      ("fused", "fused"), ("seed", "seed"),
                                      ("pooling, reference", "pooling")])
def test_module_arguments_bad_or_different_on_one_rank_raise_on_every_rank(world2, case, arg):
    """An argument refused on rank 1 alone left rank 0 waiting in the context's set-up until
    the process group's timeout, and arguments that differed hung the same way or made tables
    that differ with the sharding, with no error. Every rank raises at once."""
    mine, peer = world2.run(_module_made_on_two_ranks, case, timeout=90)
    assert mine[2] < 30 and peer[2] < 30, (mine, peer)
    if arg is None:
        assert peer[0] == "ValueError", peer
        assert mine[0] == "PeerSetupError" and "rank 1 refused to make " \
            "ShardedEmbeddingBagCollection" in mine[1], mine
    else:
        for got in (mine, peer):
            assert got[0] == "RankMismatchError" and f"{arg}: rank 0: " in got[1], got
            assert got[1].startswith("ShardedEmbeddingBagCollection: "), got


def _module_after_close(world):
    """A fused module's call after close() (twice): the error raised."""
    from portable_overlap.modules import ShardedEmbeddingBagCollection

    m = ShardedEmbeddingBagCollection(world, [5, 6], 4, max_local_batch=2)
    lengths = torch.ones(len(m.local_tables) * 2 * world.world_size, dtype=torch.int64)
    m.close()
    m.close()
    try:
        with torch.no_grad():
            m(lengths, torch.zeros(int(lengths.sum()), dtype=torch.int64))
        return "no error"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def test_module_call_after_close_says_it_was_closed(world2):
    """close() dropped the context, and a call then raised the op's TypeError that ctx must be
    an EmbeddingAllToAll, got NoneType."""
    for got in world2.run(_module_after_close):
        assert got.startswith("ContextClosedError: ") and "closed" in got, got


def _grad_on_some_ranks(world, transport, case):
    """Autograd records the call on rank 0 only (``case``: the other ranks' weight does not
    require grad, or they call under ``torch.no_grad()``): the backward's reverse All-to-All
    would then run on rank 0 alone and wait for ever. The forward raises RankMismatchError on
    every rank instead, at once, and the context serves the next matched call (recorded on
    every rank, backward included). ``"auto"``: the key decided first (its call then runs the
    fused kernel, whose flags' tag differs); ``"auto, new key"``: the mixed call is the key's
    first (the agreement finds it); ``"auto, sequential"``: the key decided for the plain
    path, whose calls agree first (the agreement finds it)."""
    import contextlib
    import time

    decided = transport in ("auto", "auto, sequential")
    kw = dict(transport=transport.split(",")[0])
    if kw["transport"] == "auto":
        # one candidate where decided: nothing timed
        cands = {"auto": ("stores",), "auto, sequential": ("sequential",)}
        kw.update(candidates=cands.get(transport, ("stores", "sequential")), iters=1, warmup=0)
    ctx = EmbeddingAllToAll(world, ROWS, 8, max_local_batch=5, block_b=4, timeout_s=30.0, **kw)
    gen = torch.Generator().manual_seed(5 + world.rank)
    splits = [3, 5]
    weight, lengths, indices, _ = _input(ctx, splits, gen, torch.float32, False)
    found = {}
    try:
        if decided:  # the key decided first, with autograd on every rank
            w0 = weight.clone().requires_grad_()
            embedding_all_to_all(w0, lengths, indices, ctx, batch_splits=splits).sum().backward()
        records = world.rank == 0
        w1 = weight.clone().requires_grad_(records or case == "no_grad")
        quiet = torch.no_grad() if case == "no_grad" and not records else contextlib.nullcontext()
        t0 = time.monotonic()
        try:
            with quiet:
                y = embedding_all_to_all(w1, lengths, indices, ctx, batch_splits=splits)
            ctx.synchronize()
            if y.requires_grad:
                y.sum().backward()
            found["mixed"] = ("no error", "")
        except PortableOverlapError as e:
            found["mixed"] = (type(e).__name__, str(e))
        found["seconds"] = time.monotonic() - t0
        w2 = weight.clone().requires_grad_()
        y = embedding_all_to_all(w2, lengths, indices, ctx, batch_splits=splits)
        g = torch.randn(y.shape, generator=gen)
        (y * g).sum().backward()
        w3 = weight.clone().requires_grad_()
        r = embedding_all_to_all_reference(w3, lengths, indices, None, ctx.plan, world.rank,
                                           splits, "sum", world.group)
        (r * g).sum().backward()
        found["next"] = max(rel_err(y.detach(), r.detach()), rel_err(w2.grad, w3.grad))
    finally:
        ctx.close()
    return found


@pytest.mark.parametrize("case", ["requires_grad", "no_grad"])
@pytest.mark.parametrize("transport", ["stores", "auto", "auto, new key", "auto, sequential"])
def test_autograd_recorded_on_some_ranks_raises_in_the_forward(world2, transport, case):
    for rank, found in enumerate(world2.run(_grad_on_some_ranks, transport, case, timeout=300)):
        kind, msg = found["mixed"]
        assert kind == "RankMismatchError" and "records_grad" in msg, (rank, found)
        assert found["seconds"] < 20, (rank, found)
        assert found["next"] < 1e-5, (rank, found)


def _bag_offsets_outgrown(world):
    """Calls of a small batch, then of larger ones: every call matches the reference, and the
    offsets buffer of the small batch is still alive (a CUDA graph captured over that call
    replays its prefix sum into it and reads the offsets from there)."""
    import weakref

    res = []
    for transport in ("stores", "sequential"):
        ctx = EmbeddingAllToAll(world, ROWS, 4, max_local_batch=5, block_b=2,
                                transport=transport)
        try:
            gen = torch.Generator().manual_seed(90 + world.rank)
            held = []
            for splits in ([1] * world.world_size, [2] * world.world_size,
                           [5] * world.world_size):
                res += _one(world, ctx, splits, torch.float32, "sum", False, False, gen)
                bag_offsets = ctx.workspace(transport)._bag_offsets
                held.append(weakref.ref(bag_offsets._offsets.buffer))
            res.append((f"{transport}: offsets buffers freed", sum(h() is None for h in held),
                        0, False))
        finally:
            ctx.close()
    return res


def test_offsets_a_larger_batch_outgrew_stay_alive(world2):
    for name, err, tol, nan in [r for rank in world2.run(_bag_offsets_outgrown) for r in rank]:
        assert not nan and err <= tol, name


def _state_dict_layouts(world):
    """Two reference-path modules of two equal tables placed the other way round: each
    rank's state dict loaded back (works, same values), into the other placement, and the
    other rank's state dict, and a weight without its layout (all refused, the weight left as
    it was)."""
    import io

    from portable_overlap.modules.embedding import ShardedEmbeddingBagCollection

    def make(ranks):
        return ShardedEmbeddingBagCollection(world, [6, 6], 4, max_local_batch=2,
                                             table_ranks=ranks, fused=False, seed=3)

    a, b = make([0, 1]), make([1, 0])
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    mine = torch.load(buf)
    theirs = [None] * world.world_size
    torch.distributed.all_gather_object(theirs, mine, group=world.group)
    out = {}
    c = make([0, 1])
    with torch.no_grad():
        c.weight.add_(1.0)
    c.load_state_dict(mine)
    out["same"] = torch.equal(c.weight, a.weight)
    out["tensors"] = all(isinstance(v, torch.Tensor) for v in mine.values())
    legacy = {"weight": mine["weight"]}
    for name, target, state, strict in (
            ("placement", b, mine, True),
            ("rank", c, theirs[(world.rank + 1) % world.world_size], True),
            ("no layout", c, legacy, True), ("no layout, not strict", c, legacy, False)):
        before = target.weight.detach().clone()
        try:
            target.load_state_dict(state, strict=strict)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
        out[name + ": kept"] = torch.equal(target.weight, before)
    return out


def test_a_state_dict_loads_only_under_its_own_layout(world2):
    """A state dict holds one rank's packed tables: loaded into a module whose tables sit on
    other ranks (equal rows, so the same shape), or on another rank, it was taken with no
    error, and the tables answered with other tables' rows. Both raise now, before the weight
    is copied, and so does a weight without its layout; the same layout loads."""
    for r, out in enumerate(world2.run(_state_dict_layouts)):
        assert out["same"] and out["tensors"], (r, out)
        assert all(v for k, v in out.items() if k.endswith(": kept")), (r, out)
        for key in ("no layout", "no layout, not strict"):
            assert out[key] and "not the layout it was packed under" in out[key], (r, out)
        assert out["placement"] and "table_ranks [0, 1] there, [1, 0] here" in out["placement"]
        assert out["rank"] and f"rank {1 - r} there, {r} here" in out["rank"], (r, out)


@pytest.mark.parametrize("rows", [torch.tensor([True, True]), [True, 4]])
def test_plan_refuses_bools_of_every_kind_as_rows(rows):
    """A bool tensor's elements pass ``operator.index`` as 0 or 1: ``table_rows`` given a mask
    made tables of one row. Refused, as Python bools are."""
    from portable_overlap.ops.embedding_alltoall import ShardingPlan

    with pytest.raises(ValueError, match="floats and bools are not rounded"):
        ShardingPlan.make(rows, 4, 2, None)
