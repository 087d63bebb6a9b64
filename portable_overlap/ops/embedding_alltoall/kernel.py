"""Fused embedding pooling + All-to-All: one persistent kernel, pooled vectors stored straight
into the destination rank's heap (zero-copy scale-up).

Rank r holds ``n_loc`` tables (global ids ``gtab[r][0..n_loc)``) and pools them for the whole
global batch; samples ``[boff[d], boff[d+1])`` belong to rank d. The work of rank r is a task
list of *slices* (one local table × up to BLOCK_B consecutive samples of one destination rank),
table-major within a destination, destination by destination starting at rank r+1 and ending
with r itself, so everything that travels is computed first (communication-aware order).
Program ``pid`` takes the tasks ``pid, pid + G, ...`` of each destination's run. On rank r, program pid:

1. for each destination d in that order: before its first store into d's ``recv`` in this call,
   waits until ``consumed[d]`` holds the previous epoch (d has copied the previous call out);
   pools its slices for d and stores each tile where it belongs in d's output layout — into r's
   own ``out`` when d == r, else into ``recv`` in d's heap; then signals ``sent[r][pid]`` on d
   (release, after a CTA barrier): d may start on what this program sent while it works on the
   next destination;
2. waits (acquire, bounded) for ``sent[q][pid]`` of every peer q;
3. copies from ``recv`` to ``out`` the tiles peer q's program pid sent it — the task list of q
   is a function of (q, pid, the plan), so r recomputes it and no program waits for another
   program of its own launch;
4. takes a ticket; the last program out publishes the epoch locally and ``consumed[r] = epoch``
   in every peer's heap.

Flags carry ``(shape tag << 32) | epoch`` (shmem/device.py): a peer called with another batch
split, dtype or table plan is caught as a mismatch; a program that gave up signals FAILED_TAG.
An index outside its table is never read (pool.py): the program that finds one reports it
(``CHECK_INDEX``: the global table, the index), pools no more and signals FAILED_TAG to the
destinations it has not signalled yet, but keeps every wait, so the ranks stay in step.
"""
import triton
import triton.language as tl

from ...shmem.device import (REFRESH_CALLS, STATUS_BAD_INPUT, await_free, begin_call, call_flag,
                             end_call_free, live, peer_buffer, refresh_words, report, signal_peer,
                             wait_peers)
from ...shmem.providers.device import flush as shmem_flush, put_strided as shmem_put_strided
from .pool import first_outside, indices_outside, pooled_rows

FLAG_SENT = tl.constexpr(1)
FLAG_CONSUMED = tl.constexpr(2)
CHECK_INDEX = tl.constexpr(3)
FLAG_NAMES = {1: "slices-sent", 2: "recv-consumed",
              3: "embedding index (outside its table's rows, not read) of global table"}


@triton.jit
def store_slice(recv_ptr, bases_ptr, rank, d, offs, y, mask, stage_ptr, pid, row0, row_stride,
                col0, n_rows, ncols, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr):
    """Zero-copy transport: the pooled tile straight into rank d's ``recv`` (plain stores;
    peer_buffer keeps recv's 16-byte alignment, so they are vector stores)."""
    tl.store(peer_buffer(recv_ptr, bases_ptr, rank, d) + offs, y, mask=mask)


@triton.jit
def no_flush():
    """Zero-copy stores need no completion step before the release signal."""
    pass


