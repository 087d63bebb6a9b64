"""The dispatch's scatter and the experts' gated first GEMM in one persistent launch: the GEMM
starts on the rows that have arrived, not after the last peer's.

Runs after the dispatch's count and exchange launches (kernel.py), in place of the dispatch's
scatter launch. On rank r, with the dispatch's layout (rows by source rank q, then local expert
e, ``counts[q, e]`` rows per segment)::

    x = the dispatch's receive buffer (rows of every source, stored here by the sources)
    h[i] = silu(x[i] @ w_gate[e(i)]) * (x[i] @ w_up[e(i)])      # the rows of counts.sum()

Roles by program id (every program of the grid is resident at once; the host caps the grid):

- programs ``0 .. senders-1`` send. Sender p takes slot blocks ``p, p + senders, ...`` and
  stores their rows (``scatter_rows``) one destination per pass, in the order ``r, r+1, ...``
  (its own rank first: a local copy, so the rank's own GEMM tiles can start early), and after
  each pass releases ``sent[r][p]`` in that destination's heap. Rank d thus receives source
  ``d - j``'s rows in its j-th pass, so each source serves a different rank first.
- the others compute. A tile reads one (source, expert) segment, and its first wait for
  source q (acquire, bounded) is for ``sent[q][0 .. senders)``, every sender of q: then all
  of q's rows are here. Two tile queues, claimed by atomic counters: the tiles of this rank's
  own rows, then the peers' in the order they arrive (source ``r-1``, ``r-2``, ...; expert by
  expert inside a source, grouped order inside a segment). Every program takes from the
  first queue, then the second; senders once they have sent.

Under the interpreter, which runs programs one after another in program order, every sender
runs before any compute program starts, and a compute program waits only for senders (of its
own launch, done by then, or of other ranks, which wait for nothing before they signal): no
program waits for a program of its own launch that has not run. Senders take no tiles there
(``SENDERS_COMPUTE`` false) unless there is one sender per rank: sender 0 of rank r waiting
for sender 1 of rank q, which runs after q's sender 0, which waits for r's sender 1, would be
a cycle; with one sender per rank each waits only for the others' sender 0, which signals
before it waits (its own rows' tiles wait for itself, done by then).

The last program out zeroes the queue counters for the next call (each program takes its
ticket after its last claim). Every wait is bounded (the status board names the source and
the sender flag); a source that gave up (the exchange failed there) is reported, and a program
that gave up stops claiming tiles. Only the tiles' own rows are stored, so a source's rows
past the capacity (not sent) or a rank whose counts were zeroed (an overflow) store nothing.
"""
import triton
import triton.language as tl

from ...backends.proxy_fence import async_proxy_fence
from ...shmem.device import (REFRESH_CALLS, await_flags, call_flag, calls_done, live,
                             signal_peer)
from ...tiles.gemm import grouped_tile
from ..moe_experts.kernel import swiglu_segment_tile
from .kernel import FLAG_SENT, refresh_sent, scatter_rows, store_rows


#: what a tile given up on adds to its row tile's ready count (take_tiles): more than any
#: count of computed tiles, so the consumer's wait ends and it sees the row tile is not there
READY_SKIPPED = tl.constexpr(1 << 20)


