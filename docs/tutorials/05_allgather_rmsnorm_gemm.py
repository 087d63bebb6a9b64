"""Tutorial 5: AllGather + RMSNorm + GEMM (sequence parallel; not a library op).

Rank r holds ``x_r`` [m, K] (a slice of the sequence), every rank the same ``gamma`` [K] and ``w``
[K, N]; every rank computes ``out = rms_norm(cat(x_0, ..., x_{W-1}), gamma, eps) @ w`` [W*m, N].
As gamma scales the K axis the product sums over, ``rms_norm(x) @ w == rstd(x)[:, None] * (x @
w_gamma)`` with ``w_gamma = gamma[:, None] * w`` (made once: both are weights). Each rank computes
the rstd of its own rows (one read of its shard); the rows travel with their rstd as in tutorial
3, whose GEMM tiles are scaled by their rows' rstd at the end. (Summing squares in the K loop from
the tiles the dot reads is wrong with Triton 3.6 once the loop is pipelined: triton-lang/triton
issue 6691.) It checks itself against torch in fp32 (rows of unequal scales) and times it.

    torchrun --nproc-per-node 2 docs/tutorials/05_allgather_rmsnorm_gemm.py     # GPUs
    python docs/tutorials/05_allgather_rmsnorm_gemm.py                          # CPU-emulated
"""
import sys

import torch
import triton
import triton.language as tl

import portable_overlap.language as pol
from portable_overlap import Workspace
from portable_overlap.ops.matmul.api import default_config, tile_descriptors
from portable_overlap.testing import report, run_on_ranks, time_paths
from portable_overlap.tiles.gemm import gemm_tile, gemm_tile_desc, grouped_tile


