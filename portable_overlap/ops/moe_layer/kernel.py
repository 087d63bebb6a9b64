"""The MoE layer's dispatch scatter, both expert GEMMs and the combine's row stores in one
persistent launch.

Runs after the dispatch's count and exchange launches (ops/moe_dispatch/kernel.py) and before
the combine's weighted sum (ops/moe_combine/kernel.py ``moe_combine_kernel``), in place of the
dispatch's scatter, the gated GEMM and the down GEMM. On rank r, with the dispatch's layout
(rows by source rank q, then local expert e, ``counts[q, e]`` rows per segment)::

    x = the dispatch's receive buffer (rows of every source, stored here by the sources)
    h[i] = silu(x[i] @ w_gate[e(i)]) * (x[i] @ w_up[e(i)])
    y[i] = h[i] @ w_down[e(i)]             # stored into source q(i)'s combine buffer at slot[i]

Roles and queues (every program of the grid is resident at once; the host caps the grid):

- programs ``0 .. senders-1`` store the rows into their destinations' heaps, as in
  ``moe_dispatch_swiglu`` (``swiglu_kernel.send_rows``);
- the gated GEMM's tiles come from two queues, this rank's own rows first, then the peers' in
  the order they arrive (``swiglu_kernel.take_tiles``); each finished tile counts itself in its
  row tile's ready counter;
- then the down GEMM's tiles, from a third queue in the same (source, expert) order (at
  decode sizes expert by expert, each expert's row tiles of all sources together): a tile
  waits (bounded) until every gated tile of its row tile is counted, then computes its rows of
  ``h @ w_down`` and stores them at their slots in the source's combine buffer
  (``moe_combine.kernel.down_tile``: the combine's zero-copy store, stamps and row counts).
  A program takes from the third queue only once the first two have run dry for it, so every
  gated tile has been claimed by a running program before any down tile waits for it: the
  waits end. Row tiles have the same height in both GEMMs (the host sees to it);
- last, every program signals the combine's ``sent[r][pid]`` on every rank
  (``finish_down``), and the last one out zeroes the queues and the ready counters for the
  next call.

Under the interpreter (programs one after another in program order) senders take no down
tiles: a down tile of the own rows would wait for gated tiles that only later programs take.
The first compute program then takes every remaining tile itself, in queue order; a grid
of one program (its sender, which computes) takes them itself.

Two call protocols share the launch: the dispatch's (epoch published by its exchange, flags
``sent``, the dispatch context's clock and status board) for the rows that arrive, the
combine's (``begin_call`` / ``end_call`` on its ``ctl``, its flags, clock and board) for the
rows that leave. A program that gave up on the dispatch's side stores no row and signals the
combine's failure tag, so the sources' weighted sums raise for the same call.
"""
import triton
import triton.language as tl

from ...backends.proxy_fence import async_proxy_fence
from ...shmem.device import STATUS_PEER_FAILED, await_count, begin_call, live, report
from ...tiles.gemm import grouped_tile
from ..moe_combine.kernel import (FLAG_READY, begin_down, down_tile, expert_rows, expert_tile,
                                  finish_down, no_flush, store_rows)
from ..moe_dispatch.swiglu_kernel import (READY_SKIPPED, dispatch_and_gate, fused_segment,
                                          row_tile)


