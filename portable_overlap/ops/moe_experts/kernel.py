"""The experts' first GEMMs with the gated activation: one persistent grouped kernel over the
dispatch layout, reading the row counts on the device.

Rows of ``x`` come in segments (source rank q, local expert e) of ``counts[q, e]`` rows, segment
s = q * E + e starting where the segments before it end. Tile (pid_m, pid_n) of segment s
computes, for its rows i and columns j of I::

    h[i, j] = silu(x[i] @ w_gate[e][:, j]) * (x[i] @ w_up[e][:, j])      (float32, then h's dtype)

Tiles are walked expert by expert; an expert's row tiles of all sources are laid end to end and
walked in grouped order, so consecutive tiles read the same expert's weight columns from L2 (at
decode sizes, where each source sends an expert a few rows, every column block of its weights
is then read from memory once, not once per source). The tile count comes from the counts
on the device: the host never reads them, and a grid of one program per SM covers any routing.
Rows past ``counts.sum()`` are neither read nor written.

With ``GATHER`` a row tile holds the expert's rows of all sources together (rows gathered from
the sources' segments, pointer loads), not one source's: at decode sizes each source sends an
expert a few rows, and per-source tiles would be mostly empty, computing zeros (128 tokens per
rank, top-2 of 8 experts: 32 rows per source, so on 8 ranks an expert's 256 rows fill 8
half-empty 64-row tiles where 4 full ones would do).
"""
import triton
import triton.language as tl

from ...tiles.gemm import gemm_tile_pair, gemm_tile_pair_desc, gemm_tile_pair_rows, grouped_tile


