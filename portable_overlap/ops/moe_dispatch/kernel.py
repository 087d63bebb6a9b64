"""Device-initiated MoE dispatch: three launches, no host sync.

Rank r holds ``tokens`` [S, H] and ``topk_ids`` [S, k] (global expert ids). Slot ``i = s * k + j``
is token s's j-th choice; expert ``g`` lives on rank ``g // E`` as local expert ``g % E``. Each
destination d receives its rows by source rank q, then by local expert e, and within one
(q, e) segment in slot order: the layout of ``moe_dispatch_reference`` (a stable sort of the
slots by expert), which is what ``moe_gemm_combine`` takes.

The slots are cut into blocks of BLOCK_T. A row's place at its destination is

    dest_start[g] + block_base[b, g] + (slots of block b before it with the same expert)

where ``block_base[b, g]`` counts expert g's slots in blocks before b (on this rank) and
``dest_start[g]`` is where source r's segment of expert g starts at g's rank: the rows of the
sources before r at that rank, then r's rows of the experts before g there. So the sender
computes every row's address itself and stores the row straight into the destination's heap.

``route_count_kernel`` (persistent): expert histogram of each block; ids outside [0, W·E) are
reported (``CHECK_EXPERT``), counted in ``bad[0]`` and routed nowhere (their source's combine
then finds the slot without a row and raises too).

``route_exchange_kernel`` (one program): scans the histograms into ``block_base`` and this
rank's send counts, frees this rank's receive buffers of the previous call on every peer
(``consumed[r]``: this launch runs after everything the caller queued on the previous call's
results), stores its send counts and its count of bad ids into row r of every rank's
``counts_in`` (after that rank freed its buffers), signals ``count_flag[r]``, waits for every
source's counts, and derives ``dest_start``, the counts this rank receives and each rank's
total. A source's bad ids are reported by every rank (``CHECK_PEER_IDS``), so that every rank
raises for the call. A rank whose total passes
the capacity is reported by every rank (``CHECK_CAPACITY``: all ranks raise for the same call);
rows past the capacity are not stored and that rank's received counts are written as zeros, so
a consumer launched before the error is seen reads no row past the buffer.

``dispatch_scatter_kernel`` (persistent, G programs on every rank): stores each row and its slot
into the destination's receive buffers (zero-copy; this rank's own rows too), signals
``sent[r][pid]`` on every peer (release), then waits for ``sent[q][pid]`` of every peer q: when
the launch ends, every source's rows have landed here. ``dispatch_put_kernel`` is the same
kernel body with the receive buffers in the SHMEM library's symmetric memory: a peer's rows and
slots are put by the library (``put_rows``), and the program's puts complete (quiet) before its
release signal. The counts, flags and signals stay in this library's heap on both.

With ``ONCE`` (the context's ``dedup``) the zero-copy scatter sends a token to a peer once,
however many of its experts are there (``scatter_rows_once``): the slots go to their places as
above, each slot's place (stamped with the call) into the peer's ``place`` map, the row into
the peer's ``once`` buffer at the token's index; once a program's counterparts have signalled,
it copies each row their slots name to its places (``expand_rows``). A token with ``c``
experts on a peer crosses the link once instead of ``c`` times, for one more local copy of the
rows at the receiver, in the same launch.

No program waits for another program of its own launch (the interpreter runs them one after
another), and every wait is bounded (status board).
"""
import triton
import triton.language as tl

from ...shmem.device import (REFRESH_CALLS, STATUS_BAD_INPUT, await_flag, await_free,
                             begin_call, call_flag, calls_done, count_out, flag_value, live,
                             peer_buffer, refresh_words, report, signal_peer, signal_peers,
                             wait_peers)
from ...shmem.providers.device import flush as shmem_flush, put as shmem_put

