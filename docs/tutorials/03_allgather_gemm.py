"""Tutorial 3: AllGather + GEMM in one kernel, the multiply starting on the rows at hand.

Rank r holds ``a_r`` [m, K] and the same ``b`` [K, N]; every rank computes
``out = cat(a_0, ..., a_{W-1}) @ b`` [W*m, N] (rows ``q*m .. (q+1)*m`` from rank q's shard).
The first ``senders`` programs push this rank's shard into row block ``me`` of every peer's
``gathered`` [W*m, K] (peer after peer, ``pol.peer_at``, in chunks of rows) and raise a flag per
(source, chunk) there. Then every program claims output tiles from a counter (an atomic add per
tile: none idles while tiles are left; the last program out resets it): this rank's rows first
(from ``a``, no wait), then the peers' shards in the order they arrive, each tile waiting for
its rows' chunk. (Under the interpreter, which runs programs one by one, senders do not compute:
one waiting for a peer's chunk would wait for a program of that peer queued behind the peer's
own waiting sender.) ``pol.announce_call`` / ``pol.wait_free`` (tutorial 2) make back-to-back
calls safe. With bulk tensor copies (TMA on Hopper: ``world.facts.tensor_descriptors``) the tiles
load through tensor descriptors (``tiles.gemm.gemm_tile_desc``: 95-99 % of cuBLAS on H200,
pointer loads 79-91 %), ``pol.fence_bulk_reads()`` after each wait; elsewhere (AMD, the
interpreter, fp32) through pointers (``tiles.gemm.gemm_tile``).

    torchrun --nproc-per-node 2 docs/tutorials/03_allgather_gemm.py     # GPUs
    python docs/tutorials/03_allgather_gemm.py                          # CPU-emulated ranks

It checks itself against torch in fp32 and times torch and ``AllGatherMatmul(transport="stores")``.
"""
import sys

import torch
import triton
import triton.language as tl

import portable_overlap.language as pol
from portable_overlap import AllGatherMatmul, Workspace
from portable_overlap.ops.matmul.api import default_config, tile_descriptors
from portable_overlap.testing import report, run_on_ranks, time_paths
from portable_overlap.tiles.gemm import gemm_tile, gemm_tile_desc, grouped_tile

MAX_CHUNKS = 256  # the most flags per source rank (a chunk is at least a tile row)