@triton.jit
def expert_swiglu_kernel(
    x_ptr, wg_ptr, wu_ptr, counts_ptr, h_ptr, x_desc, wg_desc, wu_desc,
    I, H, n_seg, E, stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_hm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, USE_DESC: tl.constexpr, BLOCK_SEG: tl.constexpr,
    BLOCK_SRC: tl.constexpr, GATHER: tl.constexpr,
):
    pid = tl.program_id(0)
    n_src = n_seg // E
    num_pid_n = tl.cdiv(I, BLOCK_N)
    segs = tl.arange(0, BLOCK_SEG)
    cnt = tl.load(counts_ptr + segs, mask=segs < n_seg, other=0)
    srcs = tl.arange(0, BLOCK_SRC)
    if GATHER:  # an expert's rows of all sources in one run of row tiles
        per_e = tl.sum(tl.where((segs % E)[None, :] == tl.arange(0, BLOCK_SEG)[:, None],
                                cnt[None, :], 0), axis=1)
        total = tl.sum((per_e + BLOCK_M - 1) // BLOCK_M) * num_pid_n
    else:
        total = tl.sum((cnt + BLOCK_M - 1) // BLOCK_M) * num_pid_n
    # the walk's cursor (monotone in t): expert, its first tile, its row tiles over all sources
    # (per source, and their running sum), its tile count
    e = 0
    e_t0 = 0
    c_e = tl.load(counts_ptr + srcs * E, mask=srcs < n_src, other=0)
    mt_q = _row_tiles(c_e, BLOCK_M, BLOCK_SRC, GATHER)
    cum = tl.cumsum(mt_q, axis=0)
    e_nt = tl.sum(mt_q) * num_pid_n
    for t in range(pid, total, tl.num_programs(0)):
        while t >= e_t0 + e_nt:  # `total` bounds t, so the walk stays inside the experts
            e += 1
            e_t0 += e_nt
            c_e = tl.load(counts_ptr + srcs * E + e, mask=srcs < n_src, other=0)
            mt_q = _row_tiles(c_e, BLOCK_M, BLOCK_SRC, GATHER)
            cum = tl.cumsum(mt_q, axis=0)
            e_nt = tl.sum(mt_q) * num_pid_n
        # row tile vm of the expert's sources laid end to end (grouped order: GROUP_M row
        # tiles per weight column block, so at decode sizes every source's rows of the expert
        # read a column block of its weights together, from L2 after the first)
        vm, pid_n = grouped_tile(t - e_t0, tl.sum(mt_q), num_pid_n, GROUP_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if GATHER:
            # virtual row v of the expert (sources end to end) -> its source q and row
            v = vm * BLOCK_M + tl.arange(0, BLOCK_M)
            ends = tl.cumsum(c_e, axis=0)  # the expert's rows up to each source's, inclusive
            q_v = tl.sum((ends[None, :] <= v[:, None]).to(tl.int32), axis=1)
            # where source q's segment of expert e starts in x, minus the rows of e before it
            starts = tl.sum(tl.where(segs[None, :] < (srcs * E + e)[:, None], cnt[None, :], 0),
                            axis=1)
            shift = starts - (ends - c_e)
            valid = v < tl.sum(c_e)
            rows = v + tl.sum(tl.where(srcs[None, :] == q_v[:, None], shift[None, :], 0), axis=1)
            rows = tl.where(valid, rows, 0)
            g, u = gemm_tile_pair_rows(x_ptr, rows, wg_ptr + tl.cast(e, tl.int64) * stride_we,
                                       wu_ptr + tl.cast(e, tl.int64) * stride_we, wg_desc,
                                       wu_desc, e * H, I, H, stride_xm, stride_xk, stride_wk,
                                       stride_wn, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES,
                                       EVEN_K, PRECISION, UPCAST, USE_DESC)
            store_swiglu(g, u, rows, valid, cols, h_ptr, I, stride_hm)
        else:
            q = tl.sum((cum <= vm).to(tl.int32))  # the source whose row tiles hold vm
            pid_m = vm - tl.sum(tl.where(srcs == q, cum - mt_q, 0))
            n = tl.sum(tl.where(srcs == q, c_e, 0))
            seg = q * E + e
            start = tl.sum(tl.where(segs < seg, cnt, 0))  # rows of the segments before seg
            swiglu_segment_tile(x_ptr, wg_ptr, wu_ptr, h_ptr, x_desc, wg_desc, wu_desc, start, n,
                                e, pid_m, pid_n, I, H, stride_xm, stride_xk, stride_we,
                                stride_wk, stride_wn, stride_hm, BLOCK_M, BLOCK_N, BLOCK_K,
                                NUM_STAGES, EVEN_K, PRECISION, UPCAST, USE_DESC)


@triton.jit
def swiglu_segment_tile(x_ptr, wg_ptr, wu_ptr, h_ptr, x_desc, wg_desc, wu_desc, start, n, e,
                        pid_m, pid_n, I, H, stride_xm, stride_xk, stride_we, stride_wk,
                        stride_wn, stride_hm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr,
                        PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_DESC: tl.constexpr):
    """Tile (pid_m, pid_n) of one segment: ``h[start + i, j]`` of the module docstring for
    the segment's rows ``start .. start + n`` of ``x`` (all of expert ``e``), computed and
    stored. Pointer loads read no row outside the segment; descriptor loads may read rows past
    its end, whose products are never stored (so those rows need not be there yet)."""
    if USE_DESC:
        g, u = gemm_tile_pair_desc(x_desc, wg_desc, wu_desc, start + pid_m * BLOCK_M, e * H,
                                   pid_n * BLOCK_N, H, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES,
                                   PRECISION)
    else:
        g, u = gemm_tile_pair(x_ptr + start.to(tl.int64) * stride_xm,
                              wg_ptr + tl.cast(e, tl.int64) * stride_we,
                              wu_ptr + tl.cast(e, tl.int64) * stride_we, n, I, H, stride_xm,
                              stride_xk, stride_wk, stride_wn, pid_m, pid_n, BLOCK_M, BLOCK_N,
                              BLOCK_K, NUM_STAGES, EVEN_K, PRECISION, UPCAST)
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    store_swiglu(g, u, start + offs, offs < n, cols, h_ptr, I, stride_hm)


@triton.jit
def store_swiglu(g, u, rows, valid, cols, h_ptr, I, stride_hm):
    """The epilogue: ``silu(g) * u`` in float32, stored in h's dtype at ``rows`` x ``cols``
    (the rows where ``valid``, the columns below I)."""
    h = g / (1.0 + tl.exp(-g)) * u
    ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hm + cols[None, :]
    tl.store(ptrs, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & (cols < I)[None, :])


@triton.jit
def _row_tiles(c_e, BLOCK_M: tl.constexpr, BLOCK_SRC: tl.constexpr, GATHER: tl.constexpr):
    """Row tiles of one expert per source: per-source tiles, or (``GATHER``) all of the
    expert's rows in the first source's place (its tiles hold every source's rows)."""
    if GATHER:
        n = tl.sum(c_e)
        return tl.where(tl.arange(0, BLOCK_SRC) == 0, (n + BLOCK_M - 1) // BLOCK_M, 0)
    return (c_e + BLOCK_M - 1) // BLOCK_M
