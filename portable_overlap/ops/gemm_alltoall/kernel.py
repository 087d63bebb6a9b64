"""Fused dense GEMM + equal-split All-to-All by stores into the destination's heap.

Rank r computes ``c_r = a_r @ b_r`` ([M, N], from its own K, which no peer reads); rows
``[d·chunk, (d+1)·chunk)`` of ``c_r`` belong to rank d (``chunk = M / world``) and end in rows
``[r·chunk, (r+1)·chunk)`` of rank d's output, as ``torch.distributed.all_to_all_single`` on
``c_r`` would put them.

Program ``pid`` of rank r takes the tiles ``pid, pid + G, ...`` of the grouped order, with tile
rows rotated to start at rank r+1's chunk, so the rows r keeps come last (communication-aware).
A finished tile is stored where it belongs: rows r keeps straight into r's output, rows of rank d
into ``recv`` in d's heap, at the rows they take in d's output. Then, on rank r, program pid:

1. signals ``sent[r][pid]`` on every peer (release, after a CTA barrier);
2. waits for ``sent[q][pid]`` of every peer q (acquire, bounded);
3. copies from ``recv`` to its output the rows peer q's program pid sent it — it recomputes q's
   tile list (the schedule is a function of q, pid and the shapes), so no program waits for
   another program of its own launch;
4. takes a ticket; the last program of the launch publishes the epoch locally and
   ``consumed[r] = epoch`` in every peer's heap.

Before its first store into rank d's ``recv`` in a call, a program waits until ``consumed[d]``
holds the previous epoch: d has copied out the previous call's rows, so nothing is overwritten
while d still needs it (shapes may change between calls).
"""
import triton
import triton.language as tl

from ...shmem.device import (REFRESH_CALLS, await_free_once, begin_call, call_flag,
                             end_call_free, live, peer_buffer, refresh_words, signal_peers,
                             wait_peers)
from ...tiles.gemm import gemm_tile_auto, grouped_tile

FLAG_SENT = tl.constexpr(1)
FLAG_CONSUMED = tl.constexpr(2)
FLAG_NAMES = {1: "tiles-sent", 2: "recv-consumed"}


@triton.jit
def _tile_of(t, rank, world, chunk, num_pid_m, num_pid_n, BLOCK_M: tl.constexpr,
             GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of ``rank``'s t-th tile: grouped order, rows rotated so that the chunk of
    rank+1 comes first."""
    vm, pid_n = grouped_tile(t, num_pid_m, num_pid_n, GROUP_M)
    shift = (((rank + 1) % world) * chunk) // BLOCK_M
    return (vm + shift) % num_pid_m, pid_n


# Every rank must run the same compiled code (same registers, so the same resident grid, which
# the shape tag includes): the rank number and per-rank counts are never specialized on (the
# JIT would bake rank == 1 into rank 1's kernel only).
@triton.jit(do_not_specialize=["rank"])
def gemm_alltoall_kernel(
    a_ptr, b_ptr, out_ptr,  # a [M, K], b [K, N], out [M, N] (contiguous)
    recv_ptr, sent_ptr, consumed_ptr, ctl_ptr,  # heap: recv [M, N], int64 [world, G_MAX], [world], [2]
    clock_ptr, bases_ptr, status_addr,  # heap [2] (call clock); heap bases; status board
    M, N, K, stride_am, stride_ak, stride_bk, stride_bn, chunk, G, rank, world, tag, timeout_us,
    a_desc, b_desc,  # tensor descriptors of a and b when USE_DESC (else None): gemm_tile_desc
    USE_DESC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, G_MAX: tl.constexpr,
):
    pid = tl.program_id(0)
    epoch = begin_call(ctl_ptr)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    n_tiles = num_pid_m * num_pid_n
    ok = live(clock_ptr)
    cleared = tl.zeros((), tl.int64)  # bit d: rank d's recv is free for this call

    for i in range(0, tl.cdiv(n_tiles, G)):
        t = pid + i * G
        if t < n_tiles:
            pid_m, pid_n = _tile_of(t, rank, world, chunk, num_pid_m, num_pid_n, BLOCK_M, GROUP_M)
            acc = gemm_tile_auto(a_ptr, b_ptr, a_desc, b_desc, M, N, K, stride_am, stride_ak,
                                 stride_bk, stride_bn, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K,
                                 NUM_STAGES, EVEN_K, PRECISION, UPCAST, USE_DESC)
            y = acc.to(out_ptr.dtype.element_ty)
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols[None, :] < N
            d_first = (pid_m * BLOCK_M) // chunk
            d_last = (pid_m * BLOCK_M + BLOCK_M - 1) // chunk
            # a tile's rows may straddle two ranks' chunks: one masked store per rank it touches
            for d in range(0, world):  # bounds from arguments only (the interpreter needs that)
                if (d >= d_first) & (d <= d_last):
                    in_d = (rows >= d * chunk) & (rows < (d + 1) * chunk) & (rows < M)
                    offs = (rows - d * chunk + rank * chunk)[:, None].to(tl.int64) * N \
                        + cols[None, :]
                    if d == rank:
                        tl.store(out_ptr + offs, y, mask=in_d[:, None] & col_ok)
                    else:
                        # d must have copied out the previous call before we overwrite recv
                        ok, cleared = await_free_once(consumed_ptr, d, cleared, epoch,
                                                      clock_ptr, timeout_us, status_addr, pid,
                                                      FLAG_CONSUMED, ok)
                        if ok:
                            dst = peer_buffer(recv_ptr, bases_ptr, rank, d)
                            tl.store(dst + offs, y, mask=in_d[:, None] & col_ok)

    # 1-2. this program's tiles have landed everywhere: tell the peers, wait for theirs
    signal_peers(sent_ptr, bases_ptr, pid, rank, world, call_flag(epoch, tag, ok), G_MAX)
    ok = wait_peers(sent_ptr, FLAG_SENT, pid, rank, world, epoch, tag, clock_ptr, timeout_us,
                    status_addr, ok, G_MAX)

    # 3. copy out the rows each peer's program pid stored into recv
    if ok:
        my_lo = rank * chunk
        for q in range(0, world):
            if q != rank:
                for i in range(0, tl.cdiv(n_tiles, G)):
                    t = pid + i * G
                    if t < n_tiles:
                        pid_m, pid_n = _tile_of(t, q, world, chunk, num_pid_m, num_pid_n,
                                                BLOCK_M, GROUP_M)
                        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
                        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                        mine = (rows >= my_lo) & (rows < my_lo + chunk) & (rows < M)
                        offs = (rows - my_lo + q * chunk)[:, None].to(tl.int64) * N \
                            + cols[None, :]
                        mask = mine[:, None] & (cols[None, :] < N)
                        tl.store(out_ptr + offs, tl.load(recv_ptr + offs, mask=mask), mask=mask)

    # the words of programs past the grid, which follows the shape, every 2**30 calls
    # (``refresh_words``): at the end, where the tile's registers are free
    if (epoch & (REFRESH_CALLS - 1)) == 0:
        refresh_words(sent_ptr, bases_ptr, G, pid, G, rank, world,
                      call_flag(epoch, tag, live(clock_ptr)), G_MAX)
    # 4. the last program out publishes the epoch here and "recv consumed" on every peer
    end_call_free(ctl_ptr, epoch, consumed_ptr, bases_ptr, rank, world)
