"""AllGather + GEMM in one persistent kernel: some programs push this rank's shard into every
peer's heap while the others multiply what has arrived (the ``"stores"`` transport).

Rank r holds ``a_r`` [m, K]; the result is ``cat(a_0, ..., a_{W-1}) @ b`` [W*m, N]. Every rank's
heap has a gather buffer [W*m, K] (rows ``q*m .. (q+1)*m`` for rank q's shard) and ready flags
``ready[q][c]``, one per source rank q and row chunk c of its shard (``chunk_rows`` rows each).

The grid's first ``senders`` programs move data first, the rest compute (roles by program id,
so every program of the launch is resident at once and the senders start first; under the
interpreter, which runs programs one after another, the senders finish before any tile waits).

- A sender takes units ``pid, pid + senders, ...`` of this rank's list: chunk-major, and within
  a chunk peer r+1, r+2, ... (every peer receives chunk 0 from all its peers first, so all links
  carry data at once). A unit is one chunk's rows, contiguous in ``a`` and in the peer's buffer,
  stored straight into the peer's heap (zero-copy, vector stores, ``COPY_BLOCK`` elements in
  flight per step; with ``COPY_TMA``, boxes of ``BOX_R`` x ``BOX_K`` through two tensor
  descriptors, written by the Tensor Memory Accelerator, and the writes awaited before the
  flag); then a barrier and the release of ``ready[r][c]`` in that peer's heap. When
  ``m`` is not a multiple of BLOCK_M some tiles hold rows of two shards, and this rank's own
  shard is copied into its own buffer too (``COPY_OWN``; those units come first).
- A compute program claims tiles one at a time from the call's counter (``tile_ptr``, an
  atomic add), in a grouped order over the M tiles listed in ``order`` (the host puts the tiles
  of this rank's own rows first, then the rest by when their rows arrive). A tile inside this
  rank's rows reads ``a`` at once; any other tile first waits (acquire, bounded) for the ready
  flag of every chunk its rows touch, then reads the gather buffer. With ``JOIN`` a sender
  claims tiles too once its units are sent, so its processor computes for the rest of the call
  instead of idling (not under the interpreter: there a sender that waited for a peer's chunk
  would wait for a program of that peer that runs after the peer's own waiting sender). The
  last program out resets the counter for the next call.

With ``PULLS`` the first ``n_pull`` chunks of every shard come by copy engine instead (pulled
by the receiver, their flags set by the copy streams' flag kernels; ``stores.py``): senders
skip them, and the call number is the one the copy-engine side counted on the stream before
the launch (``pol.begin_call(ctx, COUNTED=True)``), which the flags of both kinds carry.

Before its first store into rank d in a call, a sender waits until d has read the previous
call's gather buffer (``pol.wait_consumed_once`` on ``consumed[d]``); the last program of a
launch tells every peer that this rank's buffer is read (``pol.end_call_consumed``).

Written on the public device API (``portable_overlap.language``): flags carry the call number
(counted on the device, so a CUDA graph replays unchanged) and the shape tag, and every wait is
bounded and reported by the flag it waited for.
"""
import triton
import triton.language as tl

from ... import language as pol
from ...backends.proxy_fence import async_proxy_fence, bulk_stores_done
from ...tiles.gemm import gemm_tile, gemm_tile_desc_of, grouped_tile

#: the flags' names in timeout reports (the reports name a flag by its heap buffer)
FLAG_LABELS = {"ready": "chunk-ready", "consumed": "gather-consumed"}


