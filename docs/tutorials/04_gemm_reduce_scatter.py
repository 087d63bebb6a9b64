"""Tutorial 4: GEMM + ReduceScatter in one kernel, each partial tile stored in its owner's heap.

Rank q holds ``a_q`` [M, K] and ``b_q`` [K, N] (the full K split over the ranks); rank r keeps
row block r of the sum: ``out_r = (sum_q a_q @ b_q)[M*r//W : M*(r+1)//W]``. Tile T of block d
is program ``(T + d * tiles_per_block) % P``'s on every rank, so the P programs share all the
blocks' tiles evenly (a stride within each block would give 2 blocks of 1024 tiles on 132
programs 2 x 8 rounds, where 15.5 do). Each program walks the blocks me+1, me+2, ...
(``pol.peer_at``: the peers' partials travel while this rank computes), its own last. A peer's
partial tile goes straight into slot ``me`` of the owner's ``recv`` [W, rows per block, N]
(``pol.store_remote``, after the owner's ``pol.announce_call``: tutorial 2's "free" flag,
``pol.wait_free``); once the program's tiles of that block are stored it raises one flag,
``ready[me][p]`` in the owner's heap. One per tile would cost more than the flags: a release
holds the program until its stores have landed in the peer, so the next tile's multiply could
not run under this one's trip over the link. A tile of its own block stays in registers (its
``recv`` slot is never written): the program waits for ``ready[q][p]`` of every peer q and adds
their partials in float32 before the one store. Program p of each peer sent them: every wait is
on the same program of a peer, never on another program of this launch, so the kernel is right
whether the programs run at once (GPUs) or one after another (the interpreter). Tiles load
through tensor descriptors where the device has bulk tensor copies (TMA), else through pointers
(tutorial 3).

    torchrun --nproc-per-node 2 docs/tutorials/04_gemm_reduce_scatter.py     # GPUs
    python docs/tutorials/04_gemm_reduce_scatter.py                          # CPU-emulated ranks

It prints whether every rank's block is right (against torch in fp32) and the time against
torch (matmul, then NCCL reduce-scatter) and ``MatmulReduceScatter(transport="stores")``.
"""
import sys

import torch
import triton
import triton.language as tl

import portable_overlap.language as pol
from portable_overlap import MatmulReduceScatter, Workspace
from portable_overlap.ops.matmul.api import default_config, tile_descriptors
from portable_overlap.testing import report, run_on_ranks, time_paths
from portable_overlap.tiles.gemm import gemm_tile, gemm_tile_desc, grouped_tile