@triton.jit
def _take_down_tiles(queue_ptr, total, ready_ptr, counts_ptr, cnt, segs, h_ptr, wd_ptr, h_desc,
                     wd_desc, slots_ptr, combine_ptr, slot_epoch_ptr, rows_mine_ptr,
                     consumed_ptr, clock_ptr, bases_ptr, status_addr, H, I, E, max_slots,
                     stride_hm, stride_de, stride_dk, stride_dn, rank, world, epoch, timeout_us,
                     pid, cleared, ok, BLOCK_M: tl.constexpr, BLOCK_N1: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                     UPCAST: tl.constexpr, G_MAX: tl.constexpr, USE_DESC: tl.constexpr,
                     EXPERT_MAJOR: tl.constexpr, BLOCK_SRC: tl.constexpr):
    """Claim down-GEMM tiles (``total``) until the queue is empty or this program gives up, in
    the fused segment order, or (``EXPERT_MAJOR``, at decode sizes) expert by expert, each
    expert's row tiles of all sources (in the same source order) in grouped order, so the few
    row tiles that share a weight column block run together and read it from memory once (as
    the staged combine's decode walk, ``moe_combine.api.decode_walk``). Returns
    ``(cleared, ok)``."""
    need = tl.cdiv(I, BLOCK_N1)  # gated tiles per row tile
    num_pid_n = tl.cdiv(H, BLOCK_N)
    # the cursor (monotone in t, claims only grow): segment f or expert f, its first tile and
    # its tile count; expert-major also its row tiles per source (j-th source in the order:
    # this rank, then r-1, r-2, ...) and their running sum
    f = 0
    s_t0 = 0
    js = tl.arange(0, BLOCK_SRC)
    q_of = (rank + world - js) % world
    c_e, mt, cum = expert_rows(counts_ptr, q_of, js, f, E, world, BLOCK_M)
    q, e, n, s_nt = fused_segment(f, rank, world, E, counts_ptr, num_pid_n, BLOCK_M)
    if EXPERT_MAJOR:
        s_nt = tl.sum(mt) * num_pid_n
    t = tl.atomic_add(queue_ptr, 1, sem="relaxed", scope="gpu")
    while (t < total) & ok:
        while t >= s_t0 + s_nt:  # (t < total: the cursor stops at a segment with tiles)
            f += 1
            s_t0 += s_nt
            if EXPERT_MAJOR:
                c_e, mt, cum = expert_rows(counts_ptr, q_of, js, f, E, world, BLOCK_M)
                s_nt = tl.sum(mt) * num_pid_n
            else:
                q, e, n, s_nt = fused_segment(f, rank, world, E, counts_ptr, num_pid_n, BLOCK_M)
        if EXPERT_MAJOR:
            j, pid_m, pid_n, n = expert_tile(t - s_t0, c_e, mt, cum, js, num_pid_n, GROUP_M)
            q = (rank + world - j) % world
            e = f
        else:
            pid_m, pid_n = grouped_tile(t - s_t0, tl.cdiv(n, BLOCK_M), num_pid_n, GROUP_M)
        rt = row_tile(q * E + e, pid_m, cnt, segs, BLOCK_M)
        ok, got = await_count(ready_ptr + rt, need, epoch, clock_ptr, timeout_us, status_addr,
                              pid, rank, (FLAG_READY << 32) + rt.to(tl.int64), ok)
        if ok & (got >= READY_SKIPPED):
            # a gated tile of this row tile was given up on (its reason is on the dispatch's
            # board): store nothing, and the failure tag tells the sources
            report(status_addr, pid, STATUS_PEER_FAILED, rank,
                   (FLAG_READY << 32) + rt.to(tl.int64), tl.cast(need, tl.int64))
            ok = False
        tl.debug_barrier()  # the acquiring thread's view becomes the whole program's
        if ok:
            if USE_DESC:
                async_proxy_fence()  # the acquire, before the bulk copies' reads of h
            start = tl.sum(tl.where(segs < q * E + e, cnt, 0))
            ok, cleared = down_tile(
                h_ptr, wd_ptr, h_desc, wd_desc, slots_ptr, combine_ptr, combine_ptr,
                slot_epoch_ptr, rows_mine_ptr, consumed_ptr, clock_ptr, bases_ptr, status_addr,
                q, e, n, start, pid_m, pid_n, H, I, max_slots, stride_hm, 1, stride_de,
                stride_dk, stride_dn, rank, epoch, timeout_us, pid, cleared, ok, BLOCK_M,
                BLOCK_N, BLOCK_K, NUM_STAGES, EVEN_K, PRECISION, UPCAST, G_MAX, USE_DESC,
                store_rows)
        t = tl.atomic_add(queue_ptr, 1, sem="relaxed", scope="gpu")
    return cleared, ok