@triton.jit
def row_tile(s, pid_m, cnt, segs, BLOCK_M: tl.constexpr):
    """The number of row tile ``pid_m`` of segment ``s`` (= source * E + expert) among all row
    tiles of the call, segment by segment (``cnt``: the rows of every segment, lane ``segs``)."""
    return tl.sum(tl.where(segs < s, (cnt + BLOCK_M - 1) // BLOCK_M, 0)) + pid_m


@triton.jit
def send_rows(tokens_ptr, ids_ptr, base_ptr, dest_start_ptr, recv_ptr, recv_slots_ptr, sent_ptr,
              bases_ptr, pid, senders, n_slots, k, H, stride_ts, E, capacity, rank, world, epoch,
              tag, ok, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
              G_MAX: tl.constexpr):
    """Sender ``pid`` of ``senders``: its slot blocks' rows stored one destination per pass,
    its own rank first, each pass ending with ``sent[rank][pid]`` released in that
    destination's heap (the module docstring)."""
    for j in range(0, world):
        d = (rank + j) % world
        if ok:  # (zero-copy stores: no slot ids or stage, the put transport's)
            scatter_rows(tokens_ptr, ids_ptr, base_ptr, dest_start_ptr, recv_ptr,
                         recv_slots_ptr, recv_slots_ptr, recv_slots_ptr, bases_ptr, pid,
                         senders, n_slots, k, H, stride_ts, E, capacity, rank, world, d,
                         d + 1, BLOCK_T, BLOCK_E, BLOCK_H, store_rows)
        tl.debug_barrier()  # every thread's stores before the (cumulative) release
        signal_peer(sent_ptr + rank * G_MAX + pid, call_flag(epoch, tag, ok), bases_ptr,
                    rank, d)


@triton.jit
def fused_segment(f, rank, world, E, counts_ptr, num_pid_n, BLOCK_M: tl.constexpr):
    """Segment ``f`` of the fused order (source ``r - f // E``, expert ``f % E``): its source,
    expert, rows and tile count."""
    q = (rank + world - f // E) % world
    e = f % E
    n = tl.load(counts_ptr + q * E + e)
    return q, e, n, tl.cdiv(n, BLOCK_M) * num_pid_n


@triton.jit
def take_tiles(queue_ptr, total, f0, have, ok, counts_ptr, cnt, segs, sent_ptr, senders, x_ptr,
               wg_ptr, wu_ptr, h_ptr, x_desc, wg_desc, wu_desc, ready_ptr, I, H, E, rank, world,
               epoch, tag, clock_ptr, timeout_us, status_addr, pid, stride_we, stride_wk,
               stride_wn, stride_hm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr,
               EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
               USE_DESC: tl.constexpr, BLOCK_F: tl.constexpr, G_MAX: tl.constexpr,
               NOTIFY: tl.constexpr):
    """Claim tiles of one queue (``total`` tiles, the fused order from segment ``f0``) until it
    is empty or this program gives up; ``have`` bit q: source q's rows are known here. With
    ``NOTIFY``, each claimed tile then counts itself in ``ready_ptr[row tile]`` (release): one
    per tile computed, ``READY_SKIPPED`` for a tile given up on (row tiles numbered segment by
    segment in (source, expert) order, ``row_tile``), so a consumer of the row tile's
    activations waits for ``cdiv(I, BLOCK_N)`` and sees whether any is missing."""
    num_pid_n = tl.cdiv(I, BLOCK_N)
    f = f0
    q, e, n, s_nt = fused_segment(f, rank, world, E, counts_ptr, num_pid_n, BLOCK_M)
    s_t0 = 0
    t = tl.atomic_add(queue_ptr, 1, sem="relaxed", scope="gpu")
    # (with NOTIFY a program that gave up still drains the queue, counting each tile it claims
    # as given up: a consumer waits for every tile of its row tile, and no one else may take it)
    while (t < total) & (ok | NOTIFY):
        # claims only grow, so the cursor only moves forward; `total` keeps it in the queue
        while t >= s_t0 + s_nt:
            f += 1
            s_t0 += s_nt
            q, e, n, s_nt = fused_segment(f, rank, world, E, counts_ptr, num_pid_n, BLOCK_M)
        if ((have >> q) & 1) == 0:
            what = (q * G_MAX).to(tl.int64) + (FLAG_SENT << 32)
            ok = await_flags(sent_ptr + q * G_MAX, senders, epoch, tag, clock_ptr, timeout_us,
                             status_addr, pid, q, what, ok, BLOCK_F)
            tl.debug_barrier()  # the acquiring thread's view becomes the whole program's
            if USE_DESC:
                async_proxy_fence()  # the acquire, before the bulk copies' reads of the rows
            have = have | (tl.full((), 1, tl.int64) << q)
        pid_m, pid_n = grouped_tile(t - s_t0, tl.cdiv(n, BLOCK_M), num_pid_n, GROUP_M)
        if ok:
            start = tl.sum(tl.where(segs < q * E + e, cnt, 0))  # rows of the segments before
            swiglu_segment_tile(x_ptr, wg_ptr, wu_ptr, h_ptr, x_desc, wg_desc, wu_desc, start,
                                n, e, pid_m, pid_n, I, H, H, 1, stride_we, stride_wk,
                                stride_wn, stride_hm, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES,
                                EVEN_K, PRECISION, UPCAST, USE_DESC)
        if NOTIFY:
            tl.debug_barrier()  # every thread's stores of the tile before the (cumulative) release
            tl.atomic_add(ready_ptr + row_tile(q * E + e, pid_m, cnt, segs, BLOCK_M),
                          tl.where(ok, 1, READY_SKIPPED), sem="release", scope="gpu")
        t = tl.atomic_add(queue_ptr, 1, sem="relaxed", scope="gpu")
    return have, ok


@triton.jit
def dispatch_and_gate(
    tokens_ptr, ids_ptr, base_ptr, dest_start_ptr, recv_ptr, recv_slots_ptr, sent_ptr,
    ctl_ptr, clock_ptr, bases_ptr, status_addr, counts_ptr, queue_ptr, ready_ptr,
    wg_ptr, wu_ptr, h_ptr, x_desc, wg_desc, wu_desc,
    n_slots, k, H, stride_ts, E, capacity, rank, world, tag, timeout_us, senders,
    I, stride_we, stride_wk, stride_wn, stride_hm,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, G_MAX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, USE_DESC: tl.constexpr, BLOCK_SEG: tl.constexpr,
    BLOCK_F: tl.constexpr, SENDERS_COMPUTE: tl.constexpr, NOTIFY: tl.constexpr,
):
    """This program's part of the module docstring's roles: its sender passes (if it sends),
    then the tiles it claims from the two queues (``take_tiles``; ``NOTIFY``: each counted in
    ``ready_ptr``), then, at every ``REFRESH_CALLS``-th call, the ``sent`` words past the
    senders (``refresh_sent``; here, so that the call number is not kept past it). Returns
    whether the program stayed on track (the dispatch's ``ok``)."""
    pid = tl.program_id(0)
    epoch = calls_done(ctl_ptr)  # published by the exchange
    ok = live(clock_ptr) & (tl.atomic_add(ctl_ptr + 3, 0, sem="relaxed", scope="gpu") == epoch)
    # the tile lists, from the counts on the device
    num_pid_n = tl.cdiv(I, BLOCK_N)
    segs = tl.arange(0, BLOCK_SEG)
    cnt = tl.load(counts_ptr + segs, mask=segs < world * E, other=0)
    tiles = tl.cdiv(cnt, BLOCK_M) * num_pid_n
    own_total = tl.sum(tl.where(segs // E == rank, tiles, 0))
    peer_total = tl.sum(tiles) - own_total
    have = tl.zeros((), tl.int64)
    if pid < senders:
        send_rows(tokens_ptr, ids_ptr, base_ptr, dest_start_ptr, recv_ptr, recv_slots_ptr,
                  sent_ptr, bases_ptr, pid, senders, n_slots, k, H, stride_ts, E, capacity, rank,
                  world, epoch, tag, ok, BLOCK_T, BLOCK_E, BLOCK_H, G_MAX)
    # queue 0: the own rows' tiles, queue 1: the peers' (one call site, so the GEMM's
    # pipeline buffers are laid out once)
    for qi in range(0, tl.where(SENDERS_COMPUTE or (pid >= senders), 2, 0)):
        have, ok = take_tiles(queue_ptr + qi, tl.where(qi == 0, own_total, peer_total), qi * E,
                              have, ok, counts_ptr, cnt, segs, sent_ptr, senders, recv_ptr,
                              wg_ptr, wu_ptr, h_ptr, x_desc, wg_desc, wu_desc, ready_ptr, I, H, E,
                              rank, world, epoch, tag, clock_ptr, timeout_us, status_addr, pid,
                              stride_we, stride_wk, stride_wn, stride_hm, BLOCK_M, BLOCK_N,
                              BLOCK_K, GROUP_M, NUM_STAGES, EVEN_K, PRECISION, UPCAST, USE_DESC,
                              BLOCK_F, G_MAX, NOTIFY)
    if (epoch & (REFRESH_CALLS - 1)) == 0:
        refresh_sent(sent_ptr, epoch, clock_ptr, bases_ptr, senders, senders, rank, world, tag,
                     G_MAX)
    return ok


# S changes from call to call and every rank must run the same code: neither S nor the rank
# is specialized on (as the scatter).
@triton.jit(do_not_specialize=["n_slots", "rank"])
def dispatch_swiglu_kernel(
    tokens_ptr, ids_ptr, base_ptr, dest_start_ptr,  # the scatter's inputs (kernel.py)
    recv_ptr, recv_slots_ptr, sent_ptr,  # heap: [capacity, H], int32 [capacity], [W, G_MAX]
    ctl_ptr, clock_ptr, bases_ptr, status_addr,
    counts_ptr,  # int32 [W, E]: the rows this rank receives (the exchange's)
    queue_ptr,  # int32 [3]: own tiles claimed, peers' tiles claimed, programs finished
    wg_ptr, wu_ptr, h_ptr, x_desc, wg_desc, wu_desc,  # [E, H, I] weights, h [capacity, I]
    n_slots, k, H, stride_ts, E, capacity, rank, world, tag, timeout_us, senders,
    I, stride_we, stride_wk, stride_wn, stride_hm,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, G_MAX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, USE_DESC: tl.constexpr, BLOCK_SEG: tl.constexpr,
    BLOCK_F: tl.constexpr, SENDERS_COMPUTE: tl.constexpr,
):
    dispatch_and_gate(
        tokens_ptr, ids_ptr, base_ptr, dest_start_ptr, recv_ptr, recv_slots_ptr, sent_ptr,
        ctl_ptr, clock_ptr, bases_ptr, status_addr, counts_ptr, queue_ptr, queue_ptr, wg_ptr,
        wu_ptr, h_ptr, x_desc, wg_desc, wu_desc, n_slots, k, H, stride_ts, E, capacity, rank,
        world, tag, timeout_us, senders, I, stride_we, stride_wk, stride_wn, stride_hm, BLOCK_T,
        BLOCK_E, BLOCK_H, G_MAX, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_STAGES, EVEN_K,
        PRECISION, UPCAST, USE_DESC, BLOCK_SEG, BLOCK_F, SENDERS_COMPUTE, False)
    # the last program out (every program has made its last claim) zeroes the queues
    tl.debug_barrier()
    ticket = tl.atomic_add(queue_ptr + 2, 1, sem="acq_rel", scope="gpu")
    last = ticket == tl.num_programs(0) - 1
    for i in range(0, 3):
        tl.atomic_xchg(queue_ptr + i, 0, mask=last, sem="relaxed", scope="gpu")