@triton.jit
def gemm_reduce_scatter_kernel(ctx, a_ptr, b_ptr, out_ptr, recv_ptr, ready_ptr, free_ptr, a_desc,
                               b_desc, M, N, K, block_rows, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               GROUP_M: tl.constexpr, STAGES: tl.constexpr,
                               EVEN_K: tl.constexpr, USE_DESC: tl.constexpr):
    call = pol.begin_call(ctx)
    me, world, p, P = pol.rank(ctx), pol.num_ranks(ctx), pol.program(), pol.num_programs()
    tiles_m, tiles_n = tl.cdiv(block_rows, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_block = tiles_m * tiles_n  # every block is cut alike; tiles past a short one's end skip
    if p == 0:  # "my recv is free for this call": my previous call has finished reading it
        pol.announce_call(ctx, free_ptr, call)
    for s in range(1, world + 1):  # blocks me+1, ..., me-1, then mine: one GEMM call site
        d = pol.peer_at(s, me, world)
        lo = M * d // world
        rows = M * (d + 1) // world - lo
        pol.wait_free(ctx, free_ptr, d, call)  # (at once for d == me)
        for T in range((p - d * per_block % P + P) % P, per_block, P):
            tm, tn = grouped_tile(T, tiles_m, tiles_n, GROUP_M)
            row0 = tm * BLOCK_M
            if row0 < rows:
                if USE_DESC:  # rows past the block are zeros or the next block's: not stored
                    acc = gemm_tile_desc(a_desc, b_desc, lo + row0, 0, tn * BLOCK_N, 0, K, BLOCK_M,
                                         BLOCK_N, BLOCK_K, STAGES, "ieee")
                else:
                    acc = gemm_tile(a_ptr + (lo + row0).to(tl.int64) * K, b_ptr, rows - row0, N,
                                    K, K, 1, N, 1, 0, tn, BLOCK_M, BLOCK_N, BLOCK_K, STAGES,
                                    EVEN_K, "ieee", False)
                r = row0 + tl.arange(0, BLOCK_M)
                cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
                mask = (r < rows)[:, None] & (cols < N)[None, :]
                offs = r[:, None].to(tl.int64) * N + cols[None, :]  # in the block
                slot = block_rows.to(tl.int64) * N  # elements per slot of recv
                if d != me:  # a peer's partial: into its recv, slot me
                    pol.store_remote(ctx, recv_ptr + me * slot + offs,
                                     acc.to(recv_ptr.dtype.element_ty), d, mask)
                else:  # my block: add the peers' partials, in the order they were sent
                    for i in range(1, world):
                        q = pol.peer_at(world - i, me, world)
                        pol.wait(ctx, ready_ptr + q * P + p, call, q)
                        acc += tl.load(recv_ptr + q * slot + offs, mask=mask,
                                       other=0.0).to(tl.float32)
                    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        if d != me:  # one release per (program, block), after its last tile's stores
            pol.signal(ctx, ready_ptr + me * P + p, d, call)
    pol.end_call(ctx, call)


def main(world, M=None, N=None, K=None, dtype=None):
    dev, W, gpu = world.device, world.world_size, world.device.type == "cuda"
    dtype = dtype or (torch.bfloat16 if gpu else torch.float32)  # fp16 works too on GPUs
    M, N, K = (M or 8192, N or 8192, K or 8192 // W) if gpu else (M or 74, N or 50, K or 29)
    cfg = default_config(dtype, dev)  # the library's GEMM tiles (small on the interpreter)
    tiles = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                 STAGES=cfg.num_stages, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    block_rows = triton.cdiv(M, W)
    P = world.facts.sm_count  # the grid: one ready flag per (source rank, program)
    ws = Workspace(world, Workspace.bytes_for(((W, block_rows, N), dtype),
                                              ((W, P), torch.int64), ((W,), torch.int64)),
                   name="gemm_reduce_scatter")
    recv = ws.tensor((W, block_rows, N), dtype)
    ready, free = ws.flags((W, P), "ready"), ws.flags((W,), "free")
    g = torch.Generator(dev).manual_seed(world.rank)
    a, b = torch.empty(M, K, device=dev, dtype=dtype), torch.empty(K, N, device=dev, dtype=dtype)
    lo, hi = M * world.rank // W, M * (world.rank + 1) // W
    out = torch.empty(hi - lo, N, device=dev, dtype=dtype)
    # (None, None) where pointer loads must do; made once: a and b keep their addresses
    a_desc, b_desc = tile_descriptors(a, b, cfg, world.facts)

    def ours():
        ws.launch(gemm_reduce_scatter_kernel, (P,), a, b, out, recv, ready, free,
                  a_desc, b_desc, M, N, K, block_rows, EVEN_K=K % cfg.block_k == 0,
                  USE_DESC=a_desc is not None, **tiles)

    dist, scattered = torch.distributed, torch.empty(M // W, N, device=dev, dtype=dtype)

    def torch_path():  # torch's blocks are equal: M // W rows each
        dist.reduce_scatter_tensor(scattered, a @ b)

    ok = True
    for _ in range(3):  # fresh data each call, back to back
        a.copy_(torch.randn(M, K, device=dev, generator=g))
        b.copy_(torch.randn(K, N, device=dev, generator=g) / (W * K) ** 0.5)
        out.fill_(float("nan"))
        recv.fill_(float("nan"))  # a tile that read partials before they came would show
        ours()
        want = a.float() @ b.float()
        dist.all_reduce(want)
        diff = (out.float() - want[lo:hi]).abs()  # (no rows here where M < W)
        err = (diff.max() / want.abs().max()).item() if diff.numel() else 0.0
        ok &= err < (2e-2 if dtype != torch.float32 else 1e-4)  # NaN fails too
    ws.synchronize()
    paths = {"portable_overlap.language": ours}
    if M % W == 0:  # torch's reduce-scatter takes equal blocks only
        paths["torch matmul + reduce_scatter"] = torch_path
    if gpu:  # the library's op: the same design
        builtin = MatmulReduceScatter(world, M, N, transport="stores")
        paths["MatmulReduceScatter(stores)"] = lambda: builtin(a, b)
    ms = time_paths(paths, world, iters=60 if gpu else 1, warmup=3 if gpu else 0, graph=gpu)
    for w in (ws, builtin) if gpu else (ws,):
        w.close()
    return report(world, f"reduce_scatter(a [{M}, {K}] @ b [{K}, {N}] on each rank), {dtype}, "
                  f"{W} ranks ({dev.type}): block", ok, ms, graph=gpu,
                  rate=(lambda t: f", {2 * W * M * N * K / t / 1e9:.0f} TFLOP/s") if gpu else None)


if __name__ == "__main__":
    sys.exit(max(run_on_ranks(main)))
