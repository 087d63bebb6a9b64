"""Persistent tile GEMM ``c = a @ b``: the compute baseline of the GEMM-based ops and the skeleton
their producers extend (their epilogues send tiles instead of storing them locally).

Program ``pid`` takes tiles ``pid, pid + G, ...`` of the grouped order; G is at most what fits on
the device at once, so a later epilogue may wait on other programs or peers."""
import triton
import triton.language as tl

from ...tiles.gemm import gemm_tile_auto, grouped_tile


@triton.jit
def persistent_matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
    stride_cn, G,
    a_desc, b_desc,  # tensor descriptors of a and b when USE_DESC (else None): gemm_tile_desc
    USE_DESC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    n_tiles = num_pid_m * num_pid_n
    for i in range(0, tl.cdiv(n_tiles, G)):
        t = pid + i * G
        if t < n_tiles:
            pid_m, pid_n = grouped_tile(t, num_pid_m, num_pid_n, GROUP_M)
            acc = gemm_tile_auto(a_ptr, b_ptr, a_desc, b_desc, M, N, K, stride_am, stride_ak,
                                 stride_bk, stride_bn, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K,
                                 NUM_STAGES, EVEN_K, PRECISION, UPCAST, USE_DESC)
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty),
                     mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
