"""Fused GEMV + AllReduce: one persistent Triton kernel, two-phase direct all-reduce by stores.

Output columns are cut into blocks of BLOCK_N; block ``b`` is the ``i``-th block of program
``pid = b % G`` (``i = b // G``) and is *owned* by rank ``(i + pid) % world``, so every program
owns about 1/world of its blocks and the owners are spread over the programs. Program ``pid`` of
every rank handles the same blocks, which is what makes one flag per (program, peer) enough.

On rank r, program pid:

1. computes the partial ``x_r @ W_rᵀ`` of the blocks other ranks own, first (communication-aware
   order), and stores each fp32 tile straight into the owner's ``partial[r]`` slot in the owner's
   heap (zero-copy: no staging buffer, no copy kernel);
2. signals ``ready[r][pid]`` on every peer (release, after a CTA barrier);
3. computes the blocks it owns and keeps its own partial in ``partial[r]`` of its own heap;
4. waits (acquire, bounded) for ``ready[q][pid]`` of every peer q, sums ``partial[0..world-1]``
   in that fixed order, casts, and stores the result to its output and into every peer's
   ``result`` buffer; signals ``bcast[r][pid]`` on every peer;
5. waits for ``bcast[q][pid]`` of every peer and copies the blocks peers own from ``result`` to
   the output.

Every rank ends with the same bits: each block is summed once, by its owner, in rank order.
Flags carry ``(shape tag << 32) | epoch``; the epoch lives in the heap (``ctl``) and is advanced by
the last program of each launch, so the kernel can be replayed from a CUDA graph unchanged.
"""
import triton
import triton.language as tl

from ...shmem.device import (begin_call, call_flag, end_call, live, peer_ptr,
                             signal_peers, wait_peers)
from ...tiles.gemv import gemv_tile

#: flag kinds named in timeout reports
FLAG_READY = tl.constexpr(1)
FLAG_BCAST = tl.constexpr(2)
FLAG_NAMES = {1: "partials-ready", 2: "result-broadcast"}


# Every rank must run the same compiled code (same registers, so the same resident grid, which
# the shape tag includes): the rank number and per-rank counts are never specialized on (the
# JIT would bake rank == 1 into rank 1's kernel only).
@triton.jit(do_not_specialize=["rank"])
def gemv_allreduce_kernel(
    x_ptr, w_ptr, out_ptr,  # user tensors: x [M, K], w [N, K], out [M, N]
    partial_ptr, result_ptr,  # heap: fp32 [world, M, N] partials, [M, N] results (out dtype)
    ready_ptr, bcast_ptr, ctl_ptr,  # heap: int64 flags [world, G_MAX] x2, int64 [epoch, count]
    clock_ptr, bases_ptr, status_addr,  # heap call clock; int64 [world] heap bases; status board
    M, N, K, stride_xm, stride_wn, n_blocks, G, rank, world, tag, timeout_us,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, G_MAX: tl.constexpr,
):
    pid = tl.program_id(0)  # G == the grid size (an argument: loop bounds must not depend on
    #                         program_id, which the interpreter keeps as a 1-element array)
    epoch = begin_call(ctl_ptr)
    ok = live(clock_ptr)
    flag = call_flag(epoch, tag, ok)
    n_rounds = tl.cdiv(n_blocks, G)  # program pid takes blocks pid, pid + G, ... < n_blocks
    offs_m = tl.arange(0, BLOCK_M)
    offs_nb = tl.arange(0, BLOCK_N)
    m_mask = offs_m[:, None] < M
    MN = M * N
    tile_off = offs_m[:, None] * N + offs_nb[None, :]

    # 1. blocks that peers own: compute first, store into the owner's partial[rank] (not once
    #    the context is out of step: ``ok`` only masks the stores, so the tile's loads do not
    #    wait for the atomic that reads it)
    for i in range(0, n_rounds):
        owner = (i + pid) % world
        if (owner != rank) & (pid + i * G < n_blocks):
            n0 = (pid + i * G) * BLOCK_N
            acc = gemv_tile(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, n0, BLOCK_M, BLOCK_N,
                            BLOCK_K, NUM_STAGES, EVEN_K, EVEN_N, PRECISION, UPCAST)
            dst = peer_ptr(partial_ptr + rank * MN + n0, bases_ptr, rank, owner)
            tl.store(dst + tile_off, acc, mask=m_mask & ((n0 + offs_nb)[None, :] < N) & ok)
    # 2. tell every peer this program's partials for it have landed
    signal_peers(ready_ptr, bases_ptr, pid, rank, world, flag, G_MAX)

    # 3. blocks this rank owns: own partial into the local slot (read back in step 4)
    for i in range(0, n_rounds):
        owner = (i + pid) % world
        if (owner == rank) & (pid + i * G < n_blocks):
            n0 = (pid + i * G) * BLOCK_N
            acc = gemv_tile(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, n0, BLOCK_M, BLOCK_N,
                            BLOCK_K, NUM_STAGES, EVEN_K, EVEN_N, PRECISION, UPCAST)
            dst = partial_ptr + rank * MN + n0
            tl.store(dst + tile_off, acc, mask=m_mask & ((n0 + offs_nb)[None, :] < N))

    # 4. reduce owned blocks in rank order, store locally and into every peer's result buffer
    ok = wait_peers(ready_ptr, FLAG_READY, pid, rank, world, epoch, tag, clock_ptr,
                    timeout_us, status_addr, ok, G_MAX)
    if ok:
        for i in range(0, n_rounds):
            owner = (i + pid) % world
            if (owner == rank) & (pid + i * G < n_blocks):
                n0 = (pid + i * G) * BLOCK_N
                mask = m_mask & ((n0 + offs_nb)[None, :] < N)
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for q in range(0, world):
                    total += tl.load(partial_ptr + q * MN + n0 + tile_off, mask=mask, other=0.0)
                y = total.to(out_ptr.dtype.element_ty)
                tl.store(out_ptr + n0 + tile_off, y, mask=mask)
                for q in range(0, world):
                    if q != rank:
                        dst = peer_ptr(result_ptr + n0, bases_ptr, rank, q)
                        tl.store(dst + tile_off, y, mask=mask)
    signal_peers(bcast_ptr, bases_ptr, pid, rank, world, call_flag(epoch, tag, ok), G_MAX)

    # 5. blocks peers own: their reduced tiles arrived in result; copy them to the output
    ok = wait_peers(bcast_ptr, FLAG_BCAST, pid, rank, world, epoch, tag, clock_ptr,
                    timeout_us, status_addr, ok, G_MAX)
    if ok:
        for i in range(0, n_rounds):
            owner = (i + pid) % world
            if (owner != rank) & (pid + i * G < n_blocks):
                n0 = (pid + i * G) * BLOCK_N
                mask = m_mask & ((n0 + offs_nb)[None, :] < N)
                y = tl.load(result_ptr + n0 + tile_off, mask=mask)
                tl.store(out_ptr + n0 + tile_off, y, mask=mask)
    end_call(ctl_ptr, epoch)
