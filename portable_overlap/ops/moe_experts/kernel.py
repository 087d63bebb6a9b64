"""The experts' first GEMMs with the gated activation: one persistent grouped kernel over the
dispatch layout, reading the row counts on the device.

Rows of ``x`` come in segments (source rank q, local expert e) of ``counts[q, e]`` rows, segment
s = q * E + e starting where the segments before it end. Tile (pid_m, pid_n) of segment s
computes, for its rows i and columns j of I::

    h[i, j] = silu(x[i] @ w_gate[e][:, j]) * (x[i] @ w_up[e][:, j])      (float32, then h's dtype)

Segments are walked expert by expert (all sources of expert 0, then expert 1, ...), so
consecutive tiles read the same expert's weights from L2. The tile count comes from the counts
on the device: the host never reads them, and a grid of one program per SM covers any routing.
Rows past ``counts.sum()`` are neither read nor written.
"""
import triton
import triton.language as tl

from ...tiles.gemm import gemm_tile_pair, gemm_tile_pair_desc, grouped_tile


@triton.jit
def _segment(i, n_src, E):
    """Segment index of the i-th step of the walk: expert i // n_src, source i % n_src."""
    return (i % n_src) * E + i // n_src


@triton.jit
def expert_swiglu_kernel(
    x_ptr, wg_ptr, wu_ptr, counts_ptr, h_ptr, x_desc, wg_desc, wu_desc,
    I, H, n_seg, E, stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_hm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, USE_DESC: tl.constexpr, BLOCK_SEG: tl.constexpr,
):
    pid = tl.program_id(0)
    n_src = n_seg // E
    num_pid_n = tl.cdiv(I, BLOCK_N)
    segs = tl.arange(0, BLOCK_SEG)
    cnt = tl.load(counts_ptr + segs, mask=segs < n_seg, other=0)
    total = tl.sum((cnt + BLOCK_M - 1) // BLOCK_M) * num_pid_n
    # the walk's cursor (monotone in t): step, segment, its first tile, tile count, first row
    i = 0
    seg = _segment(i, n_src, E)
    seg_t0 = 0
    n = tl.load(counts_ptr + seg)
    seg_nt = tl.cdiv(n, BLOCK_M) * num_pid_n
    for t in range(pid, total, tl.num_programs(0)):
        while t >= seg_t0 + seg_nt:  # `total` bounds t, so the walk stays inside n_seg
            i += 1
            seg_t0 += seg_nt
            seg = _segment(i, n_src, E)
            n = tl.load(counts_ptr + seg)
            seg_nt = tl.cdiv(n, BLOCK_M) * num_pid_n
        e = seg % E
        start = tl.sum(tl.where(segs < seg, cnt, 0))  # rows of the segments before seg
        pid_m, pid_n = grouped_tile(t - seg_t0, tl.cdiv(n, BLOCK_M), num_pid_n, GROUP_M)
        if USE_DESC:
            g, u = gemm_tile_pair_desc(x_desc, wg_desc, wu_desc, start + pid_m * BLOCK_M,
                                       e * H, pid_n * BLOCK_N, H, BLOCK_M, BLOCK_N, BLOCK_K,
                                       NUM_STAGES, PRECISION)
        else:
            g, u = gemm_tile_pair(x_ptr + start.to(tl.int64) * stride_xm,
                                  wg_ptr + tl.cast(e, tl.int64) * stride_we,
                                  wu_ptr + tl.cast(e, tl.int64) * stride_we, n, I, H, stride_xm,
                                  stride_xk, stride_wk, stride_wn, pid_m, pid_n, BLOCK_M,
                                  BLOCK_N, BLOCK_K, NUM_STAGES, EVEN_K, PRECISION, UPCAST)
        h = g / (1.0 + tl.exp(-g)) * u
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ptrs = h_ptr + (start + rows)[:, None].to(tl.int64) * stride_hm + cols[None, :]
        tl.store(ptrs, h.to(h_ptr.dtype.element_ty), mask=(rows < n)[:, None] & (cols < I)[None, :])