@triton.jit
def _send(ctx, a_ptr, gather_ptr, ready_ptr, consumed_ptr, pid, senders, m, K, chunk_rows,
          n_chunks, n_pull, rank, world, call, tag, ok, COPY_OWN: tl.constexpr,
          COPY_BLOCK: tl.constexpr, VEC: tl.constexpr, C_MAX: tl.constexpr,
          COPY_TMA: tl.constexpr, BOX_R: tl.constexpr, BOX_K: tl.constexpr):
    """Sender ``pid``'s units (module docstring): copy, then signal the chunk's flag. Chunks
    below ``n_pull`` are the copy engines' (pulled by the peers): no unit."""
    if COPY_TMA:  # a's descriptor, once per program (its scratch is the program's own)
        a_boxes = tl.make_tensor_descriptor(a_ptr, [m, K], [K, 1], [BOX_R, BOX_K])
    n_sent = n_chunks - n_pull
    own_units = n_sent if COPY_OWN else 0
    n_units = own_units + n_sent * (world - 1)
    waited = tl.zeros((), tl.int64)  # bit d: rank d's buffer is free for this call
    lanes = tl.arange(0, COPY_BLOCK)
    for i in range(0, tl.cdiv(n_units, senders)):
        u = pid + i * senders
        if u < n_units:
            if u < own_units:
                c = n_pull + u
                d = rank
            else:
                v = u - own_units
                c = n_pull + v // (world - 1)
                d = (rank + 1 + v % (world - 1)) % world
            if d != rank:
                ok, waited = pol.wait_consumed_once(ctx, consumed_ptr, d, call, waited, ok)
            if COPY_TMA:
                if ok:
                    # boxes of BOX_R rows by BOX_K columns: the Tensor Memory Accelerator writes
                    # each into the peer's rows while the program loads the next (alone, 12
                    # programs pushed 271 GB/s into 3 peers on 4 H200s, where flat stores needed
                    # 24: benchmarks/probe_peer_stores.py). The peer's rows of this shard as one
                    # [m, K] tensor: a box past row m is clipped, never another rank's rows.
                    async_proxy_fence()  # the acquire of d's "consumed" before the bulk writes
                    lo = c * chunk_rows
                    hi = tl.minimum(lo + chunk_rows, m)
                    rows = pol.remote_ptr(ctx, gather_ptr, d) + rank.to(tl.int64) * m * K
                    peer_boxes = tl.make_tensor_descriptor(rows, [m, K], [K, 1], [BOX_R, BOX_K])
                    for r0 in range(lo, hi, BOX_R):
                        for k0 in range(0, K, BOX_K):
                            peer_boxes.store([r0, k0], a_boxes.load([r0, k0]))
                    bulk_stores_done()  # written, not only read out of shared memory: then signal
            else:
                if ok:
                    lo = c * chunk_rows
                    n = (tl.minimum(lo + chunk_rows, m) - lo).to(tl.int64) * K
                    # the chunk is contiguous in a and in the buffer: one flat copy. VEC elements
                    # make 16 bytes when K allows (the host checks), so the copy moves vectors
                    src = a_ptr + tl.multiple_of(lo.to(tl.int64) * K, VEC)
                    dst = pol.remote_ptr(ctx, gather_ptr, d) \
                        + tl.multiple_of((rank.to(tl.int64) * m + lo) * K, VEC)
                    for off in range(0, n, COPY_BLOCK):
                        idx = off + lanes
                        keep = idx < n
                        tl.store(dst + idx, tl.load(src + idx, mask=keep), mask=keep)
            pol.signal(ctx, ready_ptr + rank * C_MAX + c, d, call, ok, tag)
    return ok


@triton.jit
def _await_rows(ctx, ready_ptr, row_lo, row_hi, m, chunk_rows, call, tag, ok,
                C_MAX: tl.constexpr):
    """Wait for the ready flag of every (rank, chunk) that gathered rows [row_lo, row_hi)
    touch; returns ``ok`` and-ed with the outcome (after a failure it waits for no more)."""
    q0 = row_lo // m
    q1 = (row_hi - 1) // m
    # the world size is read here, not passed: a value loaded from the descriptor before the
    # tile loop holds a register through the GEMM main loop (195 -> 197 registers on sm_90 at
    # 128 x 256 x 64 with descriptors), where a kernel argument needed none
    for q in range(0, pol.num_ranks(ctx)):  # bounds not from program_id (the interpreter)
        if (q >= q0) & (q <= q1):
            lo = tl.maximum(row_lo - q * m, 0)
            hi = tl.minimum(row_hi - q * m, m)
            c = lo // chunk_rows
            while c <= (hi - 1) // chunk_rows:
                if ok:
                    ok = pol.wait(ctx, ready_ptr + q * C_MAX + c, call, q, tag)
                c += 1
    return ok


@triton.jit
def _compute(ctx, a_ptr, b_ptr, out_ptr, gather_ptr, ready_ptr, tile_ptr, order_ptr, m, N, K,
             stride_bk, stride_bn, chunk_rows, rank, world, call, tag, ok, a_desc, g_desc,
             b_desc, USE_DESC: tl.constexpr, B_TRANS: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
             NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
             UPCAST: tl.constexpr, C_MAX: tl.constexpr):
    """Claim tiles from the call's counter (``tile_ptr``) until none is left, and compute each
    (module docstring); returns ``ok`` (False once a wait failed: the program stops claiming)."""
    rows_all = world * m
    num_pid_m = tl.cdiv(rows_all, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    n_tiles = num_pid_m * num_pid_n
    own_lo = rank * m
    t = tl.atomic_add(tile_ptr, 1, sem="relaxed", scope="gpu").to(tl.int32)
    while (t < n_tiles) & ok:
        vm, pid_n = grouped_tile(t, num_pid_m, num_pid_n, GROUP_M)
        tm = tl.load(order_ptr + vm)
        row_lo = tm * BLOCK_M
        row_hi = tl.minimum(row_lo + BLOCK_M, rows_all)
        # one main loop for both sources (two would hold two sets of pipeline buffers: 288 KiB
        # of shared memory with descriptors, and spill registers)
        own = (row_lo >= own_lo) & (row_hi <= own_lo + m)  # this rank's rows: no wait
        if not own:
            ok = _await_rows(ctx, ready_ptr, row_lo, row_hi, m, chunk_rows, call, tag, ok,
                             C_MAX)
        if USE_DESC:
            if own:
                src_desc = a_desc
                src_row = row_lo - own_lo
            else:
                pol.fence_bulk_reads()  # the acquire above, before the bulk copies
                src_desc = g_desc
                src_row = row_lo
            acc = gemm_tile_desc_of(src_desc, b_desc, src_row, pid_n * BLOCK_N, 0, K, BLOCK_M,
                                    BLOCK_N, BLOCK_K, NUM_STAGES, PRECISION, B_TRANS)
        else:
            if own:
                src = a_ptr + (row_lo - own_lo).to(tl.int64) * K
            else:
                src = gather_ptr + row_lo.to(tl.int64) * K
            acc = gemm_tile(src, b_ptr, row_hi - row_lo, N, K, K, 1, stride_bk, stride_bn, 0,
                            pid_n, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, EVEN_K, PRECISION,
                            UPCAST)
        if ok:
            rows = row_lo + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = (rows < row_hi)[:, None] & (cols < N)[None, :]
            tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=mask)
        t = tl.atomic_add(tile_ptr, 1, sem="relaxed", scope="gpu").to(tl.int32)
    return ok


