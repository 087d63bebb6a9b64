"""GEMM + ReduceScatter / AllReduce in one persistent kernel that stores partial tiles straight
into their owner's heap and reduces them in the owner's epilogue (the ``"stores"`` transport).

Rank q computes the partial product ``a_q @ b_q`` [M, N]; row block d (rows
``[M*d//W, M*(d+1)//W)``) belongs to rank d. Every block is cut into the same ``tpb`` tiles
(tile T = (tm, tn) of ``block_rows`` = ceil(M/W) rows, tiles past a short block's end skipped).
Tile T of block d is computed by program ``(T + d * tpb) % G`` on every rank, so the grid
shares the W * tpb tiles evenly and the program that reduces a tile on its owner is the one that
computed the peers' partials of it on theirs: a program waits only for the same program on its
peers (never for another program of its own launch).

Program pid of rank r:

1. computes its tiles of blocks r+1, r+2, ... (peers first: their partials travel while this
   rank computes), each stored in the input dtype into ``recv[r]`` of the owner's heap;
2. signals ``sent[r][pid]`` on every peer (release) and waits for ``sent[q][pid]`` of every
   peer q (acquire, bounded). The grid follows the shape (one program for no rows), so a peer
   called with other rows may have no program pid: ``pol.wait_program_peers`` then stops at
   the peer's program 0 flag, whose tag says it planned otherwise (``RankMismatchError`` on
   every rank, the ranks still in step), instead of waiting out the call's deadline;
3. computes its tiles of block r and adds the peers' partials from ``recv[q]`` in float32;
   ReduceScatter: ``out = sum + bias + residual``, rounded once. AllReduce: the sum is rounded
   to the input dtype (what the vendor's all-reduce of the products would give), stored into
   ``gathered`` in every peer's heap and, with this rank's bias and residual, into ``out``;
4. AllReduce only: signals ``reduced[r][pid]``, waits for every peer's, and copies the tiles of
   the peers' blocks that their program pid reduced from ``gathered`` into ``out`` (adding this
   rank's bias and residual).

Split tiles (``SPLIT``). Where the W * tpb tiles would leave most of the grid idle (a small
M x N over a long K), each tile is cut into ``parts`` ranges of K steps and the items of a
block are its tiles' ranges (item ``T * parts + s``: range s of tile T), mapped to programs as
the tiles are above, so steps 1-2 still wait only for the counterpart program. A peer's range
travels in float32 into ``recv[r][s]``; the owner adds the peers' ranges s to its own range s
and finishes the tile as ``tiles.split`` does (a slot per range, a count per tile, the part
that completes it sums the slots in order and applies step 3's epilogue): no program waits for
another of its launch. A range a program gave up on is counted too, marked, so the counts are
whole for the next call. AllReduce: the part that completes tile T signals ``reduced[r][T]``
(one flag per tile, not per program) on every peer, and step 4 copies a peer's tile T in the
program with the highest index among those that ran T's ranges (``_copier``), after that
tile's flag. Under the interpreter (programs in order) that program is the one that completed
the tile on the peer, whose own steps 1-3 wait only for programs that ran before.

Before its first store into rank d in a call a program waits until d has read the previous
call's data (``pol.wait_consumed_once`` on ``consumed[d]``); the last program of a launch tells
every peer that this rank's buffers are read (``pol.end_call_consumed``).

Written on the public device API (``portable_overlap.language``): flags carry the call number
(counted on the device, so a CUDA graph replays unchanged) and the shape tag, and every wait is
bounded and reported by the flag it waited for.
"""
import triton
import triton.language as tl

from ... import language as pol
from ...tiles.gemm import gemm_tile, gemm_tile_desc_of, grouped_tile, store_tile_epilogue
from ...tiles.split import clear_count, count_part, store_part, sum_parts

#: the flags' names in timeout reports (the reports name a flag by its heap buffer)
FLAG_LABELS = {"sent": "partials-sent", "consumed": "recv-consumed", "reduced": "block-reduced"}


@triton.jit
def _first_tile(pid, d, tpb, G):
    """Program ``pid``'s first tile of block d: the T in [0, G) with (T + d*tpb) % G == pid."""
    return (pid - (d * tpb) % G + G) % G


