"""GPU checks of the backend primitives and of fused GEMV + AllReduce, run by ci/gpu.sh under
torchrun (2 ranks or more):

    torchrun --nproc-per-node 2 tests/gpu/gpu_checks.py
    PO_HOST_GROUP=gloo torchrun --nproc-per-node 2 tests/gpu/gpu_checks.py   # both on one GPU

Each check prints ``PASS``/``FAIL`` on rank 0; the exit code is 1 if any failed on any rank.
(Not collected by pytest: it needs one process per GPU.)
"""
from __future__ import annotations

import itertools
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist

from portable_overlap.testing.check_log import CheckLog
from portable_overlap.testing.graphs import worst_over_graph_replays
from portable_overlap.testing.streams import calls_on_three_streams
from portable_overlap import (GemvAllReduce, PeerTimeoutError, PortableOverlapError, World,
                              gemv_all_reduce, gemv_all_reduce_reference, moe_dispatch)
from portable_overlap.testing.compare import rel_err

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
LOG = CheckLog(45)
results, record = LOG.results, LOG.record


def rank_gpus(world: World) -> list:
    """Every rank's GPU as (host, device index), gathered once per world: two ranks may share
    one (``PO_HOST_GROUP=gloo``)."""
    if getattr(world, "_check_gpus", None) is None:
        world._check_gpus = world.all_gather_object((socket.gethostname(), world.device.index))
    return world._check_gpus


#: transports that move their data in the process group's collectives
HOST_COLLECTIVE = ("signal_collective", "sequential")


def host_collectives_captured(world: World) -> bool:
    """Whether the process group's collectives can be captured in a CUDA graph: NCCL's (RCCL's)
    can; gloo's (``PO_HOST_GROUP=gloo``) run on the host, and capturing one invalidates the
    capture."""
    return world.world_size == 1 or dist.get_backend(world.group) == "nccl"


def same_on_all_ranks(world: World, y: torch.Tensor) -> bool:
    gathered = [torch.empty_like(y) for _ in range(world.world_size)]
    dist.all_gather(gathered, y.contiguous(), group=world.group)
    return all(torch.equal(g.view(torch.uint8), gathered[0].view(torch.uint8)) for g in gathered)


def rand(shape, dtype, device, gen):
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def moe_routing(world: World, kind: str, S: int, E_total: int, k: int, seed: int):
    """Top-k expert ids [S, k] on ``world``'s device: uniform scores, "skewed" (a falling ramp:
    the first experts get most tokens) or "one_rank" (every token to the last rank's experts)."""
    dev, W = world.device, world.world_size
    g = torch.Generator(device=dev).manual_seed(seed)
    scores = torch.rand(S, E_total, generator=g, device=dev)
    if kind == "skewed":
        scores = scores * torch.linspace(4, 0.1, E_total, device=dev)
    elif kind == "one_rank":
        scores[:, : E_total - E_total // W] = -1
    return scores.topk(k, dim=1).indices


def check_backend(world: World, gen) -> None:
    """IPC-opened peer memory, copy-engine copies into it, and stream wait/write on a flag."""
    from portable_overlap.shmem import SymmetricHeap

    be = world.backend
    heap = SymmetricHeap(world, 1 << 20)
    try:
        _check_backend(world, gen, be, heap)
    finally:
        heap.close()


def _check_backend(world, gen, be, heap) -> None:
    buf = heap.alloc((1024,), torch.float32)
    flag = heap.alloc((4,), torch.int32)
    src = rand((1024,), torch.float32, world.device, gen)
    peer = (world.rank + 1) % world.world_size
    # the peer's GPU, which is this one where ranks share a GPU (PO_HOST_GROUP=gloo)
    peer_gpu = rank_gpus(world)[peer]
    # copy engine: my src -> the next rank's buf
    be.copy_async(heap.peer_address(buf, peer), src.data_ptr(), src.numel() * 4,
                  be.current_stream(world.device))
    torch.cuda.synchronize()
    world.barrier()
    got = world.all_gather_object(src.cpu())[(world.rank - 1) % world.world_size]
    record("backend: copy engine into a peer's heap", torch.equal(buf.cpu(), got))
    # 2-D copy: columns 3..10 of my [32, 24] matrix into columns 5..12 of the next rank's
    # [32, 40] one (pitches 96 and 160 bytes); the columns around the block must stay -1
    mat = heap.alloc((32, 40), torch.float32)
    mat.fill_(-1.0)
    src2 = rand((32, 24), torch.float32, world.device, gen)
    torch.cuda.synchronize()
    world.barrier()  # every peer's -1 is in place before anyone copies into it
    be.copy_2d_async(heap.peer_address(mat[:, 5:], peer), 40 * 4, src2[:, 3:].data_ptr(),
                     24 * 4, 8 * 4, 32, be.current_stream(world.device))
    torch.cuda.synchronize()
    world.barrier()
    got2 = world.all_gather_object(src2.cpu())[(world.rank - 1) % world.world_size]
    want2 = torch.full((32, 40), -1.0)
    want2[:, 5:13] = got2[:, 3:11]
    record("backend: 2-D copy engine into a peer's heap", torch.equal(mat.cpu(), want2))
    # stream wait-value: a side stream holds a copy until another stream writes the flag. Both
    # are created streams: the legacy default stream would wait for the held one (deadlock).
    dst = torch.zeros_like(src)
    side, main = torch.cuda.Stream(), torch.cuda.Stream()
    # Load every kernel used below before any stream is held: with CUDA's lazy module loading,
    # the first launch of a kernel waits for the device, which a held stream never releases
    # (without this warm-up the check hung twice on nvidia-h200-x2).
    torch.cuda._sleep(1)
    dst.copy_(src)
    dst.clone()
    dst.zero_()
    torch.cuda.synchronize()
    be.stream_wait_value(side.cuda_stream, flag.data_ptr(), 1)
    with torch.cuda.stream(side):
        dst.copy_(src)
    with torch.cuda.stream(main):
        torch.cuda._sleep(10_000_000)  # ~5 ms of spinning before the flag is written
        early = dst.clone()  # ordered before the flag: the copy must not have happened yet
    be.stream_write_value(main.cuda_stream, flag.data_ptr(), 1)
    torch.cuda.synchronize()
    access = ("the same GPU" if peer_gpu == rank_gpus(world)[world.rank]
              else be.can_access_peer(world.device, torch.device('cuda', peer_gpu[1])))
    record("backend: stream wait-value gates a copy", torch.equal(dst, src)
           and not torch.equal(early, src), f"peer access={access}")


def check_shapes(world: World, ctx: GemvAllReduce, gen) -> None:
    shapes = [(1, 8192, 14336), (8, 4096, 7168), (32, 8192, 4096), (64, 1000, 333),
              (3, 77, 1030), (17, 4099, 2049), (1, 16, 16), (5, 1, 7)]
    for M, N, K in shapes:
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            x, w = rand((M, K), dt, world.device, gen), rand((N, K), dt, world.device, gen)
            out = torch.full((M, N), float("nan"), dtype=dt, device=world.device)
            ctx(x, w, out=out)
            ctx.synchronize()
            err = rel_err(out, gemv_all_reduce_reference(x, w, world.group))
            same = same_on_all_ranks(world, out)
            record(f"shape M={M} N={N} K={K} {str(dt)[6:]}", err < TOL[dt] and same,
                   f"rel_err={err:.2e} identical_on_ranks={same}")


def check_back_to_back(world: World, ctx: GemvAllReduce, gen, calls: int = 1000) -> None:
    N, K = 4096, 2048
    w = rand((N, K), torch.bfloat16, world.device, gen)
    ms = torch.randint(1, 65, (calls,), generator=torch.Generator().manual_seed(7)).tolist()
    xs = [rand((m, K), torch.bfloat16, world.device, gen) for m in ms]
    outs = [torch.full((m, N), float("nan"), dtype=torch.bfloat16, device=world.device) for m in ms]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for x, o in zip(xs, outs):
        ctx(x, w, out=o)
    ctx.synchronize()
    dt = time.perf_counter() - t0
    worst = max(rel_err(o, gemv_all_reduce_reference(x, w, world.group)) for x, o in zip(xs, outs))
    record(f"{calls} back-to-back calls, random M", worst < TOL[torch.bfloat16],
           f"worst rel_err={worst:.2e}, {dt / calls * 1e6:.1f} us/call")


def check_graph(world: World, ctx: GemvAllReduce, gen, replays: int = 100) -> None:
    M, N, K = 8, 4096, 7168
    x = rand((M, K), torch.bfloat16, world.device, gen)
    w = rand((N, K), torch.bfloat16, world.device, gen)
    out = torch.empty((M, N), dtype=torch.bfloat16, device=world.device)
    ctx(x, w, out=out)  # plan + compile outside the capture
    ctx.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ctx(x, w, out=out)
    worst, same = 0.0, True
    for _ in range(replays):
        x.copy_(rand((M, K), torch.bfloat16, world.device, gen))
        out.fill_(float("nan"))
        g.replay()
        ctx.synchronize()
        worst = max(worst, rel_err(out, gemv_all_reduce_reference(x, w, world.group)))
        same &= same_on_all_ranks(world, out)
    record(f"CUDA graph: {replays} replays, changing inputs", worst < 1e-2 and same,
           f"worst rel_err={worst:.2e} identical_on_ranks={same}")


def check_compile(world: World, ctx: GemvAllReduce, gen) -> None:
    M, N, K = 4, 2048, 1024
    w = rand((N, K), torch.bfloat16, world.device, gen)

    def f(x):
        return torch.relu(gemv_all_reduce(x * 2, w, ctx)) + 1

    cf = torch.compile(f, fullgraph=True)
    x = rand((M, K), torch.bfloat16, world.device, gen)
    y = cf(x)
    ctx.synchronize()
    ref = torch.relu(gemv_all_reduce_reference(x * 2, w, world.group)) + 1
    err = rel_err(y, ref)
    record("torch.compile(fullgraph=True)", err < 1e-2, f"rel_err={err:.2e}")


def check_gemm_alltoall(world: World, gen) -> None:
    """Dense GEMM + All-to-All, both transports: odd shapes, repeated calls, graph replays."""
    from portable_overlap.ops.gemm_alltoall import GemmAllToAll, gemm_all_to_all_reference

    W = world.world_size
    shapes = [(4096, 4096, 4096), (1000 * W, 777, 333), (64 * W, 4096, 2048), (3 * W, 5, 7)]
    for transport in ("stores", "copy_engine"):
        ctx = GemmAllToAll(world, max_elems=max(m * n for m, n, _ in shapes), transport=transport)
        try:
            for M, N, K in shapes:
                for dt in (torch.bfloat16, torch.float16, torch.float32):
                    a, b = rand((M, K), dt, world.device, gen), rand((K, N), dt, world.device, gen)
                    out = torch.full((M, N), float("nan"), dtype=dt, device=world.device)
                    for _ in range(3):  # repeated calls reuse the receive buffer
                        ctx(a, b, out=out)
                    ctx.synchronize()
                    err = rel_err(out, gemm_all_to_all_reference(a, b, world.group))
                    record(f"gemm+a2a[{transport}] {M}x{N}x{K} {str(dt)[6:]}",
                           err < TOL[dt] * 2, f"rel_err={err:.2e}")
            # graph replays with inputs changing between replays
            M, N, K = 2048 * W, 1024, 512
            a = rand((M, K), torch.bfloat16, world.device, gen)
            b = rand((K, N), torch.bfloat16, world.device, gen)
            out = torch.empty(M, N, dtype=torch.bfloat16, device=world.device)
            worst = worst_over_graph_replays(
                ctx, lambda: ctx(a, b, out=out), a, out,
                lambda: gemm_all_to_all_reference(a, b, world.group), gen, 20)
            record(f"gemm+a2a[{transport}] 20 graph replays", worst < TOL[torch.bfloat16] * 2,
                   f"worst rel_err={worst:.2e}")
        finally:
            ctx.close()


def check_moe_combine(world: World, gen) -> None:
    """MoE expert GEMM + combine: the zero-copy stores with each walk, the sequential transport
    and ``"auto"``: ranks with different token counts, uniform and skewed routing, every dtype,
    repeated calls, graph replays with fixed routing (the sequential transport must refuse the
    capture). The "shmem" transport's run of the same check is one of the SHMEM checks
    (``main``)."""
    for transport, walk in (("stores", "auto"), ("stores", "sources"), ("stores", "experts"),
                            ("sequential", "auto"), ("auto", "auto")):
        _guarded(_check_moe_combine, world, gen, transport, walk)


def _check_moe_combine(world, gen, transport, walk):
    from portable_overlap.ops.moe_combine import MoeGemmCombine, moe_gemm_combine_reference
    from portable_overlap.ops.moe_dispatch import moe_dispatch_reference

    W, dev = world.world_size, world.device
    H, I, El, k = 1024, 768, 4, 2
    ctx = MoeGemmCombine(world, max_tokens=4096, top_k=k, hidden=H, experts_per_rank=El,
                         transport=transport, walk=walk)
    name = transport if walk == "auto" else f"{transport}, {walk}"
    try:
        # S = 5 and 100 are decode sizes: the "auto" walk goes expert by expert there
        for S, kind in ((4096 - 777 * world.rank, "uniform"), (3000, "skewed"), (5, "uniform"),
                        (100, "skewed")):
            for dt in (torch.bfloat16, torch.float16, torch.float32):
                g = torch.Generator(device=dev).manual_seed(7 * S + world.rank)
                scores = torch.rand(S, El * W, generator=g, device=dev)
                if kind == "skewed":  # most tokens pick the first experts
                    scores = scores * torch.linspace(4, 0.1, El * W, device=dev)
                ids = scores.topk(k, dim=1).indices
                tokens = rand((S, I), dt, dev, gen)
                w = rand((El, I, H), dt, dev, gen) / I ** 0.5
                tw = torch.softmax(torch.randn(S, k, generator=g, device=dev), 1)
                x, counts, slots = moe_dispatch_reference(tokens, ids, El, world.group)
                out = torch.full((S, H), float("nan"), dtype=dt, device=dev)
                for _ in range(3):
                    ctx(x, w, counts, slots, tw, out=out)
                ctx.synchronize()
                err = rel_err(out, moe_gemm_combine_reference(x, w, counts, slots, tw,
                                                              world.group))
                record(f"moe[{name}] S={S} {kind} {str(dt)[6:]}", err < TOL[dt] * 2,
                       f"rel_err={err:.2e} rows={x.shape[0]}")
        out.fill_(float("nan"))
        graph = torch.cuda.CUDAGraph()
        if transport == "sequential":  # the splits are read on the host: it must refuse
            try:
                with torch.cuda.graph(graph):
                    ctx(x, w, counts, slots, tw, out=out)
                record(f"moe[{name}] refuses graph capture", False, "it was captured")
            except RuntimeError as e:
                record(f"moe[{name}] refuses graph capture", "cannot be captured" in str(e),
                       str(e)[:100])
            return
        with torch.cuda.graph(graph):
            ctx(x, w, counts, slots, tw, out=out)
        ref = moe_gemm_combine_reference(x, w, counts, slots, tw, world.group)
        worst = 0.0
        for _ in range(10):
            out.fill_(float("nan"))
            graph.replay()
            ctx.synchronize()
            worst = max(worst, rel_err(out, ref))
        record(f"moe[{name}] 10 graph replays", worst < TOL[torch.float32] * 2,
               f"worst rel_err={worst:.2e} picks={ctx.choices(x, w, counts, slots, tw, out)}")
    finally:
        ctx.close()


def check_moe_dispatch(world: World, gen) -> None:
    """Device-initiated MoE dispatch against the all_to_all reference (rows, counts and slots
    equal), on contexts of the library's default transport ("auto" on a GPU world; each check
    names what ran): ranks with different token counts, uniform / skewed / one-rank routing,
    every dtype, int32 ids; graph replays with new routing each (the dispatch alone, and
    dispatch + combine in one graph); an id out of range raises on every rank, and the next call
    is right, on "stores", "sequential" and "auto"."""
    from portable_overlap import InvalidInputError
    from portable_overlap.ops.moe_combine import MoeGemmCombine, moe_gemm_combine_reference
    from portable_overlap.ops.moe_dispatch import MoeDispatch, moe_dispatch_reference

    W, r, dev = world.world_size, world.rank, world.device

    def same(got, ref):
        x, counts, slots = got
        xr, cr, sr = ref
        R = xr.shape[0]
        return (torch.equal(counts, cr) and torch.equal(slots[:R], sr)
                and torch.equal(x[:R], xr)), R

    for (S, H, El, k, kind, dt), dedup in itertools.product(
            ((4096 - 777 * r, 7168, 8, 8, "uniform", torch.bfloat16),
             (3000, 1000, 4, 2, "skewed", torch.float16),
             (5 * r, 33, 2, 2, "one_rank", torch.float32),
             # k = 6 does not divide the 64-slot block: tokens straddle two programs' blocks
             (4000 - 501 * r, 2048, 16, 6, "uniform", torch.bfloat16)), (False, True)):
        # (the library's default: "auto" on a GPU world, which times "stores" and "sequential")
        ctx = MoeDispatch(world, max_tokens=4096, top_k=k, hidden=H, experts_per_rank=El,
                          dtype=dt, dedup=dedup)
        try:
            for call in range(3):
                ids = moe_routing(world, kind, S, El * W, k, 10 * call + r)
                if call == 2:
                    ids = ids.to(torch.int32)
                tokens = rand((S, H), dt, dev, gen)
                ctx.recv.fill_(float("nan"))
                if dedup and W > 1:
                    ctx.kernel().rows_once.fill_(float("nan"))
                got = moe_dispatch(tokens, ids, ctx)
                ctx.synchronize()
                ok, R = same(got, moe_dispatch_reference(tokens, ids, El, world.group))
                record(f"moe_dispatch S={S} H={H} {kind} {str(dt)[6:]} dedup={dedup} "
                       f"call {call}", ok, f"rows={R} runs {ctx.choices(tokens, ids)}")
        finally:
            ctx.close()
    # graph replays: new routing and tokens copied into the captured inputs before each (a
    # token sent once per rank: the receiver's copies are captured too)
    S, H, I, El, k = 2048, 1024, 512, 4, 4
    disp = MoeDispatch(world, max_tokens=S, top_k=k, hidden=I, experts_per_rank=El,
                       dtype=torch.bfloat16, dedup=True)
    comb = MoeGemmCombine(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El)
    try:
        tokens = rand((S, I), torch.bfloat16, dev, gen)
        ids = moe_routing(world, "uniform", S, El * W, k, 99 + r)
        w = rand((El, I, H), torch.bfloat16, dev, gen) / I ** 0.5
        tw = torch.softmax(rand((S, k), torch.float32, dev, gen), 1)
        out = torch.empty(S, H, dtype=torch.bfloat16, device=dev)

        def layer():
            x, counts, slots = moe_dispatch(tokens, ids, disp)
            comb(x, w, counts, slots, tw, out=out)

        layer()
        disp.synchronize()
        comb.synchronize()
        g_disp, g_layer = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g_disp):
            moe_dispatch(tokens, ids, disp)
        with torch.cuda.graph(g_layer):
            layer()
        bad_disp, worst = 0, 0.0
        for rep in range(10):
            kind = ("uniform", "skewed", "one_rank")[rep % 3]
            ids.copy_(moe_routing(world, kind, S, El * W, k, 1000 + 7 * rep + r))
            tokens.copy_(rand((S, I), torch.bfloat16, dev, gen))
            disp.recv.fill_(float("nan"))
            g_disp.replay()
            disp.synchronize()
            ref = moe_dispatch_reference(tokens, ids, El, world.group)
            bad_disp += not same((disp.recv, disp.counts, disp.recv_slots), ref)[0]
            out.fill_(float("nan"))
            g_layer.replay()
            comb.synchronize()
            disp.synchronize()
            worst = max(worst, rel_err(out, moe_gemm_combine_reference(*ref[:1], w, *ref[1:],
                                                                       tw, world.group)))
        record("moe_dispatch 10 graph replays, new routing each", bad_disp == 0,
               f"{bad_disp} wrong")
        record("moe_dispatch + combine in one graph, 10 replays", worst < TOL[torch.bfloat16] * 2,
               f"worst rel_err={worst:.2e}")
    finally:
        comb.close()
        disp.close()
    # an id out of range on the last rank: every rank raises for that call; the next is right.
    # Named "stores", named "sequential", and "auto" at a decided key (a good call first; at an
    # undecided key the planner's timed runs would meet the fault instead)
    for transport in ("stores", "sequential", "auto"):
        ctx = MoeDispatch(world, max_tokens=64, top_k=2, hidden=64, experts_per_rank=2,
                          dtype=torch.float32, transport=transport)
        try:
            tokens = rand((64, 64), torch.float32, dev, gen)
            if transport == "auto":
                moe_dispatch(tokens, moe_routing(world, "uniform", 64, 2 * W, 2, 4 + r), ctx)
                ctx.synchronize()
            ids = moe_routing(world, "uniform", 64, 2 * W, 2, 5 + r)
            if r == W - 1:
                ids[7, 1] = 2 * W + 3
            try:
                moe_dispatch(tokens, ids, ctx)
                ctx.synchronize()
                res = "no error"
            except (InvalidInputError, ValueError) as e:  # (the fused / the torch path's)
                res = str(e)
            ids = moe_routing(world, "uniform", 64, 2 * W, 2, 6 + r)
            got = moe_dispatch(tokens, ids, ctx)
            ctx.synchronize()
            ok, _ = same(got, moe_dispatch_reference(tokens, ids, 2, world.group))
            raised = world.all_gather_object("expert id" in res)
            record(f"moe_dispatch {transport} (runs {ctx.choice(tokens, ids)}): bad id raises "
                   f"on every rank, next call right", all(raised) and ok,
                   res.splitlines()[-1][:120])
        finally:
            ctx.close()