@triton.jit
def _refresh_words(ctx, ready_ptr, n_chunks, call, tag, COPY_OWN: tl.constexpr,
                   C_MAX: tl.constexpr):
    """``pol.refresh_words`` of the ready words of this rank's chunks that the call does not
    write: those of chunks ``n_chunks`` and up in every heap and, without ``COPY_OWN`` (no tile
    of this launch waits for this rank's own rows), all of them in this rank's heap."""
    pol.refresh_words(ctx, ready_ptr, n_chunks, C_MAX, call, tag, OWN=COPY_OWN)
    if not COPY_OWN:
        pol.refresh_words(ctx, ready_ptr, 0, C_MAX, call, tag, OWN=True, PEERS=False)


@triton.jit
def allgather_gemm_kernel(
    a_ptr, b_ptr, out_ptr,  # a [m, K] contiguous, b [K, N] (any strides), out [W*m, N]
    gather_ptr, ready_ptr, consumed_ptr,  # heap: [W*m, K], int64 flags [W, C_MAX], [W]
    tile_ptr,  # int64: the next tile to claim in this call (0 between calls)
    ctx, order_ptr,  # the device API's descriptor; int32 M-tile order
    m, N, K, stride_bk, stride_bn, chunk_rows, n_chunks, n_pull, senders, tag,
    a_desc, g_desc, b_desc,  # descriptors of a, the gather buffer and b (b.t(): B_TRANS)
    USE_DESC: tl.constexpr, B_TRANS: tl.constexpr, COPY_OWN: tl.constexpr, JOIN: tl.constexpr,
    PULLS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, COPY_BLOCK: tl.constexpr, VEC: tl.constexpr, C_MAX: tl.constexpr,
    COPY_TMA: tl.constexpr = False, BOX_R: tl.constexpr = 128, BOX_K: tl.constexpr = 256,
):
    pid = tl.program_id(0)
    # with PULLS the copy-engine side counted the call on the stream before this launch: its
    # flag kernels and this kernel's flags carry the same number
    call = pol.begin_call(ctx, PULLS)
    rank = pol.rank(ctx)
    world = pol.num_ranks(ctx)
    ok = pol.is_live(ctx)
    if pid < senders:
        ok = _send(ctx, a_ptr, gather_ptr, ready_ptr, consumed_ptr, pid, senders, m, K,
                   chunk_rows, n_chunks, n_pull, rank, world, call, tag, ok, COPY_OWN,
                   COPY_BLOCK, VEC, C_MAX, COPY_TMA, BOX_R, BOX_K)
    if JOIN or (pid >= senders):
        ok = _compute(ctx, a_ptr, b_ptr, out_ptr, gather_ptr, ready_ptr, tile_ptr, order_ptr, m,
                      N, K, stride_bk, stride_bn, chunk_rows, rank, world, call, tag, ok,
                      a_desc, g_desc, b_desc, USE_DESC, B_TRANS, BLOCK_M, BLOCK_N, BLOCK_K,
                      GROUP_M, NUM_STAGES, EVEN_K, PRECISION, UPCAST, C_MAX)
    # the chunks' words no program or copy stream of the call writes, every 2**30 calls (the
    # number of chunks follows the shard's rows): at the end, where the tiles' registers are
    # free
    if (call & (pol.REFRESH_CALLS - 1)) == 0:
        _refresh_words(ctx, ready_ptr, n_chunks, call, tag, COPY_OWN, C_MAX)
    # the last program out: every read of the gather buffer is done (tell the peers) and every
    # claim of this call is made (the next call's tiles count from 0 again)
    last = pol.end_call_consumed(ctx, call, consumed_ptr, PULLS)
    if last:
        tl.atomic_xchg(tile_ptr, 0, sem="relaxed", scope="gpu")
