"""Every fused op once on 8 CPU-emulated ranks (small shapes: the interpreter runs 8 processes on
a 2-core CI machine), against its torch reference. The 2- and 4-rank suites cover the cases; this
file only checks that nothing assumes W <= 4 (block splits with empty blocks, peer loops, tags)."""
import torch

import portable_overlap as po
from portable_overlap import (AllGatherMatmul, EmbeddingAllToAll, GemvAllReduce,
                              MoeGemmCombine, SignalConfig, embedding_all_to_all_reference,
                              gemv_all_reduce_reference)
from portable_overlap.ops.gemm_alltoall import GemmAllToAll
from portable_overlap.ops.gemm_signal import (GemmSignal, gemm_all_reduce_reference,
                                              gemm_all_to_all_signal_reference,
                                              gemm_reduce_scatter_reference)
from portable_overlap.ops.matmul_reduce import MatmulReduce
from portable_overlap.ops.allgather_gemm import SCHEDULES, all_gather_matmul_reference
from portable_overlap.ops.gemm_alltoall import gemm_all_to_all_reference
from portable_overlap.ops.matmul import MatmulConfig
from portable_overlap.ops.matmul_reduce import (matmul_all_reduce_reference,
                                                matmul_reduce_scatter_reference)
from portable_overlap.ops.moe_combine import moe_gemm_combine_reference
from portable_overlap.ops.moe_dispatch import MoeDispatch, moe_dispatch_reference
from portable_overlap.testing.compare import rel_err

SMALL = MatmulConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1)


