"""Embedding pooling + All-to-All's ``"sequential"`` transport and ``transport="auto"`` on
CPU-emulated ranks, against F.embedding_bag per table + all_to_all_single (the fused transports:
test_embedding_alltoall.py)."""
import pytest
import torch

from portable_overlap import InvalidInputError, PortableOverlapError
from portable_overlap.ops.embedding_alltoall import (EmbeddingAllToAll, embedding_all_to_all,
                                                     embedding_all_to_all_reference)
from portable_overlap.ops.planner import Jagged
from portable_overlap.testing.compare import rel_err

from test_embedding_alltoall import _input, _one, ROWS

#: the sequential transport pools in the tables' dtype (F.embedding_bag), the reference in fp32
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}
#: "auto" on the emulated ranks: one timed run per candidate (the interpreter is slow)
QUICK = dict(iters=1, warmup=0)


def _sequential_cases(world, full):
    W = world.world_size
    gen = torch.Generator().manual_seed(20 + world.rank)
    uneven = [[3, 5], [1, 4, 0, 3]][W // 4]  # a rank with no samples at 4
    res = []
    ctx = EmbeddingAllToAll(world, ROWS, 8, max_local_batch=5, transport="sequential")
    try:
        combos = [(torch.float32, "sum", True, True), (torch.float32, "mean", False, True),
                  (torch.float16, "sum", True, False), (torch.bfloat16, "mean", False, True)]
        if full:
            combos += [(torch.float32, "sum", False, True), (torch.float16, "mean", False, True),
                       (torch.bfloat16, "sum", True, False)]
        for dtype, pooling, weighted, grad in combos:
            got = _one(world, ctx, uneven, dtype, pooling, weighted, grad=grad, gen=gen,
                       idx_dtype=torch.int32 if weighted else torch.int64, hole=1)
            res += [(n, e, max(t, TOL[dtype]), nan) for n, e, t, nan in got]
        # the default split; then a larger batch on the same context (other exchange maps)
        for splits in ([4] * W, [5] * W):
            weight, lengths, indices, _ = _input(ctx, splits, gen, torch.float32, False)
            out = ctx(weight, lengths, indices, batch_splits=None if splits[0] == 4 else splits)
            ref = embedding_all_to_all_reference(weight, lengths, indices, None, ctx.plan,
                                                 world.rank, splits, "sum", world.group)
            res.append((f"splits {splits}", rel_err(out, ref), 1e-5, False))
    finally:
        ctx.close()
    # D not a power of two, every table on rank 0 (the others hold none and only receive)
    ctx = EmbeddingAllToAll(world, ROWS[:3], 12, max_local_batch=6, table_ranks=[0, 0, 0],
                            transport="sequential")
    try:
        res += _one(world, ctx, uneven, torch.float32, "mean", False, grad=True, gen=gen)
    finally:
        ctx.close()
    return res


def test_sequential_matches_embedding_bag_plus_all_to_all(world):
    for res in world.run(_sequential_cases, world.size == 2):
        bad = [r for r in res if r[3] or not r[1] <= r[2]]
        assert not bad, bad
        assert len(res) > 8


def _sequential_bad(world):
    """Bad input the same on every rank (a rank alone with bad input would leave its peers in
    the collective, as NCCL's would: ``"auto"`` agrees first, ``_auto_refusal``)."""
    ctx = EmbeddingAllToAll(world, ROWS, 8, max_local_batch=5, transport="sequential")
    gen = torch.Generator().manual_seed(3)
    splits = [3, 5]
    w, lengths, idx, psw = _input(ctx, splits, gen, torch.float32, True)
    _, _, idx_oob, _ = _input(ctx, splits, torch.Generator().manual_seed(3), torch.float32,
                              True, oob=True)
    calls = {
        "out of range": lambda: ctx(w, lengths, idx_oob, batch_splits=splits),
        "lengths sum": lambda: ctx(w, lengths, idx[:-1], batch_splits=splits),
        "weight shape": lambda: ctx(w[:-1], lengths, idx, batch_splits=splits),
        "index dtype": lambda: ctx(w, lengths, idx.float(), batch_splits=splits),
        "mean + weights": lambda: ctx(w, lengths, idx, psw, batch_splits=splits,
                                      pooling="mean"),
        "splits": lambda: ctx(w, lengths, idx, batch_splits=[8, "x"]),
        "out shape": lambda: ctx(w, lengths, idx, batch_splits=splits,
                                 out=torch.empty(2, 48)),
        "options": lambda: EmbeddingAllToAll(world, ROWS, 8, 5, transport="sequential",
                                             pieces=2),
        "tiling": lambda: EmbeddingAllToAll(world, ROWS, 8, 5, transport="sequential",
                                            block_b=3),
    }
    msgs = {}
    for name, call in calls.items():
        try:
            call()
            msgs[name] = None
        except (ValueError, TypeError) as e:
            msgs[name] = str(e)
    out = ctx(w, lengths, idx, psw, batch_splits=splits)
    ref = embedding_all_to_all_reference(w, lengths, idx, psw, ctx.plan, world.rank, splits,
                                         "sum", world.group)
    ctx.close()
    return msgs, rel_err(out, ref)


def test_sequential_refuses_bad_input_as_the_fused_transports_do(world2):
    for msgs, err in world2.run(_sequential_bad):
        missing = [k for k, m in msgs.items() if not (m and m.startswith("embedding_all_to_all"))]
        assert not missing, (missing, msgs)
        assert "out of range" in msgs["out of range"] and "sum to" in msgs["lengths sum"]
        assert "takes no options" in msgs["options"] and "block_b" in msgs["tiling"]
        assert err < 1e-5


def _sequential_unchecked(world):
    """Rank 1 passes an index one past its table's last row with ``validate=False``: the call
    reads nothing outside the table, the next synchronize raises on rank 1 alone, and the
    context serves the next call."""
    ctx = EmbeddingAllToAll(world, ROWS, 8, max_local_batch=5, transport="sequential")
    splits = [3, 5]
    gen = torch.Generator().manual_seed(40 + world.rank)
    w, lengths, idx, _ = _input(ctx, splits, gen, torch.float32, False)
    if world.rank == 1:
        idx[-1] = ctx.plan.table_rows[ctx.local_tables[-1]]
    ctx(w, lengths, idx, batch_splits=splits, validate=False)
    try:
        ctx.synchronize()
        r = "ok"
    except InvalidInputError as e:
        r = "invalid: " + str(e)
    w, lengths, idx, _ = _input(ctx, splits, gen, torch.float32, False)
    out = ctx(w, lengths, idx, batch_splits=splits, validate=False)
    ctx.synchronize()
    ref = embedding_all_to_all_reference(w, lengths, idx, None, ctx.plan, world.rank, splits,
                                         "sum", world.group)
    ctx.close()
    return r, rel_err(out, ref)


def test_sequential_unchecked_index_raises_at_synchronize(world2):
    (r0, e0), (r1, e1) = world2.run(_sequential_unchecked)
    assert r0 == "ok" and r1.startswith("invalid") and "1 indices outside" in r1, (r0, r1)
    assert e0 < 1e-5 and e1 < 1e-5


def _auto(world):
    """``"auto"`` picks one of its two default candidates at a key's first call, keeps it for
    a later batch of the same size with another index count on every rank (the second call,
    one index fewer on rank 0 only: keys must stay the same on every rank), decides again for
    another batch size, and runs the backward; the results match the reference every time."""
    gen = torch.Generator().manual_seed(50 + world.rank)
    ctx = EmbeddingAllToAll(world, ROWS, 8, max_local_batch=5, transport="auto", **QUICK)
    res = {"candidates": ctx.planner.candidates}
    try:
        errs, picks, n_idx = [], [], []
        for splits in ([4] * world.world_size, [4] * world.world_size, [5] * world.world_size):
            # two indices per bag; the second call has one fewer on rank 0, the third a larger
            # batch (another lengths shape: a new key)
            w, lengths, idx, psw = _input(ctx, splits, gen, torch.float32, True)
            lengths.fill_(2)
            idx = torch.cat([torch.randint(0, ctx.plan.table_rows[t],
                                           (2 * sum(splits),), generator=gen)
                             for t in ctx.local_tables])
            if len(n_idx) == 1 and world.rank == 0:
                lengths[-1] = 1
                idx = idx[:-1]
            psw = torch.rand(idx.numel(), generator=gen) + 0.5
            out = torch.full(ctx.output_shape(splits), float("nan"))
            ctx(w, lengths, idx, psw, batch_splits=splits, out=out)
            ref = embedding_all_to_all_reference(w, lengths, idx, psw, ctx.plan, world.rank,
                                                 splits, "sum", world.group)
            errs.append(rel_err(out, ref))
            picks.append(ctx.choice(w, lengths, idx, psw, batch_splits=splits))
            n_idx.append(idx.numel())
        res.update(errs=errs, picks=picks, decisions=len(ctx.decisions), n_idx=n_idx)
        # differentiable through the op, on the decided transport
        splits = [4] * world.world_size
        res["grad"] = _one(world, ctx, splits, torch.float32, "sum", True, grad=True, gen=gen)
    finally:
        ctx.close()
    return res


def test_auto_picks_and_keeps_a_transport(world2):
    results = world2.run(_auto, timeout=540)
    for res in results:
        assert res["candidates"] == ("stores", "sequential"), res
        assert all(e < 1e-5 for e in res["errs"]), res
        assert all(p in ("stores", "sequential") for p in res["picks"]), res
        # two index counts (on rank 0) of one key, then another batch: two decisions
        assert (res["n_idx"][0] != res["n_idx"][1]) == (res is results[0]), res
        assert res["decisions"] == 2, res
        bad = [r for r in res["grad"] if r[3] or not r[1] <= max(r[2], 1e-5)]
        assert not bad, bad


def _auto_refusal(world):
    """One rank's bad input under ``"auto"`` (the sequential candidate's collective has no
    deadline): every rank raises in the same call, and the context serves the next one."""
    ctx = EmbeddingAllToAll(world, ROWS, 8, max_local_batch=5, transport="auto",
                            candidates=("sequential",), **QUICK)
    splits = [3, 5]
    gen = torch.Generator().manual_seed(60 + world.rank)
    w, lengths, idx, _ = _input(ctx, splits, gen, torch.float32, False)
    out = []
    for bad in (world.rank == 1, False):
        try:
            ctx(w, lengths, idx[:-1] if bad else idx, batch_splits=splits)
            out.append("ok")
        except (ValueError, PortableOverlapError) as e:
            out.append(f"{type(e).__name__}: {e}")
    ctx.close()
    return out


def test_auto_one_rank_refusing_fails_the_call_on_every_rank(world2):
    (a0, b0), (a1, b1) = world2.run(_auto_refusal, timeout=300)
    assert a1.startswith("ValueError") and "sum to" in a1, a1
    assert a0.startswith("RankMismatchError") and "rank 1 refused" in a0, a0
    assert b0 == b1 == "ok", (b0, b1)


def _auto_weights_on_some_ranks(world):
    """``"auto"`` over calls in which each rank passes per-index weights or not, of its own
    dtype, changing from call to call on one rank only (each rank weights its own tables):
    every call runs and matches the reference, with one decision for the batch size."""
    ctx = EmbeddingAllToAll(world, ROWS, 8, max_local_batch=5, transport="auto", **QUICK)
    splits = [3, 5]
    gen = torch.Generator().manual_seed(70 + world.rank)
    res = []
    try:
        for k, weighted in enumerate((world.rank == 0, False, True, world.rank == 1)):
            w, lengths, idx, psw = _input(ctx, splits, gen, torch.float32, weighted)
            if psw is not None and world.rank == 1:
                psw = psw.to(torch.float16)
            try:
                out = ctx(w, lengths, idx, psw, batch_splits=splits)
                ref = embedding_all_to_all_reference(w, lengths, idx, psw, ctx.plan,
                                                     world.rank, splits, "sum", world.group)
                res.append(rel_err(out, ref))
            except PortableOverlapError as e:
                res.append(f"call {k}: {type(e).__name__}: {e}")
        res.append(len(ctx.decisions))
    finally:
        ctx.close()
    return res


def test_auto_takes_weights_some_ranks_pass_and_others_not(world2):
    for res in world2.run(_auto_weights_on_some_ranks, timeout=300):
        assert all(isinstance(e, float) and e < 1e-3 for e in res[:-1]), res
        assert res[-1] == 1, res


def test_jagged_key():
    """A jagged input is keyed by its dtype alone: its length differs from rank to rank and
    from call to call, and every rank's key must change together."""
    i32 = torch.int32
    assert Jagged.of(torch.zeros(5, dtype=i32)) == Jagged.of(torch.zeros(9000, dtype=i32))
    assert Jagged.of(torch.zeros(5)) != Jagged.of(torch.zeros(5, dtype=torch.int32))


def _candidates(world):
    from portable_overlap.shmem.providers import ShmemUnavailable

    ctx = EmbeddingAllToAll(world, ROWS, 8, 5, transport="auto", **QUICK)
    got = [ctx.planner.candidates, repr(ctx)]
    ctx.close()
    try:
        EmbeddingAllToAll(world, ROWS, 8, 5, transport="auto", candidates=("stores", "shmem"))
        got.append(None)
    except ShmemUnavailable as e:
        got.append(str(e))
    try:
        EmbeddingAllToAll(world, ROWS, 8, 5, transport="auto", candidates=("dma",))
        got.append(None)
    except ValueError as e:
        got.append(str(e))
    return got


def test_auto_candidates(world2):
    """``"shmem"`` only when named (it needs the SHMEM library on every rank)."""
    for cands, text, shmem, bad in world2.run(_candidates):
        assert cands == ("stores", "sequential") and "auto" in text, (cands, text)
        assert shmem and "cpu" in shmem, shmem
        assert bad and "candidates" in bad, bad


def test_default_transport_is_auto_on_a_gpu_world():
    gpu = type("GpuWorld", (), {"backend": type("Backend", (), {"name": "cuda"})})()
    assert EmbeddingAllToAll.default_transport(gpu) == "auto"
    with pytest.raises(ValueError, match="an option of a named transport"):
        EmbeddingAllToAll.default_transport(gpu, {"pieces": 2})


def _grad_sequential_op(world):
    """The differentiable op on the named sequential transport (module path)."""
    ctx = EmbeddingAllToAll(world, ROWS, 8, max_local_batch=5, transport="sequential")
    gen = torch.Generator().manual_seed(70 + world.rank)
    splits = [2, 3]
    w, lengths, idx, _ = _input(ctx, splits, gen, torch.float32, False)
    w1 = w.clone().requires_grad_()
    y = embedding_all_to_all(w1, lengths, idx, ctx, batch_splits=splits)
    y.sum().backward()
    w2 = w.clone().requires_grad_()
    embedding_all_to_all_reference(w2, lengths, idx, None, ctx.plan, world.rank, splits, "sum",
                                   world.group).sum().backward()
    ctx.close()
    return rel_err(w1.grad, w2.grad)


def test_sequential_backward(world2):
    assert all(e < 1e-5 for e in world2.run(_grad_sequential_op))
