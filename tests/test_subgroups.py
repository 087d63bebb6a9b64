"""Worlds made on sub process groups (``World.from_process_group(group)``), as tensor or expert
parallelism is laid out inside a larger job: 4 emulated ranks split into two groups of 2,
contiguous ({0, 1} / {2, 3}) or interleaved ({0, 2} / {1, 3}), both groups running their ops at
the same time; every rank's result against torch's reference on its own group."""
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import portable_overlap as po
from portable_overlap.testing.compare import rel_err
from portable_overlap.testing.patterns import GEMM_PATTERNS, pattern_inputs

LAYOUTS = {"contiguous": [[0, 1], [2, 3]], "interleaved": [[0, 2], [1, 3]]}


def _subworld(world, layout):
    """This rank's world on its group of ``layout`` (every rank makes every group, as
    ``dist.new_group`` asks), and the group's index."""
    groups = [dist.new_group(ranks) for ranks in LAYOUTS[layout]]
    mine = next(i for i, ranks in enumerate(LAYOUTS[layout]) if world.rank in ranks)
    return po.World.from_process_group(groups[mine], backend="cpu"), mine


def _facts_and_broadcast(world, layout):
    """What the subgroup world reports, with the launcher's local variables and without them,
    and ``broadcast_object`` from each of its ranks."""
    sw, gi = _subworld(world, layout)
    got = [sw.broadcast_object(("group", gi, "rank", sw.rank), src=q)
           for q in range(sw.world_size)]
    saved = {k: os.environ.pop(k) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    try:
        bare, _ = _subworld(world, layout)
    finally:
        os.environ.update(saved)
    return (gi, sw.rank, sw.world_size, [(w.local_rank, w.local_world_size, str(w.device))
                                         for w in (sw, bare)], got)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_world_facts_and_broadcast_by_group_rank(world4, layout):
    """A group's rank ``q`` is the broadcast's source (torch reads a plain ``src`` as a rank of
    the whole job: a group without the job's rank 0 raised, another group's process was
    named). The local rank, which picks the device, is the job's, also where the launcher set
    no LOCAL_RANK (the group's rank would put two processes on one device)."""
    for g, (gi, rank, size, local, got) in enumerate(world4.run(_facts_and_broadcast, layout)):
        assert (rank, size) == (LAYOUTS[layout][gi].index(g), 2)
        assert local == [(g, 4, "cpu")] * 2, local
        assert got == [("group", gi, "rank", q) for q in range(2)], got


def _ops(world, layout):
    """One call of each op family on this rank's group: the GEMM and GEMV patterns through
    ``transport="auto"`` (the planner's rank 0 of the group decides and tells its peers), the
    MoE layer (fused dispatch, expert GEMMs and combine) against its torch path, the sharded
    embedding against its reference path, the parallel linears against torch."""
    sw, gi = _subworld(world, layout)
    W, r = sw.world_size, sw.rank
    g = torch.Generator().manual_seed(100 * world.rank + 7)
    shared = torch.Generator().manual_seed(gi)  # the same on the group's ranks
    errs = {}
    for name, (make, ref, rows) in GEMM_PATTERNS.items():
        ctx = make(sw, 4, 6, transport="auto", iters=1, warmup=0)
        try:
            a, b, bias, res = pattern_inputs(g, 4, 6, 5, rows(4, W), torch.float32)
            y = getattr(po, name)(a, b, ctx, bias=bias, residual=res)
            ctx.synchronize()
            errs[name] = rel_err(y, ref(a, b, sw.group, bias, res))
        finally:
            ctx.close()
    with po.GemvAllReduce(sw, 16, transport="auto", iters=1, warmup=0) as ctx:
        x, w = torch.randn(2, 8, generator=g), torch.randn(16, 8, generator=g)
        errs["gemv_all_reduce"] = rel_err(po.gemv_all_reduce(x, w, ctx),
                                          po.gemv_all_reduce_reference(x, w, sw.group))
    with po.AllGatherMatmul(sw, 4 * 8, transport="auto", iters=1, warmup=0) as ctx:
        a, b = torch.randn(3, 8, generator=g), torch.randn(8, 6, generator=shared)
        errs["all_gather_matmul"] = rel_err(po.all_gather_matmul(a, b, ctx),
                                            po.all_gather_matmul_reference(a, b, sw.group))
    torch.manual_seed(gi)
    H, I, E, k = 16, 12, 2 * W, 2
    moe = po.ExpertParallelMoE(sw, H, I, E, k, max_tokens=6, dtype=torch.float32)
    torch.manual_seed(gi)
    moe_ref = po.ExpertParallelMoE(sw, H, I, E, k, max_tokens=6, dtype=torch.float32,
                                   fused=False)
    try:
        with torch.no_grad():
            tokens = torch.randn(5 + r, H, generator=g)
            errs["moe"] = rel_err(moe(tokens), moe_ref(tokens))
    finally:
        moe.close()
    torch.manual_seed(gi)
    embs = [po.ShardedEmbeddingBagCollection(sw, [7, 5, 9, 4], 8, max_local_batch=5, fused=f)
            for f in (True, False)]
    try:
        m, B = embs[0], 4
        lengths = torch.randint(1, 3, (len(m.local_tables) * B,), generator=g)
        idx = torch.cat([torch.randint(0, m.plan.table_rows[t],
                                       (int(lengths[j * B:(j + 1) * B].sum()),), generator=g)
                         for j, t in enumerate(m.local_tables)])
        with torch.no_grad():
            embs[1].weight.copy_(embs[0].weight)
            errs["embedding"] = rel_err(embs[0](lengths, idx), embs[1](lengths, idx))
    finally:
        for e in embs:
            e.close()
    full_w = torch.randn(12, 8, generator=shared)
    kk = 8 // W
    row = po.RowParallelLinear(8, 12, sw, bias=False, dtype=torch.float32)
    col = po.ColumnParallelLinear(8, 6 * W, sw, max_rows=3, bias=False, dtype=torch.float32)
    try:
        with torch.no_grad():
            row.weight.copy_(full_w[:, r * kk:(r + 1) * kk])
            x = torch.randn(3, 8, generator=shared)
            errs["row_parallel"] = rel_err(row(x[:, r * kk:(r + 1) * kk]), x @ full_w.T)
            cw = torch.randn(6 * W, 8, generator=shared)
            col.weight.copy_(cw[r * 6:(r + 1) * 6])
            xs = torch.randn(3 * W, 8, generator=shared)
            errs["column_parallel"] = rel_err(col(xs[r * 3:(r + 1) * 3]),
                                              (xs @ cw.T)[:, r * 6:(r + 1) * 6])
    finally:
        row.ctx.close()
        col.close()
    return errs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_op_family_on_two_groups_at_once(world4, layout):
    for errs in world4.run(_ops, layout, timeout=600):
        assert errs and all(e < 1e-5 for e in errs.values()), errs


def _signal_groups_of_two_stages(world):
    """Tensor-parallel groups {0, 1} / {2, 3} whose stages run different transports (only the
    first makes a signal group), then the data-parallel groups {0, 2} / {1, 3} make theirs:
    rank 0 has made one group more than rank 2 by then."""
    tp = [dist.new_group(ranks) for ranks in LAYOUTS["contiguous"]]
    dp = [dist.new_group(ranks) for ranks in LAYOUTS["interleaved"]]
    tpw = po.World.from_process_group(tp[world.rank // 2], backend="cpu")
    dpw = po.World.from_process_group(dp[world.rank % 2], backend="cpu")
    g = torch.Generator().manual_seed(world.rank + 3)
    ref = GEMM_PATTERNS["matmul_reduce_scatter"][1]
    stage = po.MatmulReduceScatter(tpw, 4, 6, transport=("signal_collective", "stores")[
        world.rank // 2])
    data = po.MatmulReduceScatter(dpw, 4, 6, transport="signal_collective")
    try:
        errs = []
        for ctx, w in ((stage, tpw), (data, dpw)):
            a, b, bias, res = pattern_inputs(g, 4, 6, 5, 2, torch.float32)
            errs.append(rel_err(po.matmul_reduce_scatter(a, b, ctx, bias=bias, residual=res),
                                ref(a, b, w.group, bias, res)))
        return errs
    finally:
        stage.close()
        data.close()


def test_signal_groups_when_the_groups_made_differ(world4):
    """torch names a group its members make alone by their ranks and the number of groups each
    process made: the data-parallel members made their signal group under different names and
    waited for each other in ``new_group`` for ever."""
    for errs in world4.run(_signal_groups_of_two_stages, timeout=120):
        assert all(e < 1e-5 for e in errs), errs


def _torch_fused_hosts(world):
    """Why torch's fused ops cannot run on a stand-in GPU world of this rank's group, with the
    job on one host (4 ranks on this one) and on two (2 on each)."""
    from portable_overlap.ops.torch_fused import unavailable_reason

    sw, _ = _subworld(world, "interleaved")
    why = []
    for local in (4, 2):
        gpu = SimpleNamespace(backend=SimpleNamespace(name="cuda"), rank=sw.rank,
                              world_size=sw.world_size, local_rank=world.rank % local,
                              local_world_size=local, group=sw.group, device=sw.device,
                              shares_devices=lambda: False)
        why.append(unavailable_reason(gpu, "all_gather_matmul"))
    return why


def test_torch_fused_on_a_group_of_a_job_on_one_host(world4):
    """A group of a job on one host is on that host (it was refused as spanning hosts, its
    size compared with the host's ranks); a group of a job on two hosts is taken to span them
    ({0, 2} does with two ranks per host, and was let through)."""
    for one_host, two_hosts in world4.run(_torch_fused_hosts):
        if one_host is not None and "symm_mem" in one_host:
            pytest.skip(f"this torch lacks the fused ops: {one_host}")
        assert one_host is None, one_host
        assert "more than one host (4 ranks in the job, 2 on this one; this world is 2" \
            in two_hosts, two_hosts


def _linears_given_contexts(world):
    """The parallel linears of the tensor-parallel world given contexts of the data-parallel
    world (as large, another process group): refused when the layer is made; a context made on
    another ``World`` of the layer's own group is taken, and the layer's result is torch's."""
    tp = [dist.new_group(ranks) for ranks in LAYOUTS["contiguous"]]
    dp = [dist.new_group(ranks) for ranks in LAYOUTS["interleaved"]]
    tpw = po.World.from_process_group(tp[world.rank // 2], backend="cpu")
    dpw = po.World.from_process_group(dp[world.rank % 2], backend="cpu")
    other = po.World.from_process_group(tp[world.rank // 2], backend="cpu")  # same group
    gemv, ar, ag = (po.GemvAllReduce(dpw, 12), po.MatmulAllReduce(dpw, 4, 12),
                    po.AllGatherMatmul(dpw, 3 * 8))
    msgs = []
    for make in (lambda: po.RowParallelLinear(8, 12, tpw, ctx=gemv),
                 lambda: po.RowParallelLinear(8, 12, tpw, reduce_ctx=ar),
                 lambda: po.ColumnParallelLinear(8, 12, tpw, max_rows=3, ctx=ag)):
        try:
            layer = make()
            msgs.append(None)
            layer.close()
        except ValueError as e:
            msgs.append(str(e))
    for c in (gemv, ar, ag):
        c.close()
    own = po.GemvAllReduce(other, 12)
    try:
        lin = po.RowParallelLinear(8, 12, tpw, ctx=own, dtype=torch.float32)
        r = tpw.rank
        full_w = torch.randn(12, 8, generator=torch.Generator().manual_seed(world.rank // 2))
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(world.rank // 2 + 9))
        with torch.no_grad():
            lin.weight.copy_(full_w[:, r * 4:(r + 1) * 4])
            err = rel_err(lin(x[:, r * 4:(r + 1) * 4]), x @ full_w.T)
    finally:
        own.close()
    return msgs, err


def test_linears_refuse_a_context_of_another_group(world4):
    """A context of the data-parallel group in a tensor-parallel layer summed or gathered the
    other group's shards: relative errors of 0.8 to 1.3 on every rank, no error."""
    for msgs, err in world4.run(_linears_given_contexts):
        assert len(msgs) == 3 and all(
            m is not None and "was made on another world than the layer's" in m
            for m in msgs), msgs
        assert err < 1e-5, err