@triton.jit
def _block_start(M, d, world):
    """Row ``M * d // world``, where rank d's block starts, through int64: ``M * d`` wraps in
    int32 from M * (world - 1) >= 2**31 rows."""
    return ((tl.zeros((), tl.int64) + M) * d // world).to(tl.int32)


@triton.jit
def _add_peers(acc, r, cols, rows_d, rank, world, block_rows, N, recv_ptr, s, parts):
    """``acc`` (rows ``r`` of this rank's block, columns ``cols``) plus the peers' partials of
    it from ``recv`` (of K range ``s`` of ``parts``; 0 of 1 unsplit), in float32."""
    mask = (r < rows_d)[:, None] & (cols < N)[None, :]
    for q in range(0, world):
        if q != rank:
            offs = ((q * parts + s) * block_rows + r)[:, None].to(tl.int64) * N + cols[None, :]
            acc += tl.load(recv_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _finish_own(ctx, acc, r, c, col0, lo_d, rows_d, rank, world, block_rows, N, out_ptr,
                bias_ptr, res_ptr, stride_res, recv_ptr, gathered_ptr, consumed_ptr, call, ok,
                waited, ALL_REDUCE: tl.constexpr, HAS_BIAS: tl.constexpr,
                HAS_RES: tl.constexpr):
    """Step 3 for columns ``col0 + c`` of one tile of this rank's block (rows ``r`` counted in
    the block, which starts at row ``lo_d`` and has ``rows_d`` rows): add the peers' partials
    to ``acc`` and store the result (module docstring). Returns ``(ok, waited)``."""
    # the peers' partials added here, not by ``_add_peers``: through it the full tile's
    # ReduceScatter with bias and residual spilled 44 bytes on sm_90 instead of 32
    cols = col0 + c
    mask = (r < rows_d)[:, None] & (cols < N)[None, :]
    for q in range(0, world):
        if q != rank:
            offs = (q * block_rows + r)[:, None].to(tl.int64) * N + cols[None, :]
            acc += tl.load(recv_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    ok, waited = _store_own(ctx, acc, r, c, col0, lo_d, rows_d, rank, world, N, out_ptr,
                            bias_ptr, res_ptr, stride_res, gathered_ptr, consumed_ptr, call, ok,
                            waited, ALL_REDUCE, HAS_BIAS, HAS_RES)
    return ok, waited


@triton.jit
def _store_own(ctx, acc, r, c, col0, lo_d, rows_d, rank, world, N, out_ptr, bias_ptr, res_ptr,
               stride_res, gathered_ptr, consumed_ptr, call, ok, waited,
               ALL_REDUCE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
    """The reduced columns ``col0 + c`` of one tile of this rank's block, stored (step 3 of
    the module docstring). Returns ``(ok, waited)``."""
    cols = col0 + c
    mask = (r < rows_d)[:, None] & (cols < N)[None, :]
    if ALL_REDUCE:
        y = acc.to(out_ptr.dtype.element_ty)  # the reduced block every rank gets
        goffs = (lo_d + r)[:, None].to(tl.int64) * N + cols[None, :]
        for q in range(0, world):
            if q != rank:
                ok, waited = pol.wait_consumed_once(ctx, consumed_ptr, q, call, waited, ok)
                if ok:
                    tl.store(pol.remote_ptr(ctx, gathered_ptr, q) + goffs, y, mask=mask)
        store_tile_epilogue(y.to(tl.float32), r, c, lo_d, rows_d, col0, N, out_ptr, bias_ptr,
                            res_ptr, N, stride_res, HAS_BIAS, HAS_RES)
    else:  # out and residual hold this rank's rows only
        store_tile_epilogue(acc, r, c, 0, rows_d, col0, N, out_ptr, bias_ptr, res_ptr, N,
                            stride_res, HAS_BIAS, HAS_RES)
    return ok, waited


@triton.jit
def _finish_own_part(ctx, acc, r, tn, lo_d, rows_d, rank, world, block_rows, N, out_ptr,
                     bias_ptr, res_ptr, stride_res, recv_ptr, gathered_ptr, reduced_ptr,
                     consumed_ptr, ws_ptr, done_ptr, T, s, parts, call, tag, ok, waited,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ALL_REDUCE: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, G_MAX: tl.constexpr):
    """Step 3 of a split tile: K range ``s`` of own tile ``T`` plus the peers' partials of that
    range, into slot ``T * parts + s`` of ``ws`` (``tiles.split``); the part that completes the
    tile sums the slots in order and stores the result half a tile at a time (as
    ``_finish_own``), and under AllReduce signals ``reduced[rank][T]`` on every peer, failed
    where a range of the tile was not computed (``_drop_part``). Returns ``(ok, waited)``."""
    HALF: tl.constexpr = BLOCK_N // 2
    left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
    c = tl.arange(0, HALF)
    col0 = tn * BLOCK_N
    slot = T * parts + s
    # each half summed and stored before the next (both halves' peer partials at once beside
    # the accumulator spilled 112 bytes on sm_90 at 128 x 128 over 4 warps)
    left = _add_peers(left, r, col0 + c, rows_d, rank, world, block_rows, N, recv_ptr, s, parts)
    store_part(ws_ptr, slot, left, BLOCK_M * BLOCK_N, 0, BLOCK_M, HALF)
    right = _add_peers(right, r, col0 + HALF + c, rows_d, rank, world, block_rows, N, recv_ptr,
                       s, parts)
    store_part(ws_ptr, slot, right, BLOCK_M * BLOCK_N, BLOCK_M * HALF, BLOCK_M, HALF)
    last, whole = count_part(done_ptr, T, parts, ok)
    if last:
        if whole:  # (else the call fails on this rank: a range's wait failed and reported)
            for h in range(0, 2):
                total = sum_parts(ws_ptr, T * parts, parts, BLOCK_M * BLOCK_N,
                                  h * BLOCK_M * HALF, BLOCK_M, HALF)
                ok, waited = _store_own(ctx, total, r, c, col0 + h * HALF, lo_d, rows_d, rank,
                                        world, N, out_ptr, bias_ptr, res_ptr, stride_res,
                                        gathered_ptr, consumed_ptr, call, ok, waited,
                                        ALL_REDUCE, HAS_BIAS, HAS_RES)
        _close_tile(ctx, reduced_ptr, done_ptr, T, call, ok & whole, tag, rank, ALL_REDUCE,
                    G_MAX)
    return ok, waited


@triton.jit
def _drop_part(ctx, reduced_ptr, done_ptr, T, parts, call, tag, rank, ALL_REDUCE: tl.constexpr,
               G_MAX: tl.constexpr):
    """A range of own tile ``T`` this program does not compute (it gave up on the call): count
    it, failed, so the count is whole again for the next call; if it completes the tile, clear
    the count and (AllReduce) tell the peers the tile failed."""
    last, _ = count_part(done_ptr, T, parts, False)
    if last:
        _close_tile(ctx, reduced_ptr, done_ptr, T, call, False, tag, rank, ALL_REDUCE, G_MAX)


@triton.jit
def _close_tile(ctx, reduced_ptr, done_ptr, T, call, ok, tag, rank, ALL_REDUCE: tl.constexpr,
                G_MAX: tl.constexpr):
    """The last part of own split tile ``T``: zero its count for the next call and, under
    AllReduce, signal ``reduced[rank][T]`` on every peer (failed unless ``ok``)."""
    clear_count(done_ptr, T)
    if ALL_REDUCE:
        pol.signal_all(ctx, reduced_ptr + rank * G_MAX + T, call, ok, tag)


@triton.jit
def _copier(T, q, parts, tpb, G):
    """The program that copies block ``q``'s reduced split tile ``T`` on the peers: the one
    with the highest index among those that ran its ranges. Under the interpreter (programs in
    order) that one finishes the tile, so its counterpart waits only for programs that ran."""
    top = 0
    for s in range(0, parts):
        top = tl.maximum(top, (T * parts + s + q * tpb) % G)
    return top


@triton.jit
def _copy_reduced(gathered_ptr, row0, tn, lo_q, rows_q, N, out_ptr, bias_ptr, res_ptr,
                  stride_res, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
    """Step 4 for one tile of peer block q (rows ``row0 + ...`` of it, column tile ``tn``): its
    reduced values from ``gathered`` into ``out``, with this rank's bias and residual."""
    r = row0 + tl.arange(0, BLOCK_M)  # in block q
    c = tl.arange(0, BLOCK_N)
    mask = (r < rows_q)[:, None] & (tn * BLOCK_N + c < N)[None, :]
    y = tl.load(gathered_ptr + (lo_q + r)[:, None].to(tl.int64) * N
                + (tn * BLOCK_N + c)[None, :], mask=mask, other=0.0)
    store_tile_epilogue(y.to(tl.float32), r, c, lo_q, rows_q, tn * BLOCK_N, N, out_ptr,
                        bias_ptr, res_ptr, N, stride_res, HAS_BIAS, HAS_RES)


@triton.jit(noinline=True)
def _refresh_words(ctx, sent_ptr, reduced_ptr, M, N, block_rows, G, call, tag,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                   ALL_REDUCE: tl.constexpr, SPLIT: tl.constexpr, G_MAX: tl.constexpr):
    """``pol.refresh_words`` of the flag words no program of the grid writes: this rank's
    ``sent`` words of programs ``G`` and up and, under AllReduce, its ``reduced`` words the
    call does not write: of programs ``G`` and up, or with ``SPLIT`` of the tiles past its
    block's and of its block's tiles that start past its rows (the last row of tiles of a block
    one row shorter than ``block_rows``, every tile of a block with no rows)."""
    pol.refresh_words(ctx, sent_ptr, G, G_MAX, call, tag)
    if ALL_REDUCE:
        if SPLIT:
            rank = pol.rank(ctx)
            world = pol.num_ranks(ctx)
            rows = _block_start(M, rank + 1, world) - _block_start(M, rank, world)
            n_tm = tl.cdiv(block_rows, BLOCK_M)
            n_tn = tl.cdiv(N, BLOCK_N)
            pol.refresh_words(ctx, reduced_ptr, n_tm * n_tn, G_MAX, call, tag)
            ok = pol.is_live(ctx)
            for T in range(pol.program(), tl.minimum(n_tm * n_tn, G_MAX), G):
                tm, tn = grouped_tile(T, n_tm, n_tn, GROUP_M)
                if tm * BLOCK_M >= rows:
                    pol.signal_all(ctx, reduced_ptr + rank * G_MAX + T, call, ok, tag)
        else:
            pol.refresh_words(ctx, reduced_ptr, G, G_MAX, call, tag)


@triton.jit
def matmul_reduce_stores_kernel(
    a_ptr, b_ptr, out_ptr, bias_ptr, res_ptr,  # a [M, K_r], b [K_r, N]; out, residual by mode
    recv_ptr, gathered_ptr,  # heap: [W, parts, block_rows, N] partials by source (float32
    #                          when split, else the input dtype); [M, N] (AllReduce)
    sent_ptr, reduced_ptr, consumed_ptr,  # heap: int64 flags [W, G_MAX] x2, [W]
    ctx,  # the device API's descriptor
    ws_ptr, done_ptr,  # SPLIT: float32 [tiles * parts, BLOCK_M * BLOCK_N] slots, int32 [tiles]
    M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_res, block_rows, G, tag, parts,
    a_desc, b_desc,  # tensor descriptors of a and b (of b.t() when B_TRANS) when USE_DESC
    ALL_REDUCE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    USE_DESC: tl.constexpr, B_TRANS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, G_MAX: tl.constexpr,
    SPLIT: tl.constexpr,
):
    pid = tl.program_id(0)
    call = pol.begin_call(ctx)
    rank = pol.rank(ctx)
    world = pol.num_ranks(ctx)
    ok = pol.is_live(ctx)
    n_tm = tl.cdiv(block_rows, BLOCK_M)
    n_tn = tl.cdiv(N, BLOCK_N)
    tpb = n_tm * n_tn
    if SPLIT:  # a block's work: its tiles' K ranges (tile T's range s is item T * parts + s)
        tpb = tpb * parts
        span = tl.cdiv(tl.cdiv(K, BLOCK_K), parts) * BLOCK_K  # K elements per range
    # most items of one block a program takes; at least one, so that a call with no rows
    # (tpb = 0) still reaches step 2's flags (their shape tag catches a peer with rows)
    per = tl.maximum(tl.cdiv(tpb, G), 1)
    waited = tl.zeros((), tl.int64)  # bit d: rank d's buffers are free for this call
    # One loop over the blocks in order r+1, ..., r-1, r, with one tile-GEMM call site: a
    # second call site would hold a second set of pipeline buffers (shared memory).
    for idx in range(0, world * per):
        # read again for every tile: the two words loaded once before the loop would hold
        # registers through the GEMM main loop, where kernel arguments held none (on sm_90 at
        # 128 x 256 x 64, AllReduce with bias + residual: 24 bytes of spills instead of 16)
        rank = pol.rank(ctx)
        world = pol.num_ranks(ctx)
        i = idx // per  # position of the block in this rank's order; world-1 = its own
        if idx == (world - 1) * per:  # 2. every peer partial this program owes is stored
            pol.signal_all(ctx, sent_ptr + rank * G_MAX + pid, call, ok, tag)
            if ok:  # (a peer whose grid lacks program pid: its program 0's tag says why)
                ok = pol.wait_program_peers(ctx, sent_ptr, pid, G_MAX, call, tag)
        d = (rank + 1 + i) % world
        item = _first_tile(pid, d, tpb, G) + (idx % per) * G
        T = item
        s = 0
        k_lo = 0
        k_hi = K
        if SPLIT:
            T = item // parts
            s = item % parts
            k_lo = s * span
            k_hi = tl.minimum(K, k_lo + span)
        lo_d = _block_start(M, d, world)
        rows_d = _block_start(M, d + 1, world) - lo_d
        tm, tn = grouped_tile(T, n_tm, n_tn, GROUP_M)
        row0 = tm * BLOCK_M  # in the block
        mine = (item < tpb) & (row0 < rows_d)
        if mine & ok:
            if USE_DESC:
                acc = gemm_tile_desc_of(a_desc, b_desc, lo_d + row0, tn * BLOCK_N, k_lo, k_hi,
                                        BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, PRECISION,
                                        B_TRANS)
            else:  # (a range starts on a K block: EVEN_K holds for every range where it does)
                acc = gemm_tile(a_ptr + (lo_d + row0).to(tl.int64) * stride_am
                                + tl.cast(k_lo, tl.int64) * stride_ak,
                                b_ptr + tl.cast(k_lo, tl.int64) * stride_bk, rows_d - row0, N,
                                k_hi - k_lo, stride_am, stride_ak, stride_bk, stride_bn, 0, tn,
                                BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, EVEN_K, PRECISION,
                                UPCAST)
            if d != rank:  # 1. a peer's partial, into its heap at this rank's slot
                ok, waited = pol.wait_consumed_once(ctx, consumed_ptr, d, call, waited, ok)
                if ok:
                    rows = row0 + tl.arange(0, BLOCK_M)  # in the block
                    cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
                    mask = (rows < rows_d)[:, None] & (cols < N)[None, :]
                    dst = pol.remote_ptr(ctx, recv_ptr, d)
                    offs = ((rank * parts + s) * block_rows + rows)[:, None].to(tl.int64) * N \
                        + cols[None, :]
                    tl.store(dst + offs, acc.to(recv_ptr.dtype.element_ty), mask=mask)
            elif SPLIT:  # 3. a range of this rank's own tile
                ok, waited = _finish_own_part(
                    ctx, acc, row0 + tl.arange(0, BLOCK_M), tn, lo_d, rows_d, rank, world,
                    block_rows, N, out_ptr, bias_ptr, res_ptr, stride_res, recv_ptr,
                    gathered_ptr, reduced_ptr, consumed_ptr, ws_ptr, done_ptr, T, s, parts,
                    call, tag, ok, waited, BLOCK_M, BLOCK_N, ALL_REDUCE, HAS_BIAS, HAS_RES,
                    G_MAX)
            else:  # 3. this rank's block: its partial plus the peers', half a tile at a time
                # (a whole tile's peer partials, residual and bias beside the float32
                # accumulator spilled 768 bytes of registers on sm_90 at 128 x 256)
                HALF: tl.constexpr = BLOCK_N // 2
                left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)),
                                                  (0, 2, 1)))
                r = row0 + tl.arange(0, BLOCK_M)
                c = tl.arange(0, HALF)
                ok, waited = _finish_own(ctx, left, r, c, tn * BLOCK_N, lo_d, rows_d, rank,
                                         world, block_rows, N, out_ptr, bias_ptr, res_ptr,
                                         stride_res, recv_ptr, gathered_ptr, consumed_ptr, call,
                                         ok, waited, ALL_REDUCE, HAS_BIAS, HAS_RES)
                ok, waited = _finish_own(ctx, right, r, c, tn * BLOCK_N + HALF, lo_d, rows_d,
                                         rank, world, block_rows, N, out_ptr, bias_ptr, res_ptr,
                                         stride_res, recv_ptr, gathered_ptr, consumed_ptr, call,
                                         ok, waited, ALL_REDUCE, HAS_BIAS, HAS_RES)
        elif SPLIT:
            if mine & (d == rank):  # still counted: the next call's counts start at zero
                _drop_part(ctx, reduced_ptr, done_ptr, T, parts, call, tag, rank, ALL_REDUCE,
                           G_MAX)

    if ALL_REDUCE & SPLIT:  # 4. the peers' reduced split tiles, each once its flag is set
        for i in range(1, world):
            q = (rank + i) % world
            lo_q = _block_start(M, q, world)
            rows_q = _block_start(M, q + 1, world) - lo_q
            for j in range(0, per):
                item = _first_tile(pid, q, tpb, G) + j * G
                T = item // parts
                tm, tn = grouped_tile(T, n_tm, n_tn, GROUP_M)
                row0 = tm * BLOCK_M
                if (item < tpb) & (row0 < rows_q):
                    if _copier(T, q, parts, tpb, G) == pid:
                        if ok:
                            ok = pol.wait(ctx, reduced_ptr + q * G_MAX + T, call, q, tag)
                        if ok:
                            _copy_reduced(gathered_ptr, row0, tn, lo_q, rows_q, N, out_ptr,
                                          bias_ptr, res_ptr, stride_res, BLOCK_M, BLOCK_N,
                                          HAS_BIAS, HAS_RES)
    elif ALL_REDUCE:  # 4. the peers' reduced blocks, the tiles their program pid reduced
        pol.signal_all(ctx, reduced_ptr + rank * G_MAX + pid, call, ok, tag)
        if ok:
            ok = pol.wait_program_peers(ctx, reduced_ptr, pid, G_MAX, call, tag)
        if ok:
            for i in range(1, world):
                q = (rank + i) % world
                lo_q = _block_start(M, q, world)
                rows_q = _block_start(M, q + 1, world) - lo_q
                for j in range(0, per):
                    T = _first_tile(pid, q, tpb, G) + j * G
                    tm, tn = grouped_tile(T, n_tm, n_tn, GROUP_M)
                    row0 = tm * BLOCK_M
                    if (T < tpb) & (row0 < rows_q):
                        _copy_reduced(gathered_ptr, row0, tn, lo_q, rows_q, N, out_ptr,
                                      bias_ptr, res_ptr, stride_res, BLOCK_M, BLOCK_N, HAS_BIAS,
                                      HAS_RES)

    # the words no program of the grid writes, every 2**30 calls: at the end, where the tiles'
    # registers are free, and not inlined (inlined, ReduceScatter's 128 x 128 tile with
    # descriptors, bias and residual spilled 16 bytes on sm_90 instead of 8)
    if (call & (pol.REFRESH_CALLS - 1)) == 0:
        _refresh_words(ctx, sent_ptr, reduced_ptr, M, N, block_rows, G, call, tag, BLOCK_M,
                       BLOCK_N, GROUP_M, ALL_REDUCE, SPLIT, G_MAX)
    # the last program out: every read of this rank's buffers is done; tell the peers
    pol.end_call_consumed(ctx, call, consumed_ptr)