# S and the rank are not specialized on (as in the dispatch's kernels): every rank runs the same
# code, and S changes from call to call.
@triton.jit(do_not_specialize=["n_slots", "rank"])
def moe_layer_kernel(
    # the dispatch and the gated GEMM (as swiglu_kernel.dispatch_swiglu_kernel)
    tokens_ptr, ids_ptr, base_ptr, dest_start_ptr, recv_ptr, recv_slots_ptr, sent_ptr,
    ctl_ptr, clock_ptr, bases_ptr, status_addr, counts_ptr,
    queue_ptr,  # int32 [3]: own gated tiles, peers' gated tiles, down tiles claimed
    ready_ptr,  # int32 [row tiles]: gated tiles finished per row tile (zero between calls)
    wg_ptr, wu_ptr, h_ptr, x_desc, wg_desc, wu_desc,
    n_slots, k, H, stride_ts, E, capacity, rank, world, tag, timeout_us, senders,
    I, stride_we, stride_wk, stride_wn, stride_hm,
    # the down GEMM and the combine's stores (as moe_combine.kernel.moe_gemm_scatter_kernel)
    wd_ptr, h_desc, wd_desc, combine_ptr, slot_epoch_ptr, c_sent_ptr, rows_in_ptr,
    rows_mine_ptr, c_consumed_ptr, c_ctl_ptr, c_clock_ptr, c_bases_ptr, c_status_addr, max_slots,
    stride_de, stride_dk, stride_dn, c_tag, c_timeout_us,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, G_MAX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, USE_DESC: tl.constexpr, BLOCK_SEG: tl.constexpr,
    BLOCK_F: tl.constexpr, SENDERS_COMPUTE: tl.constexpr,
    BLOCK_N2: tl.constexpr, BLOCK_K2: tl.constexpr, GROUP_M2: tl.constexpr,
    NUM_STAGES2: tl.constexpr, EVEN_K2: tl.constexpr, USE_DESC2: tl.constexpr,
    SENDERS_DOWN: tl.constexpr, EXPERT_MAJOR: tl.constexpr, BLOCK_SRC: tl.constexpr,
):
    pid = tl.program_id(0)
    c_epoch = begin_call(c_ctl_ptr)
    c_ok = live(c_clock_ptr)
    cleared = tl.zeros((), tl.int64)  # bit q: rank q's combine buffer is free for this call
    begin_down(rows_mine_ptr, pid, world, G_MAX)
    ok = dispatch_and_gate(
        tokens_ptr, ids_ptr, base_ptr, dest_start_ptr, recv_ptr, recv_slots_ptr, sent_ptr,
        ctl_ptr, clock_ptr, bases_ptr, status_addr, counts_ptr, queue_ptr, ready_ptr, wg_ptr,
        wu_ptr, h_ptr, x_desc, wg_desc, wu_desc, n_slots, k, H, stride_ts, E, capacity, rank,
        world, tag, timeout_us, senders, I, stride_we, stride_wk, stride_wn, stride_hm, BLOCK_T,
        BLOCK_E, BLOCK_H, G_MAX, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_STAGES, EVEN_K,
        PRECISION, UPCAST, USE_DESC, BLOCK_SEG, BLOCK_F, SENDERS_COMPUTE, True)
    # the down tiles, from the counts on the device
    segs = tl.arange(0, BLOCK_SEG)
    cnt = tl.load(counts_ptr + segs, mask=segs < world * E, other=0)
    row_tiles = tl.cdiv(cnt, BLOCK_M)
    down_total = tl.sum(row_tiles) * tl.cdiv(H, BLOCK_N2)
    c_ok = c_ok & ok  # rows this program failed to receive or compute make no results
    if (SENDERS_DOWN or (pid >= senders)) & c_ok:
        cleared, c_ok = _take_down_tiles(
            queue_ptr + 2, down_total, ready_ptr, counts_ptr, cnt, segs, h_ptr, wd_ptr, h_desc,
            wd_desc, recv_slots_ptr, combine_ptr, slot_epoch_ptr, rows_mine_ptr,
            c_consumed_ptr, c_clock_ptr, c_bases_ptr, c_status_addr, H, I, E, max_slots,
            stride_hm, stride_de, stride_dk, stride_dn, rank, world, c_epoch, c_timeout_us, pid,
            cleared, c_ok, BLOCK_M, BLOCK_N, BLOCK_N2, BLOCK_K2, GROUP_M2, NUM_STAGES2, EVEN_K2,
            PRECISION, UPCAST, G_MAX, USE_DESC2, EXPERT_MAJOR, BLOCK_SRC)
    last = finish_down(rows_mine_ptr, rows_in_ptr, c_sent_ptr, c_consumed_ptr, c_ctl_ptr,
                       c_clock_ptr, c_bases_ptr, c_status_addr, cleared, c_epoch, c_tag, c_ok, pid,
                       rank, world, c_timeout_us, G_MAX, no_flush)
    # the last program out (every program has made its last claim and wait) clears the queues
    # and the ready counts of this call's row tiles for the next call
    if last:
        for i in range(0, 3):
            tl.atomic_xchg(queue_ptr + i, 0, sem="relaxed", scope="gpu")
        n_rt = tl.sum(row_tiles)
        for i0 in range(0, n_rt, BLOCK_SEG):
            idx = i0 + segs
            tl.store(ready_ptr + idx, 0, mask=idx < n_rt)