def _check_moe_dispatch_shmem(world: World, gen) -> None:
    """The dispatch's ``"shmem"`` transport (NVSHMEM / ROC_SHMEM puts) against the reference:
    the routings of the stores check, 3 calls each; a bad id raises on every rank and the next
    call is right; the fused dispatch + GEMM refused; 5 graph replays with new routing. SKIP
    where no library is usable or the world has one rank (every rank raises the same
    ShmemUnavailable, before anything is allocated)."""
    from portable_overlap import InvalidInputError
    from portable_overlap.ops.moe_dispatch import MoeDispatch, moe_dispatch_reference
    from portable_overlap.shmem.providers import ShmemUnavailable

    W, r, dev = world.world_size, world.rank, world.device

    def same(got, ref):
        R = ref[0].shape[0]
        return (torch.equal(got[1], ref[1]) and torch.equal(got[2][:R], ref[2])
                and torch.equal(got[0][:R], ref[0]))

    def make(**kw):
        return MoeDispatch(world, transport="shmem", **kw)

    try:
        make(max_tokens=8, top_k=1, hidden=8, experts_per_rank=1,
             dtype=torch.float32).close()
    except ShmemUnavailable as e:
        LOG.skip("moe_dispatch[shmem]", str(e)[:500])
        return
    for S, H, El, k, kind, dt in ((4096 - 777 * r, 7168, 8, 8, "uniform", torch.bfloat16),
                                  (3000, 1000, 4, 2, "skewed", torch.float16),
                                  (5 * r, 33, 2, 2, "one_rank", torch.float32)):
        ctx = make(max_tokens=4096, top_k=k, hidden=H, experts_per_rank=El, dtype=dt)
        try:
            for call in range(3):
                ids = moe_routing(world, kind, S, El * W, k, 10 * call + r)
                tokens = rand((S, H), dt, dev, gen)
                ctx.recv.fill_(float("nan"))
                got = moe_dispatch(tokens, ids, ctx)
                ctx.synchronize()
                record(f"moe_dispatch[shmem] S={S} H={H} {kind} {str(dt)[6:]} call {call}",
                       same(got, moe_dispatch_reference(tokens, ids, El, world.group)))
        finally:
            ctx.close()
    S, H, El, k = 512, 1024, 4, 4
    ctx = make(max_tokens=S, top_k=k, hidden=H, experts_per_rank=El, dtype=torch.bfloat16)
    try:
        tokens = rand((S, H), torch.bfloat16, dev, gen)
        ids = moe_routing(world, "uniform", S, El * W, k, 5 + r)
        if r == W - 1:
            ids[7, 1] = El * W + 3
        try:
            moe_dispatch(tokens, ids, ctx)
            ctx.synchronize()
            res = "no error"
        except InvalidInputError as e:
            res = str(e)
        try:
            ctx.dispatch_swiglu(tokens, ids, rand((El, H, 64), torch.bfloat16, dev, gen),
                                rand((El, H, 64), torch.bfloat16, dev, gen))
            swiglu = "no error"
        except ValueError as e:
            swiglu = str(e)
        ids = moe_routing(world, "uniform", S, El * W, k, 6 + r)
        got = moe_dispatch(tokens, ids, ctx)
        ctx.synchronize()
        ok = same(got, moe_dispatch_reference(tokens, ids, El, world.group))
        raised = world.all_gather_object("expert id" in res and "'stores'" in swiglu)
        record("moe_dispatch[shmem] bad id and dispatch_swiglu raise on every rank, next call "
               "right", all(raised) and ok, res.splitlines()[-1][:120])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            moe_dispatch(tokens, ids, ctx)
        bad = 0
        for rep in range(5):
            kind = ("uniform", "skewed", "one_rank")[rep % 3]
            ids.copy_(moe_routing(world, kind, S, El * W, k, 2000 + 7 * rep + r))
            tokens.copy_(rand((S, H), torch.bfloat16, dev, gen))
            ctx.recv.fill_(float("nan"))
            graph.replay()
            ctx.synchronize()
            bad += not same((ctx.recv, ctx.counts, ctx.recv_slots),
                            moe_dispatch_reference(tokens, ids, El, world.group))
        record("moe_dispatch[shmem] 5 graph replays, new routing each", bad == 0, f"{bad} wrong")
    finally:
        ctx.close()


def check_moe_layer(world: World, gen) -> None:
    """The fused ExpertParallelMoE against its torch path (same weights), eager and as 10
    replays of one CUDA graph with new tokens each (so new routing: no host sync anywhere),
    with its staged launches and in one launch, at a prefill and a decode size."""
    H, I, E, k = 1024, 768, 4 * world.world_size, 4
    # a prefill size, and a decode size (other tiles: 64-row, the down GEMM walked by experts)
    for S, what in ((1536, ""), (48, " (decode)")):
        for opts, form in (({}, "fused"), ({"dedup": True}, "fused, dedup"),
                           ({"one_launch": True}, "one launch")):
            _moe_layer_case(world, gen, H, I, E, k, S, opts, f"{form}{what}")
    for form in (None, "fuse_dispatch", "one_launch"):
        _moe_layer_compiled(world, gen, H, I, E, k, 256, form)
    moe_layer_backward(world, gen)


def _moe_layer_compiled(world: World, gen, H, I, E, k, S, form) -> None:  # noqa: E741
    """The layer under torch.compile(fullgraph=True) (inductor): its parts are opaque ops, so
    the forward is one graph; against the torch path, two calls with new tokens."""
    from portable_overlap import ExpertParallelMoE

    torch._dynamo.reset()
    fused = ExpertParallelMoE(world, H, I, E, k, max_tokens=S, dtype=torch.bfloat16)
    if form:
        setattr(fused, form, True)
    ref = ExpertParallelMoE(world, H, I, E, k, max_tokens=S, dtype=torch.bfloat16, fused=False)
    try:
        layer = torch.compile(fused, fullgraph=True)
        worst = 0.0
        with torch.no_grad():
            for _ in range(2):
                tokens = rand((S - 16 * world.rank, H), torch.bfloat16, world.device, gen)
                y = layer(tokens)
                fused.synchronize()
                worst = max(worst, rel_err(y, ref(tokens)))
        record(f"moe layer {form or 'staged'}: torch.compile(fullgraph=True) vs torch path",
               worst < 3e-2, f"worst rel_err={worst:.2e}")
    finally:
        fused.close()