FLAG_COUNTS = tl.constexpr(1)
FLAG_SENT = tl.constexpr(2)
FLAG_CONSUMED = tl.constexpr(3)
CHECK_EXPERT = tl.constexpr(4)
CHECK_CAPACITY = tl.constexpr(5)
CHECK_PEER_IDS = tl.constexpr(6)
FLAG_NAMES = {1: "routing-counts", 2: "rows-sent", 3: "receive-buffer-free",
              4: "expert id of routing slot (must be in [0, world * experts_per_rank))",
              5: "rows routed to a rank past its capacity (the index: the rank; the value: the "
                 "rows; raise the context's capacity)",
              6: "expert ids on a source rank (the index: the rank; the value: how many are out "
                 "of range)"}


@triton.jit(do_not_specialize=["n_slots"])
def route_count_kernel(ids_ptr, hist_ptr, bad_ptr, status_addr, n_slots, E_total,
                       BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """``hist[b, g]``: the slots of block b routed to expert g (row stride BLOCK_E); ``bad[0]``
    += the ids out of range."""
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    for b in range(pid, tl.cdiv(n_slots, BLOCK_T), tl.num_programs(0)):
        i = b * BLOCK_T + lanes
        valid = i < n_slots
        g = tl.load(ids_ptr + i, mask=valid, other=0).to(tl.int64)
        bad = valid & ((g < 0) | (g >= E_total))
        if tl.sum(bad.to(tl.int32)) > 0:
            first = tl.min(tl.where(bad, i, n_slots))
            report(status_addr, pid, STATUS_BAD_INPUT, -1,
                   (CHECK_EXPERT << 32) + first.to(tl.int64), tl.sum(tl.where(i == first, g, 0)))
            tl.atomic_add(bad_ptr, tl.sum(bad.to(tl.int32)), sem="relaxed", scope="gpu")
        hit = (g[:, None] == experts[None, :]) & (valid & ~bad)[:, None]
        tl.store(hist_ptr + b * BLOCK_E + experts, tl.sum(hit.to(tl.int32), axis=0))


@triton.jit(do_not_specialize=["n_slots", "rank"])
def route_exchange_kernel(
    hist_ptr, base_ptr,  # [blocks, BLOCK_E] int32 each: per-block histograms -> block bases
    bad_ptr,  # int32 [1]: bad ids the count kernel found (read and cleared here)
    dest_start_ptr,  # int32 [W * E]: where this rank's segment of each expert starts at its rank
    counts_ptr,  # int32 [W, E] (output): rows this rank receives from each source per expert
    counts_in_ptr,  # heap int32 [W, W * E + 1]: row q = source q's send counts, its bad ids
    count_flag_ptr, consumed_ptr, ctl_ptr, clock_ptr, bases_ptr, status_addr,
    n_slots, E, capacity, rank, world, tag, timeout_us,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_EL: tl.constexpr,
):
    epoch = begin_call(ctl_ptr)
    ok = live(clock_ptr)
    E_total = world * E
    ROW = E_total + 1
    # 1. what peers sent this rank in the previous call has been read (stream order): free
    for q in range(0, world):
        if q != rank:
            signal_peer(consumed_ptr + rank, flag_value(epoch - 1, 0), bases_ptr, rank, q)
    # 2. exclusive scan of the block histograms along the blocks, BLOCK_P blocks per step
    experts = tl.arange(0, BLOCK_E)
    run = tl.zeros((BLOCK_E,), tl.int32)
    n_blocks = tl.cdiv(n_slots, BLOCK_T)
    for p0 in range(0, n_blocks, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        offs = p[:, None] * BLOCK_E + experts[None, :]
        m = (p < n_blocks)[:, None] & (experts < BLOCK_E)[None, :]
        h = tl.load(hist_ptr + offs, mask=m, other=0)
        tl.store(base_ptr + offs, tl.cumsum(h, axis=0) - h + run[None, :], mask=m)
        run += tl.sum(h, axis=0)
    # 3. this rank's send counts into row `rank` of every rank's counts_in, once that rank has
    #    read the previous call's (it frees at its own step 1), then the counts flag
    n_bad = tl.atomic_xchg(bad_ptr, 0, sem="relaxed", scope="gpu")
    for q in range(0, world):
        if q != rank:
            ok = await_free(consumed_ptr, q, epoch, clock_ptr, timeout_us, status_addr, 0,
                            FLAG_CONSUMED, ok)
        if ok:
            dst = peer_buffer(counts_in_ptr, bases_ptr, rank, q) + rank * ROW
            tl.store(dst + experts, run, mask=experts < E_total)
            tl.store(dst + E_total, n_bad)
    tl.debug_barrier()  # every thread's stores before the (cumulative) release
    for q in range(0, world):
        if q != rank:
            signal_peer(count_flag_ptr + rank, call_flag(epoch, tag, ok), bases_ptr, rank, q)
    # 4. every source's counts
    for q in range(0, world):
        if q != rank:
            ok = await_flag(count_flag_ptr + q, epoch, tag, clock_ptr, timeout_us, status_addr,
                            0, q, tl.cast(q, tl.int64) + (FLAG_COUNTS << 32), ok, True)
    tl.debug_barrier()  # the acquiring thread's view becomes the whole program's
    if ok:
        # 5. per destination d (rows) and local expert e (columns): C[q][d][e] summed over q
        d_idx = tl.arange(0, BLOCK_W)
        e_idx = tl.arange(0, BLOCK_EL)
        g = d_idx[:, None] * E + e_idx[None, :]
        m2 = (d_idx < world)[:, None] & (e_idx < E)[None, :]
        total = tl.zeros((BLOCK_W,), tl.int32)  # rows each rank receives
        before = tl.zeros((BLOCK_W,), tl.int32)  # rows of the sources before this rank there
        mine = tl.zeros((BLOCK_W, BLOCK_EL), tl.int32)  # this rank's send counts
        for q in range(0, world):
            c = tl.load(counts_in_ptr + q * ROW + g, mask=m2, other=0)
            q_bad = tl.load(counts_in_ptr + q * ROW + E_total)
            if (q != rank) & (q_bad > 0):  # (the source itself named the slot)
                report(status_addr, 0, STATUS_BAD_INPUT, q,
                       (CHECK_PEER_IDS << 32) + tl.cast(q, tl.int64), q_bad)
            rows = tl.sum(c, axis=1)
            total += rows
            before += tl.where(q < rank, rows, 0)
            mine += tl.where(q == rank, c, 0)
        start = before[:, None] + tl.cumsum(mine, axis=1) - mine
        tl.store(dest_start_ptr + g, start, mask=m2)
        over = (d_idx < world) & (total > capacity)
        if tl.sum(over.to(tl.int32)) > 0:
            d = tl.min(tl.where(over, d_idx, BLOCK_W))
            report(status_addr, 0, STATUS_BAD_INPUT, -1,
                   (CHECK_CAPACITY << 32) + d.to(tl.int64),
                   tl.sum(tl.where(d_idx == d, total, 0)))
        # 6. what this rank receives: counts[q, e] = C[q][rank][e]; zeros past the capacity
        fits = tl.sum(tl.where(d_idx == rank, total, 0)) <= capacity
        cin = tl.load(counts_in_ptr + d_idx[:, None] * ROW + rank * E + e_idx[None, :],
                      mask=m2, other=0)
        tl.store(counts_ptr + d_idx[:, None] * E + e_idx[None, :], tl.where(fits, cin, 0),
                 mask=m2)
    # the scatter goes ahead only on a call whose counts all arrived (ctl[3] = epoch)
    tl.atomic_xchg(ctl_ptr + 3, tl.where(ok, epoch.to(tl.int64), 0), sem="relaxed", scope="gpu")
    count_out(ctl_ptr, tl.program_id(0), tl.num_programs(0))  # no one waits for the last


@triton.jit
def _store_rows_at(tokens_ptr, dst_rows, dst_slots, i, k, pos, mq, H, stride_ts, h_lo, h_hi,
                   first, BLOCK_H: tl.constexpr):
    """Columns ``[h_lo, h_hi)`` of the rows of the lanes ``mq`` of a slot block stored at their
    places ``pos`` of the receive buffers ``dst_rows`` [capacity, H], and with ``first`` their
    slots in ``dst_slots`` (plain stores)."""
    tok = (i // k).to(tl.int64)
    tl.store(dst_slots + pos, i, mask=mq & first)
    for h0 in range(h_lo, h_hi, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        m = mq[:, None] & (cols < h_hi)[None, :]
        v = tl.load(tokens_ptr + tok[:, None] * stride_ts + cols[None, :], mask=m)
        tl.store(dst_rows + pos[:, None].to(tl.int64) * H + cols[None, :], v, mask=m)


@triton.jit
def store_rows(tokens_ptr, recv_ptr, recv_slots_ptr, bases_ptr, slot_ids_ptr, stage_ptr, pid,
               rank, q, i, k, pos, mq, H, stride_ts, h_lo, h_hi, first, BLOCK_T: tl.constexpr,
               BLOCK_H: tl.constexpr):
    """Zero-copy transport: columns ``[h_lo, h_hi)`` of the block's rows for rank ``q`` (lanes
    ``mq``), and with ``first`` their slots, stored straight into q's heap receive buffers
    (plain stores over NVLink / Infinity Fabric; this rank's own when q == rank).
    ``slot_ids_ptr`` and ``stage_ptr`` are the put transport's."""
    _store_rows_at(tokens_ptr, peer_buffer(recv_ptr, bases_ptr, rank, q),
                   peer_buffer(recv_slots_ptr, bases_ptr, rank, q), i, k, pos, mq, H, stride_ts,
                   h_lo, h_hi, first, BLOCK_H)


@triton.jit
def put_rows(tokens_ptr, recv_ptr, recv_slots_ptr, bases_ptr, slot_ids_ptr, stage_ptr, pid,
             rank, q, i, k, pos, mq, H, stride_ts, h_lo, h_hi, first, BLOCK_T: tl.constexpr,
             BLOCK_H: tl.constexpr):
    """Device-initiated transport: ``recv_ptr``, ``recv_slots_ptr``, ``tokens_ptr`` (a copy of
    the tokens, rows ``stride_ts`` apart) and ``slot_ids_ptr`` (``slot_ids[i] = i``) are in the
    SHMEM library's symmetric memory, where one address names every rank's copy. This rank's
    own rows: plain stores. A peer's, row by row: the block's lanes for q are packed into this
    program's stage (their places, then their slots: BLOCK_T int32 each), then each row is one
    block-wide put of its columns ``[h_lo, h_hi)`` and, with ``first``, one of its slot into
    q's receive buffers. The puts read symmetric memory only: over a network the library sends
    from memory it registered, which its symmetric memory is. One put per row: a row's place
    follows the previous lane's only for the same expert, and even then its token and its slot
    do not follow that lane's (the token's other choices lie between)."""
    if q == rank:
        _store_rows_at(tokens_ptr, recv_ptr, recv_slots_ptr, i, k, pos, mq, H, stride_ts, h_lo,
                       h_hi, first, BLOCK_H)
    else:
        stage = stage_ptr + tl.cast(pid, tl.int64) * (2 * BLOCK_T)
        at = tl.cumsum(mq.to(tl.int32), axis=0) - 1
        tl.store(stage + at, pos, mask=mq)
        tl.store(stage + BLOCK_T + at, i, mask=mq)
        tl.debug_barrier()  # the whole stage is written before any thread reads it
        for j in range(0, tl.sum(mq.to(tl.int32))):
            p = tl.load(stage + j).to(tl.int64)
            s = tl.load(stage + BLOCK_T + j)
            shmem_put(recv_ptr + p * H + h_lo,
                      tokens_ptr + (s // k).to(tl.int64) * stride_ts + h_lo, h_hi - h_lo, q)
            if first:
                shmem_put(recv_slots_ptr + p, slot_ids_ptr + s, 1, q)
        tl.debug_barrier()  # every thread has read the stage before the next block's writes


@triton.jit
def no_flush():
    """Zero-copy stores need no completion step before the release signal."""
    pass


@triton.jit
def slot_places(ids_ptr, base_ptr, dest_start_ptr, b, n_slots, E, capacity, world,
                BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """Slot block ``b``'s slots ``i``, their places ``pos`` in their destinations' receive
    buffers (module docstring), which of them to store (``keep``: not a bad id, not past the
    capacity; the count and exchange kernels reported those) and their destination ranks."""
    lanes = tl.arange(0, BLOCK_T)
    E_total = world * E
    i = b * BLOCK_T + lanes
    g = tl.load(ids_ptr + i, mask=i < n_slots, other=-1).to(tl.int64)
    keep = (g >= 0) & (g < E_total)
    g = tl.where(keep, g, 0).to(tl.int32)
    # the slot's rank among the block's slots of the same expert (a stable sort's)
    same = (g[:, None] == g[None, :]) & keep[None, :] & (lanes[None, :] < lanes[:, None])
    pos = (tl.load(dest_start_ptr + g) + tl.load(base_ptr + b * BLOCK_E + g)
           + tl.sum(same.to(tl.int32), axis=1))
    return i, pos, keep & (pos < capacity), g // E


@triton.jit
def scatter_rows(tokens_ptr, ids_ptr, base_ptr, dest_start_ptr, recv_ptr, recv_slots_ptr,
                 slot_ids_ptr, stage_ptr, bases_ptr, pid, step, n_slots, k, H, stride_ts, E,
                 capacity, rank, world, d_lo, d_hi, BLOCK_T: tl.constexpr,
                 BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, STORE: tl.constexpr):
    """The scatter's work for items ``pid, pid + step, ...``: each slot routed to a rank in
    ``[d_lo, d_hi)`` has its row and its slot placed at its place in that rank's receive
    buffers (module docstring) by the transport's ``STORE`` (``store_rows``, ``put_rows``).
    Slots with bad ids and rows past the capacity are skipped (the count and exchange kernels
    reported them). Shared by the dispatch's scatter (every destination in one pass) and the
    fused dispatch + gated GEMM (one destination per pass).

    An item is a slot block's rows, or where the blocks are fewer than the ``step`` programs
    (a decode step's few tokens) a share of their columns: ``splits`` items per block, so that
    every program moves bytes. Without it, 128 tokens of top-8 make 16 blocks of 64 rows, and
    16 programs each stored 0.9 MB while the other 116 idled (the scatter took 0.046 ms on
    2 H200s for 7.3 MB to the peer). The slots are stored by the block's first item."""
    n_blocks = tl.cdiv(n_slots, BLOCK_T)
    n_chunks = tl.cdiv(H, BLOCK_H)
    splits = tl.maximum(tl.minimum(n_chunks, step // tl.maximum(n_blocks, 1)), 1)
    for w in range(pid, n_blocks * splits, step):
        b = w // splits
        c = w % splits
        h_lo = c * n_chunks // splits * BLOCK_H
        h_hi = tl.minimum((c + 1) * n_chunks // splits * BLOCK_H, H)
        i, pos, keep, dest = slot_places(ids_ptr, base_ptr, dest_start_ptr, b, n_slots, E,
                                         capacity, world, BLOCK_T, BLOCK_E)
        for q in range(d_lo, d_hi):
            mq = keep & (dest == q)
            if tl.sum(mq.to(tl.int32)) > 0:  # each row is loaded once, for its own rank
                STORE(tokens_ptr, recv_ptr, recv_slots_ptr, bases_ptr, slot_ids_ptr, stage_ptr,
                      pid, rank, q, i, k, pos, mq, H, stride_ts, h_lo, h_hi, c == 0, BLOCK_T,
                      BLOCK_H)


@triton.jit
def scatter_rows_once(tokens_ptr, ids_ptr, base_ptr, dest_start_ptr, recv_ptr, recv_slots_ptr,
                      once_ptr, place_ptr, bases_ptr, pid, step, epoch, n_slots, k, H,
                      stride_ts, E, capacity, max_tokens, rank, world, BLOCK_T: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    """``scatter_rows`` that sends a token to a peer once per slot block, whatever the number
    of its experts there: the slot ids to their places as there; each slot's place, stamped
    with the call (``epoch << 32 | place``), at the slot's index in the peer's ``place`` map
    (``[W - 1, max_tokens * k]``); and the row only from the token's first slot of the block
    routed to that peer, into the peer's ``once`` buffer (``[W - 1, max_tokens, H]``, token s
    at row s; a token whose k slots straddle two blocks is stored there from both, the same
    bytes). In both of rank
    q's buffers source ``r`` is index ``r - (r > q)``. The peer's ``expand_rows`` fills every
    place from them. This rank's own rows are stored at their places directly."""
    for b in range(pid, tl.cdiv(n_slots, BLOCK_T), step):
        i, pos, keep, dest = slot_places(ids_ptr, base_ptr, dest_start_ptr, b, n_slots, E,
                                         capacity, world, BLOCK_T, BLOCK_E)
        tok = (i // k).to(tl.int64)
        j = i % k
        # a slot leads its token's rows for its rank unless an earlier choice of this block
        # goes there too (bad ids go nowhere; a row past a rank's capacity may then go unsent,
        # but that call fails on every rank and the rank's counts are zeros). Of this block
        # only: the receiving side copies a block's rows once the program that sent that
        # block has signalled, and the block before may be another program's, still running;
        # a token whose choices straddle two blocks is sent once from each
        first = j - (i - b * BLOCK_T)  # the choice of the block's first slot (<= 0 when none)
        dup = tl.zeros((BLOCK_T,), tl.int1)
        for jj in range(0, k):
            m = keep & (jj < j) & (jj >= first)
            g2 = tl.load(ids_ptr + tok * k + jj, mask=m, other=-1)
            dup = dup | (m & (g2 >= 0) & (g2 < world * E) & (g2 // E == dest))
        for q in range(0, world):
            mq = keep & (dest == q)
            if tl.sum(mq.to(tl.int32)) > 0:
                if q == rank:
                    _store_rows_at(tokens_ptr, recv_ptr, recv_slots_ptr, i, k, pos, mq, H,
                                   stride_ts, 0, H, True, BLOCK_H)
                else:
                    tl.store(peer_buffer(recv_slots_ptr, bases_ptr, rank, q) + pos, i, mask=mq)
                    lead = mq & ~dup
                    me = tl.where(rank > q, rank - 1, rank).to(tl.int64)
                    tl.store(peer_buffer(place_ptr, bases_ptr, rank, q) + me * max_tokens * k + i,
                             (epoch.to(tl.int64) << 32) | pos.to(tl.int64), mask=mq)
                    src = me * max_tokens
                    dst = peer_buffer(once_ptr, bases_ptr, rank, q)
                    for h0 in range(0, H, BLOCK_H):
                        cols = h0 + tl.arange(0, BLOCK_H)
                        m = lead[:, None] & (cols < H)[None, :]
                        v = tl.load(tokens_ptr + tok[:, None] * stride_ts + cols[None, :], mask=m)
                        tl.store(dst + (src + tok)[:, None] * H + cols[None, :], v, mask=m)


@triton.jit
def expand_rows(recv_ptr, once_ptr, place_ptr, pid, step, epoch, k, H, max_tokens, rank, world,
                BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """The receiving side of ``scatter_rows_once``, in program ``pid`` of the scatter once its
    counterparts on every peer have signalled: the slot blocks those programs sent (``pid,
    pid + step, ...``, the same blocks of every source, up to the most a source can have) and,
    for each slot whose place is stamped with this call, its token's row copied from the
    ``once`` buffer to that place (a slot stamped by an earlier call went elsewhere in this
    one)."""
    lanes = tl.arange(0, BLOCK_T)
    n_max = max_tokens * k
    for q in range(0, world):
        if q != rank:
            src = tl.where(q > rank, q - 1, q).to(tl.int64)
            places = place_ptr + src * n_max
            rows = once_ptr + src * max_tokens * H
            for b in range(pid, tl.cdiv(n_max, BLOCK_T), step):
                i = b * BLOCK_T + lanes
                v = tl.load(places + i, mask=i < n_max, other=0)
                m = (i < n_max) & ((v >> 32) == epoch.to(tl.int64))
                if tl.sum(m.to(tl.int32)) > 0:
                    pos = v & 0xFFFFFFFF
                    tok = (i // k).to(tl.int64)
                    for h0 in range(0, H, BLOCK_H):
                        cols = h0 + tl.arange(0, BLOCK_H)
                        mm = m[:, None] & (cols < H)[None, :]
                        x = tl.load(rows + tok[:, None] * H + cols[None, :], mask=mm)
                        tl.store(recv_ptr + pos[:, None] * H + cols[None, :], x, mask=mm)


# S changes from call to call, and every rank must run the same code (same registers, so the
# same resident grid, which the tag includes): not specialized on either.
@triton.jit(do_not_specialize=["n_slots", "rank"])
def dispatch_scatter_kernel(
    tokens_ptr, ids_ptr, base_ptr, dest_start_ptr,
    recv_ptr, recv_slots_ptr,  # heap [capacity, H] and int32 [capacity]: every rank's receive
    slot_ids_ptr, stage_ptr,  # the put transport's (unused here)
    once_ptr,  # heap [W - 1, max_tokens, H]: the tokens sent once per rank (ONCE)
    place_ptr,  # heap int64 [W - 1, max_tokens * top_k]: their slots' stamped places (ONCE)
    sent_ptr, ctl_ptr, clock_ptr, bases_ptr, status_addr,
    n_slots, k, H, stride_ts, E, capacity, max_tokens, rank, world, tag, timeout_us,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, G_MAX: tl.constexpr,
    ONCE: tl.constexpr,
):
    """The zero-copy scatter (rows stored into the destinations' heaps; with ``ONCE``, a token
    once per peer rank, ``scatter_rows_once``, copied to its places by ``expand_rows``)."""
    _scatter(tokens_ptr, ids_ptr, base_ptr, dest_start_ptr, recv_ptr, recv_slots_ptr,
             slot_ids_ptr, stage_ptr, once_ptr, place_ptr, sent_ptr, ctl_ptr, clock_ptr, bases_ptr,
             status_addr, n_slots, k, H, stride_ts, E, capacity, max_tokens, rank, world, tag,
             timeout_us, BLOCK_T, BLOCK_E, BLOCK_H, G_MAX, store_rows, no_flush, ONCE)


@triton.jit(do_not_specialize=["n_slots", "rank"])
def dispatch_put_kernel(
    tokens_ptr, ids_ptr, base_ptr, dest_start_ptr,
    recv_ptr, recv_slots_ptr,  # symmetric memory of the SHMEM library: [capacity, H], [capacity]
    slot_ids_ptr,  # symmetric int32 [max_tokens * top_k]: slot_ids[i] = i, the slots' puts' source
    stage_ptr,  # int32 [G_MAX, 2 * BLOCK_T]: each program's packed places and slots
    once_ptr, place_ptr,  # (unused: the put transport sends a row per slot)
    sent_ptr, ctl_ptr, clock_ptr, bases_ptr, status_addr,
    n_slots, k, H, stride_ts, E, capacity, max_tokens, rank, world, tag, timeout_us,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, G_MAX: tl.constexpr,
):
    """The same scatter with the peers' rows put by the process's SHMEM provider (device-
    initiated puts, then their completion before the release signals; ``put_rows``). A kernel
    of its own: the provider's launcher sets up its compiled modules, and it is compiled only
    where a provider exists (GPUs with NVSHMEM / ROC_SHMEM)."""
    _scatter(tokens_ptr, ids_ptr, base_ptr, dest_start_ptr, recv_ptr, recv_slots_ptr,
             slot_ids_ptr, stage_ptr, once_ptr, place_ptr, sent_ptr, ctl_ptr, clock_ptr, bases_ptr,
             status_addr, n_slots, k, H, stride_ts, E, capacity, max_tokens, rank, world, tag,
             timeout_us, BLOCK_T, BLOCK_E, BLOCK_H, G_MAX, put_rows, shmem_flush, False)


@triton.jit
def _scatter(tokens_ptr, ids_ptr, base_ptr, dest_start_ptr, recv_ptr, recv_slots_ptr,
             slot_ids_ptr, stage_ptr, once_ptr, place_ptr, sent_ptr, ctl_ptr, clock_ptr, bases_ptr,
             status_addr, n_slots, k, H, stride_ts, E, capacity, max_tokens, rank, world, tag,
             timeout_us, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
             G_MAX: tl.constexpr, STORE: tl.constexpr, FLUSH: tl.constexpr,
             ONCE: tl.constexpr):
    pid = tl.program_id(0)
    epoch = calls_done(ctl_ptr)  # published by the exchange
    ok = live(clock_ptr) & (tl.atomic_add(ctl_ptr + 3, 0, sem="relaxed", scope="gpu") == epoch)
    if ok:
        if ONCE:
            scatter_rows_once(tokens_ptr, ids_ptr, base_ptr, dest_start_ptr, recv_ptr,
                              recv_slots_ptr, once_ptr, place_ptr, bases_ptr, pid,
                              tl.num_programs(0), epoch, n_slots, k, H, stride_ts, E, capacity,
                              max_tokens, rank, world, BLOCK_T, BLOCK_E, BLOCK_H)
        else:
            scatter_rows(tokens_ptr, ids_ptr, base_ptr, dest_start_ptr, recv_ptr,
                         recv_slots_ptr, slot_ids_ptr, stage_ptr, bases_ptr, pid,
                         tl.num_programs(0), n_slots, k, H, stride_ts, E, capacity, rank, world,
                         0, world, BLOCK_T, BLOCK_E, BLOCK_H, STORE)
    FLUSH()  # the transport's rows have landed before the release
    # the rows of this program have landed everywhere (release), then every peer's have here
    signal_peers(sent_ptr, bases_ptr, pid, rank, world, call_flag(epoch, tag, ok), G_MAX)
    ok = wait_peers(sent_ptr, FLAG_SENT, pid, rank, world, epoch, tag, clock_ptr, timeout_us,
                    status_addr, ok, G_MAX)
    if ONCE:
        if ok:  # the counterparts' rows, slots and places have landed here
            expand_rows(recv_ptr, once_ptr, place_ptr, pid, tl.num_programs(0), epoch, k, H,
                        max_tokens, rank, world, BLOCK_T, BLOCK_H)
    if (epoch & (REFRESH_CALLS - 1)) == 0:
        refresh_sent(sent_ptr, epoch, clock_ptr, bases_ptr, tl.num_programs(0), 0, rank, world,
                     tag, G_MAX)


@triton.jit(noinline=True)
def refresh_sent(sent_ptr, epoch, clock_ptr, bases_ptr, first, own_first, rank, world, tag,
                 G_MAX: tl.constexpr):
    """``refresh_words`` of this rank's ``sent`` words that a launch of the dispatch's call
    ``epoch`` does not write: from ``first`` up in the peers' heaps (the scatter's grid, the
    fused launches' senders) and from ``own_first`` up in this rank's (0 for the scatter, which
    writes none there; the fused launches' senders), by every program of the launch, as its
    last step, at every ``REFRESH_CALLS``-th call (the caller tests ``epoch``: a call that
    refreshes nothing calls nothing). The launches of one context share the words and write
    different numbers of them (the scatter's grid is the programs resident at once, which may
    differ with the tokens' dtype; the fused launches' senders follow their plan). Not
    inlined: inlined, the fused dispatch + gated GEMM with descriptors spilled 4 bytes on
    sm_90 (none so)."""
    value = call_flag(epoch, tag, live(clock_ptr))
    pid = tl.program_id(0)
    refresh_words(sent_ptr, bases_ptr, first, pid, tl.num_programs(0), rank, world, value, G_MAX)
    refresh_words(sent_ptr, bases_ptr, own_first, pid, tl.num_programs(0), rank, world, value,
                  G_MAX, OWN=True, PEERS=False)
