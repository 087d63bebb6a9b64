"""Kernels of the tile-group-signal transport (FlashOverlap's signaling and reordering).

``gemm_signal_kernel`` is the shared persistent tile GEMM (``tiles.gemm``) with a different
epilogue: instead of storing a tile into ``c``, it stores the whole ``[BLOCK_M, BLOCK_N]`` tile
(edge rows/columns zeroed) into staging slot ``slot[t]`` and counts it in its group's
counter ``count[group[t]]`` (int32, +1 per tile, release at system scope after a CTA barrier).
The counters are the backend's gate words (``transports.gate.gate_word``): ``count_ptr`` points
at them, or with ``GATE_TABLE`` at the int64 table of their addresses (each a separate
allocation: ROCm's signal memory, which its command processor can wait on).
A host stream wait (``stream_wait_value(count[g] >= size_g)``) then releases group g's collective.

Why the counters can never leave a stream wait hanging: the kernel has no waits, no early exits
and no error branch; every tile ``t < n_tiles`` is computed by exactly one program and bumps its
group exactly once, whatever the data. The host checks every input before the launch and enqueues
a stream wait only after the launch returned.

Tile order. Schedule-order tile ``t`` belongs to destination ``d = t % dests`` and is tile
``u = t // dests`` (grouped order) of the ``[M_dest, N]`` row block ``d`` of the output
(rows ``[d·M_dest, (d+1)·M_dest)`` of ``a``); ``dests`` is 1 for AllReduce.

``signal_reorder_kernel`` restores the layout after communication: received tile ``s`` goes to
``out[row0 : row0 + nrows, col0 : col0 + BLOCK_N]`` (masked at N) from a host-built table, with
an optional fused bias (per column) and residual add.
"""
import triton
import triton.language as tl

from ...tiles.gemm import gemm_tile, gemm_tile_desc, grouped_tile, store_tile_epilogue
from ...transports.gate import gate_word


