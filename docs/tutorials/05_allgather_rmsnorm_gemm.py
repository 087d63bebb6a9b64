"""Tutorial 5: AllGather + RMSNorm + GEMM in one kernel (sequence parallel; not a library op).

Rank r holds ``x_r`` [m, K] (a slice of the sequence), every rank the same ``gamma`` [K] and ``w``
[K, N]; every rank computes ``out = rms_norm(cat(x_0, ..., x_{W-1}), gamma, eps) @ w`` [W*m, N],
the rows travelling as in tutorial 3 (same senders, flags, order, descriptors). The norm needs no
pass of its own: ``rms_norm(x) @ w == rstd(x)[:, None] * (x @ (gamma[:, None] * w))``, with
``rstd(x) = 1 / sqrt(mean(x**2, 1) + eps)``, as gamma scales the K axis the product sums over;
gamma and w are weights, so the host makes ``w_gamma = gamma[:, None] * w`` once. The kernel is
tutorial 3's GEMM with ``w_gamma`` plus each row's sum of squares from the same tiles (read from
shared memory where TMA put them: the tiles the tensor cores read stay untouched), then scales
the rows by ``rstd``. Multiplying x tiles by gamma in the K loop would take them through registers.

    torchrun --nproc-per-node 2 docs/tutorials/05_allgather_rmsnorm_gemm.py     # GPUs
    python docs/tutorials/05_allgather_rmsnorm_gemm.py                          # CPU-emulated

It checks itself against torch in fp32 (rows of unequal scales: a wrong norm shows) and times it.
"""
import sys

import torch
import triton
import triton.language as tl

import portable_overlap.language as pol
from portable_overlap import Workspace
from portable_overlap.ops.matmul.api import default_config, tile_descriptors
from portable_overlap.testing import run_on_ranks, time_call
from portable_overlap.tiles.gemm import grouped_tile, tile_offsets


@triton.jit
def rmsnorm_gemm_tile(x_ptr, x_desc, row0, rows, w_ptr, w_desc, N, K, eps, tn,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      STAGES: tl.constexpr, USE_DESC: tl.constexpr):
    """The fp32 tile ``rms_norm(x[row0:], gamma) @ w[:, tn*BLOCK_N:]``, unmasked (w: w_gamma)."""
    x_offs, w_offs, k = tile_offsets(rows, N, K, 1, N, 1, 0, tn, BLOCK_M, BLOCK_N, BLOCK_K)
    acc, squares = tl.zeros((BLOCK_M, BLOCK_N), tl.float32), tl.zeros((BLOCK_M,), tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        if USE_DESC:
            x = x_desc.load([row0, k0])
            w = w_desc.load([k0, tn * BLOCK_N])
        else:  # x_ptr: at row0
            x = tl.load(x_ptr + x_offs + k0, mask=(k0 + k < K)[None, :], other=0.0)
            w = tl.load(w_ptr + w_offs + k0 * N, mask=(k0 + k < K)[:, None], other=0.0)
        squares += tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=1)
        acc = tl.dot(x, w, acc, input_precision="ieee")
    return acc * tl.rsqrt(squares / K + eps)[:, None]