@triton.jit
def allgather_gemm_kernel(ctx, a_ptr, b_ptr, out_ptr, gathered_ptr, ready_ptr, free_ptr,
                          claim_ptr, a_desc, g_desc, b_desc, m, N, K, chunk_rows, senders,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr, STAGES: tl.constexpr, EVEN_K: tl.constexpr,
                          COPY: tl.constexpr, USE_DESC: tl.constexpr, JOIN: tl.constexpr):
    call = pol.begin_call(ctx)
    me, world, p = pol.rank(ctx), pol.num_ranks(ctx), pol.program()
    chunks = tl.cdiv(m, chunk_rows)
    # waits are for the peers' program 0 (free) and senders (ready), none for this launch's
    if p == 0:  # "my gathered is free for this call": my previous call has finished reading it
        pol.announce_call(ctx, free_ptr, call)
    if p < senders:  # item i: chunk i % chunks to the peer at step 1 + i // chunks
        for i in range(p, (world - 1) * chunks, senders):
            q = pol.peer_at(1 + i // chunks, me, world)
            pol.wait_free(ctx, free_ptr, q, call)
            lo = i % chunks * chunk_rows
            n = (tl.minimum(lo + chunk_rows, m) - lo).to(tl.int64) * K
            pol.put(ctx, gathered_ptr + (me * m + lo).to(tl.int64) * K,
                    a_ptr + lo.to(tl.int64) * K, n, q, COPY)
            pol.signal(ctx, ready_ptr + me * chunks + i % chunks, q, call)
    if JOIN or p >= senders:
        tiles_m, tiles_n = tl.cdiv(m, BLOCK_M), tl.cdiv(N, BLOCK_N)  # a tile is in one shard
        per_shard = tiles_m * tiles_n
        t = tl.atomic_add(claim_ptr, 1, sem="relaxed", scope="gpu").to(tl.int32)  # orders nothing
        while t < world * per_shard:
            q = pol.peer_at(world - t // per_shard, me, world)  # mine, then rank me-1's, ...
            tm, tn = grouped_tile(t % per_shard, tiles_m, tiles_n, GROUP_M)
            lo, rows = tm * BLOCK_M, tl.minimum(m - tm * BLOCK_M, BLOCK_M)
            src, desc, row0 = a_ptr, a_desc, lo  # this rank's rows: no wait
            if q != me:  # chunks are whole tile rows: one flag covers the tile
                pol.wait(ctx, ready_ptr + q * chunks + lo // chunk_rows, call, q)
                pol.fence_bulk_reads()  # the wait's acquire, then the tile's bulk copies
                src, desc, row0 = gathered_ptr, g_desc, q * m + lo
            if USE_DESC:  # one call site per path: another would hold more pipeline buffers
                acc = gemm_tile_desc(desc, b_desc, row0, 0, tn * BLOCK_N, 0, K, BLOCK_M, BLOCK_N,
                                     BLOCK_K, STAGES, "ieee")
            else:
                acc = gemm_tile(src + row0.to(tl.int64) * K, b_ptr, rows, N, K, K, 1, N, 1, 0,
                                tn, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, EVEN_K, "ieee", False)
            r, cols = tl.arange(0, BLOCK_M), tn * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(out_ptr + (q * m + lo + r)[:, None].to(tl.int64) * N + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty),
                     mask=(r < rows)[:, None] & (cols < N)[None, :])  # not the next shard's
            t = tl.atomic_add(claim_ptr, 1, sem="relaxed", scope="gpu").to(tl.int32)
    if pol.end_call_last(ctx, call):  # every claim of this call is made: the next counts from 0
        tl.atomic_xchg(claim_ptr, 0, sem="relaxed", scope="gpu")


def main(world, m=None, N=None, K=None, dtype=None):
    dev, W, gpu = world.device, world.world_size, world.device.type == "cuda"
    dtype = dtype or (torch.bfloat16 if gpu else torch.float32)  # fp16 works too on GPUs
    m, N, K = (m or 8192 // W, N or 8192, K or 8192) if gpu else (m or 37, N or 50, K or 45)
    cfg = default_config(dtype, dev)  # the library's GEMM tiles (small on the interpreter)
    tiles = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                 STAGES=cfg.num_stages, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    chunk_rows = cfg.block_m * triton.cdiv(triton.cdiv(m, cfg.block_m), MAX_CHUNKS)  # tile rows
    chunks = triton.cdiv(m, chunk_rows)
    flags = (((W, chunks), "ready"), ((W,), "free"), ((1,), "tiles"))
    ws = Workspace(world, Workspace.bytes_for(((W * m, K), dtype),
                                              *((sh, torch.int64) for sh, _ in flags)))
    gathered = ws.tensor((W * m, K), dtype)
    ready, free, claimed = (ws.flags(sh, name) for sh, name in flags)
    # 16 of 132 H200 SMs send on 2 ranks (~200 GB/s: more than the GEMM reads), then compute
    senders = min(max(1, ws.sm_count * (W - 1) // (4 * W)), (W - 1) * chunks, ws.sm_count - 1)
    g = torch.Generator(dev).manual_seed(world.rank)
    a = torch.randn(m, K, device=dev, generator=g).to(dtype)
    b = (torch.randn(K, N, device=dev, generator=torch.Generator(dev).manual_seed(7))
         / K ** 0.5).to(dtype)  # the same on every rank
    out = torch.empty(W * m, N, device=dev, dtype=dtype)
    # (None, None) where pointer loads must do; made once: a, b, gathered keep their addresses
    a_desc, b_desc = tile_descriptors(a, b, cfg, world.facts)
    g_desc = tile_descriptors(gathered, b, cfg, world.facts)[0]

    def ours():
        ws.launch(allgather_gemm_kernel, (ws.sm_count,), a, b, out, gathered, ready, free,
                  claimed, a_desc, g_desc, b_desc, m, N, K, chunk_rows, senders,
                  EVEN_K=K % cfg.block_k == 0, COPY=8192, USE_DESC=a_desc is not None,
                  JOIN=gpu, **tiles)

    full = torch.empty(W * m, K, device=dev, dtype=dtype)
    dist = torch.distributed  # (all_gather_single is the newer name of the same collective)
    gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def torch_path():
        gather_into(full, a)
        return full @ b

    ok = True
    for _ in range(3):  # fresh data each call, back to back
        a.copy_(torch.randn(m, K, device=dev, generator=g).to(dtype))
        out.fill_(float("nan"))
        gathered.fill_(float("nan"))  # a tile that read rows before they came would show
        ours()
        gather_into(full, a)
        want = full.float() @ b.float()
        err = ((out.float() - want).abs().max() / want.abs().max()).item()
        ok &= err < (2e-2 if dtype != torch.float32 else 1e-4)  # NaN fails too
    ws.synchronize()
    paths = {"portable_overlap.language": ours, "torch all_gather + matmul": torch_path}
    if gpu:  # the library's op: the same design, with a tile order by arrival time
        builtin = AllGatherMatmul(world, m * K, transport="stores")
        paths["AllGatherMatmul(stores)"] = lambda: builtin(a, b)
    ms = time_paths(paths, world, iters=60 if gpu else 1, warmup=3 if gpu else 0, graph=gpu)
    for w in (ws, builtin) if gpu else (ws,):
        w.close()
    return report(world, f"all_gather(a [{m}, {K}] per rank) @ b [{K}, {N}], {dtype}, {W} ranks "
                  f"({dev.type}): product", ok, ms, graph=gpu,
                  rate=(lambda t: f", {2 * W * m * N * K / t / 1e9:.0f} TFLOP/s") if gpu else None)


if __name__ == "__main__":
    sys.exit(max(run_on_ranks(main)))
