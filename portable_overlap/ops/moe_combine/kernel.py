"""Fused MoE expert GEMM + combine All-to-All: two kernels.

``moe_gemm_scatter_kernel`` (persistent grouped GEMM). Rank r holds ``x`` [R, I]: the rows it was
dispatched, in the order an ``all_to_all_single`` dispatch delivers them: by source rank q, then by
local expert e (``counts[q, e]`` rows, starting at row ``starts[q, e]``). Row i of segment (q, e)
computes ``x[i] @ w[e]`` ([H]) and belongs to slot ``slots[i]`` of rank q's combine buffer.

The tiles of a segment never straddle two segments, so each tile has one destination and one
expert. Tiles load through tensor descriptors (TMA) where the host built them (``x_desc`` over x,
``w_desc`` over the experts' weights stacked as one [E * I, H] matrix), else by pointers.
Segments are walked source by source starting at q = r+1, so the tiles whose rows go to
other ranks come first and this rank's own rows last (communication-aware order); program ``pid``
takes the tiles ``pid, pid + G, ...`` of that walk. At decode sizes (``EXPERT_MAJOR``, chosen by
``api.decode_walk``) the walk goes expert by expert instead, each expert's row tiles of all
sources (from q = r+1 on) in grouped order, so the few row tiles that share a weight column
block run together and read it from memory once, not once per source. A finished tile's rows
are stored straight into the destination's combine buffer at their slots (zero-copy, only real
rows travel), and each row's slot is stamped with the call's epoch in the destination's
``slot_epoch``. A row whose slot is outside the buffer is skipped and reported
(``CHECK_SLOT``). Afterwards each program tells every rank how many rows it stored there and
signals ``sent[r][pid]`` (release).
Before its first store into rank q in a call, and in any case before it writes q's count and
flag, a program waits until ``consumed[q]`` holds the previous epoch (q's combine has read the
previous call's rows, stamps, counts and flags).

``moe_combine_kernel`` (on each rank, for its own tokens). Waits for ``sent[q][p]`` of every peer
q and program p, checks that the rows that arrived add up to S·k (``CHECK_ROWS``) and that each
slot of [0, S·k) carries this call's stamp (``CHECK_SLOT_MISSING``): together, the rows are
exactly one per slot, so a duplicate slot or one in [S·k, max_slots) on any sender is found
here. Then ``out[s] = sum_j topk_weights[s, j] * combine[s·k + j]`` in float32 (NaN for a
token with a slot that got no row). Its last program tells every peer that this rank's combine
buffer is free again (``consumed[r] = epoch`` in their heaps).

No program ever waits for another program of its own launch (the interpreter runs them one after
another), and every wait is bounded (status board).
"""
import triton
import triton.language as tl

from ...shmem.device import (REFRESH_CALLS, STATUS_BAD_INPUT, await_flags, await_free_once,
                             begin_call, call_flag, calls_done, end_call, end_call_free, live,
                             peer_buffer, peer_ptr, refresh_words, report, report_first,
                             signal_peers)
from ...shmem.providers.device import flush as shmem_flush, put_rows as shmem_put_rows
from ...tiles.gemm import gemm_tile, gemm_tile_desc, grouped_tile

FLAG_SENT = tl.constexpr(1)
FLAG_CONSUMED = tl.constexpr(2)
CHECK_SLOT = tl.constexpr(3)
CHECK_ROWS = tl.constexpr(4)
CHECK_SLOT_MISSING = tl.constexpr(5)
FLAG_READY = tl.constexpr(6)  # (the one-launch layer's, ops/moe_layer/kernel.py)
CHECK_COUNTS = tl.constexpr(7)
FLAG_BLOCK = tl.constexpr(128)  # flags polled (and row counts summed) per vector load
FLAG_NAMES = {1: "rows-sent", 2: "combine-consumed", 3: "routing slot of dispatched row",
              4: "row count arriving (expected S*top_k)",
              5: "routing slot with no row in this call (duplicate or out-of-range slot on a "
                 "sender; the value: the call that last filled it, 0 for none)",
              6: "gated activations of a row tile (the gated GEMM tiles of the same launch; a "
                 "peer-failed report: a tile of it was given up on, see the dispatch's error)",
              7: "routing counts: not this rank's rows of x (index 0: their sum, past x's "
                 "rows; index 1: a negative count; the value: the sum or the count); nothing "
                 "was computed or sent"}


