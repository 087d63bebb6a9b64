"""Embedding pooling + All-to-All on the inputs a DLRM / TorchRec user passes, against
``F.embedding_bag`` on every GLOBAL table and the batch split done by hand (not the library's
reference): every bag empty, a table without lookups, a batch of one sample, bags of one row,
mean of empty bags, repeated rows within and across bags (their gradients accumulate), int32
and int64 features, fp16 tables, a rank that holds no table; the module training (an
optimizer step, then a call that sees the new weights) on 3 ranks; and what a call refuses
on every rank: batch splits that are not integers, one rank's bad input on the module's
reference path. Tiny shapes (the CI machine has 2 cores)."""
import torch
import torch.nn.functional as F

import portable_overlap as po
from portable_overlap.ops.embedding_alltoall import EmbeddingAllToAll, embedding_all_to_all

ROWS = [7, 5, 9, 4, 6]
D = 4


def _global(splits, seed, dtype=torch.float32, max_len=3, empty=(), weighted=False, rows=ROWS):
    """Every global table and its features for the global batch (the same on every rank):
    ``[(table, lengths, indices, per-index weights or None)]``; tables in ``empty`` (or "all")
    have no lookup."""
    g = torch.Generator().manual_seed(seed)
    B = sum(splits)
    out = []
    for t, n in enumerate(rows):
        table = torch.randn(n, D, generator=g).to(dtype)
        lengths = torch.randint(0, max_len + 1, (B,), generator=g)
        if empty == "all" or t in empty:
            lengths.zero_()
        indices = torch.randint(0, n, (int(lengths.sum()),), generator=g)
        psw = torch.rand(indices.numel(), generator=g) + 0.5 if weighted else None
        out.append((table, lengths, indices, psw))
    return out


def _by_hand(feats, splits, rank, pooling, tables=None):
    """``F.embedding_bag`` per global table over the whole batch (float32), then rank
    ``rank``'s samples, columns in global table order. ``tables``: the tables to use instead
    of ``feats``' own (autograd leaves)."""
    lo = sum(splits[:rank])
    cols = []
    for t, (table, lengths, indices, psw) in enumerate(feats):
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
        w = table.float() if tables is None else tables[t]
        cols.append(F.embedding_bag(indices, w, offsets, mode=pooling,
                                    per_sample_weights=psw)[lo:lo + splits[rank]])
    return torch.cat(cols, 1)


def _local(local_tables, feats, idx_dtype=torch.int64):
    """This rank's packed weight and its tables' features (table-major, KeyedJaggedTensor)."""
    if not local_tables:
        return (torch.empty(0, D, dtype=feats[0][0].dtype), torch.zeros(0, dtype=idx_dtype),
                torch.zeros(0, dtype=idx_dtype), None)
    parts = [feats[t] for t in local_tables]
    psw = None if parts[0][3] is None else torch.cat([p[3] for p in parts])
    return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]).to(idx_dtype),
            torch.cat([p[2] for p in parts]).to(idx_dtype), psw)


def _forward_cases(world):
    W, r = world.world_size, world.rank
    res = []
    cases = {
        "every bag empty": dict(empty="all"),
        "every bag empty, mean": dict(empty="all", pooling="mean"),
        "tables without lookups": dict(empty=(0, 3)),
        "mean with empty bags": dict(pooling="mean"),
        "bags of one row": dict(max_len=1),
        "one sample": dict(splits=[0] * (W - 1) + [1]),
        "int32": dict(idx_dtype=torch.int32),
        "fp16, weighted": dict(dtype=torch.float16, weighted=True),
        "largest batch": dict(splits=[3] * W),
    }
    for transport in ("stores", "sequential"):
        ctx = EmbeddingAllToAll(world, ROWS, D, max_local_batch=3, block_b=2,
                                transport=transport)
        try:
            for k, (name, c) in enumerate(cases.items()):
                splits = c.get("splits", [1 + (q % 2) for q in range(W)])
                pooling, dtype = c.get("pooling", "sum"), c.get("dtype", torch.float32)
                feats = _global(splits, 100 + k, dtype, c.get("max_len", 3), c.get("empty", ()),
                                c.get("weighted", False))
                w, lengths, indices, psw = _local(ctx.local_tables, feats,
                                                  c.get("idx_dtype", torch.int64))
                out = torch.full(ctx.output_shape(splits), float("nan"), dtype=dtype)
                ctx(w, lengths, indices, psw, batch_splits=splits, pooling=pooling, out=out)
                err = (out.float() - _by_hand(feats, splits, r, pooling)).abs().max().item() \
                    if out.numel() else 0.0
                res.append((transport, name, err, 2e-3 if dtype == torch.float16 else 1e-5))
        finally:
            ctx.close()
    return res