# Every rank must run the same compiled code (same registers, so the same resident grid, which
# the shape tag includes): the rank number and per-rank counts are never specialized on (the
# JIT would bake rank == 1 into rank 1's kernel only).
@triton.jit(do_not_specialize=["rank", "n_loc", "B"])
def embedding_alltoall_kernel(
    weight_ptr,  # this rank's tables packed: [sum of local rows, D]
    indices_ptr, psw_ptr, offsets_ptr,  # jagged input: indices, per-index weights, [n_loc*B + 1]
    out_ptr,  # [B_local, T_total * D], global table order
    row_off_ptr,  # int64 [n_loc]: first row of each local table in weight
    rows_ptr,  # int64 [n_loc]: rows of each local table (indices are checked against it)
    gtab_ptr,  # int32 [world, t_max]: global table id of every rank's local tables
    ntab_ptr,  # int32 [world]: local table count of every rank
    boff_ptr,  # int32 [world + 1]: batch offsets (rank d's samples are [boff[d], boff[d+1]))
    recv_ptr, stage_ptr,  # like out (heap, or a SHMEM library's symmetric memory); staging tiles
    sent_ptr, consumed_ptr, ctl_ptr, clock_ptr,  # heap: [world, G_MAX], [world], [2], [2]
    bases_ptr, status_addr,
    B, D, n_loc, row_stride, t_max, iters, G, rank, world, tag, timeout_us,
    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
    MEAN: tl.constexpr, G_MAX: tl.constexpr,
):
    """The zero-copy kernel (tiles stored into the destinations' heaps)."""
    _embedding_alltoall(weight_ptr, indices_ptr, psw_ptr, offsets_ptr, out_ptr, row_off_ptr,
                        rows_ptr, gtab_ptr, ntab_ptr, boff_ptr, recv_ptr, stage_ptr, sent_ptr,
                        consumed_ptr, ctl_ptr, clock_ptr, bases_ptr, status_addr, B, D, n_loc,
                        row_stride, t_max, iters, G, rank, world, tag, timeout_us, BLOCK_B, BLOCK_D,
                        HAS_WEIGHTS, MEAN, G_MAX, store_slice, no_flush)


@triton.jit(do_not_specialize=["rank", "n_loc", "B"])
def embedding_alltoall_put_kernel(
    weight_ptr, indices_ptr, psw_ptr, offsets_ptr, out_ptr, row_off_ptr, rows_ptr, gtab_ptr,
    ntab_ptr, boff_ptr, recv_ptr, stage_ptr, sent_ptr, consumed_ptr, ctl_ptr, clock_ptr, bases_ptr,
    status_addr, B, D, n_loc, row_stride, t_max, iters, G, rank, world, tag, timeout_us,
    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
    MEAN: tl.constexpr, G_MAX: tl.constexpr,
):
    """The scale-out kernel: slices for other ranks go by device-initiated puts of the process's
    SHMEM provider (shmem/providers/device.py), completed (quiet) before each destination's
    release signal. Compiled only where a provider exists."""
    _embedding_alltoall(weight_ptr, indices_ptr, psw_ptr, offsets_ptr, out_ptr, row_off_ptr,
                        rows_ptr, gtab_ptr, ntab_ptr, boff_ptr, recv_ptr, stage_ptr, sent_ptr,
                        consumed_ptr, ctl_ptr, clock_ptr, bases_ptr, status_addr, B, D, n_loc,
                        row_stride, t_max, iters, G, rank, world, tag, timeout_us, BLOCK_B, BLOCK_D,
                        HAS_WEIGHTS, MEAN, G_MAX, shmem_put_strided, shmem_flush)