@triton.jit
def _segment(i, rank, world, E):
    """(source rank, local expert) of the i-th segment of the walk: sources from rank+1 on."""
    return (rank + 1 + i // E) % world, i % E


@triton.jit
def store_rows(combine_ptr, bases_ptr, stage_ptr, slots_ptr, row0, n_rows, col0, max_slots,
               rank, peer, slot, cols, y, keep, H, pid,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Zero-copy transport: the tile's rows stored straight into ``peer``'s combine buffer at
    their slots (plain stores over NVLink / Infinity Fabric; this rank's own when peer == rank)."""
    dst = peer_buffer(combine_ptr, bases_ptr, rank, peer)
    offs = slot[:, None].to(tl.int64) * H + cols[None, :]
    tl.store(dst + offs, y, mask=keep[:, None] & (cols[None, :] < H))


@triton.jit
def no_flush():
    """Zero-copy stores need no completion step before the release signal."""
    pass


@triton.jit
def expert_rows(counts_ptr, q_src, qs, e, E, world, BLOCK_M: tl.constexpr):
    """Expert ``e``'s rows from each source (lane j: source ``q_src[j]``, lanes ``qs`` past the
    world empty, as is an ``e`` past the experts), their row tiles and the tiles' running sum:
    the cursor of a walk of an expert's row tiles of all sources (``expert_tile``)."""
    c_e = tl.load(counts_ptr + q_src * E + e, mask=(qs < world) & (e < E), other=0)
    mt = tl.cdiv(c_e, BLOCK_M)
    return c_e, mt, tl.cumsum(mt, axis=0)


@triton.jit
def expert_tile(t_rel, c_e, mt, cum, qs, num_pid_n, GROUP_M: tl.constexpr):
    """Tile ``t_rel`` of one expert's row tiles of all sources end to end, in grouped order, so
    the row tiles that share a weight column block follow one another (``expert_rows`` gives
    ``c_e``, ``mt``, ``cum``). Returns (the source's lane j, the row tile within its rows, the
    column tile, its rows); the max keeps the divisions defined for a tile past the walk."""
    vm, pid_n = grouped_tile(t_rel, tl.maximum(tl.sum(mt), 1), num_pid_n, GROUP_M)
    j = tl.sum((cum <= vm).to(tl.int32))  # the source whose row tiles hold vm
    pid_m = vm - tl.sum(tl.where(qs == j, cum - mt, 0))
    return j, pid_m, pid_n, tl.sum(tl.where(qs == j, c_e, 0))


@triton.jit
def begin_down(rows_mine_ptr, pid, world, G_MAX: tl.constexpr):
    """Zero this program's counts of the rows it stores into each rank in this call."""
    for q in range(0, world):
        tl.store(rows_mine_ptr + q * G_MAX + pid, 0)
    tl.debug_barrier()  # zeroed before any thread of the program counts into it


@triton.jit
def down_tile(x_ptr, w_ptr, x_desc, w_desc, slots_ptr, combine_ptr, stage_ptr, slot_epoch_ptr,
              rows_mine_ptr, consumed_ptr, clock_ptr, bases_ptr, status_addr, src, e, n, start,
              pid_m, pid_n, H, I, max_slots, stride_xm, stride_xk, stride_we, stride_wk,
              stride_wn, rank, epoch, timeout_us, pid, cleared, ok, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
              EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
              G_MAX: tl.constexpr, USE_DESC: tl.constexpr, STORE: tl.constexpr):
    """Tile (pid_m, pid_n) of segment (src, e): its ``n`` rows ``x[start:start + n]`` times
    ``w[e]``, column block pid_n, stored by ``STORE`` into src's combine buffer at the rows'
    slots, each row counted (``rows_mine``) and its slot stamped with the call once. Before the
    first store into a peer in a call (bit src of ``cleared``), waits until that peer has read
    the previous call's rows. Returns ``(ok, cleared)``."""
    if USE_DESC:  # rows past the segment's end are the next one's: masked below
        acc = gemm_tile_desc(x_desc, w_desc, start + pid_m * BLOCK_M, e * I, pid_n * BLOCK_N, 0,
                             I, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, PRECISION)
    else:
        acc = gemm_tile(x_ptr + start.to(tl.int64) * stride_xm,
                        w_ptr + tl.cast(e, tl.int64) * stride_we, n, H, I, stride_xm,
                        stride_xk, stride_wk, stride_wn, pid_m, pid_n, BLOCK_M, BLOCK_N,
                        BLOCK_K, NUM_STAGES, EVEN_K, PRECISION, UPCAST)
    y = acc.to(combine_ptr.dtype.element_ty)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = rows < n
    slot = tl.load(slots_ptr + start + rows, mask=valid, other=0)
    slot_ok = (slot >= 0) & (slot < max_slots)
    if tl.sum((valid & ~slot_ok).to(tl.int32)) > 0:
        # skip the row and go on: src's combine then misses that slot's stamp and raises too,
        # and this program's flags stay in step (no failure tag)
        bad = tl.max(tl.where(valid & ~slot_ok, start + rows, -1))
        report(status_addr, pid, STATUS_BAD_INPUT, src, (CHECK_SLOT << 32) + bad.to(tl.int64),
               tl.load(slots_ptr + bad).to(tl.int64))
    keep = valid & slot_ok
    if src != rank:  # src must have read the previous call's rows before we overwrite them
        ok, cleared = await_free_once(consumed_ptr, src, cleared, epoch, clock_ptr, timeout_us,
                                      status_addr, pid, FLAG_CONSUMED, ok)
    if ok:
        STORE(combine_ptr, bases_ptr, stage_ptr, slots_ptr, start + pid_m * BLOCK_M,
              tl.minimum(n - pid_m * BLOCK_M, BLOCK_M), pid_n * BLOCK_N, max_slots, rank, src,
              slot, cols, y, keep, H, pid, BLOCK_M, BLOCK_N)
        if pid_n == 0:  # count and stamp each row once, not once per column block
            tl.atomic_add(rows_mine_ptr + src * G_MAX + pid, tl.sum(keep.to(tl.int64)),
                          sem="relaxed", scope="gpu")
            # src's slot_epoch[slot] = this call: src's combine proves with it that every one
            # of its S*k slots got a row. Plain stores through this library's heap on both
            # transports, like the row counts (the "shmem" transport's puts carry only the
            # rows); ordered before the release signal by finish_down's barrier. Cost: 8 bytes
            # per row next to the row's H elements.
            tl.store(peer_buffer(slot_epoch_ptr, bases_ptr, rank, src) + slot, epoch, mask=keep)
    return ok, cleared


@triton.jit
def finish_down(rows_mine_ptr, rows_in_ptr, sent_ptr, consumed_ptr, ctl_ptr, clock_ptr,
                bases_ptr, status_addr, cleared, epoch, tag, ok, pid, rank, world, timeout_us,
                G_MAX: tl.constexpr, FLUSH: tl.constexpr):
    """After a program's last ``down_tile`` of the call: tell every rank how many rows it
    stored there, signal ``sent[rank][pid]`` there (release) and count the program out
    (``end_call``). Returns whether it was the launch's last program."""
    # A program that stored nothing into rank q has not waited for q's previous combine yet, but
    # it is about to overwrite q's rows-in count and rows-sent flag of that call: q's combine may
    # still be polling them (a slow or busy rank), and the flag wait is for equality, so a word
    # overwritten early is a lost signal (it shows on 4 ranks with skewed routing:
    # tests/test_moe_combine.py::test_a_late_combine_loses_no_signal).
    for q in range(0, world):
        if q != rank:
            ok, cleared = await_free_once(consumed_ptr, q, cleared, epoch, clock_ptr, timeout_us,
                                          status_addr, pid, FLAG_CONSUMED, ok)
    FLUSH()  # the transport's rows have landed before the counts and the release
    tl.debug_barrier()
    for q in range(0, world):
        cnt = tl.atomic_add(rows_mine_ptr + q * G_MAX + pid, 0, sem="relaxed", scope="gpu")
        tl.store(peer_ptr(rows_in_ptr + rank * G_MAX + pid, bases_ptr, rank, q), cnt)
    signal_peers(sent_ptr, bases_ptr, pid, rank, world, call_flag(epoch, tag, ok), G_MAX)
    # the words of programs past the grid, every 2**30 calls: the grid is the programs
    # resident at once, which may differ with the tiling, and the MoE layer's launch signals
    # the same words
    if (epoch & (REFRESH_CALLS - 1)) == 0:
        _refresh_sent(sent_ptr, clock_ptr, bases_ptr, epoch, tag, pid, rank, world, G_MAX)
    return end_call(ctl_ptr, epoch)


@triton.jit(noinline=True)
def _refresh_sent(sent_ptr, clock_ptr, bases_ptr, epoch, tag, pid, rank, world,
                  G_MAX: tl.constexpr):
    """``refresh_words`` of this rank's ``sent`` words past the grid. Not inlined, as the
    dispatch's ``refresh_sent``, which the MoE layer's launch calls beside it: with both
    inlined its 128 x 64 bf16 tile spilled 1564 bytes on sm_90, with neither 1536."""
    refresh_words(sent_ptr, bases_ptr, tl.num_programs(0), pid, tl.num_programs(0), rank, world,
                  call_flag(epoch, tag, live(clock_ptr)), G_MAX)


# R (rows received) and S (tokens) change from call to call with the routing: compiled once, the
# kernels must not be specialized on their values (== 1, divisible by 16). Nor on the rank: every
# rank must run the same code (same registers, so the same resident grid, which the tag includes).
@triton.jit(do_not_specialize=["R", "rank"])
def moe_gemm_scatter_kernel(
    x_ptr, w_ptr, counts_ptr, starts_ptr, slots_ptr, combine_ptr, stage_ptr, slot_epoch_ptr,
    sent_ptr, rows_in_ptr, rows_mine_ptr, consumed_ptr, ctl_ptr, clock_ptr, bases_ptr,
    status_addr,
    R, H, I, E, max_slots, stride_xm, stride_xk, stride_we, stride_wk, stride_wn,
    G, rank, world, tag, timeout_us, x_desc, w_desc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, G_MAX: tl.constexpr, USE_DESC: tl.constexpr,
    EXPERT_MAJOR: tl.constexpr, BLOCK_SRC: tl.constexpr,
):
    """The zero-copy grouped GEMM (rows stored into the sources' heaps)."""
    _grouped_gemm_scatter(
        x_ptr, w_ptr, counts_ptr, starts_ptr, slots_ptr, combine_ptr, stage_ptr, slot_epoch_ptr,
        sent_ptr, rows_in_ptr, rows_mine_ptr, consumed_ptr, ctl_ptr, clock_ptr, bases_ptr,
        status_addr, R, H, I, E, max_slots, stride_xm, stride_xk, stride_we, stride_wk,
        stride_wn, G, rank, world, tag, timeout_us, x_desc, w_desc, BLOCK_M, BLOCK_N, BLOCK_K,
        GROUP_M, NUM_STAGES, EVEN_K, PRECISION, UPCAST, G_MAX, USE_DESC, EXPERT_MAJOR, BLOCK_SRC,
        store_rows, no_flush)


@triton.jit(do_not_specialize=["R", "rank"])
def moe_gemm_put_kernel(
    x_ptr, w_ptr, counts_ptr, starts_ptr, slots_ptr, combine_ptr, stage_ptr, slot_epoch_ptr,
    sent_ptr, rows_in_ptr, rows_mine_ptr, consumed_ptr, ctl_ptr, clock_ptr, bases_ptr,
    status_addr,
    R, H, I, E, max_slots, stride_xm, stride_xk, stride_we, stride_wk, stride_wn,
    G, rank, world, tag, timeout_us, x_desc, w_desc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, G_MAX: tl.constexpr, USE_DESC: tl.constexpr,
    EXPERT_MAJOR: tl.constexpr, BLOCK_SRC: tl.constexpr,
):
    """The same grouped GEMM with the rows put by the process's SHMEM provider (device-initiated
    puts, then their completion before the signals; shmem/providers/device.py). A kernel of its
    own: the provider's launcher sets up its compiled modules, and it is compiled only where a
    provider exists (GPUs with NVSHMEM / ROC_SHMEM)."""
    _grouped_gemm_scatter(
        x_ptr, w_ptr, counts_ptr, starts_ptr, slots_ptr, combine_ptr, stage_ptr, slot_epoch_ptr,
        sent_ptr, rows_in_ptr, rows_mine_ptr, consumed_ptr, ctl_ptr, clock_ptr, bases_ptr,
        status_addr, R, H, I, E, max_slots, stride_xm, stride_xk, stride_we, stride_wk,
        stride_wn, G, rank, world, tag, timeout_us, x_desc, w_desc, BLOCK_M, BLOCK_N, BLOCK_K,
        GROUP_M, NUM_STAGES, EVEN_K, PRECISION, UPCAST, G_MAX, USE_DESC, EXPERT_MAJOR, BLOCK_SRC,
        shmem_put_rows, shmem_flush)


@triton.jit(do_not_specialize=["R"])
def segment_starts_kernel(counts_ptr, safe_ptr, starts_ptr, status_addr, n_seg, R,
                          BLOCK: tl.constexpr):
    """One program, before the GEMM: the segments' row counts as the GEMM reads them
    (``safe``) and their first rows in ``x`` (``starts``, the exclusive prefix sum). Counts that
    are not rows of x (a negative count, more rows than x's R) would have the tiles read x and
    the slots past their ends: then every segment is empty, nothing is computed or stored, and
    the fault is reported here (``CHECK_COUNTS``); the sources, missing this rank's rows,
    report theirs. Here and not in the GEMM: a check kept through the GEMM's walk took a
    register its 128 x 256 tile (at 255) does not have, and spilled."""
    lanes = tl.arange(0, BLOCK)
    inside = lanes < n_seg
    c = tl.load(counts_ptr + lanes, mask=inside, other=0)
    lowest = tl.min(c)
    total = tl.sum(c.to(tl.int64))
    ok = (lowest >= 0) & (total <= R)
    c = tl.where(ok, c, 0)
    tl.store(safe_ptr + lanes, c, mask=inside)
    tl.store(starts_ptr + lanes, tl.cumsum(c, 0) - c, mask=inside)
    if not ok:
        report(status_addr, 0, STATUS_BAD_INPUT, -1,
               (CHECK_COUNTS << 32) + tl.where(lowest < 0, 1, 0).to(tl.int64),
               tl.where(lowest < 0, lowest.to(tl.int64), total))


@triton.jit
def _grouped_gemm_scatter(
    x_ptr, w_ptr, counts_ptr, starts_ptr, slots_ptr, combine_ptr, stage_ptr, slot_epoch_ptr,
    sent_ptr, rows_in_ptr, rows_mine_ptr, consumed_ptr, ctl_ptr, clock_ptr, bases_ptr,
    status_addr,
    R, H, I, E, max_slots, stride_xm, stride_xk, stride_we, stride_wk, stride_wn,
    G, rank, world, tag, timeout_us, x_desc, w_desc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, G_MAX: tl.constexpr, USE_DESC: tl.constexpr,
    EXPERT_MAJOR: tl.constexpr, BLOCK_SRC: tl.constexpr, STORE: tl.constexpr,
    FLUSH: tl.constexpr,
):
    pid = tl.program_id(0)
    epoch = begin_call(ctl_ptr)
    num_pid_n = tl.cdiv(H, BLOCK_N)
    n_seg = world * E
    # every segment adds at most one partial row block
    t_max = (tl.cdiv(R, BLOCK_M) + n_seg) * num_pid_n
    ok = live(clock_ptr)
    cleared = tl.zeros((), tl.int64)  # bit q: rank q's combine buffer is free for this call
    begin_down(rows_mine_ptr, pid, world, G_MAX)

    # the walk's cursors (monotone in t). Source-major: segment index, its first tile, its tile
    # count. Expert-major: expert, its first tile, its row tiles per source (in walk order,
    # sources rank+1, ..., rank) and their running sum, its tile count.
    seg = 0
    seg_t0 = 0
    src, e = _segment(seg, rank, world, E)
    n = tl.load(counts_ptr + src * E + e)
    seg_nt = tl.cdiv(n, BLOCK_M) * num_pid_n
    qs = tl.arange(0, BLOCK_SRC)  # a source's place in the walk
    q_src = (rank + 1 + qs) % world
    c_e, mt_q, cum = expert_rows(counts_ptr, q_src, qs, 0, E, world, BLOCK_M)
    seg_nt_e = tl.sum(mt_q) * num_pid_n
    for i in range(0, tl.cdiv(t_max, G)):
        t = pid + i * G
        if EXPERT_MAJOR:
            # an expert's row tiles of all sources end to end, in grouped order: at decode
            # sizes (a tile or two per source) the tiles of one weight column block follow one
            # another, so the block is read from memory once per expert, not once per source
            while (t >= seg_t0 + seg_nt_e) & (seg < E):
                seg += 1
                seg_t0 += seg_nt_e
                c_e, mt_q, cum = expert_rows(counts_ptr, q_src, qs, seg, E, world, BLOCK_M)
                seg_nt_e = tl.sum(mt_q) * num_pid_n
            walking = seg < E
            # (past the walk's end the tile is not used)
            q, pid_m, pid_n, n = expert_tile(t - seg_t0, c_e, mt_q, cum, qs, num_pid_n, GROUP_M)
            src = (rank + 1 + q) % world
            e = seg
        else:
            while (t >= seg_t0 + seg_nt) & (seg < n_seg):
                seg += 1
                seg_t0 += seg_nt
                src, e = _segment(seg, rank, world, E)
                n = tl.load(counts_ptr + src * E + e, mask=seg < n_seg, other=0)
                seg_nt = tl.cdiv(n, BLOCK_M) * num_pid_n
            walking = seg < n_seg
            pid_m, pid_n = grouped_tile(t - seg_t0, tl.maximum(tl.cdiv(n, BLOCK_M), 1),
                                        num_pid_n, GROUP_M)
        if walking:
            start = tl.load(starts_ptr + src * E + e)
            ok, cleared = down_tile(
                x_ptr, w_ptr, x_desc, w_desc, slots_ptr, combine_ptr, stage_ptr, slot_epoch_ptr,
                rows_mine_ptr, consumed_ptr, clock_ptr, bases_ptr, status_addr, src, e, n, start,
                pid_m, pid_n, H, I, max_slots, stride_xm, stride_xk, stride_we, stride_wk,
                stride_wn, rank, epoch, timeout_us, pid, cleared, ok, BLOCK_M, BLOCK_N, BLOCK_K,
                NUM_STAGES, EVEN_K, PRECISION, UPCAST, G_MAX, USE_DESC, STORE)

    finish_down(rows_mine_ptr, rows_in_ptr, sent_ptr, consumed_ptr, ctl_ptr, clock_ptr,
                bases_ptr, status_addr, cleared, epoch, tag, ok, pid, rank, world, timeout_us,
                G_MAX, FLUSH)


@triton.jit(do_not_specialize=["S", "rank"])
def moe_combine_kernel(
    combine_ptr, topk_ptr, out_ptr,  # heap [max_slots, H]; [S, k] (any float); [S, H]
    slot_epoch_ptr,  # heap int64 [max_slots]: the call whose row last landed in each slot
    sent_ptr, rows_in_ptr, consumed_ptr, ctl_ptr, clock_ptr, bases_ptr, status_addr,
    S, H, k, stride_ts, stride_tk, G_src, rank, world, tag, timeout_us,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, G_MAX: tl.constexpr,
):
    pid = tl.program_id(0)
    epoch = calls_done(ctl_ptr)  # published by the GEMM
    ok = live(clock_ptr)
    # 1. every peer program's rows have landed (this rank's own came before, in stream order):
    #    the G_src flags of a peer polled FLAG_BLOCK at a time, not one after another
    for q in range(0, world):
        if q != rank:
            ok = await_flags(sent_ptr + q * G_MAX, G_src, epoch, tag, clock_ptr, timeout_us,
                             status_addr, pid, q, tl.cast(q * G_MAX, tl.int64) + (FLAG_SENT << 32),
                             ok, FLAG_BLOCK)
    tl.debug_barrier()
    # 2. the rows that arrived must be exactly this rank's S*k slots
    rows_ok = tl.full((), 1, tl.int1)
    if ok & (pid == 0):
        total = tl.zeros((), tl.int64)
        lanes = tl.arange(0, FLAG_BLOCK)
        for q in range(0, world):
            for c in range(0, G_src, FLAG_BLOCK):
                total += tl.sum(tl.load(rows_in_ptr + q * G_MAX + c + lanes,
                                        mask=c + lanes < G_src, other=0, volatile=True))
        if total != tl.cast(S, tl.int64) * k:
            # (first: where this rank's own GEMM found its counts bad, that is the cause)
            report_first(status_addr, pid, STATUS_BAD_INPUT, -1,
                         tl.cast(rank, tl.int64) + (CHECK_ROWS << 32), total)
            rows_ok = False  # program 0's report names the count, not a slot it implies
    # 3. every slot of this program's tokens got a row in this call. With the total of
    #    step 2 equal to S*k this proves the rows are exactly one per slot of [0, S*k): a
    #    duplicate slot, or one in [S*k, max_slots), on any sender leaves a slot here unstamped.
    #    Cost: k int64 loads per token (8 bytes per slot next to the slot's H-element row).
    if ok:
        toks = pid * BLOCK_S + tl.arange(0, BLOCK_S)
        tok_ok = toks < S
        missing = tl.zeros((BLOCK_S,), tl.int32)  # per token: slots with no row of this call
        first = tl.full((BLOCK_S,), -1, tl.int64)  # per token: its first such slot
        stamp = tl.zeros((BLOCK_S,), tl.int64)  # and the call that last filled it
        for j in range(0, k):
            s_j = toks.to(tl.int64) * k + j
            st = tl.load(slot_epoch_ptr + s_j, mask=tok_ok, other=0)
            miss = tok_ok & (st != epoch)
            new_miss = miss & (missing == 0)
            first = tl.where(new_miss, s_j, first)
            stamp = tl.where(new_miss, st, stamp)
            missing += miss.to(tl.int32)
        if (tl.sum(missing) > 0) & rows_ok:
            lowest = tl.min(tl.where(first >= 0, first, 0x7FFFFFFFFFFFFFFF))
            report_first(status_addr, pid, STATUS_BAD_INPUT, -1,
                         (CHECK_SLOT_MISSING << 32) + lowest,
                         tl.sum(tl.where(first == lowest, stamp, 0)))
        filled = missing == 0
        # 4. weighted sum over each token's k slots; a token with a slot that got no row gets
        #    NaN (the call raises; the sum would mix in another call's row)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            m = tok_ok[:, None] & (cols[None, :] < H)
            acc = tl.zeros((BLOCK_S, BLOCK_H), dtype=tl.float32)
            for j in range(0, k):
                wt = tl.load(topk_ptr + toks.to(tl.int64) * stride_ts + j * stride_tk,
                             mask=tok_ok, other=0.0).to(tl.float32)
                rows = toks.to(tl.int64) * k + j
                v = tl.load(combine_ptr + rows[:, None] * H + cols[None, :], mask=m, other=0.0)
                acc += wt[:, None] * v.to(tl.float32)
            acc = tl.where(filled[:, None], acc, float("nan"))
            tl.store(out_ptr + toks[:, None].to(tl.int64) * H + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=m)
    # 5. the last program out frees this rank's combine buffer on every peer
    end_call_free(ctl_ptr + 2, epoch, consumed_ptr, bases_ptr, rank, world)