@triton.jit
def allgather_rmsnorm_gemm_kernel(
        ctx, x_ptr, w_ptr, out_ptr, gathered_ptr, ready_ptr, free_ptr, x_desc, g_desc, w_desc, m,
        N, K, eps, chunk_rows, senders, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr, USE_DESC: tl.constexpr):
    call, me, world, p = pol.begin_call(ctx), pol.rank(ctx), pol.num_ranks(ctx), pol.program()
    chunks = tl.cdiv(m, chunk_rows)  # (no program waits for one of this launch: tutorial 3)
    if p == 0:  # "my gathered is free for this call": my previous call has finished reading it
        pol.announce_call(ctx, free_ptr, call)
    if p < senders:  # item i: chunk i % chunks to the peer at step 1 + i // chunks
        for i in range(p, (world - 1) * chunks, senders):
            q = pol.peer_at(1 + i // chunks, me, world)
            pol.wait_free(ctx, free_ptr, q, call)
            lo = i % chunks * chunk_rows
            n = (tl.minimum(lo + chunk_rows, m) - lo).to(tl.int64) * K
            pol.put(ctx, gathered_ptr + (me * m + lo).to(tl.int64) * K,
                    x_ptr + lo.to(tl.int64) * K, n, q, 8192)  # 16 KiB of bf16 per step
            pol.signal(ctx, ready_ptr + me * chunks + i % chunks, q, call)
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
            y = rmsnorm_gemm_tile(src + row0.to(tl.int64) * K, desc, row0, rows, w_ptr, w_desc,
                                  N, K, eps, tn, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, USE_DESC)
            r, cols = tl.arange(0, BLOCK_M), tn * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(out_ptr + (q * m + lo + r)[:, None].to(tl.int64) * N + cols[None, :],
                     y.to(out_ptr.dtype.element_ty), mask=(r < rows)[:, None] & (cols < N)[None, :])
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
    ws = Workspace(world, Workspace.bytes_for(((W * m, K), dtype), ((W, chunks), torch.int64),
                                              ((W,), torch.int64)), name="allgather_rmsnorm_gemm")
    gathered = ws.tensor((W * m, K), dtype)
    ready, free = ws.flags((W, chunks), "ready"), ws.flags((W,), "free")
    senders = min(max(1, ws.sm_count * (W - 1) // (4 * W)), (W - 1) * chunks, ws.sm_count - 1)
    g, same = torch.Generator(dev).manual_seed(world.rank), torch.Generator(dev).manual_seed(7)
    x, out = gathered.new_empty(m, K), gathered.new_empty(W * m, N)  # on dev, in dtype
    gamma = (1 + 0.5 * torch.rand(K, device=dev, generator=same)).to(dtype)  # same on every rank
    w = (torch.randn(K, N, device=dev, generator=same) / K ** 0.5).to(dtype)
    w_gamma = (gamma.float()[:, None] * w.float()).to(dtype)  # once: both are weights
    x_desc, w_desc = tile_descriptors(x, w_gamma, cfg, world.facts)  # (None, None): pointers
    g_desc = tile_descriptors(gathered, w_gamma, cfg, world.facts)[0]

    def ours():
        ws.launch(allgather_rmsnorm_gemm_kernel, (ws.sm_count,), x, w_gamma, out, gathered,
                  ready, free, x_desc, g_desc, w_desc, m, N, K, eps, chunk_rows, senders,
                  USE_DESC=x_desc is not None, **tiles)

    full = torch.empty(W * m, K, device=dev, dtype=dtype)
    dist = torch.distributed  # (all_gather_single is the newer name of the same collective)
    gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def torch_path():
        gather_into(full, x)
        return torch.nn.functional.rms_norm(full, (K,), gamma, eps) @ w

    ok = True
    for _ in range(3):  # fresh data each call, back to back
        x.copy_(torch.randn(m, K, device=dev, generator=g)
                * torch.rand(m, 1, device=dev, generator=g) * 4)
        out.fill_(float("nan"))
        gathered.fill_(float("nan"))  # a tile that read rows before they came would show
        ours()
        gather_into(full, x)
        want = torch.nn.functional.rms_norm(full.float(), (K,), gamma.float(), eps) @ w.float()
        err = ((out.float() - want).abs().max() / want.abs().max()).item()
        ok &= err < (2e-2 if dtype != torch.float32 else 1e-4)  # NaN fails too
    ws.synchronize()
    ms = {name: time_call(f, world, iters=30 if gpu else 1, warmup=3 if gpu else 0, graph=gpu)
          for name, f in (("portable_overlap.language", ours),
                          ("torch all_gather + rms_norm + matmul", torch_path))}
    ws.close()
    oks = world.all_gather_object(ok)
    if world.rank == 0:
        print(f"rms_norm(all_gather(x [{m}, {K}] per rank)) @ w [{K}, {N}], {dtype}, {W} ranks "
              f"({dev.type}): result right on every rank: {all(oks)}")
        for name, t in ms.items():
            print(f"  {name}: {t:.3f} ms" + (f", {2 * W * m * N * K / t / 1e9:.0f} TFLOP/s"
                  f" (slowest rank's median, graph replay)" if gpu else " (slowest rank's median)"))
    return 0 if all(oks) else 1


if __name__ == "__main__":
    sys.exit(max(run_on_ranks(main)))