def _moe_layer_case(world: World, gen, H, I, E, k, S, opts, name) -> None:  # noqa: E741
    from portable_overlap import ExpertParallelMoE

    fused = ExpertParallelMoE(world, H, I, E, k, max_tokens=S, dtype=torch.bfloat16, **opts)
    ref = ExpertParallelMoE(world, H, I, E, k, max_tokens=S, dtype=torch.bfloat16, fused=False)
    try:
        with torch.no_grad():
            tokens = rand((S - S // 16 * world.rank, H), torch.bfloat16, world.device, gen)
            err = rel_err(fused(tokens), ref(tokens))
            fused.synchronize()
            record(f"moe layer {name} vs torch path", err < 3e-2, f"rel_err={err:.2e}")
            # the one-launch kernel's resources, to read (its plans live on the combine
            # context's "stores" workspace)
            for plan in fused.ctx.kernel()._plans.values():
                k = getattr(getattr(plan, "launches", (None,) * 3)[2], "compiled", None)
                if k is not None and world.rank == 0:
                    print(f"info  moe layer {name}: one-launch kernel {k.n_regs} registers, "
                          f"{k.n_spills} spilled, {k.metadata.shared} B shared, "
                          f"{plan.launches[2].programs} programs", flush=True)
            out = torch.empty_like(tokens)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out.copy_(fused(tokens))
            worst = 0.0
            for _ in range(10):
                tokens.copy_(rand(tuple(tokens.shape), tokens.dtype, tokens.device, gen))
                out.fill_(float("nan"))
                graph.replay()
                fused.synchronize()
                worst = max(worst, rel_err(out, ref(tokens)))
            record(f"moe layer {name}: 10 graph replays, new tokens each", worst < 3e-2,
                   f"worst rel_err={worst:.2e}")
    finally:
        fused.close()


def moe_layer_backward(world: World, gen) -> None:
    """Gradients of the fused layer (fp32) against autograd of the dense layer over every
    rank's tokens and experts: tokens, this rank's experts, the router summed over ranks."""
    from portable_overlap import ExpertParallelMoE
    from portable_overlap.modules.moe_backward import dense_layer_reference

    W, r, dev = world.world_size, world.rank, world.device
    H, I, E, k, S = 256, 192, 4 * W, 2, 300 - 50 * r
    layer = ExpertParallelMoE(world, H, I, E, k, max_tokens=300, dtype=torch.float32)
    try:
        tokens = rand((S, H), torch.float32, dev, gen).requires_grad_()
        dout = rand((S, H), torch.float32, dev, gen)
        layer(tokens).backward(dout)
        layer.synchronize()
        cpu = {"tokens": tokens.detach().cpu(), "dout": dout.cpu(),
               **{n: p.detach().cpu() for n, p in layer.named_parameters()},
               "drouter": layer.router.grad.cpu()}
        every = world.all_gather_object(cpu)
        T = torch.cat([m["tokens"] for m in every]).to(dev).requires_grad_()
        ws = [torch.cat([m[n] for m in every]).to(dev).requires_grad_()
              for n in ("w_gate", "w_up", "w_down")]
        router = layer.router.detach().clone().requires_grad_()
        out = dense_layer_reference(T, router, *ws, k)
        (out * torch.cat([m["dout"] for m in every]).to(dev)).sum().backward()
        lo, El = sum(m["tokens"].shape[0] for m in every[:r]), E // W
        pairs = {"tokens": (tokens.grad, T.grad[lo:lo + S]),
                 "router": (sum(m["drouter"] for m in every).to(dev), router.grad)}
        for n, w in zip(("w_gate", "w_up", "w_down"), ws):
            pairs[n] = (getattr(layer, n).grad, w.grad[r * El:(r + 1) * El])
        errs = {n: rel_err(got, ref) for n, (got, ref) in pairs.items()}
        # rel_err is 0 where both are zeros: a reference gradient of zeros would pass anything
        # that also gave zeros, so every reference must hold something (each of this rank's
        # experts gets rows at these sizes). Bit-equal weight gradients (an error of exactly 0)
        # are expected: the staged backward sums each expert's rows in the dense order
        zero = [n for n, (_, ref) in pairs.items() if not bool(ref.ne(0).any())]
        worst = max(errs.values())
        record("moe layer backward (fused forward) vs dense autograd", worst < 1e-2 and not zero,
               " ".join(f"{n}={e:.1e}" for n, e in errs.items())
               + (f" zero references: {zero}" if zero else ""))
    finally:
        layer.close()


def check_expert_swiglu(world: World, gen) -> None:
    """The experts' gated grouped GEMM alone (no communication: every rank checks its own) at
    the layouts one rank of a W-rank layer receives at decode sizes, with packed experts (the
    device's rule, every expert) and per-source tiles, against the torch reference: DeepSeek-
    and Mixtral-like widths and odd ones (H not a multiple of the K block: pointer loads),
    balanced / one-hot / empty routing, every dtype, rows past ``counts.sum()`` poisoned and
    left alone; 10 CUDA-graph replays with new counts each."""
    from portable_overlap.ops.moe_experts import expert_swiglu, expert_swiglu_reference

    dev = world.device
    g = torch.Generator().manual_seed(world.rank)
    for W, El, H, I, per_seg, dt in ((8, 2, 7168, 2048, 64, torch.bfloat16),
                                     (8, 1, 4096, 3584, 32, torch.bfloat16),
                                     (2, 8, 7168, 2048, 64, torch.bfloat16),
                                     (4, 3, 1000, 333, 20, torch.float16),
                                     (3, 2, 96, 80, 9, torch.float32)):
        wg, wu = (rand((El, H, I), dt, dev, gen) / H ** 0.5 for _ in range(2))
        for kind in ("balanced", "one_source", "empty"):
            if kind == "balanced":
                counts = torch.randint(per_seg // 2, 3 * per_seg // 2 + 1, (W, El), generator=g)
            elif kind == "one_source":  # every row of the first expert from one source
                counts = torch.zeros(W, El, dtype=torch.int64)
                counts[W - 1, 0] = 3 * per_seg + 5
            else:
                counts = torch.zeros(W, El, dtype=torch.int64)
            counts = counts.to(torch.int32)
            R = int(counts.sum())
            cap = max(R + 7, 8)
            x = rand((cap, H), dt, dev, gen)
            c_d = counts.to(dev)
            ref = expert_swiglu_reference(x, wg, wu, c_d)
            outs = {}
            for gather in (None, True, False):
                out = torch.full((cap, I), float("nan"), dtype=dt, device=dev)
                expert_swiglu(x, wg, wu, c_d, out, gather=gather, rows_per_segment=per_seg)
                torch.cuda.synchronize(dev)
                outs[gather] = out
                err = rel_err(out[:R], ref) if R else 0.0
                record(f"expert_swiglu W={W} E={El} H={H} I={I} {kind} {str(dt)[6:]} "
                       f"gather={gather}", err < TOL[dt] and bool(torch.isnan(out[R:]).all()),
                       f"rows={R} rel_err={err:.1e}")
            for gather in (True, False):  # whole K loops: the tiles' own sums
                outs[gather] = expert_swiglu(x, wg, wu, c_d, gather=gather, split=False,
                                             rows_per_segment=per_seg)
            torch.cuda.synchronize(dev)
            record(f"expert_swiglu W={W} E={El} H={H} I={I} {kind} {str(dt)[6:]} packed == "
                   f"per-source", torch.equal(outs[True][:R], outs[False][:R]),
                   "(the same rows' products, other tiles, none split)")
    # the last round split (``split``): one segment of 128-row tiles and 16 column blocks,
    # one row tile more than the programs hold in a round (on 132 processors: 144 tiles, 12
    # in the last round, each cut in parts); against the reference, whole K loops, itself
    from portable_overlap.ops.matmul import MatmulConfig
    from portable_overlap.ops.moe_experts.api import workspace

    cfg = MatmulConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    H, I = 7168, 2048  # noqa: E741
    R = (sms // 16) * 128 + 5
    wg, wu = (rand((1, H, I), torch.bfloat16, dev, gen) / H ** 0.5 for _ in range(2))
    x = rand((R + 3, H), torch.bfloat16, dev, gen)
    c_d = torch.tensor([[R]], dtype=torch.int32, device=dev)
    ref = expert_swiglu_reference(x, wg, wu, c_d)
    outs = []
    for split in (True, True, False):
        out = torch.full((R + 3, I), float("nan"), dtype=torch.bfloat16, device=dev)
        expert_swiglu(x, wg, wu, c_d, out, config=cfg, split=split)
        outs.append(out)
    torch.cuda.synchronize(dev)
    err, err_whole = rel_err(outs[0][:R], ref), rel_err(outs[0][:R], outs[2][:R])
    zero = not workspace(dev, "split_counts", sms, torch.int32).any()
    record(f"expert_swiglu last round split ({R} rows, one segment)",
           err < TOL[torch.bfloat16] and torch.equal(outs[0][:R], outs[1][:R]) and zero
           and bool(torch.isnan(outs[0][R:]).all()),
           f"rel_err={err:.1e} vs whole K {err_whole:.1e} (bitwise: "
           f"{torch.equal(outs[0][:R], outs[2][:R])}), counts left zero: {zero}")
    # graph replays: new counts (and rows) copied into the captured inputs before each
    W, El, H, I = 8, 2, 1024, 512  # noqa: E741
    wg, wu = (rand((El, H, I), torch.bfloat16, dev, gen) / H ** 0.5 for _ in range(2))
    cap = W * El * 96
    x = rand((cap, H), torch.bfloat16, dev, gen)
    c_d = torch.full((W, El), 64, dtype=torch.int32, device=dev)
    out = torch.empty(cap, I, dtype=torch.bfloat16, device=dev)
    expert_swiglu(x, wg, wu, c_d, out, rows_per_segment=64)
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        expert_swiglu(x, wg, wu, c_d, out, rows_per_segment=64)
    worst, exact = 0.0, True
    for rep in range(10):
        c_d.copy_(torch.randint(0 if rep % 2 else 30, 97, (W, El), generator=g).to(torch.int32))
        x.copy_(rand((cap, H), torch.bfloat16, dev, gen))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize(dev)
        R = int(c_d.sum())
        worst = max(worst, rel_err(out[:R], expert_swiglu_reference(x, wg, wu, c_d)))
        exact = exact and bool(torch.isnan(out[R:]).all())
    record("expert_swiglu 10 graph replays, new counts each (packed experts)",
           worst < TOL[torch.bfloat16] and exact, f"worst rel_err={worst:.2e}")


def check_moe_dispatch_swiglu(world: World, gen) -> None:
    """The dispatch with the gated first GEMM fused into it against the two launches on the same
    context (same tiles) and the torch reference: a DeepSeek-like row width, ranks with
    different token counts, uniform / skewed / one-rank routing, every dtype; 10 CUDA-graph
    replays with new routing each; the layer with ``fuse_dispatch=True`` against the torch
    path; an id out of range raises on every rank and the next call is right."""
    from portable_overlap import ExpertParallelMoE, InvalidInputError
    from portable_overlap.ops.moe_dispatch import (MoeDispatch, moe_dispatch,
                                                   moe_dispatch_swiglu,
                                                   moe_dispatch_swiglu_reference)
    from portable_overlap.ops.moe_experts import expert_swiglu

    W, r, dev = world.world_size, world.rank, world.device

    for S, H, I, El, k, kind, dt in ((4096 - 777 * r, 7168, 2048, 8, 8, "uniform", torch.bfloat16),
                                     (3000, 1024, 768, 4, 2, "skewed", torch.float16),
                                     (5 * r + 3, 33, 40, 2, 2, "one_rank", torch.float32)):
        ctx = MoeDispatch(world, max_tokens=4096, top_k=k, hidden=H, experts_per_rank=El,
                          dtype=dt)
        wg, wu = (rand((El, H, I), dt, dev, gen) / H ** 0.5 for _ in range(2))
        try:
            for call in range(2):
                ids = moe_routing(world, kind, S, El * W, k, 10 * call + r)
                tokens = rand((S, H), dt, dev, gen)
                h = torch.full((ctx.capacity, I), float("nan"), dtype=dt, device=dev)
                got, counts, slots = moe_dispatch_swiglu(tokens, ids, wg, wu, ctx, h)
                ctx.synchronize()
                h_ref, c_ref, s_ref = moe_dispatch_swiglu_reference(tokens, ids, wg, wu, El,
                                                                    world.group)
                R = h_ref.shape[0]
                fused = h[:R].clone()
                layout = (torch.equal(counts, c_ref) and torch.equal(slots[:R], s_ref)
                          and bool(torch.isnan(h[R:]).all()))
                x, c2, _ = moe_dispatch(tokens, ids, ctx)
                # the fused launch's tiles: per source, the default for the mean segment
                h2 = expert_swiglu(x, wg, wu, c2, gather=False, split=False,
                                   rows_per_segment=ctx.capacity / (W * W * El))
                ctx.synchronize()
                err_ref, err_unfused = rel_err(fused, h_ref), rel_err(fused, h2[:R])
                record(f"moe_dispatch_swiglu S={S} H={H} I={I} {kind} {str(dt)[6:]} call "
                       f"{call}", layout and err_ref < TOL[dt] * 2 and err_unfused < TOL[dt],
                       f"rows={R} vs reference {err_ref:.1e}, vs unfused {err_unfused:.1e} "
                       f"(bitwise equal: {torch.equal(fused, h2[:R])})")
        finally:
            ctx.close()
    # graph replays: new routing and tokens copied into the captured inputs before each
    S, H, I, El, k = 2048, 1024, 512, 4, 4
    ctx = MoeDispatch(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El,
                      dtype=torch.bfloat16)
    try:
        tokens = rand((S, H), torch.bfloat16, dev, gen)
        ids = moe_routing(world, "uniform", S, El * W, k, 99 + r)
        wg, wu = (rand((El, H, I), torch.bfloat16, dev, gen) / H ** 0.5 for _ in range(2))
        h = torch.empty(ctx.capacity, I, dtype=torch.bfloat16, device=dev)
        moe_dispatch_swiglu(tokens, ids, wg, wu, ctx, h)
        ctx.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            moe_dispatch_swiglu(tokens, ids, wg, wu, ctx, h)
        worst = 0.0
        for rep in range(10):
            kind = ("uniform", "skewed", "one_rank")[rep % 3]
            ids.copy_(moe_routing(world, kind, S, El * W, k, 1000 + 7 * rep + r))
            tokens.copy_(rand((S, H), torch.bfloat16, dev, gen))
            h.fill_(float("nan"))
            graph.replay()
            ctx.synchronize()
            h_ref = moe_dispatch_swiglu_reference(tokens, ids, wg, wu, El, world.group)[0]
            worst = max(worst, rel_err(h[:h_ref.shape[0]], h_ref))
        record("moe_dispatch_swiglu 10 graph replays, new routing each",
               worst < TOL[torch.bfloat16] * 2, f"worst rel_err={worst:.2e}")
        # an id out of range on the last rank: every rank raises; the next call is right
        bad = moe_routing(world, "uniform", S, El * W, k, 5 + r)
        if r == W - 1:
            bad[7, 1] = El * W + 3
        try:
            moe_dispatch_swiglu(tokens, bad, wg, wu, ctx, h)
            ctx.synchronize()
            res = "no error"
        except InvalidInputError as e:
            res = str(e)
        moe_dispatch_swiglu(tokens, ids, wg, wu, ctx, h)
        ctx.synchronize()
        h_ref = moe_dispatch_swiglu_reference(tokens, ids, wg, wu, El, world.group)[0]
        err = rel_err(h[:h_ref.shape[0]], h_ref)
        raised = world.all_gather_object("expert id" in res)
        record("moe_dispatch_swiglu bad id raises on every rank, next call right",
               all(raised) and err < TOL[torch.bfloat16] * 2, res.splitlines()[-1][:120])
    finally:
        ctx.close()
    # the layer with the fused dispatch against the torch path, eager and 10 graph replays
    H, I, E, k, S = 1024, 768, 4 * W, 4, 1536
    fused = ExpertParallelMoE(world, H, I, E, k, max_tokens=S, dtype=torch.bfloat16,
                              fuse_dispatch=True)
    ref = ExpertParallelMoE(world, H, I, E, k, max_tokens=S, dtype=torch.bfloat16, fused=False)
    try:
        with torch.no_grad():
            tokens = rand((S - 100 * r, H), torch.bfloat16, dev, gen)
            err = rel_err(fused(tokens), ref(tokens))
            fused.synchronize()
            out = torch.empty_like(tokens)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out.copy_(fused(tokens))
            worst = 0.0
            for _ in range(10):
                tokens.copy_(rand(tuple(tokens.shape), tokens.dtype, dev, gen))
                out.fill_(float("nan"))
                graph.replay()
                fused.synchronize()
                worst = max(worst, rel_err(out, ref(tokens)))
            record("moe layer fuse_dispatch vs torch path, eager and 10 graph replays",
                   err < 3e-2 and worst < 3e-2, f"rel_err={err:.2e}, replays {worst:.2e}")
    finally:
        fused.close()


def check_allgather_gemm(world: World, gen) -> None:
    """AllGather + GEMM over copy engines: every FiCCO schedule, odd shapes, graph replay."""
    from portable_overlap.ops.allgather_gemm import (SCHEDULES, AllGatherMatmul,
                                                     all_gather_matmul_reference)

    dev = world.device

    def replays(label, ctx, a, b, out, **kw):  # 10 graph replays of one call, fresh inputs each
        worst = worst_over_graph_replays(
            ctx, lambda: ctx(a, b, out, **kw), a, out,
            lambda: all_gather_matmul_reference(a, b, world.group), gen, 10)
        record(f"allgather+gemm {label}10 graph replays", worst < TOL[torch.bfloat16] * 2,
               f"worst rel_err={worst:.2e}")

    ctx = AllGatherMatmul(world, max_shard_elems=4096 * 8192, transport="copy_engine")
    try:
        for m, N, K in ((4096, 8192, 8192), (1000, 777, 333), (3, 5, 7)):
            for dt in (torch.bfloat16, torch.float32):
                a, b = rand((m, K), dt, dev, gen), rand((K, N), dt, dev, gen)
                ref = all_gather_matmul_reference(a, b, world.group)
                for sched in SCHEDULES:
                    out = torch.full((world.world_size * m, N), float("nan"), dtype=dt,
                                     device=dev)
                    for _ in range(2):
                        ctx(a, b, out, schedule=sched)
                    ctx.synchronize()
                    err = rel_err(out, ref)
                    record(f"allgather+gemm {sched} {m}x{N}x{K} {str(dt)[6:]}",
                           err < TOL[dt] * 2, f"rel_err={err:.2e}")
        a = rand((2048, 1024), torch.bfloat16, dev, gen)
        b = rand((1024, 512), torch.bfloat16, dev, gen)
        out = torch.empty(world.world_size * 2048, 512, dtype=torch.bfloat16, device=dev)
        replays("", ctx, a, b, out)
        # the default schedule is 1-D; the 2-D copies (cuMemcpy2DAsync) under capture too
        replays("uniform-fused-2d ", ctx, a, b, out, schedule="uniform-fused-2d")
    finally:
        ctx.close()
    # the SM-store transport: tile-aligned and odd shards (a tile then holds two ranks' rows
    # and the own shard is copied too; K = 333 rows are not whole 16-byte vectors), one sender
    # and many, back-to-back calls, graph replay
    # (bulk: the senders' boxes through tensor descriptors, rows of whole 16-byte units)
    for senders, bulk in ((None, False), (1, False), (64, False), (None, True)):
        st = AllGatherMatmul(world, max_shard_elems=4096 * 8192, transport="stores",
                             senders=senders, bulk_copies=bulk)
        try:
            shapes = ((4096, 8192, 8192), (1000, 777, 336), (8, 5, 8)) if bulk else \
                ((4096, 8192, 8192), (1000, 777, 333), (3, 5, 7)) if senders is None \
                else ((1000, 777, 333),)
            for m, N, K in shapes:
                for dt in (torch.bfloat16, torch.float32):
                    a, b = rand((m, K), dt, dev, gen), rand((K, N), dt, dev, gen)
                    ref = all_gather_matmul_reference(a, b, world.group)
                    out = torch.full((world.world_size * m, N), float("nan"), dtype=dt,
                                     device=dev)
                    for _ in range(3):
                        st(a, b, out)
                    st.synchronize()
                    err = rel_err(out, ref)
                    record(f"allgather+gemm stores senders={senders}{' bulk' if bulk else ''} "
                           f"{m}x{N}x{K} {str(dt)[6:]}", err < TOL[dt] * 2, f"rel_err={err:.2e}")
            if senders is None:
                a, b = rand((2048, 1024), torch.bfloat16, dev, gen), rand(
                    (1024, 512), torch.bfloat16, dev, gen)
                out = torch.empty(world.world_size * 2048, 512, dtype=torch.bfloat16,
                                  device=dev)
                replays("stores bulk " if bulk else "stores ", st, a, b, out)
        finally:
            st.close()
    # the sequential transport (NCCL all_gather_into_tensor, then cuBLAS): odd shapes, graph
    seq = AllGatherMatmul(world, max_shard_elems=1000 * 333, transport="sequential")
    try:
        for m, N, K in ((1000, 777, 333), (3, 5, 7)):
            for dt in (torch.bfloat16, torch.float32):
                a, b = rand((m, K), dt, dev, gen), rand((K, N), dt, dev, gen)
                out = torch.full((world.world_size * m, N), float("nan"), dtype=dt, device=dev)
                seq(a, b, out)
                seq.synchronize()
                err = rel_err(out, all_gather_matmul_reference(a, b, world.group))
                record(f"allgather+gemm sequential {m}x{N}x{K} {str(dt)[6:]}",
                       err < TOL[dt] * 2, f"rel_err={err:.2e}")
        a = rand((300, 333), torch.bfloat16, dev, gen)
        b = rand((333, 512), torch.bfloat16, dev, gen)
        out = torch.empty(world.world_size * 300, 512, dtype=torch.bfloat16, device=dev)
        if host_collectives_captured(world):
            replays("sequential ", seq, a, b, out)
        else:
            LOG.skip("allgather+gemm sequential graph replays",
                     "the host group's collectives (gloo) cannot be captured")
    finally:
        seq.close()


def check_matmul_reduce(world: World, gen) -> None:
    """GEMM + ReduceScatter / AllReduce over copy engines: both modes, odd shapes, uneven K
    shards, back-to-back calls, graph replay."""
    from portable_overlap.ops.matmul_reduce import (MatmulReduce, matmul_all_reduce_reference,
                                                    matmul_reduce_scatter_reference)

    dev = world.device
    refs = {"reduce_scatter": matmul_reduce_scatter_reference,
            "all_reduce": matmul_all_reduce_reference}
    ctx = MatmulReduce(world, max_elems=8192 * 8192)
    try:
        W = world.world_size  # reduce_scatter needs M % W == 0
        for M, N, K in ((8192, 8192, 4096), (1000, 777, 333), (3 * W, 5, 7 + world.rank)):
            for dt in (torch.bfloat16, torch.float32):
                a, b = rand((M, K), dt, dev, gen), rand((N, K), dt, dev, gen).t()
                for mode, ref_fn in refs.items():
                    ref = ref_fn(a, b, world.group)
                    out = torch.full(ref.shape, float("nan"), dtype=dt, device=dev)
                    for _ in range(3):
                        getattr(ctx, mode)(a, b, out)
                    ctx.synchronize()
                    err = rel_err(out, ref)
                    record(f"matmul+{mode} {M}x{N}x{K} {str(dt)[6:]}", err < TOL[dt] * 2,
                           f"rel_err={err:.2e}")
        a = rand((4096, 1024), torch.bfloat16, dev, gen)
        b = rand((1024, 2048), torch.bfloat16, dev, gen)
        for mode, ref_fn in refs.items():
            fn = getattr(ctx, mode)
            out = fn(a, b)
            worst = worst_over_graph_replays(ctx, lambda: fn(a, b, out), a, out,
                                             lambda: ref_fn(a, b, world.group), gen, 10)
            record(f"matmul+{mode} 10 graph replays", worst < TOL[torch.bfloat16] * 2,
                   f"worst rel_err={worst:.2e}")
    finally:
        ctx.close()
    # the SM-store transport: the same shapes (a transposed weight view: pointer loads),
    # back-to-back calls; its graph replays are in check_patterns
    import portable_overlap as po

    W = world.world_size
    for mode, make in (("reduce_scatter", po.MatmulReduceScatter),
                       ("all_reduce", po.MatmulAllReduce)):
        st = make(world, 8192, 8192, transport="stores")
        try:
            # the last two: few tiles over a long K, which ReduceScatter splits into K ranges
            for M, N, K in ((8192, 8192, 4096), (1000, 777, 333), (3 * W, 5, 7 + world.rank),
                            (64 * W, 1024, 4096 + 8 * world.rank), (128 * W, 3584, 8191)):
                for dt in (torch.bfloat16, torch.float32):
                    a = rand((M, K), dt, dev, gen)
                    for b in (rand((K, N), dt, dev, gen), rand((N, K), dt, dev, gen).t()):
                        ref = refs[mode](a, b, world.group)
                        out = torch.full(ref.shape, float("nan"), dtype=dt, device=dev)
                        for _ in range(3):
                            st(a, b, out=out)
                        st.synchronize()
                        err = rel_err(out, ref)
                        record(f"matmul+{mode} stores {M}x{N}x{K} {str(dt)[6:]}"
                               f"{'' if b.is_contiguous() else ' b transposed'}",
                               err < TOL[dt] * 2, f"rel_err={err:.2e}")
        finally:
            st.close()
    # split tiles in a context sized for the call (the peers' float32 ranges in the room the
    # context keeps for them), with bias and residual, replayed from a CUDA graph. W x 2 x N/128
    # tiles of 64 x 128 fill at most half the processors, so tile_parts cuts each in 2 or more
    # at any world size (3584 columns, as one rank ran it, leave none to cut on 2)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    M, N, K = 128 * W, 128 * max(2, sms // (4 * W)), 8192
    for mode, make in (("reduce_scatter", po.MatmulReduceScatter),
                       ("all_reduce", po.MatmulAllReduce)):
        st = make(world, M, N, transport="stores")
        try:
            a = rand((M, K), torch.bfloat16, dev, gen)
            b = rand((N, K), torch.bfloat16, dev, gen).t()
            bias = rand((N,), torch.bfloat16, dev, gen)
            res = rand((M // W if mode == "reduce_scatter" else M, N), torch.bfloat16, dev, gen)
            out = st(a, b, bias=bias, residual=res)
            parts = next(iter(st.workspace("stores")._plans.values())).parts
            worst = worst_over_graph_replays(
                st, lambda: st(a, b, out=out, bias=bias, residual=res), a, out,
                lambda: refs[mode](a, b, world.group) + bias + res, gen, 5)
            record(f"matmul+{mode} stores {M}x{N}x{K} split in {parts}, bias+residual, "
                   f"5 graph replays", parts > 1 and worst < TOL[torch.bfloat16] * 2,
                   f"worst rel_err={worst:.2e}")
        finally:
            st.close()


def check_patterns(world: World, gen, replays: int = 5) -> None:
    """The public API: every transport of every GEMM pattern through its op function, with bias
    and residual, eagerly and replayed from a CUDA graph (fresh inputs, poisoned output before
    each replay), against the torch reference. On one rank every op is its local computation."""
    import portable_overlap as po
    from portable_overlap.ops.gemm_signal import (gemm_all_reduce_reference,
                                                  gemm_all_to_all_signal_reference,
                                                  gemm_reduce_scatter_reference)

    W, dev = world.world_size, world.device
    M, N, K = 1024 * W, 768, 512
    cases = [(po.MatmulAllReduce, po.matmul_all_reduce, gemm_all_reduce_reference, M),
             (po.MatmulReduceScatter, po.matmul_reduce_scatter, gemm_reduce_scatter_reference,
              M // W),
             (po.MatmulAllToAll, po.matmul_all_to_all, gemm_all_to_all_signal_reference, M)]
    from portable_overlap.ops.pattern import transport_unavailable

    for make, fn, ref_fn, rows in cases:
        for transport in make.TRANSPORTS:
            name = f"{fn.__name__}[{transport}]"
            why = transport_unavailable(world, transport)
            if why is not None:  # e.g. torch's fused ops after the SHMEM checks (NVSHMEM bound)
                LOG.skip(name, why[:300])
                continue
            ctx = make(world, M, N, transport=transport)
            try:
                a, b = rand((M, K), torch.bfloat16, dev, gen), rand((K, N), torch.bfloat16, dev,
                                                                    gen)
                bias = rand((N,), torch.bfloat16, dev, gen)
                res = rand((rows, N), torch.bfloat16, dev, gen)
                out = torch.full((rows, N), float("nan"), dtype=torch.bfloat16, device=dev)
                fn(a, b, ctx, out, bias=bias, residual=res)
                ctx.synchronize()
                err = rel_err(out, ref_fn(a, b, world.group, bias, res))
                if transport in HOST_COLLECTIVE and not host_collectives_captured(world):
                    record(name, err < 1e-2, f"rel_err={err:.2e}")
                    LOG.skip(f"{name} graph replays", "the host group's collectives (gloo) "
                             "cannot be captured")
                    continue
                worst = worst_over_graph_replays(
                    ctx, lambda: fn(a, b, ctx, out, bias=bias, residual=res), a, out,
                    lambda: ref_fn(a, b, world.group, bias, res), gen, replays)
                record(name, err < 1e-2 and worst < 1e-2,
                       f"rel_err={err:.2e}, graph replays worst={worst:.2e}")
            except Exception as e:  # noqa: BLE001  (one transport's failure is one finding)
                record(name, False, f"{type(e).__name__}: {str(e)[:300]}")
            finally:
                ctx.close()
    # AllGather + GEMM and GEMV + AllReduce, the single-transport patterns, in a graph too
    ag = po.AllGatherMatmul(world, max_shard_elems=M // W * K, transport="copy_engine")
    try:
        a, b = rand((M // W, K), torch.bfloat16, dev, gen), rand((K, N), torch.bfloat16, dev, gen)
        out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=dev)
        from portable_overlap.ops.allgather_gemm import all_gather_matmul_reference

        worst = worst_over_graph_replays(
            ag, lambda: po.all_gather_matmul(a, b, ag, out), a, out,
            lambda: all_gather_matmul_reference(a, b, world.group), gen, replays)
        record("all_gather_matmul[copy_engine] graph", worst < 1e-2, f"worst={worst:.2e}")
    except Exception as e:  # noqa: BLE001
        record("all_gather_matmul[copy_engine] graph", False, f"{type(e).__name__}: {e}")
    finally:
        ag.close()


def check_empty_dims(world: World, gen) -> None:
    """Calls with an empty dimension, through every transport that takes them, against torch:
    no rows (M = 0 on every rank: the empty [0, N] result) and an empty K shard on rank 0 only
    or on every rank (``[M, 0] @ [0, N]`` is zeros, so the result is the other ranks' sum, or
    zeros). Every transport of the GEMM patterns (all-reduce, reduce-scatter, all-to-all) and
    of GEMV + AllReduce, and AllGather + GEMM with no rows, eagerly; outputs poisoned with NaN
    first."""
    import portable_overlap as po
    from portable_overlap.ops.gemm_signal import (gemm_all_reduce_reference,
                                                  gemm_all_to_all_signal_reference,
                                                  gemm_reduce_scatter_reference)
    from portable_overlap.ops.pattern import transport_unavailable

    W, dev, dt = world.world_size, world.device, torch.bfloat16
    M, N, K = 96 * W, 200, 136
    # (no rows: refused on every rank by these two transports, whose flags are per chunk or
    # per wave group of rows; README, "No rows")
    no_rows_refused = {("matmul_reduce_scatter", "signal_copy_engine")}
    cases = [(po.MatmulAllReduce, po.matmul_all_reduce, gemm_all_reduce_reference, 1),
             (po.MatmulReduceScatter, po.matmul_reduce_scatter, gemm_reduce_scatter_reference,
              W),
             (po.MatmulAllToAll, po.matmul_all_to_all, gemm_all_to_all_signal_reference, 1)]
    for make, fn, ref_fn, div in cases:
        for transport in make.TRANSPORTS:
            name = f"{fn.__name__}[{transport}]"
            why = transport_unavailable(world, transport)
            if why is not None:
                LOG.skip(f"{name} empty dims", why[:300])
                continue
            ctx = make(world, M, N, transport=transport)
            try:
                for label, k in (("K=0 on rank 0", 0 if world.rank == 0 else K),
                                 ("K=0 on every rank", 0)):
                    a, b = rand((M, k), dt, dev, gen), rand((k, N), dt, dev, gen)
                    out = torch.full((M // div, N), float("nan"), dtype=dt, device=dev)
                    fn(a, b, ctx, out)
                    ctx.synchronize()
                    ref = ref_fn(a, b, world.group, None, None)
                    ok = bool(torch.isfinite(out).all()) and (
                        rel_err(out, ref) < 1e-2 if ref.abs().max() > 0 else not out.any())
                    record(f"{name} {label}", ok, f"max |out - ref| "
                           f"{(out.float() - ref.float()).abs().max().item():.2e}")
                if (fn.__name__, transport) not in no_rows_refused:
                    a, b = rand((0, K), dt, dev, gen), rand((K, N), dt, dev, gen)
                    y = fn(a, b, ctx)
                    ctx.synchronize()
                    record(f"{name} no rows", tuple(y.shape) == (0, N), f"shape {tuple(y.shape)}")
            except Exception as e:  # noqa: BLE001  (one transport's failure is one finding)
                record(f"{name} empty dims", False, f"{type(e).__name__}: {str(e)[:300]}")
            finally:
                ctx.close()
    for transport in GemvAllReduce.TRANSPORTS:
        why = transport_unavailable(world, transport)
        if why is not None:
            LOG.skip(f"gemv[{transport}] empty dims", why[:300])
            continue
        ctx = GemvAllReduce(world, max_n=8192, transport=transport)
        try:
            # N = 1024: the one-shot form splits K there (fewer column blocks than SMs)
            for n in (1024, 8192):
                for label, k in (("K=0 on rank 0", 0 if world.rank == 0 else 3584),
                                 ("K=0 on every rank", 0)):
                    x, w = rand((8, k), dt, dev, gen), rand((n, k), dt, dev, gen)
                    out = torch.full((8, n), float("nan"), dtype=dt, device=dev)
                    ctx(x, w, out=out)
                    ctx.synchronize()
                    ref = gemv_all_reduce_reference(x, w, world.group)
                    ok = bool(torch.isfinite(out).all()) and (
                        rel_err(out, ref) < TOL[dt] if ref.abs().max() > 0 else not out.any())
                    record(f"gemv[{transport}] N={n} {label}", ok and same_on_all_ranks(world, out),
                           f"max |out - ref| {(out.float() - ref.float()).abs().max().item():.2e}")
            y = ctx(rand((0, 512), dt, dev, gen), rand((1024, 512), dt, dev, gen))
            ctx.synchronize()
            record(f"gemv[{transport}] no rows", tuple(y.shape) == (0, 1024),
                   f"shape {tuple(y.shape)}")
        except Exception as e:  # noqa: BLE001
            record(f"gemv[{transport}] empty dims", False, f"{type(e).__name__}: {str(e)[:300]}")
        finally:
            ctx.close()
    # AllGather + GEMM: no rows on every rank (its K is shared, and `stores` refuses no rows)
    for transport in po.AllGatherMatmul.TRANSPORTS:
        why = transport_unavailable(world, transport)
        if transport == "stores" or why is not None:
            continue
        ctx = po.AllGatherMatmul(world, max_shard_elems=96 * K, transport=transport)
        try:
            y = po.all_gather_matmul(rand((0, K), dt, dev, gen), rand((K, N), dt, dev, gen), ctx)
            ctx.synchronize()
            record(f"all_gather_matmul[{transport}] no rows", tuple(y.shape) == (0, N),
                   f"shape {tuple(y.shape)}")
        except Exception as e:  # noqa: BLE001
            record(f"all_gather_matmul[{transport}] no rows", False,
                   f"{type(e).__name__}: {str(e)[:300]}")
        finally:
            ctx.close()


def check_sweep(world: World, gen, steps: int = 80, max_dim: int = 320) -> None:
    """The randomized sweep (portable_overlap/testing/sweep.py) with GPU-sized bounds: every op
    through every transport that can run here (``"auto"`` too), dims up to ``max_dim`` drawn
    around the tile sizes, every dtype, strided, stride-0, misaligned and padded operands, so
    the compiled kernels meet the specializations on strides and alignment that the
    interpreter never makes. ``PO_SWEEP_SEED`` (default 1) and ``PO_SWEEP_STEPS`` pick the
    draw; a failure names its seed and step, replayed by ``run_sweep(world, seed, step + 1,
    max_dim=...)``. One result per op: its calls, and its failures on any rank."""
    from portable_overlap.testing.sweep import run_sweep

    seed = int(os.environ.get("PO_SWEEP_SEED", "0") or 0) or 1
    steps = int(os.environ.get("PO_SWEEP_STEPS", "0") or 0) or steps
    # NVSHMEM takes one GPU per rank: where ranks share one, its transports are left out
    leave_out = ("shmem",) if world.shares_devices() else ()
    report = run_sweep(world, seed, steps, max_dim=max_dim, leave_out=leave_out)
    everyone = world.all_gather_object(report["failures"])
    failures = [f for fs in everyone for f in fs]
    for f in failures[:20]:
        print(f"sweep: {f[:2000]}", flush=True)
    calls: dict = {}
    for s in report["steps"]:
        calls.setdefault(s["op"], []).append(s["transport"])
    for op, transports in sorted(calls.items()):
        bad = [f for f in failures if f": {op}[" in f]
        record(f"sweep seed {seed}: {op}", not bad,
               f"{len(transports)} calls over {sorted(set(transports))}; {len(bad)} failures")
    for op, why in sorted(report["unavailable"].items()):
        LOG.skip(f"sweep seed {seed}: {op} {sorted(why)}", "unavailable here")


def check_streams(world: World, gen) -> None:
    """Calls of one context made on three streams one after another with nothing ordering
    them but the context (``ContextBase._follow_stream``): every result against torch, for
    GEMV + AllReduce's two forms and GEMM + AllReduce / AllGather + GEMM over their stores."""
    import portable_overlap as po
    from portable_overlap.ops.allgather_gemm import all_gather_matmul_reference
    from portable_overlap.ops.matmul_reduce.reference import matmul_all_reduce_reference

    gemv_shapes = [((8, 14336), (8192, 14336)), ((1, 4096), (8192, 4096)),
                   ((32, 2048), (8192, 2048))]
    mm_shapes = [((2048, 4096), (4096, 4096)), ((512, 1024), (1024, 4096)),
                 ((1024, 2048), (2048, 4096))]
    ag_shapes = [((1024, 4096), (4096, 4096)), ((256, 4096), (4096, 4096)),
                 ((512, 4096), (4096, 4096))]
    cases = [("gemv[stores]", lambda: GemvAllReduce(world, max_n=8192, transport="stores"),
              lambda c: (lambda x, w: c(x, w)),
              lambda x, w: gemv_all_reduce_reference(x, w, world.group), gemv_shapes),
             ("gemv[one_shot]", lambda: GemvAllReduce(world, max_n=8192, transport="one_shot"),
              lambda c: (lambda x, w: c(x, w)),
              lambda x, w: gemv_all_reduce_reference(x, w, world.group), gemv_shapes),
             ("matmul_all_reduce[stores]",
              lambda: po.MatmulAllReduce(world, 2048, 4096, transport="stores"),
              lambda c: (lambda a, b: po.matmul_all_reduce(a, b, c)),
              lambda a, b: matmul_all_reduce_reference(a, b, world.group), mm_shapes),
             ("all_gather_matmul[stores]",
              lambda: po.AllGatherMatmul(world, max_shard_elems=1024 * 4096, transport="stores"),
              lambda c: (lambda a, b: po.all_gather_matmul(a, b, c)),
              lambda a, b: all_gather_matmul_reference(a, b, world.group), ag_shapes)]
    for name, make, bind, ref, shapes in cases:
        try:
            ctx = make()
        except Exception as e:  # noqa: BLE001
            record(f"{name} calls on three streams", False, f"{type(e).__name__}: {e}"[:300])
            continue
        try:
            wrong, errors, worst = calls_on_three_streams(ctx, bind(ctx), ref, shapes, gen, 20)
            record(f"{name} calls on three streams, 20 rounds", not wrong and not errors,
                   f"worst rel_err={worst:.2e} errors={errors}")
        finally:
            ctx.close()


def _graph_tree_calls(name: str, compiled, reference, make_input, calls: int, tol: float):
    """``calls`` calls of ``compiled`` on fresh inputs, each output cloned before the next call
    reuses the graph trees' memory, against ``reference`` on the same input."""
    try:
        worst = 0.0
        for _ in range(calls):
            x = make_input()
            with torch.no_grad():
                y = compiled(x).clone()
                worst = max(worst, rel_err(y, reference(x)))
        record(f"{name} under torch.compile(mode='reduce-overhead'), {calls} calls", worst < tol,
               f"worst rel_err={worst:.2e}")
    except Exception as e:  # noqa: BLE001  (reported as the finding)
        record(f"{name} under torch.compile(mode='reduce-overhead')", False,
               f"{type(e).__name__}: {str(e)[:1500]}")


def check_compile_graphs(world: World, gen, calls: int = 6) -> None:
    """``torch.compile(mode="reduce-overhead")`` (torch's CUDA-graph trees: warm-up calls run
    eagerly with the trees' memory pool, then the calls are recorded and replayed): the op,
    ``RowParallelLinear`` at a decode and a prefill row count, ``ColumnParallelLinear`` and
    ``ExpertParallelMoE``, with the contexts' default transport (``"auto"`` on a GPU: decided
    in the warm-up calls, whose plans and staging must stay out of the trees' pool:
    ``portable_overlap/kept.py``); fresh inputs at every call, against torch."""
    import torch._inductor.config as inductor_config

    import portable_overlap as po

    if not host_collectives_captured(world):
        # "auto" times its candidates in graph replays at a shape's first call, inside the
        # trees' warm-up; a capture of gloo's collective ("sequential") fails there and leaves
        # its allocation in the trees' pool, which they then refuse (two ranks on one H100)
        LOG.skip("torch.compile(mode='reduce-overhead') of the ops and layers",
                 "the host group's collectives (gloo) cannot be captured")
        return
    # a failure names where each tensor left in the trees' pool was made
    inductor_config.triton.cudagraph_trees_history_recording = True
    dev, dt, W, r = world.device, torch.bfloat16, world.world_size, world.rank
    M, N, K = 4, 2048, 1024
    w = rand((N, K), dt, dev, gen)
    ctx = GemvAllReduce(world, max_n=N)
    try:
        _graph_tree_calls(
            "gemv_all_reduce", torch.compile(
                lambda x: torch.relu(gemv_all_reduce(x * 2, w, ctx)) + 1,
                mode="reduce-overhead", fullgraph=True),
            lambda x: torch.relu(gemv_all_reduce_reference(x * 2, w, world.group)) + 1,
            lambda: rand((M, K), dt, dev, gen), calls, 1e-2)
    finally:
        ctx.close()

    def replicated(shape):  # the same tensor on every rank
        t = rand(shape, dt, dev, gen)
        dist.broadcast(t, 0)
        return t

    in_f, out_f = 1024 * W, 2048
    full = replicated((out_f, in_f))
    row = po.RowParallelLinear(in_f, out_f, world, dtype=dt, device=dev, max_rows=512)
    with torch.no_grad():
        row.weight.copy_(full[:, r * 1024:(r + 1) * 1024])
    compiled_row = torch.compile(row, mode="reduce-overhead")
    try:
        for rows in (8, 512):
            _graph_tree_calls(
                f"RowParallelLinear, {rows} rows",
                lambda xs: compiled_row(xs[:, r * 1024:(r + 1) * 1024].contiguous()),
                lambda xs: (xs.float() @ full.float().t()).to(dt),
                lambda rows=rows: replicated((rows, in_f)), calls, 2e-2)
    finally:
        row.close()
    S = 256 * W
    col = po.ColumnParallelLinear(in_f, out_f, world, max_rows=S // W, dtype=dt, device=dev)
    with torch.no_grad():
        col.weight.copy_(full[r * out_f // W:(r + 1) * out_f // W])
    compiled_col = torch.compile(col, mode="reduce-overhead")
    try:
        _graph_tree_calls(
            "ColumnParallelLinear", lambda xs: compiled_col(xs[r * S // W:(r + 1) * S // W]),
            lambda xs: (xs.float() @ full[r * out_f // W:(r + 1) * out_f // W].float().t()).to(dt),
            lambda: replicated((S, in_f)), calls, 2e-2)
    finally:
        col.close()
    moe_args = dict(hidden=512, intermediate=256, num_experts=4 * W, top_k=2, max_tokens=128,
                    seed=3)
    fused = po.ExpertParallelMoE(world, **moe_args)
    plain = po.ExpertParallelMoE(world, fused=False, **moe_args)
    compiled_moe = torch.compile(fused, mode="reduce-overhead")
    try:
        _graph_tree_calls("ExpertParallelMoE", compiled_moe, plain,
                          lambda: rand((128, 512), dt, dev, gen), calls, 3e-2)
    finally:
        fused.close()
        plain.close()


def _replayed_error(ctx, g, y, ins, shapes, ref, gen) -> float:
    """Fresh inputs copied into a graph's captured ones ``ins``, a replay of ``g``, and the
    relative error of its output ``y`` against ``ref(*ins)``."""
    for t, sh in zip(ins, shapes):
        t.copy_(rand(sh, t.dtype, t.device, gen))
    g.replay()
    ctx.synchronize()
    return rel_err(y, ref(*ins))


def _capture_cases(world: World) -> list:
    """(name, make the context, call, reference, input shapes) of the GEMV and GEMM patterns
    on the transports that keep host-written buffers, and ``"auto"``, at one bf16 shape each."""
    import portable_overlap as po
    from portable_overlap.ops.allgather_gemm import all_gather_matmul_reference
    from portable_overlap.ops.matmul_reduce.reference import matmul_all_reduce_reference

    cases = [(f"gemv_all_reduce[{t}]", lambda t=t: GemvAllReduce(world, max_n=4096, transport=t),
              lambda c, x, w: gemv_all_reduce(x, w, c),
              lambda x, w: gemv_all_reduce_reference(x, w, world.group), ((8, 1024), (4096, 1024)))
             for t in ("stores", "one_shot", "auto")]
    cases += [(f"matmul_all_reduce[{t}]",
               lambda t=t: po.MatmulAllReduce(world, 512, 1024, transport=t),
               lambda c, a, b: po.matmul_all_reduce(a, b, c),
               lambda a, b: matmul_all_reduce_reference(a, b, world.group),
               ((512, 768), (768, 1024))) for t in ("stores", "signal_collective", "auto")]
    cases += [(f"all_gather_matmul[{t}]",
               lambda t=t: po.AllGatherMatmul(world, max_shard_elems=256 * 768, transport=t),
               lambda c, a, b: po.all_gather_matmul(a, b, c),
               lambda a, b: all_gather_matmul_reference(a, b, world.group),
               ((256, 768), (768, 1024))) for t in ("stores", "copy_engine", "auto")]
    return cases


def check_inference_mode(world: World, gen) -> None:
    """Contexts made under ``torch.inference_mode()`` (a serving process's), whose first call
    and a graph capture run in that mode too, then eager calls and a capture outside it: every
    result right (a context must keep no inference tensor, which torch refuses to write in
    place outside the mode)."""
    import portable_overlap as po
    from portable_overlap.ops.matmul_reduce.reference import (
        matmul_all_reduce_reference, matmul_reduce_scatter_reference)

    dev, dt = world.device, torch.bfloat16
    W = world.world_size
    cases = _capture_cases(world) + [  # the copy engines' host-written tables too
        ("matmul_all_reduce[copy_engine]",
         lambda: po.MatmulAllReduce(world, 512, 1024, transport="copy_engine"),
         lambda c, a, b: po.matmul_all_reduce(a, b, c),
         lambda a, b: matmul_all_reduce_reference(a, b, world.group), ((512, 768), (768, 1024))),
        ("matmul_reduce_scatter[copy_engine]",
         lambda: po.MatmulReduceScatter(world, 512 * W, 1024, transport="copy_engine"),
         lambda c, a, b: po.matmul_reduce_scatter(a, b, c),
         lambda a, b: matmul_reduce_scatter_reference(a, b, world.group),
         ((512 * W, 768), (768, 1024)))]
    for name, make, call, ref, shapes in cases:
        ctx = None
        # (gloo's collectives, where ranks share a GPU, cannot be captured)
        capture = name.split("[")[1].rstrip("]") not in HOST_COLLECTIVE \
            or host_collectives_captured(world)

        def eager_and_replay():
            ins = [rand(sh, dt, dev, gen) for sh in shapes]
            y = call(ctx, *ins)
            ctx.synchronize()
            errs = [rel_err(y, ref(*ins))]
            if capture:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    y = call(ctx, *ins)
                errs.append(_replayed_error(ctx, g, y, ins, shapes, ref, gen))
            return errs

        try:
            with torch.inference_mode():
                ctx = make()
                errs = eager_and_replay()
            errs += eager_and_replay()
            record(f"{name} made under inference_mode, called outside it", max(errs) < 1e-2,
                   "rel_err in the mode, outside it (eager" + (", replay" if capture else "")
                   + "): " + " ".join(f"{e:.2e}" for e in errs))
        except Exception as e:  # noqa: BLE001
            record(f"{name} made under inference_mode", False,
                   f"{type(e).__name__}: {str(e)[:300]}")
        finally:
            if ctx is not None:
                ctx.close()


def check_capture_first(world: World, gen, replays: int = 3) -> None:
    """A shape's first call made under CUDA-graph capture, with no eager call before it (the
    first call plans and compiles, which a capture does not allow): either the graph replays
    right, or the call raises an error that says so and leaves the context and the device
    usable (an eager call after it is right). Then a capture after that eager call replays
    right."""
    dev, dt = world.device, torch.bfloat16
    cases = _capture_cases(world)
    for name, make, call, ref, shapes in cases:
        ctx = make()
        try:
            ins = [rand(sh, dt, dev, gen) for sh in shapes]
            g = torch.cuda.CUDAGraph()
            outcome = None
            try:
                with torch.cuda.graph(g):
                    y = call(ctx, *ins)
            except Exception as e:  # noqa: BLE001  (an error is one of the two outcomes)
                outcome = f"{type(e).__name__}: {str(e)[:200]}"
            if outcome is None:
                worst = max(_replayed_error(ctx, g, y, ins, shapes, ref, gen)
                            for _ in range(replays))
                record(f"{name} first call captured: replays", worst < 1e-2,
                       f"worst rel_err={worst:.2e}")
            else:
                # (torch's own CUDA errors, "operation not permitted when stream is
                # capturing", do not say what to do: the message must)
                torch.cuda.synchronize()
                y = call(ctx, *ins)
                ctx.synchronize()
                err = rel_err(y, ref(*ins))
                clear = "eager" in outcome or "outside graph capture" in outcome or \
                    "before capturing" in outcome
                record(f"{name} first call captured: refused", err < 1e-2 and clear,
                       f"{outcome}; eager call after it rel_err={err:.2e}")
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    y = call(ctx, *ins)
                err = _replayed_error(ctx, g, y, ins, shapes, ref, gen)
                record(f"{name} captured after an eager call", err < 1e-2, f"rel_err={err:.2e}")
        except Exception as e:  # noqa: BLE001
            record(f"{name} first call captured", False, f"{type(e).__name__}: {str(e)[:300]}")
        finally:
            try:
                ctx.close()
            except Exception as e:  # noqa: BLE001
                record(f"{name} close after the capture", False, f"{type(e).__name__}: {e}"[:300])


def check_context_churn(world: World, gen, cycles: int = 20) -> None:
    """Contexts made, called once and closed ``cycles`` times over (a layer rebuilt in a loop):
    the device memory free after the last close (torch's cache emptied) is what it was after
    the first, within 64 MiB, and every call is right."""
    import portable_overlap as po
    from portable_overlap.ops.matmul_reduce.reference import matmul_all_reduce_reference

    dev, dt = world.device, torch.bfloat16
    a, b = rand((256, 1024), dt, dev, gen), rand((1024, 2048), dt, dev, gen)
    x, w = rand((4, 1024), dt, dev, gen), rand((2048, 1024), dt, dev, gen)
    ref_mm = matmul_all_reduce_reference(a, b, world.group)
    ref_gemv = gemv_all_reduce_reference(x, w, world.group)

    def cycle():
        worst = 0.0
        for make, call, ref in (
                (lambda: GemvAllReduce(world, max_n=2048), lambda c: c(x, w), ref_gemv),
                (lambda: po.MatmulAllReduce(world, 256, 2048, transport="stores"),
                 lambda c: po.matmul_all_reduce(a, b, c), ref_mm),
                (lambda: po.MatmulAllReduce(world, 256, 2048, transport="signal_collective"),
                 lambda c: po.matmul_all_reduce(a, b, c), ref_mm)):
            ctx = make()
            try:
                y = call(ctx)
                ctx.synchronize()
                worst = max(worst, rel_err(y, ref))
            finally:
                ctx.close()
        return worst

    def free_bytes():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(dev)[0]

    worst = cycle()
    before, t0 = free_bytes(), time.perf_counter()
    for _ in range(cycles - 1):
        worst = max(worst, cycle())
    per_cycle = (time.perf_counter() - t0) / max(cycles - 1, 1)
    lost = before - free_bytes()
    # the device's free memory counts every process on it: where ranks share a GPU, a peer's
    # cache and its failed captures of gloo's collectives (each new context's "auto" decision
    # tries one) count too, so there the memory is reported, not judged (two ranks on one
    # H100: 172 MiB over 19 cycles)
    shared = world.shares_devices()
    record(f"{cycles} cycles of three contexts made, called and closed",
           worst < 1e-2 and (shared or lost < 64 << 20),
           f"worst rel_err={worst:.2e}, device memory lost {lost / 2**20:.1f} MiB"
           f"{' (not judged: ranks share the GPU)' if shared else ''}, "
           f"{per_cycle * 1e3:.0f} ms per cycle")


def check_eager_and_replays(world: World, gen, rounds: int = 6) -> None:
    """One context's captured call and its eager calls of another shape, taken in turns on one
    stream (a decode step replayed, a prefill or a first step eager): every replay and every
    eager call right, with fresh inputs at each."""
    import portable_overlap as po
    from portable_overlap.ops.allgather_gemm import all_gather_matmul_reference
    from portable_overlap.ops.matmul_reduce.reference import matmul_all_reduce_reference

    dev, dt = world.device, torch.bfloat16
    gemv_ref = lambda x, w: gemv_all_reduce_reference(x, w, world.group)  # noqa: E731
    mm_ref = lambda a, b: matmul_all_reduce_reference(a, b, world.group)  # noqa: E731
    ag_ref = lambda a, b: all_gather_matmul_reference(a, b, world.group)  # noqa: E731
    cases = [(f"gemv_all_reduce[{t}]", lambda t=t: GemvAllReduce(world, max_n=4096, transport=t),
              lambda c, x, w: gemv_all_reduce(x, w, c), gemv_ref,
              ((4, 2048), (4096, 2048)), ((32, 2048), (4096, 2048)))
             for t in ("stores", "one_shot", "auto")]
    cases += [(f"matmul_all_reduce[{t}]",
               lambda t=t: po.MatmulAllReduce(world, 512, 1024, transport=t),
               lambda c, a, b: po.matmul_all_reduce(a, b, c), mm_ref,
               ((128, 768), (768, 1024)), ((512, 768), (768, 1024)))
              for t in ("stores", "copy_engine", "signal_collective", "sequential", "auto")]
    cases += [(f"all_gather_matmul[{t}]",
               lambda t=t: po.AllGatherMatmul(world, max_shard_elems=256 * 768, transport=t),
               lambda c, a, b: po.all_gather_matmul(a, b, c), ag_ref,
               ((64, 768), (768, 1024)), ((256, 768), (768, 1024)))
              for t in ("stores", "copy_engine", "auto")]
    for name, make, call, ref, captured, eager in cases:
        ctx = make()
        try:
            ins = [rand(sh, dt, dev, gen) for sh in captured]
            for sh in (captured, eager):  # each shape's first call eager (plans, decides)
                call(ctx, *[rand(s_, dt, dev, gen) for s_ in sh])
            ctx.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = call(ctx, *ins)
            worst_replay = worst_eager = 0.0
            for _ in range(rounds):
                worst_replay = max(worst_replay,
                                   _replayed_error(ctx, g, y, ins, captured, ref, gen))
                e_in = [rand(sh, dt, dev, gen) for sh in eager]
                ye = call(ctx, *e_in)
                ctx.synchronize()
                worst_eager = max(worst_eager, rel_err(ye, ref(*e_in)))
            record(f"{name} replays and eager calls in turns, {rounds} rounds",
                   worst_replay < 1e-2 and worst_eager < 1e-2,
                   f"worst rel_err replays {worst_replay:.2e}, eager {worst_eager:.2e}")
        except Exception as e:  # noqa: BLE001
            record(f"{name} replays and eager calls in turns", False,
                   f"{type(e).__name__}: {str(e)[:300]}")
        finally:
            ctx.close()


def check_bad_input(world: World, ctx: GemvAllReduce) -> None:
    d = world.device
    x = torch.randn(4, 64, device=d, dtype=torch.bfloat16)
    w = torch.randn(128, 64, device=d, dtype=torch.bfloat16)
    cases = {
        "dtype mismatch": (x, w.float()),
        "int dtype": (x.to(torch.int32), w.to(torch.int32)),
        "cpu tensor": (x.cpu(), w),
        "K mismatch": (x, w[:, :32].contiguous()),
        "non-contiguous": (x, w.t().contiguous().t()),
        "M > 64": (torch.randn(65, 64, device=d, dtype=torch.bfloat16), w),
        "3-d x": (x[None], w),
    }
    for name, (a, b) in cases.items():
        try:
            ctx(a, b)
            record(f"bad input: {name}", False, "no error raised")
        except (ValueError, TypeError) as e:
            record(f"bad input: {name}", True, str(e)[:70])


def check_late_stores(world: World, gen, timeout_s: float = 3.0) -> None:
    """The transports that store or copy into peers after a refused call that a peer made late
    (``testing.faults.late_and_refused``): every rank fails that call, and the next call, of
    other shapes, is right: the late rank's stores of the failed call must land before the
    next call uses the buffers they land in."""
    from portable_overlap import AllGatherMatmul, MatmulAllReduce, MatmulReduceScatter
    from portable_overlap.ops.allgather_gemm import all_gather_matmul_reference
    from portable_overlap.ops.matmul_reduce import (matmul_all_reduce_reference,
                                                    matmul_reduce_scatter_reference)
    from portable_overlap.testing.faults import late_and_refused

    W, r, dev = world.world_size, world.rank, world.device
    # with 3 ranks or more the late rank is another than the refusing one; with 2, rank 0 is
    # late to the first of two refused calls
    late, refused, calls = ((W - 1, 1), (1, (1,)), 3) if W > 2 else ((0, 1), (1, (1, 2)), 4)
    want = ["no error"] * calls
    for i in refused[1]:
        want[i] = "ValueError" if r == refused[0] else "PeerTimeoutError"
    # each next shape puts a peer's own rows or partials where the late rank's rows of the
    # failed call land (tests/test_allgather_gemm.py, tests/test_matmul_reduce_stores.py)
    ag_shapes = [(64, 80, 128), (256, 48, 256), (320, 48, 256), (64, 80, 128)][:calls]
    mr_shapes = [(128, 80, 128), (256, 48, 256), (320, 112, 256), (128, 80, 128)][:calls]

    def ag_call(ctx, i, m, N, K):
        def run(bad):
            a, b = rand((m, K), torch.bfloat16, dev, gen), rand((K, N), torch.bfloat16, dev, gen)
            out = torch.full((W * m, N), float("nan"), dtype=torch.bfloat16, device=dev)
            ctx(a, b, torch.empty(1, N, dtype=torch.bfloat16, device=dev) if bad else out)
            return lambda: rel_err(out, all_gather_matmul_reference(a, b, world.group))
        return run

    def mr_call(ctx, mode, i, M, N, K):
        ref = (matmul_reduce_scatter_reference if mode == "reduce_scatter"
               else matmul_all_reduce_reference)

        def run(bad):
            a, b = rand((M, K), torch.bfloat16, dev, gen), rand((K, N), torch.bfloat16, dev, gen)
            out = torch.full((M // W if mode == "reduce_scatter" else M, N), float("nan"),
                             dtype=torch.bfloat16, device=dev)
            ctx(a, b, out=torch.empty(1, N, dtype=torch.bfloat16, device=dev) if bad else out)
            return lambda: rel_err(out, ref(a, b, world.group))
        return run

    cases = {}
    for transport in ("stores", "copy_engine"):  # (copy_engine: the default push direction)
        cases[f"allgather+gemm {transport}"] = (
            lambda t=transport: AllGatherMatmul(
                world, max_shard_elems=max(m * K for m, _, K in ag_shapes), transport=t,
                timeout_s=timeout_s),
            lambda ctx: [ag_call(ctx, i, *s) for i, s in enumerate(ag_shapes)])
    for transport in ("stores", "copy_engine"):
        for mode, make in (("reduce_scatter", MatmulReduceScatter),
                           ("all_reduce", MatmulAllReduce)):
            cases[f"gemm+{mode} {transport}"] = (
                lambda make=make, t=transport: make(world, max(s[0] for s in mr_shapes),
                                                    max(s[1] for s in mr_shapes), transport=t,
                                                    timeout_s=timeout_s),
                lambda ctx, mode=mode: [mr_call(ctx, mode, i, *s)
                                        for i, s in enumerate(mr_shapes)])
    for name, (make_ctx, make_calls) in cases.items():
        ctx = make_ctx()
        try:
            found = late_and_refused(world, ctx, make_calls(ctx), late, refused)
        finally:
            ctx.close()
        record(f"{name}: late stores of a refused call", found[:-1] == want
               and found[-1] < TOL[torch.bfloat16] * 2, f"{found[:-1]} rel_err={found[-1]:.2e}")


def check_peer_failures(world: World, gen) -> None:
    # A rank called with other shapes: every rank gets a clear error, nobody hangs.
    ctx = GemvAllReduce(world, max_n=4096, transport="stores", timeout_s=1.0)
    N = 2048 if world.rank == 0 else 2048 + 64
    x = rand((4, 512), torch.bfloat16, world.device, gen)
    w = rand((N, 512), torch.bfloat16, world.device, gen)
    t0 = time.perf_counter()
    try:
        ctx(x, w)
        ctx.synchronize()
        record("ranks disagree on N", False, "no error raised")
    except PortableOverlapError as e:
        record("ranks disagree on N", True,
               f"{type(e).__name__} after {time.perf_counter() - t0:.2f}s: "
               f"{str(e).splitlines()[1].strip()[:90]}")
    except Exception as e:
        record("ranks disagree on N", False, f"raised {type(e).__name__}: {e}"[:200])
    finally:
        ctx.close()
    # One rank skips a call: the other times out, names op, rank and flag, then raises.
    ctx = GemvAllReduce(world, max_n=4096, transport="stores", timeout_s=1.0)
    w = rand((2048, 512), torch.bfloat16, world.device, gen)
    t0 = time.perf_counter()
    try:
        if world.rank != world.world_size - 1:
            ctx(x, w)
            ctx.synchronize()
            record("peer skips a call", False, "no error raised")
    except PeerTimeoutError as e:
        msg = str(e).splitlines()[1].strip()
        record("peer skips a call", f"rank {world.world_size - 1}" in msg,
               f"after {time.perf_counter() - t0:.2f}s: {msg[:110]}")
    except Exception as e:
        record("peer skips a call", False, f"raised {type(e).__name__}: {e}"[:200])
    finally:
        ctx.close()


#: the call number at which ``check_refresh`` runs its ops: the first that refreshes the flag
#: words (every ``shmem.device.REFRESH_CALLS``-th call)
REFRESH_AT = 1 << 30
#: the waits' limit of ``check_refresh``'s contexts (s): a rank that compiles the first call's
#: kernels later than its peers must not be taken for one that skipped the call
REFRESH_TIMEOUT_S = 60.0


def check_refresh(world: World, gen, names=None) -> None:
    """The calls that refresh the flag words (every 2**30-th call: the branch no other check
    reaches) of the ops whose grid or flag count follows the call, on their ``"stores"``
    workspaces: GEMV + AllReduce (both forms), GEMM + AllReduce (split tiles, a rank's last row
    tile past its rows), AllGather + GEMM, GEMM + All-to-All, the MoE dispatch, the fused
    dispatch + gated GEMM, the MoE combine and the one-launch MoE layer. Each context makes a
    call of a large shape (so every word a call writes has been written once, as in a context
    that ran for hours), its counters and flag words move on to the call before 2**30
    (``testing.call_numbers``), then it makes a call of a small shape (call 2**30, which
    refreshes) and calls with other grids after it, each against the reference on fresh inputs
    with a poisoned output. After the refreshing call every word of the checked flag rows must
    hold its number (written by it or by its refresh): the peers' rows, and this rank's own
    where the op writes them (so on one rank only those of the MoE dispatch and AllGather +
    GEMM are checked). ``names``: the cases of ``REFRESH_CASES`` to run (None: all)."""
    for name, make in REFRESH_CASES:
        if names is not None and name not in names:
            continue
        try:
            _check_refresh_case(world, name, make(world, gen))
        except Exception as e:
            record(f"refresh {name}", False, f"raised {type(e).__name__}: {e}"[:300])
            traceback.print_exc()


def _check_refresh_case(world: World, name: str, case) -> None:
    """One op of ``check_refresh``. ``case``: its ``contexts`` (closed here), ``moves``
    (``(counters, flag arrays)`` per context), ``checked`` (``(label, row)``: flag words that
    the refreshing call or its refresh writes in this rank's heap) and ``calls`` (``(label,
    call)``, ``call()`` giving ``(ok, detail)``): the first before the move (the context's
    first call), the second at 2**30 (``testing.call_numbers.calls_at_numbers``)."""
    from portable_overlap.testing.call_numbers import calls_at_numbers

    try:
        for i, (ok, detail), stale in calls_at_numbers(
                world, {1: REFRESH_AT}, case.moves, case.checked, [c for _, c in case.calls]):
            number = "1" if i == 0 else "2**30" + (f" + {i - 1}" if i > 1 else "")
            record(f"refresh {name}: call {number}, {case.calls[i][0]}", ok, detail)
            if stale is not None and case.checked:
                record(f"refresh {name}: every checked flag word holds call 2**30", not stale,
                       "; ".join(stale) or ", ".join(what for what, _ in case.checked))
    finally:
        for ctx in case.contexts:
            ctx.close()


def _refresh_case(contexts, moves, checked, calls):
    from types import SimpleNamespace

    return SimpleNamespace(contexts=contexts, moves=moves, checked=checked, calls=calls)


def _peers(world: World) -> list:
    return [q for q in range(world.world_size) if q != world.rank]


def _close_to(out: torch.Tensor, ref: torch.Tensor) -> tuple:
    """``(ok, detail)`` of a float32 result against its reference."""
    err = rel_err(out, ref)
    return err < TOL[torch.float32] * 2, f"rel_err={err:.2e}"


def _refresh_gemv(world: World, gen, transport: str):
    """GEMV + AllReduce: N 256 (a program per block of rows), N 64 at 2**30 (one block, a
    grid of one program), then both again. Checked: the peers' ``ready`` and ``bcast``
    rows."""
    ctx = GemvAllReduce(world, max_n=256, transport=transport, timeout_s=REFRESH_TIMEOUT_S)
    ws = ctx.impl

    def call(M, N, K):
        x = rand((M, K), torch.float32, world.device, gen)
        w = rand((N, K), torch.float32, world.device, gen)
        out = torch.full((M, N), float("nan"), device=world.device)
        ctx(x, w, out=out)
        ctx.synchronize()
        return _close_to(out, gemv_all_reduce_reference(x, w, world.group))

    shapes = ((4, 256, 256), (1, 64, 256), (4, 256, 256), (1, 64, 256))
    return _refresh_case(
        [ctx], [(ws.ctx, [ws.ready, ws.bcast])],
        [(f"{f} of rank {q}", getattr(ws, f)[q]) for q in _peers(world)
         for f in ("ready", "bcast")],
        [(f"{M}x{N}x{K}", lambda s=(M, N, K): call(*s)) for M, N, K in shapes])


def _refresh_gemv_stores(world: World, gen):
    return _refresh_gemv(world, gen, "stores")


def _refresh_gemv_one_shot(world: World, gen):
    return _refresh_gemv(world, gen, "one_shot")


def _refresh_matmul_all_reduce(world: World, gen):
    """GEMM + AllReduce over stores with 64 x 64 tiles (float32's on 32-lane warps): M 576, N
    512 (72 to 128 tiles on 1 to 8 ranks: whole tiles on up to 143 SMs), then at 2**30 M =
    W * 129 - 1, N 128 over a long K (3 row tiles a block, the last partial and, on a rank
    one row short, past its rows: split into K ranges where the grid has room), then both
    again. Checked: the peers' ``sent`` and ``reduced`` rows."""
    import portable_overlap as po
    from portable_overlap.ops.matmul import MatmulConfig

    W = world.world_size
    cfg = MatmulConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3)
    ctx = po.MatmulAllReduce(world, 576, 512, transport="stores", config=cfg,
                             timeout_s=REFRESH_TIMEOUT_S)
    ws = ctx.workspace("stores")

    def call(M, N, K):
        a = rand((M, K), torch.float32, world.device, gen)
        b = rand((K, N), torch.float32, world.device, gen)
        ref = a @ b
        dist.all_reduce(ref, group=world.group)
        out = torch.full((M, N), float("nan"), device=world.device)
        ctx(a, b, out=out)
        ctx.synchronize()
        ok, detail = _close_to(out, ref)
        return ok, f"{detail} parts={[p.parts for p in ws._plans.values()]}"

    split, whole = (W * 129 - 1, 128, 1024), (576, 512, 64)
    shapes = (whole, split, whole, split)
    return _refresh_case(
        [ctx], [(ws.ctx, [ws.sent, ws.reduced, ws.consumed])],
        [(f"{f} of rank {q}", getattr(ws, f)[q]) for q in _peers(world)
         for f in ("sent", "reduced")],
        [(f"{M}x{N}x{K}", lambda s=(M, N, K): call(*s)) for M, N, K in shapes])


def _refresh_allgather_gemm(world: World, gen):
    """AllGather + GEMM over stores: a shard of 512 rows (several chunks), of 2 at 2**30 (one
    chunk), then both again. Checked: the peers' ``ready`` rows and this rank's own."""
    from portable_overlap.ops.allgather_gemm import AllGatherMatmul, all_gather_matmul_reference

    ctx = AllGatherMatmul(world, max_shard_elems=512 * 64, transport="stores",
                          timeout_s=REFRESH_TIMEOUT_S)
    ws = ctx.workspace("stores")

    def call(m):
        a = rand((m, 64), torch.float32, world.device, gen)
        b = rand((64, 64), torch.float32, world.device, gen)
        out = torch.full((world.world_size * m, 64), float("nan"), device=world.device)
        ctx(a, b, out)
        ctx.synchronize()
        return _close_to(out, all_gather_matmul_reference(a, b, world.group))

    return _refresh_case(
        [ctx], [(ws.ctx, [ws.ready, ws.consumed])],
        [(f"ready of rank {q}", ws.ready[q]) for q in range(world.world_size)],
        [(f"shard {m}x64x64", lambda m=m: call(m)) for m in (512, 2, 512, 2)])


def _refresh_gemm_alltoall(world: World, gen):
    """GEMM + All-to-All over stores: M = 64 W, N 256 (a program per tile up to the SMs), at
    2**30 M = 2 W, N 64 (one tile, a grid of one program), then both again. Checked: the
    peers' ``sent`` rows."""
    from portable_overlap.ops.gemm_alltoall import GemmAllToAll, gemm_all_to_all_reference

    W = world.world_size
    ctx = GemmAllToAll(world, max_elems=64 * W * 256, transport="stores",
                       timeout_s=REFRESH_TIMEOUT_S)

    def call(M, N):
        a = rand((M, 64), torch.float32, world.device, gen)
        b = rand((64, N), torch.float32, world.device, gen)
        out = torch.full((M, N), float("nan"), device=world.device)
        ctx(a, b, out=out)
        ctx.synchronize()
        return _close_to(out, gemm_all_to_all_reference(a, b, world.group))

    shapes = ((64 * W, 256), (2 * W, 64), (64 * W, 256), (2 * W, 64))
    return _refresh_case(
        [ctx], [(ctx.ctl, [ctx.sent, ctx.consumed])],
        [(f"sent of rank {q}", ctx.sent[q]) for q in _peers(world)],
        [(f"{M}x{N}x64", lambda s=(M, N): call(*s)) for M, N in shapes])


#: the MoE refresh checks' sizes: hidden, intermediate, experts a rank, choices a token, and
#: the tokens of the larger calls
MOE_REFRESH = dict(H=128, I=64, El=2, k=2, S=128)


def _moe_refresh_inputs(world: World, gen, S: int, seed: int):
    """Tokens [S, H] (float32), uniform top-k ids (each rank its own) and the weights [S, k]
    of one call."""
    p = MOE_REFRESH
    tokens = rand((S, p["H"]), torch.float32, world.device, gen)
    ids = moe_routing(world, "uniform", S, p["El"] * world.world_size, p["k"],
                      100 * seed + world.rank)
    tw = torch.softmax(rand((S, p["k"]), torch.float32, world.device, gen), 1)
    return tokens, ids, tw


def _moe_refresh_weights(world: World, gen):
    """This rank's experts: w_gate, w_up [El, H, I] and w_down [El, I, H] (float32)."""
    H, I, El = MOE_REFRESH["H"], MOE_REFRESH["I"], MOE_REFRESH["El"]
    wg, wu = (rand((El, H, I), torch.float32, world.device, gen) / H ** 0.5 for _ in range(2))
    return wg, wu, rand((El, I, H), torch.float32, world.device, gen) / I ** 0.5


def _moe_refresh_contexts(world: World, dispatch: bool, combine: bool):
    """The MoE refresh checks' contexts (``"stores"``): their list, the dispatch's and the
    combine's (None where not asked for), what moves on for each and the rows checked (the
    dispatch's ``sent`` rows of every rank, its own too; the combine's of the peers)."""
    from portable_overlap.ops.moe_combine import MoeGemmCombine
    from portable_overlap.ops.moe_dispatch import MoeDispatch

    p = MOE_REFRESH
    sizes = dict(max_tokens=p["S"], top_k=p["k"], hidden=p["H"], experts_per_rank=p["El"],
                 transport="stores", timeout_s=REFRESH_TIMEOUT_S)
    d = c = None
    contexts, moves, checked = [], [], []
    if dispatch:
        d = MoeDispatch(world, dtype=torch.float32, **sizes)
        contexts.append(d)
        wd = d.kernel()
        moves.append((wd.ctl, [wd.count_flag, wd.sent, wd.consumed]))
        checked += [(f"dispatch sent of rank {q}", wd.sent[q]) for q in range(world.world_size)]
    if combine:
        c = MoeGemmCombine(world, **sizes)
        contexts.append(c)
        wc = c.kernel()
        moves.append(((wc.ctl, wc.ctl[2:]), [wc.sent, wc.consumed]))
        checked += [(f"combine sent of rank {q}", wc.sent[q]) for q in _peers(world)]
    return contexts, d, c, moves, checked


def _dispatch_call(world: World, gen, d, S: int, seed: int):
    """One MoE dispatch of S tokens: rows, counts and slots equal the reference's."""
    from portable_overlap.ops.moe_dispatch import moe_dispatch_reference

    tokens, ids, _ = _moe_refresh_inputs(world, gen, S, seed)
    d.recv.fill_(float("nan"))
    x, counts, slots = moe_dispatch(tokens, ids, d)
    d.synchronize()
    x_ref, c_ref, s_ref = moe_dispatch_reference(tokens, ids, MOE_REFRESH["El"], world.group)
    R = x_ref.shape[0]
    ok = (torch.equal(counts, c_ref) and torch.equal(x[:R], x_ref)
          and torch.equal(slots[:R], s_ref))
    return ok, f"rows={R}"


def _swiglu_call(world: World, gen, d, weights, S: int, senders, seed: int):
    """One fused dispatch + gated GEMM of S tokens (``senders`` sending programs; None: the
    default), against the reference."""
    from portable_overlap.ops.moe_dispatch import (moe_dispatch_swiglu,
                                                   moe_dispatch_swiglu_reference)

    wg, wu, _ = weights
    tokens, ids, _ = _moe_refresh_inputs(world, gen, S, seed)
    d.recv.fill_(float("nan"))
    h = torch.full((d.capacity, MOE_REFRESH["I"]), float("nan"), device=world.device)
    _, counts, slots = moe_dispatch_swiglu(tokens, ids, wg, wu, d, h, senders=senders)
    d.synchronize()
    h_ref, c_ref, s_ref = moe_dispatch_swiglu_reference(tokens, ids, wg, wu, MOE_REFRESH["El"],
                                                        world.group)
    R = h_ref.shape[0]
    ok, detail = _close_to(h[:R], h_ref) if R else (True, "no rows")
    return ok and torch.equal(counts, c_ref) and torch.equal(slots[:R], s_ref), detail


def _refresh_moe_dispatch(world: World, gen):
    """The MoE dispatch on a context that also runs the fused dispatch + gated GEMM (128 tokens,
    its default senders, which write their ``sent`` words in every heap, this rank's too):
    that first, then at 2**30 the dispatch's scatter (a grid of the resident programs, none of
    this rank's own words) with 1 token, then both again."""
    contexts, d, _, moves, checked = _moe_refresh_contexts(world, True, False)
    weights = _moe_refresh_weights(world, gen)
    S = MOE_REFRESH["S"]
    calls = [(f"dispatch + gated GEMM, {S} tokens",
              lambda: _swiglu_call(world, gen, d, weights, S, None, 1)),
             ("dispatch, 1 token", lambda: _dispatch_call(world, gen, d, 1, 2)),
             (f"dispatch + gated GEMM, {S} tokens",
              lambda: _swiglu_call(world, gen, d, weights, S, None, 3)),
             ("dispatch, 1 token", lambda: _dispatch_call(world, gen, d, 1, 4))]
    return _refresh_case(contexts, moves, checked, calls)


def _refresh_moe_dispatch_swiglu(world: World, gen):
    """The fused dispatch + gated GEMM: the default senders and 128 tokens, at 2**30 1 sender
    and 1 token, then both again."""
    contexts, d, _, moves, checked = _moe_refresh_contexts(world, True, False)
    weights = _moe_refresh_weights(world, gen)
    S = MOE_REFRESH["S"]
    calls = [(f"{n} token{'s' * (n > 1)}, senders={senders}",
              lambda a=(n, senders, seed): _swiglu_call(world, gen, d, weights, *a))
             for seed, (n, senders) in enumerate(((S, None), (1, 1), (S, None), (1, 1)), 1)]
    return _refresh_case(contexts, moves, checked, calls)


def _refresh_moe_combine(world: World, gen):
    """The MoE combine on rows the torch dispatch delivered: 128 tokens (other tiles where they
    pass decode sizes, so another resident grid where those differ), 1 token at 2**30 (decode
    tiles), then both again."""
    from portable_overlap.ops.moe_combine import moe_gemm_combine_reference
    from portable_overlap.ops.moe_dispatch import moe_dispatch_reference

    contexts, _, c, moves, checked = _moe_refresh_contexts(world, False, True)
    _, _, wd = _moe_refresh_weights(world, gen)
    p = MOE_REFRESH

    def call(S, seed):
        _, ids, tw = _moe_refresh_inputs(world, gen, S, seed)
        rows = rand((S, p["I"]), torch.float32, world.device, gen)
        x, counts, slots = moe_dispatch_reference(rows, ids, p["El"], world.group)
        out = torch.full((S, p["H"]), float("nan"), device=world.device)
        c(x, wd, counts, slots, tw, out=out)
        c.synchronize()
        return _close_to(out, moe_gemm_combine_reference(x, wd, counts, slots, tw,
                                                         world.group))

    calls = [(f"{S} token{'s' * (S > 1)}", lambda S=S, seed=seed: call(S, seed))
             for seed, S in enumerate((p["S"], 1, p["S"], 1), 1)]
    return _refresh_case(contexts, moves, checked, calls)


def _refresh_moe_layer(world: World, gen):
    """The one-launch MoE layer: the default senders and 128 tokens, at 2**30 1 sender and 1
    token, then both again; both contexts move on."""
    from portable_overlap.ops.moe_layer import moe_layer, moe_layer_reference

    contexts, d, c, moves, checked = _moe_refresh_contexts(world, True, True)
    wg, wu, wd = _moe_refresh_weights(world, gen)
    p = MOE_REFRESH

    def call(S, senders, seed):
        tokens, ids, tw = _moe_refresh_inputs(world, gen, S, seed)
        out = torch.full((S, p["H"]), float("nan"), device=world.device)
        moe_layer(tokens, ids, tw, wg, wu, wd, d, c, out, senders=senders)
        d.synchronize()
        c.synchronize()
        return _close_to(out, moe_layer_reference(tokens, ids, tw, wg, wu, wd, p["El"],
                                                  world.group))

    calls = [(f"{S} token{'s' * (S > 1)}, senders={senders}",
              lambda a=(S, senders, seed): call(*a))
             for seed, (S, senders) in enumerate(((p["S"], None), (1, 1), (p["S"], None),
                                                  (1, 1)), 1)]
    return _refresh_case(contexts, moves, checked, calls)


#: ``check_refresh``'s cases: (name, the builder of its contexts and calls)
REFRESH_CASES = (("gemv+allreduce[stores]", _refresh_gemv_stores),
                 ("gemv+allreduce[one_shot]", _refresh_gemv_one_shot),
                 ("matmul+all_reduce[stores]", _refresh_matmul_all_reduce),
                 ("allgather+gemm[stores]", _refresh_allgather_gemm),
                 ("gemm+a2a[stores]", _refresh_gemm_alltoall),
                 ("moe_dispatch[stores]", _refresh_moe_dispatch),
                 ("moe_dispatch_swiglu", _refresh_moe_dispatch_swiglu),
                 ("moe_gemm_combine[stores]", _refresh_moe_combine),
                 ("moe_layer", _refresh_moe_layer))


def _guarded(check, *args) -> None:
    """Run one check; an exception is recorded as its failure and the next check runs."""
    try:
        check(*args)
    except Exception as e:
        record(check.__name__, False, f"raised {type(e).__name__}: {e}"[:300])
        traceback.print_exc()


def main() -> int:
    import faulthandler

    # a stuck check prints where, then exits. With a cold Triton cache the checks took about
    # 450 s together on one H100 (four runs: benchmarks/results/logs/
    # 2026-12-06-h100-refresh-checks-world1/), and 4 and 8 GPUs compile and check for longer
    limit = float(os.environ.get("PO_CHECKS_TIMEOUT_S", "720"))
    faulthandler.dump_traceback_later(limit, exit=True)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    # PO_HOST_GROUP=gloo: the host collectives (references, exchanges of results) over gloo,
    # so that two ranks can share one GPU (NCCL refuses that) and a single-GPU machine checks
    # what the peers' rows hold. Their kernels time-slice the GPU: behaviour, not speed.
    if os.environ.get("PO_HOST_GROUP"):
        dist.init_process_group(os.environ["PO_HOST_GROUP"])
    world = World.from_env()
    gen = torch.Generator(device=world.device).manual_seed(1000 + world.rank)
    _guarded(check_backend, world, gen)
    if os.environ.get("PO_ONLY_BACKEND") == "1":
        dist.destroy_process_group()
        return 0 if all(ok for _, ok, _ in results) else 1
    # PO_CHECKS=name,name runs only those checks (names without "check_"), to spend the
    # device time on what changed
    only = {n for n in os.environ.get("PO_CHECKS", "").split(",") if n}
    # The SHMEM transports first: torch keeps the symmetric-memory backend of the process's
    # first symmetric tensor, so they select NVSHMEM / rocSHMEM before anything else could
    # allocate from torch's default heap (after that they raise ShmemUnavailable, which
    # tests/test_rocshmem_provider.py covers).
    # NVSHMEM (and rocSHMEM) take one GPU per rank: where ranks share one, those checks are
    # left out, and so is torch's symmetric memory (the "auto" beside the shmem combine)
    shared_gpus = world.shares_devices()
    if shared_gpus:
        print("ranks share GPUs: the SHMEM transports' checks are left out", flush=True)
    if (not only or "moe_combine" in only) and not shared_gpus:
        _guarded(_check_moe_combine, world, gen, "shmem", "auto")
    if (not only or "moe_dispatch" in only) and not shared_gpus:
        _guarded(_check_moe_dispatch_shmem, world, gen)
    if not only or "gemv" in only:
        for transport in ("stores", "one_shot"):
            LOG.prefix = "" if transport == "stores" else f"[{transport}] "
            ctx = GemvAllReduce(world, max_n=8192, transport=transport)
            for check in (check_shapes, check_back_to_back, check_graph, check_compile):
                _guarded(check, world, ctx, gen)
            check_bad_input(world, ctx)
            ctx.close()
        LOG.prefix = ""
    for check in (check_patterns, check_gemm_alltoall, check_allgather_gemm,
                  check_matmul_reduce, check_moe_combine, check_moe_dispatch,
                  check_expert_swiglu, check_moe_dispatch_swiglu, check_moe_layer,
                  check_empty_dims, check_sweep, check_streams, check_compile_graphs,
                  check_capture_first, check_inference_mode, check_context_churn,
                  check_eager_and_replays,
                  check_refresh, check_peer_failures, check_late_stores):
        if check in (check_peer_failures, check_late_stores) and world.world_size == 1:
            continue  # one rank has no peer to disagree with or to miss
        if not only or check.__name__[len("check_"):] in only:
            _guarded(check, world, gen)
    return LOG.finish(world, "gpu checks")


if __name__ == "__main__":
    sys.exit(main())