@triton.jit
def gemm_signal_kernel(
    a_ptr, b_ptr,  # a [dests * M_dest, K], b [K, N], any strides
    stage_ptr,  # staging: n_tiles tiles of BLOCK_M x BLOCK_N, row-major inside a tile
    slot_ptr, group_ptr,  # int32 [n_tiles]: staging slot and wave group of schedule-order tile t
    count_ptr,  # int32 [n_groups]: tiles finished per group (waited on by the host streams);
    # with GATE_TABLE int64 [n_groups]: the address of each group's int32 counter
    M_dest, N, K, stride_am, stride_ak, stride_bk, stride_bn, dests, G,
    a_desc, b_desc,  # tensor descriptors of a and b when USE_DESC (else None): gemm_tile_desc
    USE_DESC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, GATE_TABLE: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M_dest, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    n_tiles = num_pid_m * num_pid_n * dests
    tile_offs = (tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :])
    for i in range(0, tl.cdiv(n_tiles, G)):
        t = pid + i * G
        if t < n_tiles:
            d = t % dests
            pid_m, pid_n = grouped_tile(t // dests, num_pid_m, num_pid_n, GROUP_M)
            if USE_DESC:  # rows past M_dest in row block d are block d+1's: masked below
                acc = gemm_tile_desc(a_desc, b_desc, d * M_dest + pid_m * BLOCK_M, 0,
                                     pid_n * BLOCK_N, 0, K, BLOCK_M, BLOCK_N, BLOCK_K,
                                     NUM_STAGES, PRECISION)
            else:
                a_d = a_ptr + (d * M_dest).to(tl.int64) * stride_am
                acc = gemm_tile(a_d, b_ptr, M_dest, N, K, stride_am, stride_ak, stride_bk,
                                stride_bn, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES,
                                EVEN_K, PRECISION, UPCAST)
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            # gemm_tile computes edge rows/columns on clamped indices: zero them, so the
            # collectives carry defined values (summing copies of row 0 would be harmless but
            # confusing when a staging buffer is inspected)
            acc = tl.where((rows[:, None] < M_dest) & (cols[None, :] < N), acc, 0.0)
            slot = tl.load(slot_ptr + t)
            g = tl.load(group_ptr + t)
            tl.store(stage_ptr + slot.to(tl.int64) * (BLOCK_M * BLOCK_N) + tile_offs,
                     acc.to(stage_ptr.dtype.element_ty))
            # every thread's stores come before the one thread's release (release is cumulative)
            tl.debug_barrier()
            tl.atomic_add(gate_word(count_ptr, g, GATE_TABLE), 1, sem="release", scope="sys")


@triton.jit
def _slab_of_program(table_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     ROWS: tl.constexpr):
    """This program's slab of the tile-by-tile epilogues (the reorder, the reduction): tile
    ``s = pid // (BLOCK_M // ROWS)``, its rows ``r`` in the tile, columns ``c``, and from the host
    table its place in ``out`` (row0, nrows, col0)."""
    pid = tl.program_id(0)
    s = pid // (BLOCK_M // ROWS)
    part = pid % (BLOCK_M // ROWS)
    row0 = tl.load(table_ptr + s * 3)
    nrows = tl.load(table_ptr + s * 3 + 1)
    col0 = tl.load(table_ptr + s * 3 + 2)
    r = part * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK_N)
    return s, r, c, row0, nrows, col0


@triton.jit
def signal_reorder_kernel(
    src_ptr,  # received tiles, BLOCK_M x BLOCK_N each
    table_ptr,  # int32 [n_src, 3]: (row0, nrows, col0) of each received tile in out
    out_ptr, bias_ptr, res_ptr,  # out [rows, N]; bias [N]; residual [rows, N] (both optional)
    N, stride_om, stride_rm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
):
    # program pid copies rows [part·ROWS, (part+1)·ROWS) of received tile s
    s, r, c, row0, nrows, col0 = _slab_of_program(table_ptr, BLOCK_M, BLOCK_N, ROWS)
    x = tl.load(src_ptr + s.to(tl.int64) * (BLOCK_M * BLOCK_N) + r[:, None] * BLOCK_N
                + c[None, :]).to(tl.float32)
    store_tile_epilogue(x, r, c, row0, nrows, col0, N, out_ptr, bias_ptr, res_ptr, stride_om,
                        stride_rm, HAS_BIAS, HAS_RES)


@triton.jit
def _received_slab(src_ptr, s, r, c, col0, N, out_rows, mask, bias_ptr, res_ptr, stride_rm,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                   HAS_RES: tl.constexpr):
    """fp32 rows ``r`` of received tile ``s`` (+ bias + residual), zero outside ``mask``."""
    x = tl.load(src_ptr + s.to(tl.int64) * (BLOCK_M * BLOCK_N) + r[:, None] * BLOCK_N
                + c[None, :]).to(tl.float32)
    col_ok = (col0 + c) < N
    if HAS_BIAS:
        x += tl.load(bias_ptr + col0 + c, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        x += tl.load(res_ptr + out_rows[:, None] * stride_rm + (col0 + c)[None, :], mask=mask,
                     other=0.0).to(tl.float32)
    return tl.where(mask, x, 0.0)


@triton.jit
def signal_reorder_norm_kernel(
    src_ptr,  # received tiles, BLOCK_M x BLOCK_N each
    rows_ptr,  # int32 [n_row_blocks, 2]: (row0, nrows) of each row block of out
    index_ptr,  # int32 [n_row_blocks, n_col_tiles]: received tile holding (row block, col tile)
    out_ptr, normed_ptr, bias_ptr, res_ptr, w_ptr,  # h and rmsnorm(h) * w, both [rows, N]
    N, n_col_tiles, stride_om, stride_nm, stride_rm, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
):
    """The reorder fused with bias, residual and RMSNorm over whole rows: program pid takes
    ROWS rows of one row block, walks its column tiles once for ``h`` and the sum of squares,
    then again (recomputing ``h`` in fp32 from the received tiles) for ``h * rstd * w``."""
    pid = tl.program_id(0)
    rb = pid // (BLOCK_M // ROWS)
    part = pid % (BLOCK_M // ROWS)
    row0 = tl.load(rows_ptr + rb * 2)
    nrows = tl.load(rows_ptr + rb * 2 + 1)
    r = part * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK_N)
    out_rows = (row0 + r).to(tl.int64)
    sumsq = tl.zeros((ROWS,), dtype=tl.float32)
    for j in range(0, n_col_tiles):
        s = tl.load(index_ptr + rb * n_col_tiles + j)
        col0 = j * BLOCK_N
        mask = (r[:, None] < nrows) & ((col0 + c) < N)[None, :]
        x = _received_slab(src_ptr, s, r, c, col0, N, out_rows, mask, bias_ptr, res_ptr,
                           stride_rm, BLOCK_M, BLOCK_N, HAS_BIAS, HAS_RES)
        sumsq += tl.sum(x * x, axis=1)
        tl.store(out_ptr + out_rows[:, None] * stride_om + (col0 + c)[None, :],
                 x.to(out_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(sumsq / N + eps)
    for j in range(0, n_col_tiles):
        s = tl.load(index_ptr + rb * n_col_tiles + j)
        col0 = j * BLOCK_N
        col_ok = (col0 + c) < N
        mask = (r[:, None] < nrows) & col_ok[None, :]
        x = _received_slab(src_ptr, s, r, c, col0, N, out_rows, mask, bias_ptr, res_ptr,
                           stride_rm, BLOCK_M, BLOCK_N, HAS_BIAS, HAS_RES)
        w = tl.load(w_ptr + col0 + c, mask=col_ok, other=0.0).to(tl.float32)
        y = x * rstd[:, None] * w[None, :]
        tl.store(normed_ptr + out_rows[:, None] * stride_nm + (col0 + c)[None, :],
                 y.to(normed_ptr.dtype.element_ty), mask=mask)


@triton.jit
def signal_reduce_kernel(
    stage_ptr,  # this rank's staging: tiles of BLOCK_M x BLOCK_N (its own partial among them)
    own_slot_ptr,  # int32 [n_own]: staging slot of this rank's own tile u
    recv_ptr,  # heap: [W, n_own] tiles, region q = rank q's partial of this rank's block
    table_ptr,  # int32 [n_own, 3]: (row0, nrows, col0) of tile u in out
    out_ptr, bias_ptr, res_ptr,  # out [rows, N]; bias [N]; residual [rows, N] (both optional)
    N, stride_om, stride_rm, rank, W, region,  # region: elements of one source's region
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
):
    """ReduceScatter's reduction after copy-engine transfers: program pid sums rows
    [part·ROWS, (part+1)·ROWS) of own tile u = pid // (BLOCK_M // ROWS) over this rank's partial
    (in staging) and every peer's (in the heap), in fp32, adds bias / residual, rounds once and
    stores into out (the same table as the reorder's)."""
    s, r, c, row0, nrows, col0 = _slab_of_program(table_ptr, BLOCK_M, BLOCK_N, ROWS)
    in_tile = r[:, None] * BLOCK_N + c[None, :]
    own = tl.load(own_slot_ptr + s).to(tl.int64)
    x = tl.load(stage_ptr + own * (BLOCK_M * BLOCK_N) + in_tile).to(tl.float32)
    src = recv_ptr + s.to(tl.int64) * (BLOCK_M * BLOCK_N) + in_tile
    for q in range(0, W):  # the pointer steps one region per source (no 32-bit product)
        if q != rank:
            x += tl.load(src).to(tl.float32)
        src += region
    store_tile_epilogue(x, r, c, row0, nrows, col0, N, out_ptr, bias_ptr, res_ptr, stride_om,
                        stride_rm, HAS_BIAS, HAS_RES)