@triton.jit
def row_rstd_kernel(x_ptr, rstd_ptr, m, K, eps, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """``rstd_ptr[i] = 1 / sqrt(mean(x[i]**2) + eps)`` for rows i of x [m, K], in fp32."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    squares = tl.zeros((BLOCK_R,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + k[None, :],
                    mask=(rows < m)[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
        squares += tl.sum(x * x, axis=1)
    tl.store(rstd_ptr + rows, tl.rsqrt(squares / K + eps), mask=rows < m)


@triton.jit
def allgather_rmsnorm_gemm_kernel(
        ctx, x_ptr, w_ptr, out_ptr, gathered_ptr, rstd_ptr, ready_ptr, free_ptr, x_desc, g_desc,
        w_desc, m, N, K, chunk_rows, senders, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr, EVEN_K: tl.constexpr,
        USE_DESC: tl.constexpr):
    call, me, world, p = pol.begin_call(ctx), pol.rank(ctx), pol.num_ranks(ctx), pol.program()
    chunks = tl.cdiv(m, chunk_rows)  # (no program waits for one of this launch: tutorial 3)
    if p == 0:  # "my gathered rows and rstd are free for this call"
        pol.announce_call(ctx, free_ptr, call)
    if p < senders:  # item i: chunk i % chunks (rows, then their rstd) to the peer at step 1 + ..
        for i in range(p, (world - 1) * chunks, senders):
            q = pol.peer_at(1 + i // chunks, me, world)
            pol.wait_free(ctx, free_ptr, q, call)
            lo = i % chunks * chunk_rows
            rows = tl.minimum(lo + chunk_rows, m) - lo
            pol.put(ctx, gathered_ptr + (me * m + lo).to(tl.int64) * K,
                    x_ptr + lo.to(tl.int64) * K, rows.to(tl.int64) * K, q, 8192)
            pol.put(ctx, rstd_ptr + me * m + lo, rstd_ptr + me * m + lo, rows, q, 1024)
            pol.signal(ctx, ready_ptr + me * chunks + i % chunks, q, call)  # releases both
    else:
        tiles_m, tiles_n = tl.cdiv(m, BLOCK_M), tl.cdiv(N, BLOCK_N)
        per_shard = tiles_m * tiles_n
        for t in range(p - senders, world * per_shard, pol.num_programs() - senders):
            q = pol.peer_at(world - t // per_shard, me, world)  # mine, then rank me-1's, ...
            tm, tn = grouped_tile(t % per_shard, tiles_m, tiles_n, GROUP_M)
            lo, rows = tm * BLOCK_M, tl.minimum(m - tm * BLOCK_M, BLOCK_M)
            src, desc, row0 = x_ptr, x_desc, lo  # this rank's rows: no wait
            if q != me:  # chunks are whole tile rows: one flag covers the tile
                pol.wait(ctx, ready_ptr + q * chunks + lo // chunk_rows, call, q)
                pol.fence_bulk_reads()  # the wait's acquire, then the tile's bulk copies
                src, desc, row0 = gathered_ptr, g_desc, q * m + lo
            if USE_DESC:
                acc = gemm_tile_desc(desc, w_desc, row0, 0, tn * BLOCK_N, 0, K, BLOCK_M, BLOCK_N,
                                     BLOCK_K, STAGES, "ieee")
            else:
                acc = gemm_tile(src + row0.to(tl.int64) * K, w_ptr, rows, N, K, K, 1, N, 1, 0,
                                tn, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, EVEN_K, "ieee", False)
            r, cols = tl.arange(0, BLOCK_M), tn * BLOCK_N + tl.arange(0, BLOCK_N)
            rstd = tl.load(rstd_ptr + q * m + lo + r, mask=r < rows, other=0.0)
            tl.store(out_ptr + (q * m + lo + r)[:, None].to(tl.int64) * N + cols[None, :],
                     (acc * rstd[:, None]).to(out_ptr.dtype.element_ty),
                     mask=(r < rows)[:, None] & (cols < N)[None, :])
    pol.end_call(ctx, call)


def main(world, m=None, N=None, K=None, dtype=None, eps=1e-6):
    dev, W, gpu = world.device, world.world_size, world.device.type == "cuda"
    dtype = dtype or (torch.bfloat16 if gpu else torch.float32)  # fp16 works too on GPUs
    m, N, K = (m or 8192 // W, N or 8192, K or 8192) if gpu else (m or 37, N or 50, K or 45)
    cfg = default_config(dtype, dev)  # the library's GEMM tiles (small on the interpreter)
    tiles = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                 STAGES=cfg.num_stages, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    chunk_rows = cfg.block_m * triton.cdiv(triton.cdiv(m, cfg.block_m), 256)  # <= 256 chunks
    chunks = triton.cdiv(m, chunk_rows)
    ws = Workspace(world, Workspace.bytes_for(((W * m, K), dtype), ((W * m,), torch.float32),
                   ((W, chunks), torch.int64), ((W,), torch.int64)), name="allgather_rmsnorm_gemm")
    gathered, rstd = ws.tensor((W * m, K), dtype), ws.tensor((W * m,), torch.float32)
    ready, free = ws.flags((W, chunks), "ready"), ws.flags((W,), "free")
    senders = min(max(1, ws.sm_count * (W - 1) // (4 * W)), (W - 1) * chunks, ws.sm_count - 1)
    g, same = torch.Generator(dev).manual_seed(world.rank), torch.Generator(dev).manual_seed(7)
    x, out = gathered.new_empty(m, K), gathered.new_empty(W * m, N)  # on dev, in dtype
    gamma = (1 + 0.5 * torch.rand(K, device=dev, generator=same)).to(dtype)  # same on every rank
    w = (torch.randn(K, N, device=dev, generator=same) / K ** 0.5).to(dtype)
    w_gamma = (gamma.float()[:, None] * w.float()).to(dtype)  # once: both are weights
    x_desc, w_desc = tile_descriptors(x, w_gamma, cfg, world.facts)  # (None, None): pointers
    g_desc = tile_descriptors(gathered, w_gamma, cfg, world.facts)[0]

    def ours():  # this rank's rstd into its slot of rstd, then the fused kernel
        row_rstd_kernel[(triton.cdiv(m, 16),)](x, rstd[world.rank * m:], m, K, eps, BLOCK_R=16,
                                               BLOCK_K=256 if gpu else 16)
        ws.launch(allgather_rmsnorm_gemm_kernel, (ws.sm_count,), x, w_gamma, out, gathered,
                  rstd, ready, free, x_desc, g_desc, w_desc, m, N, K, chunk_rows, senders,
                  EVEN_K=K % cfg.block_k == 0, USE_DESC=x_desc is not None, **tiles)

    full, dist = torch.empty(W * m, K, device=dev, dtype=dtype), torch.distributed
    gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def torch_path():
        gather_into(full, x)
        return torch.nn.functional.rms_norm(full, (K,), gamma, eps) @ w

    ok = True
    for _ in range(3):  # fresh data each call, back to back
        x.copy_(torch.randn(m, K, device=dev, generator=g)
                * torch.rand(m, 1, device=dev, generator=g) * 4)
        for poisoned in (out, gathered, rstd):  # a tile that read rows before they came shows
            poisoned.fill_(float("nan"))
        ours()
        gather_into(full, x)
        want = torch.nn.functional.rms_norm(full.float(), (K,), gamma.float(), eps) @ w.float()
        err = ((out.float() - want).abs().max() / want.abs().max()).item()
        ok &= err < (2e-2 if dtype != torch.float32 else 1e-4)  # NaN fails too
    ws.synchronize()
    ms = time_paths({"portable_overlap.language": ours,
                     "torch all_gather + rms_norm + matmul": torch_path}, world,
                    iters=60 if gpu else 1, warmup=3 if gpu else 0, graph=gpu)
    ws.close()
    return report(world, f"rms_norm(all_gather(x [{m}, {K}] per rank)) @ w [{K}, {N}], {dtype}, "
                  f"{W} ranks ({dev.type}): result", ok, ms, graph=gpu,
                  rate=(lambda t: f", {2 * W * m * N * K / t / 1e9:.0f} TFLOP/s") if gpu else None)


if __name__ == "__main__":
    sys.exit(max(run_on_ranks(main)))
