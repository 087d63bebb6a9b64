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
   peer q (acquire, bounded);
3. computes its tiles of block r and adds the peers' partials from ``recv[q]`` in float32;
   ReduceScatter: ``out = sum + bias + residual``, rounded once. AllReduce: the sum is rounded
   to the input dtype (what the vendor's all-reduce of the products would give), stored into
   ``gathered`` in every peer's heap and, with this rank's bias and residual, into ``out``;
4. AllReduce only: signals ``reduced[r][pid]``, waits for every peer's, and copies the tiles of
   the peers' blocks that their program pid reduced from ``gathered`` into ``out`` (adding this
   rank's bias and residual).

Before its first store into rank d in a call a program waits until ``consumed[d]`` holds the
previous epoch; the last program of a launch sets ``consumed[r]`` in every peer's heap.
"""
import triton
import triton.language as tl

from ...shmem.device import (await_free_once, begin_call, call_flag, end_call_free, live,
                             peer_buffer, signal_peers, wait_peers)
from ...tiles.gemm import gemm_tile, gemm_tile_desc_of, grouped_tile, store_tile_epilogue

FLAG_SENT = tl.constexpr(1)
FLAG_CONSUMED = tl.constexpr(2)
FLAG_REDUCED = tl.constexpr(3)
FLAG_NAMES = {1: "partials-sent", 2: "recv-consumed", 3: "block-reduced"}


@triton.jit
def _first_tile(pid, d, tpb, G):
    """Program ``pid``'s first tile of block d: the T in [0, G) with (T + d*tpb) % G == pid."""
    return (pid - (d * tpb) % G + G) % G


@triton.jit
def _finish_own(acc, r, c, col0, lo_d, rows_d, rank, world, block_rows, N, out_ptr, bias_ptr,
                res_ptr, stride_res, recv_ptr, gathered_ptr, consumed_ptr, clock_ptr, bases_ptr,
                status_addr, epoch, timeout_us, pid, ok, cleared, ALL_REDUCE: tl.constexpr,
                HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
    """Step 3 for columns ``col0 + c`` of one tile of this rank's block (rows ``r`` counted in
    the block, which starts at row ``lo_d`` and has ``rows_d`` rows): add the peers' partials
    to ``acc`` and store the result (module docstring). Returns ``(ok, cleared)``."""
    cols = col0 + c
    mask = (r < rows_d)[:, None] & (cols < N)[None, :]
    for q in range(0, world):
        if q != rank:
            offs = (q * block_rows + r)[:, None].to(tl.int64) * N + cols[None, :]
            acc += tl.load(recv_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ALL_REDUCE:
        y = acc.to(out_ptr.dtype.element_ty)  # the reduced block every rank gets
        goffs = (lo_d + r)[:, None].to(tl.int64) * N + cols[None, :]
        for q in range(0, world):
            if q != rank:
                ok, cleared = await_free_once(consumed_ptr, q, cleared, epoch, clock_ptr,
                                              timeout_us, status_addr, pid, FLAG_CONSUMED, ok)
                if ok:
                    tl.store(peer_buffer(gathered_ptr, bases_ptr, rank, q) + goffs, y,
                             mask=mask)
        store_tile_epilogue(y.to(tl.float32), r, c, lo_d, rows_d, col0, N, out_ptr, bias_ptr,
                            res_ptr, N, stride_res, HAS_BIAS, HAS_RES)
    else:  # out and residual hold this rank's rows only
        store_tile_epilogue(acc, r, c, 0, rows_d, col0, N, out_ptr, bias_ptr, res_ptr, N,
                            stride_res, HAS_BIAS, HAS_RES)
    return ok, cleared


# Every rank runs the same compiled code (the rank is never specialized on: see
# gemm_alltoall.kernel).
@triton.jit(do_not_specialize=["rank"])
def matmul_reduce_stores_kernel(
    a_ptr, b_ptr, out_ptr, bias_ptr, res_ptr,  # a [M, K_r], b [K_r, N]; out, residual by mode
    recv_ptr, gathered_ptr,  # heap: [W, block_rows, N] partials by source; [M, N] (AllReduce)
    sent_ptr, reduced_ptr, consumed_ptr, ctl_ptr,  # heap: int64 [W, G_MAX] x2, [W], [2]
    clock_ptr, bases_ptr, status_addr,  # call clock; heap bases; status board
    M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_res, block_rows, G, rank,
    world, tag, timeout_us,
    a_desc, b_desc,  # tensor descriptors of a and b (of b.t() when B_TRANS) when USE_DESC
    ALL_REDUCE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    USE_DESC: tl.constexpr, B_TRANS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, G_MAX: tl.constexpr,
):
    pid = tl.program_id(0)
    epoch = begin_call(ctl_ptr)
    ok = live(clock_ptr)
    n_tm = tl.cdiv(block_rows, BLOCK_M)
    n_tn = tl.cdiv(N, BLOCK_N)
    tpb = n_tm * n_tn
    per = tl.cdiv(tpb, G)  # most tiles of one block a program takes
    cleared = tl.zeros((), tl.int64)  # bit d: rank d's buffers are free for this call
    # One loop over the blocks in order r+1, ..., r-1, r, with one tile-GEMM call site: a
    # second call site would hold a second set of pipeline buffers (shared memory).
    for idx in range(0, world * per):
        i = idx // per  # position of the block in this rank's order; world-1 = its own
        if idx == (world - 1) * per:  # 2. every peer partial this program owes is stored
            signal_peers(sent_ptr, bases_ptr, pid, rank, world, call_flag(epoch, tag, ok), G_MAX)
            ok = wait_peers(sent_ptr, FLAG_SENT, pid, rank, world, epoch, tag, clock_ptr,
                            timeout_us, status_addr, ok, G_MAX)
        d = (rank + 1 + i) % world
        T = _first_tile(pid, d, tpb, G) + (idx % per) * G
        lo_d = M * d // world
        rows_d = M * (d + 1) // world - lo_d
        tm, tn = grouped_tile(T, n_tm, n_tn, GROUP_M)
        row0 = tm * BLOCK_M  # in the block
        if (T < tpb) & (row0 < rows_d) & ok:
            if USE_DESC:
                acc = gemm_tile_desc_of(a_desc, b_desc, lo_d + row0, tn * BLOCK_N, K, BLOCK_M,
                                        BLOCK_N, BLOCK_K, NUM_STAGES, PRECISION, B_TRANS)
            else:
                acc = gemm_tile(a_ptr + (lo_d + row0).to(tl.int64) * stride_am, b_ptr,
                                rows_d - row0, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                                0, tn, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, EVEN_K, PRECISION,
                                UPCAST)
            if d != rank:  # 1. a peer's partial, into its heap at this rank's slot
                ok, cleared = await_free_once(consumed_ptr, d, cleared, epoch, clock_ptr,
                                              timeout_us, status_addr, pid, FLAG_CONSUMED, ok)
                if ok:
                    rows = row0 + tl.arange(0, BLOCK_M)  # in the block
                    cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
                    mask = (rows < rows_d)[:, None] & (cols < N)[None, :]
                    dst = peer_buffer(recv_ptr, bases_ptr, rank, d)
                    offs = (rank * block_rows + rows)[:, None].to(tl.int64) * N + cols[None, :]
                    tl.store(dst + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
            else:  # 3. this rank's block: its partial plus the peers', half a tile at a time
                # (a whole tile's peer partials, residual and bias beside the float32
                # accumulator spilled 768 bytes of registers on sm_90 at 128 x 256)
                HALF: tl.constexpr = BLOCK_N // 2
                left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)),
                                                  (0, 2, 1)))
                r = row0 + tl.arange(0, BLOCK_M)
                c = tl.arange(0, HALF)
                ok, cleared = _finish_own(left, r, c, tn * BLOCK_N, lo_d, rows_d, rank, world,
                                          block_rows, N, out_ptr, bias_ptr, res_ptr, stride_res,
                                          recv_ptr, gathered_ptr, consumed_ptr, clock_ptr,
                                          bases_ptr, status_addr, epoch, timeout_us, pid, ok,
                                          cleared, ALL_REDUCE, HAS_BIAS, HAS_RES)
                ok, cleared = _finish_own(right, r, c, tn * BLOCK_N + HALF, lo_d, rows_d, rank,
                                          world, block_rows, N, out_ptr, bias_ptr, res_ptr,
                                          stride_res, recv_ptr, gathered_ptr, consumed_ptr,
                                          clock_ptr, bases_ptr, status_addr, epoch, timeout_us,
                                          pid, ok, cleared, ALL_REDUCE, HAS_BIAS, HAS_RES)

    if ALL_REDUCE:  # 4. the peers' reduced blocks, the tiles their program pid reduced
        signal_peers(reduced_ptr, bases_ptr, pid, rank, world, call_flag(epoch, tag, ok), G_MAX)
        ok = wait_peers(reduced_ptr, FLAG_REDUCED, pid, rank, world, epoch, tag, clock_ptr,
                        timeout_us, status_addr, ok, G_MAX)
        if ok:
            for i in range(1, world):
                q = (rank + i) % world
                lo_q = M * q // world
                rows_q = M * (q + 1) // world - lo_q
                for j in range(0, per):
                    T = _first_tile(pid, q, tpb, G) + j * G
                    tm, tn = grouped_tile(T, n_tm, n_tn, GROUP_M)
                    row0 = tm * BLOCK_M
                    if (T < tpb) & (row0 < rows_q):
                        r = row0 + tl.arange(0, BLOCK_M)  # in block q
                        c = tl.arange(0, BLOCK_N)
                        mask = (r < rows_q)[:, None] & (tn * BLOCK_N + c < N)[None, :]
                        y = tl.load(gathered_ptr + (lo_q + r)[:, None].to(tl.int64) * N
                                    + (tn * BLOCK_N + c)[None, :], mask=mask, other=0.0)
                        store_tile_epilogue(y.to(tl.float32), r, c, lo_q, rows_q, tn * BLOCK_N,
                                            N, out_ptr, bias_ptr, res_ptr, N, stride_res,
                                            HAS_BIAS, HAS_RES)

    # the last program out: every read of this rank's buffers is done; tell the peers
    end_call_free(ctl_ptr, epoch, consumed_ptr, bases_ptr, rank, world)