def test_jagged_edge_cases_match_embedding_bag_on_three_ranks(world3):
    for res in world3.run(_forward_cases, timeout=300):
        bad = [x for x in res if not x[2] <= x[3]]
        assert not bad, bad
        assert len(res) == 18


def _repeated_rows_grad(world, pooling, weighted):
    """Gradients where one row is looked up several times in a bag and in several bags (the
    indices are 0 and 1 only): they must add up, as autograd through ``F.embedding_bag``."""
    W, r = world.world_size, world.rank
    splits = [2] * W
    feats = [(t, ln, i % 2, p) for t, ln, i, p in _global(splits, 7, max_len=4,
                                                          weighted=weighted)]
    ctx = EmbeddingAllToAll(world, ROWS, D, max_local_batch=2, block_b=2)
    try:
        w, lengths, indices, psw = _local(ctx.local_tables, feats)
        g = torch.randn(sum(splits), len(ROWS) * D, generator=torch.Generator().manual_seed(1))
        lo = sum(splits[:r])
        w1 = w.clone().requires_grad_()
        p1 = psw.clone().requires_grad_() if weighted else None
        y = embedding_all_to_all(w1, lengths, indices, ctx, p1, batch_splits=splits,
                                 pooling=pooling)
        (y * g[lo:lo + splits[r]]).sum().backward()
        tables = [f[0].clone().requires_grad_() for f in feats]
        ref_feats = [(t, ln, i, None if p is None else p.clone().requires_grad_())
                     for t, ln, i, p in feats]
        full = torch.cat([_by_hand(ref_feats, splits, q, pooling, tables) for q in range(W)])
        (full * g).sum().backward()
        err = (w1.grad - torch.cat([tables[t].grad for t in ctx.local_tables])).abs().max()
        errs = [err.item()]
        if weighted:
            ref_psw = torch.cat([ref_feats[t][3].grad for t in ctx.local_tables])
            errs.append((p1.grad - ref_psw).abs().max().item())
    finally:
        ctx.close()
    return errs


def test_repeated_rows_accumulate_their_gradients_on_three_ranks(world3):
    for pooling, weighted in (("sum", True), ("mean", False)):
        for errs in world3.run(_repeated_rows_grad, pooling, weighted, timeout=300):
            assert max(errs) < 1e-5, (pooling, weighted, errs)


def _module_trains(world):
    """The module on both paths, rank 2 holding no table (batch_splits given): two SGD steps,
    the second call seeing the first step's weights; fused and reference agree at every step,
    and both agree with ``F.embedding_bag`` on the weights of the step."""
    W, r = world.world_size, world.rank
    table_ranks = [q % (W - 1) for q in range(len(ROWS))]  # rank W-1 holds none
    splits = [1, 3, 2][:W] if W == 3 else [2] * W
    res = []
    mods = [po.ShardedEmbeddingBagCollection(world, ROWS, D, max_local_batch=3,
                                             table_ranks=table_ranks, fused=f, pooling="mean")
            for f in (True, False)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in mods]
    try:
        for step in range(2):
            feats = _global(splits, 50 + step)
            _, lengths, indices, _ = _local(mods[0].local_tables, feats)
            outs = []
            for m, opt in zip(mods, opts):
                # the tables as they are now: gathered from every rank (the same everywhere)
                tables = _all_tables(world, m)
                ref = _by_hand([(tables[t], *f[1:]) for t, f in enumerate(feats)], splits, r,
                               "mean")
                out = m(lengths, indices, batch_splits=splits)
                res.append((step, m.fused, (out.detach() - ref).abs().max().item()
                            if out.numel() else 0.0))
                opt.zero_grad()
                (out * out).sum().backward()
                opt.step()
                outs.append(out.detach())
            res.append((step, "fused vs reference", (outs[0] - outs[1]).abs().max().item()
                        if outs[0].numel() else 0.0))
    finally:
        for m in mods:
            m.close()
    return res


def _all_tables(world, module):
    """Every global table as the module holds it now (gathered over the ranks)."""
    held = world.all_gather_object(module.weight.detach().clone())
    tables = {}
    for q, w in enumerate(held):
        top = 0
        for t in module.plan.tables_of(q):
            tables[t] = w[top:top + ROWS[t]]
            top += ROWS[t]
    return [tables[t] for t in range(len(ROWS))]


def test_module_trains_with_a_rank_without_tables_on_three_ranks(world3):
    for res in world3.run(_module_trains, timeout=300):
        bad = [x for x in res if not x[2] < 1e-5]
        assert not bad, bad


