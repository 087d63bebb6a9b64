"""The tile GEMM main loop shared by the GEMM-based ops (GEMM + All-to-All and the GEMM producers
of the signal / copy-engine transports): tile order and one output tile's accumulation.

``grouped_tile`` walks output tiles in groups of GROUP_M tile rows so that consecutive tiles reuse
the same B columns from L2. ``gemm_tile`` returns the fp32 ``[BLOCK_M, BLOCK_N]`` tile
``a[rows, :] @ b[:, cols]``; rows and columns past the edge are computed on clamped indices (no
load masks in the loop) and must be masked by the caller's store. ``gemm_tile_desc`` computes
the same tile through tensor descriptors (bulk tensor copies where the device has them: TMA on
Hopper), which the host builds with ``ops.matmul.api.tile_descriptors`` when the operands allow.
"""
import triton
import triton.language as tl


@triton.jit
def grouped_tile(t, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of the ``t``-th tile in grouped order. A ``t`` past the grid (a program
    with no tile left, which its caller masks; a grid of no rows) maps to some tile instead of
    dividing by zero or a negative count: on GPUs integer division by zero does not trap but
    gives an undefined value, and the interpreter warns."""
    per_group = GROUP_M * num_pid_n
    group = t // per_group
    first_m = group * GROUP_M
    rows = tl.maximum(tl.minimum(num_pid_m - first_m, GROUP_M), 1)
    pid_m = first_m + (t % per_group) % rows
    pid_n = (t % per_group) // rows
    return pid_m, pid_n


@triton.jit
def tile_offsets(M, N, stride_am, stride_ak, stride_bk, stride_bn, pid_m, pid_n,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``(a_offs, b_offs, offs_k)``: the element offsets of tile (pid_m, pid_n)'s first K block
    in ``a`` [BLOCK_M, BLOCK_K] and ``b`` [BLOCK_K, BLOCK_N], and the K lanes."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Clamp instead of masking: the edge rows/columns load valid memory, the store drops them.
    # The hints restore what the clamp hides from the compiler (runs of 16 contiguous indices
    # starting at multiples of 16), without which the loads along N of a row-major b (or along
    # M of a column-major a) are issued element by element, not as 16-byte vectors: measured
    # 15x slower on H200. They are true where they matter: vectors need the row stride
    # divisible by 16 (a JIT specialization), and then every aligned run of a vector's width is
    # either all inside the edge or all clamped; a clamped run reads index 0's neighbours (valid
    # memory, results dropped by the store's mask).
    rm = tl.max_contiguous(tl.multiple_of(tl.where(offs_m < M, offs_m, 0), BLOCK_M), BLOCK_M)
    rn = tl.max_contiguous(tl.multiple_of(tl.where(offs_n < N, offs_n, 0), BLOCK_N), BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_offs = rm[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_offs = offs_k[:, None] * stride_bk + rn[None, :].to(tl.int64) * stride_bn
    return a_offs, b_offs, offs_k


@triton.jit
def gemm_tile(a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, pid_m, pid_n,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
              UPCAST: tl.constexpr):
    a_offs, b_offs, offs_k = tile_offsets(M, N, stride_am, stride_ak, stride_bk, stride_bn,
                                          pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K)
    a_ptrs = a_ptr + a_offs
    b_ptrs = b_ptr + b_offs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(k0 + offs_k)[None, :] < K, other=0.0)
            b = tl.load(b_ptrs, mask=(k0 + offs_k)[:, None] < K, other=0.0)
        if UPCAST:  # see tiles.gemv.dot_upcast
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def gemm_tile_desc(a_desc, b_desc, row0, b_row0, col0, k_lo, k_hi, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                   PRECISION: tl.constexpr):
    """The fp32 tile ``a[row0:row0+BLOCK_M, k_lo:k_hi] @ b[b_row0+k_lo:b_row0+k_hi,
    col0:col0+BLOCK_N]`` with ``a_desc`` ([M, K] blocks [BLOCK_M, BLOCK_K]) and ``b_desc``
    (blocks [BLOCK_K, BLOCK_N]; ``b_row0`` > 0 where ``b`` is a stack of [K, N] matrices
    described as one, and then K must be a multiple of BLOCK_K, or a block would read the next
    matrix's rows). The whole product: ``k_lo`` = 0, ``k_hi`` = K; a range of K steps (a split
    tile): ``k_lo`` a multiple of BLOCK_K, ``k_hi`` one too or K.
    Reads past the tensors' ends are zeros; rows past a caller's own edge inside the tensor are
    real data and must be masked by the caller's store. On H200 this main loop ran within
    1-5 % of cuBLAS at 132 programs where the pointer loads of ``gemm_tile`` ran 9-21 % behind
    (benchmarks/probe_gemm_tma.py): the copies bypass the register file and
    the address arithmetic."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        a = a_desc.load([row0, k0])
        b = b_desc.load([b_row0 + k0, col0])
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def gemm_tile_desc_bt(a_desc, bt_desc, row0, col0, k_lo, k_hi, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                      PRECISION: tl.constexpr):
    """``gemm_tile_desc`` where ``b`` is the transpose of a row-major [N, K] matrix (an
    ``nn.Linear`` weight, ``weight.t()``): ``bt_desc`` describes that matrix in [BLOCK_N,
    BLOCK_K] blocks and the dot takes each block transposed, which the tensor cores read from
    shared memory as it lies. Pointer loads of such a ``b`` read it column by column. K steps
    from ``k_lo`` to ``k_hi`` as in ``gemm_tile_desc``."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        a = a_desc.load([row0, k0])
        bt = bt_desc.load([col0, k0])
        acc = tl.dot(a, bt.T, acc, input_precision=PRECISION)
    return acc


@triton.jit
def gemm_tile_desc_of(a_desc, b_desc, row0, col0, k_lo, k_hi, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                      PRECISION: tl.constexpr, B_TRANS: tl.constexpr):
    """The tile ``a[row0:, k_lo:k_hi] @ b[k_lo:k_hi, col0:]`` through descriptors: ``b_desc``
    describes ``b`` (``gemm_tile_desc``) or, with ``B_TRANS``, the row-major matrix ``b`` is
    the transpose of (``gemm_tile_desc_bt``), as ``ops.matmul.api.operand_descriptors`` built
    it."""
    if B_TRANS:
        acc = gemm_tile_desc_bt(a_desc, b_desc, row0, col0, k_lo, k_hi, BLOCK_M, BLOCK_N,
                                BLOCK_K, NUM_STAGES, PRECISION)
    else:
        acc = gemm_tile_desc(a_desc, b_desc, row0, 0, col0, k_lo, k_hi, BLOCK_M, BLOCK_N,
                             BLOCK_K, NUM_STAGES, PRECISION)
    return acc


@triton.jit
def store_tile_epilogue(x, r, c, row0, nrows, col0, N, out_ptr, bias_ptr, res_ptr, stride_om,
                        stride_rm, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
    """Rows ``r`` of a tile placed at ``(row0, col0)`` of ``out``, in fp32 (``x``): add bias
    and residual (rows ``row0 + r`` of it), round once, store (masked at the tile's ``nrows``
    and at N)."""
    col_ok = (col0 + c) < N
    mask = (r[:, None] < nrows) & col_ok[None, :]
    out_rows = (row0 + r).to(tl.int64)
    if HAS_BIAS:
        x += tl.load(bias_ptr + col0 + c, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        x += tl.load(res_ptr + out_rows[:, None] * stride_rm + (col0 + c)[None, :], mask=mask,
                     other=0.0).to(tl.float32)
    tl.store(out_ptr + out_rows[:, None] * stride_om + (col0 + c)[None, :],
             x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gemm_tile_auto(a_ptr, b_ptr, a_desc, b_desc, M, N, K, stride_am, stride_ak, stride_bk,
                   stride_bn, pid_m, pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_DESC: tl.constexpr):
    """Tile ``(pid_m, pid_n)`` of ``a @ b`` through the descriptors when USE_DESC (the host's
    ``tile_descriptors`` allowed them), else through ``gemm_tile``'s pointer loads."""
    if USE_DESC:
        acc = gemm_tile_desc(a_desc, b_desc, pid_m * BLOCK_M, 0, pid_n * BLOCK_N, 0, K,
                             BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, PRECISION)
    else:
        acc = gemm_tile(a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, pid_m,
                        pid_n, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, EVEN_K, PRECISION, UPCAST)
    return acc


@triton.jit
def gemm_tile_pair(a_ptr, b_ptr, c_ptr, M, N, k_lo, k_hi, stride_am, stride_ak, stride_bk,
                   stride_bn, pid_m, pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """The fp32 tiles ``a[rows, k_lo:k_hi] @ b[k_lo:k_hi, cols]`` and the same with ``c``
    (``b`` and ``c`` of one shape and strides) in one pass over ``a``: a gated MLP's gate and
    up projections, which read the same rows (``k_lo`` = 0, ``k_hi`` = K for the whole
    product; ``k_lo`` a multiple of BLOCK_K, and ``k_hi`` too where EVEN_K). Edges as in
    ``gemm_tile`` (clamped indices, masked by the caller's store)."""
    a_offs, b_offs, offs_k = tile_offsets(M, N, stride_am, stride_ak, stride_bk, stride_bn,
                                          pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K)
    a_ptrs = a_ptr + a_offs + k_lo * stride_ak
    b_ptrs = b_ptr + b_offs + k_lo * stride_bk
    c_ptrs = c_ptr + b_offs + k_lo * stride_bk
    acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_c = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
            c = tl.load(c_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(k0 + offs_k)[None, :] < k_hi, other=0.0)
            b = tl.load(b_ptrs, mask=(k0 + offs_k)[:, None] < k_hi, other=0.0)
            c = tl.load(c_ptrs, mask=(k0 + offs_k)[:, None] < k_hi, other=0.0)
        if UPCAST:  # see tiles.gemv.dot_upcast
            acc_b = tl.dot(a.to(tl.float32), b.to(tl.float32), acc_b, input_precision="ieee")
            acc_c = tl.dot(a.to(tl.float32), c.to(tl.float32), acc_c, input_precision="ieee")
        else:
            acc_b = tl.dot(a, b, acc_b, input_precision=PRECISION)
            acc_c = tl.dot(a, c, acc_c, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
        c_ptrs += BLOCK_K * stride_bk
    return acc_b, acc_c


@triton.jit
def gemm_tile_pair_desc(a_desc, b_desc, c_desc, row0, b_row0, col0, k_lo, k_hi,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        NUM_STAGES: tl.constexpr, PRECISION: tl.constexpr):
    """``gemm_tile_pair`` through tensor descriptors: ``a`` rows from ``row0``, ``b`` / ``c``
    rows from ``b_row0`` (a stack of matrices described as one: expert e's rows start at
    e * K), columns from ``col0``, the K steps from ``k_lo`` to ``k_hi``. K must be a multiple
    of BLOCK_K where ``b`` is such a stack, or a block would read the next matrix's rows."""
    acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_c = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        a = a_desc.load([row0, k0])
        acc_b = tl.dot(a, b_desc.load([b_row0 + k0, col0]), acc_b, input_precision=PRECISION)
        acc_c = tl.dot(a, c_desc.load([b_row0 + k0, col0]), acc_c, input_precision=PRECISION)
    return acc_b, acc_c