@triton.jit
def _embedding_alltoall(
    weight_ptr, indices_ptr, psw_ptr, offsets_ptr, out_ptr, row_off_ptr, rows_ptr, gtab_ptr,
    ntab_ptr, boff_ptr, recv_ptr, stage_ptr, sent_ptr, consumed_ptr, ctl_ptr, clock_ptr, bases_ptr,
    status_addr, B, D, n_loc, row_stride, t_max, iters, G, rank, world, tag, timeout_us,
    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
    MEAN: tl.constexpr, G_MAX: tl.constexpr, STORE: tl.constexpr, FLUSH: tl.constexpr,
):
    pid = tl.program_id(0)
    epoch = begin_call(ctl_ptr)
    ok = live(clock_ptr)
    # False once this program found an index outside its table: it reports it, pools no more
    # and signals the failure tag to the destinations it has not signalled yet (their slices
    # from it are incomplete), but keeps every wait of the call, so the ranks stay in step
    valid = tl.full((), 1, tl.int1)
    b_rel = tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D

    # 1. destinations rank+1, rank+2, ..., rank: what travels first, what stays last
    for k in range(0, world):
        d = (rank + 1 + k) % world
        lo = tl.load(boff_ptr + d)
        n_d = tl.load(boff_ptr + d + 1) - lo
        n_blk = tl.cdiv(n_d, BLOCK_B)
        n_tasks = n_blk * n_loc
        if d != rank:
            # d must have copied out the previous call before recv is overwritten, and must
            # have read this program's previous sent flag before it is overwritten: wait even
            # with nothing to store there (else a peer a call behind misses that flag)
            ok = await_free(consumed_ptr, d, epoch, clock_ptr, timeout_us, status_addr, pid,
                            FLAG_CONSUMED, ok)
        for i in range(0, iters):  # bounds from arguments only (the interpreter needs that)
            t = pid + i * G
            if (t < n_tasks) & ok & valid:
                # table-major: the programs running at one time share one or two tables, so
                # their uniform random rows find each other in L2 (blocks-major spread them over
                # all tables: a 16 × 100 MB working set against a 50 MB L2)
                j = t // n_blk
                s0 = (t % n_blk) * BLOCK_B
                n_bags = tl.minimum(n_d - s0, BLOCK_B)
                bag0 = j * B + lo + s0
                # a tile with an index outside its table is not pooled (pool.py)
                i_lo = tl.load(offsets_ptr + bag0)
                i_hi = tl.load(offsets_ptr + bag0 + n_bags)
                n_bad = indices_outside(indices_ptr, i_lo, i_hi, tl.load(rows_ptr + j))
                g = tl.load(gtab_ptr + rank * t_max + j).to(tl.int64)
                if n_bad > 0:  # nothing stored: the failure tag tells the destination
                    bad = first_outside(indices_ptr, i_lo, i_hi, tl.load(rows_ptr + j))
                    report(status_addr, pid, STATUS_BAD_INPUT, -1, (CHECK_INDEX << 32) + g, bad)
                    valid = False
                else:
                    acc = pooled_rows(weight_ptr, tl.load(row_off_ptr + j), indices_ptr, psw_ptr,
                                      offsets_ptr, bag0, n_bags, D, BLOCK_B, BLOCK_D,
                                      HAS_WEIGHTS, MEAN)
                    offs = (s0 + b_rel).to(tl.int64)[:, None] * row_stride + g * D + cols[None, :]
                    y = acc.to(out_ptr.dtype.element_ty)
                    mask = (b_rel < n_bags)[:, None] & col_ok[None, :]
                    if d == rank:
                        tl.store(out_ptr + offs, y, mask=mask)
                    else:
                        STORE(recv_ptr, bases_ptr, rank, d, offs, y, mask, stage_ptr, pid, s0,
                              row_stride, g * D, n_bags, D, BLOCK_B, BLOCK_D)
        if d != rank:
            FLUSH()  # the transport's slices have landed before the release
            tl.debug_barrier()  # every thread's stores before the (cumulative) release
            signal_peer(sent_ptr + rank * G_MAX + pid, call_flag(epoch, tag, ok & valid),
                        bases_ptr, rank, d)

    # 2. what every peer's program pid sent here has landed
    ok = wait_peers(sent_ptr, FLAG_SENT, pid, rank, world, epoch, tag, clock_ptr, timeout_us,
                    status_addr, ok, G_MAX)

    # 3. copy it from recv to out: peer q's program pid sent the tasks pid, pid + G, ... of q's
    #    run for this rank
    if ok:
        my_n = tl.load(boff_ptr + rank + 1) - tl.load(boff_ptr + rank)
        for q in range(0, world):
            if q != rank:
                nq = tl.load(ntab_ptr + q)
                n_blk = tl.cdiv(my_n, BLOCK_B)
                n_tasks = n_blk * nq
                for i in range(0, iters):
                    t = pid + i * G
                    if t < n_tasks:
                        s0 = (t % n_blk) * BLOCK_B
                        g = tl.load(gtab_ptr + q * t_max + t // n_blk).to(tl.int64)
                        offs = (s0 + b_rel).to(tl.int64)[:, None] * row_stride + g * D \
                            + cols[None, :]
                        mask = (b_rel < my_n - s0)[:, None] & col_ok[None, :]
                        tl.store(out_ptr + offs, tl.load(recv_ptr + offs, mask=mask), mask=mask)

    # the words of programs past the grid, which follows the batch split, every 2**30 calls
    # (``refresh_words``)
    if (epoch & (REFRESH_CALLS - 1)) == 0:
        refresh_words(sent_ptr, bases_ptr, G, pid, G, rank, world,
                      call_flag(epoch, tag, live(clock_ptr)), G_MAX)
    # 4. the last program out publishes the epoch here and "recv consumed" on every peer
    end_call_free(ctl_ptr, epoch, consumed_ptr, bases_ptr, rank, world)