def _splits_not_integers(world):
    W = world.world_size
    ctx = EmbeddingAllToAll(world, ROWS, D, max_local_batch=3, block_b=2)
    feats = _global([2] * W, 3)
    w, lengths, indices, _ = _local(ctx.local_tables, feats)
    msgs = {}
    try:
        for name, splits in (("floats", [2.5] * W), ("bools", [True] * W),
                             ("float tensor", torch.full((W,), 2.0))):
            try:
                ctx(w, lengths, indices, batch_splits=splits)
                msgs[name] = None
            except (ValueError, TypeError) as e:
                msgs[name] = str(e)
        ok = ctx(w, lengths, indices, batch_splits=torch.tensor([2] * W))  # integer tensor
        err = (ok - _by_hand(feats, [2] * W, world.rank, "sum")).abs().max().item()
    finally:
        ctx.close()
    return msgs, err


def test_batch_splits_that_are_not_integers_are_refused(world2):
    """``int(2.5)`` would have run the call on a batch of 2 per rank: the split is the
    all-to-all's layout, never rounded."""
    for msgs, err in world2.run(_splits_not_integers):
        assert all(m and "batch_splits" in m for m in msgs.values()), msgs
        assert err < 1e-5


def _reference_path_bad_input(world):
    """The module's reference path (``fused=False``) with one rank's input refused (an index
    outside its table, lengths that miss the indices) or one rank's batch split different:
    every rank raises in that call, none waits in the exchange, and the next call works."""
    W, r = world.world_size, world.rank
    m = po.ShardedEmbeddingBagCollection(world, ROWS, D, max_local_batch=3, fused=False)
    feats = _global([2] * W, 11)
    _, lengths, indices, _ = _local(m.local_tables, feats)
    got = {}
    bad_inputs = {"index outside": (lengths, indices + 100),
                  "lengths sum": (lengths, indices[:-1])}
    for name, (ln, ix) in bad_inputs.items():
        try:
            m(ln, ix) if r == 1 else m(lengths, indices)
            got[name] = None
        except (ValueError, po.PortableOverlapError) as e:
            got[name] = f"{type(e).__name__}: {e}"
    try:  # ranks that pass different splits (the same number of bags)
        m(lengths, indices, batch_splits=[1, 2 * W - 1] + [2] * (W - 2) if r == 1 else None)
        got["splits differ"] = None
    except po.RankMismatchError as e:
        got["splits differ"] = f"{type(e).__name__}: {e}"
    tables = _all_tables(world, m)
    out = m(lengths, indices)
    ref = _by_hand([(tables[t], *f[1:]) for t, f in enumerate(feats)], [2] * W, r, "sum")
    m.close()
    return got, (out.detach() - ref).abs().max().item()


def test_module_reference_path_refuses_one_ranks_bad_input_on_every_rank(world2):
    for r, (got, err) in enumerate(world2.run(_reference_path_bad_input, timeout=120)):
        mismatch = got.pop("splits differ")
        assert mismatch and "different batch_splits" in mismatch, mismatch
        for name, msg in got.items():
            assert msg is not None, (r, name)
            if r == 1:
                assert msg.startswith("ValueError: embedding_all_to_all"), msg
            else:
                assert "rank(s) [1]" in msg, msg
        assert err < 1e-5


def _default_split_with_a_rank_without_tables(world, transport):
    """No ``batch_splits`` while rank 1 holds no table: its global batch cannot be read off
    its (empty) lengths. Every rank refuses the call, whatever the transport (the sequential
    one has no refusal its peers hear of: were one rank to refuse alone, they would wait in
    its all-to-all), and a call with the split given works after it."""
    W, r = world.world_size, world.rank
    table_ranks = [0, 0, W - 1, 0, W - 1]
    ctx = EmbeddingAllToAll(world, ROWS, D, max_local_batch=3, block_b=2,
                            table_ranks=table_ranks, transport=transport)
    try:
        feats = _global([2] * W, 21)
        w, lengths, indices, _ = _local(ctx.local_tables, feats)
        try:
            ctx(w, lengths, indices)
            msg = None
        except (ValueError, po.PortableOverlapError) as e:
            msg = f"{type(e).__name__}: {e}"
        out = ctx(w, lengths, indices, batch_splits=[2] * W)
        err = (out - _by_hand(feats, [2] * W, r, "sum")).abs().max().item()
    finally:
        ctx.close()
    return msg, err


def test_default_split_with_a_rank_without_tables_refused_on_every_rank(world3):
    for transport in ("sequential", "stores"):
        for msg, err in world3.run(_default_split_with_a_rank_without_tables, transport,
                                   timeout=150):
            assert msg and msg.startswith("ValueError") and "rank 1 holds no tables" in msg, \
                (transport, msg)
            assert err < 1e-5