def _every_op(world):
    W, r = world.world_size, world.rank
    g = torch.Generator().manual_seed(50 + r)
    errs = {}
    ctx = GemvAllReduce(world, max_n=24)
    x, w = torch.randn(3, 8, generator=g), torch.randn(24, 8, generator=g)
    errs["gemv+allreduce"] = rel_err(ctx(x, w), gemv_all_reduce_reference(x, w, world.group))
    ctx.close()
    a, b = torch.randn(2 * W, 8, generator=g), torch.randn(8, 12, generator=g)
    for transport in ("stores", "copy_engine"):
        ctx = GemmAllToAll(world, max_elems=2 * W * 12, config=SMALL, transport=transport)
        errs[f"gemm+a2a {transport}"] = rel_err(ctx(a, b),
                                             gemm_all_to_all_reference(a, b, world.group))
        ctx.close()
    S, k = 5 + r % 3, 2  # ranks hold different token counts
    ids = torch.rand(S, W, generator=g).topk(k, dim=1).indices  # one expert per rank
    tokens, tw = torch.randn(S, 8, generator=g), torch.rand(S, k, generator=g)
    we = torch.randn(1, 8, 16, generator=g)
    xr, counts, slots = moe_dispatch_reference(tokens, ids, 1, world.group)
    ctx = MoeGemmCombine(world, max_tokens=8, top_k=k, hidden=16, experts_per_rank=1,
                         config=SMALL)
    out = ctx(xr, we, counts, slots, tw)
    ctx.synchronize()
    errs["moe combine"] = rel_err(out, moe_gemm_combine_reference(xr, we, counts, slots, tw,
                                                                world.group))
    ctx.close()
    # the dispatch with a token sent once per rank it reaches (top-4 of 2 experts per rank)
    ids = torch.rand(S, 2 * W, generator=g).topk(4, dim=1).indices
    ctx = MoeDispatch(world, max_tokens=8, top_k=4, hidden=8, experts_per_rank=2,
                      dtype=torch.float32, dedup=True)
    x, counts, slots = ctx(tokens, ids)
    ctx.synchronize()
    xr, cr, sr = moe_dispatch_reference(tokens, ids, 2, world.group)
    R = xr.shape[0]
    same = torch.equal(counts, cr) and torch.equal(slots[:R], sr) and torch.equal(x[:R], xr)
    errs["moe dispatch dedup"] = 0.0 if same else float("inf")
    ctx.close()
    # the torch dispatch as a transport, and "auto" between it and the stores (one set of
    # buffers for both, one timed run each)
    for transport, opts in (("sequential", {}), ("auto", dict(iters=1, warmup=0))):
        ctx = MoeDispatch(world, max_tokens=8, top_k=4, hidden=8, experts_per_rank=2,
                          dtype=torch.float32, transport=transport, **opts)
        ctx.recv.fill_(float("nan"))
        x, counts, slots = ctx(tokens, ids)
        ctx.synchronize()
        same = torch.equal(counts, cr) and torch.equal(slots[:R], sr) and torch.equal(x[:R], xr)
        errs[f"moe dispatch {transport}"] = 0.0 if same else float("inf")
        ctx.close()
    ctx = EmbeddingAllToAll(world, [6] * W, 8, max_local_batch=2, block_b=2)
    splits = [2] * W
    lengths = torch.randint(0, 3, (ctx.n_loc * 2 * W,), generator=g)
    idx = torch.randint(0, 6, (int(lengths.sum()),), generator=g)
    wt = torch.randn(ctx.weight_rows, 8, generator=g)
    out = ctx(wt, lengths, idx, batch_splits=splits)
    errs["embedding+a2a"] = rel_err(out, embedding_all_to_all_reference(
        wt, lengths, idx, None, ctx.plan, r, splits, "sum", world.group))
    ctx.close()
    # the plain path (lookup, then all_to_all_single), an uneven split with empty ranks, and
    # "auto" choosing between it and the fused kernel (one timed run each)
    splits = [1, 0, 2, 1, 0, 2, 1, 1][:W]
    for transport, opts in (("sequential", {}), ("auto", dict(iters=1, warmup=0))):
        ctx = EmbeddingAllToAll(world, [6] * W, 8, max_local_batch=2, transport=transport,
                                **opts)
        lengths = torch.randint(0, 3, (ctx.n_loc * sum(splits),), generator=g)
        idx = torch.randint(0, 6, (int(lengths.sum()),), generator=g)
        out = ctx(wt, lengths, idx, batch_splits=splits)
        errs[f"embedding+a2a {transport}"] = rel_err(out, embedding_all_to_all_reference(
            wt, lengths, idx, None, ctx.plan, r, splits, "sum", world.group))
        ctx.close()
    # every schedule, not only the one pick_schedule gives these tiny shapes: they walk the
    # peers' pieces in different orders and layouts. 3 rows in 4 pieces, the first one empty
    # (the default, W pieces, costs twice the interpreted flag waits for the same edge case).
    # The 2-D ones cut K = 7 into 4 column pieces. One call costs about 2 s here.
    ctx = AllGatherMatmul(world, max_shard_elems=3 * 7, transport="copy_engine", pieces=4)
    a, b = torch.randn(3, 7, generator=g), torch.randn(7, 5, generator=torch.Generator())
    ref = all_gather_matmul_reference(a, b, world.group)
    for sched in SCHEDULES:
        out = ctx(a, b, schedule=sched)
        ctx.synchronize()
        errs[f"allgather+gemm {sched}"] = rel_err(out, ref)
    ctx.close()
    # the SM-store transport: 3-row shards in 16-row tiles (every tile holds rows of several
    # ranks, so it waits for several peers' chunks), two calls on one context
    ctx = AllGatherMatmul(world, max_shard_elems=3 * 7, transport="stores")
    for i in range(2):
        out = ctx(a, b)
        ctx.synchronize()
        errs[f"allgather+gemm stores #{i}"] = rel_err(out, ref)
    ctx.close()
    # K split over the ranks, each rank's shard of its own width (only M and N must agree).
    # reduce_scatter: 2 rows per rank in 3 pieces (one empty); all_reduce with M=5 < W: rank
    # blocks of 0 and 1 rows (the receive room of a call is W * ceil(M/W) * N elements).
    room = max(MatmulReduce.elems_needed(M, 7, W) for M in (2 * W, 5))
    ctx = MatmulReduce(world, max_elems=room, pieces=3)
    for mode, M, ref_fn in (("reduce_scatter", 2 * W, matmul_reduce_scatter_reference),
                            ("all_reduce", 5, matmul_all_reduce_reference)):
        a = torch.randn(M, 3 + r, generator=g)
        b = torch.randn(7, 3 + r, generator=g).t()  # a transposed weight view
        out = getattr(ctx, mode)(a, b)
        ctx.synchronize()
        errs[f"matmul+{mode} copy engine"] = rel_err(out, ref_fn(a, b, world.group))
    ctx.close()
    # the SM-store transport, the same cases: 2-row blocks in 16-row tiles, and 5 rows over 8
    # ranks (three ranks own no row, the others one)
    for pattern, mode, M, ref_fn in (
            (po.MatmulReduceScatter, "reduce_scatter", 2 * W, matmul_reduce_scatter_reference),
            (po.MatmulAllReduce, "all_reduce", 5, matmul_all_reduce_reference)):
        ctx = pattern(world, M, 7, transport="stores")
        a = torch.randn(M, 3 + r, generator=g)
        b = torch.randn(7, 3 + r, generator=g).t()
        out = ctx(a, b)
        ctx.synchronize()
        errs[f"matmul+{mode} stores"] = rel_err(out, ref_fn(a, b, world.group))
        ctx.close()
    ctx = GemmSignal(world, config=SignalConfig(matmul=SMALL))
    a, b = torch.randn(9, 8, generator=g), torch.randn(8, 12, generator=g)
    for i in range(2):  # the second call of a plan waits on the group counters
        errs[f"gemm+allreduce signal #{i}"] = rel_err(ctx.all_reduce(a, b),
                                                   gemm_all_reduce_reference(a, b, world.group))
    # the kinds with one destination per rank: 2 of the 16 rows each (one tile row per
    # destination), odd N and K. Twice as well: with 8 destinations the counters wait for
    # groups of 8-tile multiples, which only the second (guarded) call checks.
    a, b = torch.randn(2 * W, 5, generator=g), torch.randn(5, 13, generator=g)
    for kind, ref_fn in (("reduce_scatter", gemm_reduce_scatter_reference),
                         ("all_to_all", gemm_all_to_all_signal_reference)):
        for i in range(2):
            errs[f"gemm+{kind} signal #{i}"] = rel_err(getattr(ctx, kind)(a, b),
                                                   ref_fn(a, b, world.group))
    ctx.close()
    return errs


# one entry per op / variant above: a key reused by mistake would overwrite another's error
# (22 plus one per AllGather+GEMM schedule)
N_CHECKS = 22 + len(SCHEDULES)


def test_every_op_on_eight_ranks(world8):
    for errs in world8.run(_every_op, timeout=540):
        assert len(errs) == N_CHECKS and all(e < 1e-5 for e in errs.values()), errs
