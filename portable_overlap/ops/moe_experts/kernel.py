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

Packed experts (``PACK``). At decode sizes each source sends an expert a few rows, and a row
tile per source is mostly empty: 128 tokens per rank of top-8 over 16 experts on 8 ranks give
segments of about 64 rows, so half of them take a second 64-row tile for a few rows. A packed
expert's rows of all sources sit end to end in a second buffer, copied there by
``pack_rows_kernel`` (a launch before this one), and its row tiles are the packed rows' (full
tiles, loaded as any segment's: through descriptors where the device has them); the epilogue
stores each row back at its place in the dispatch layout (``row_map``). Which experts are
packed is decided on the device by both launches alike (``expert_layout``): those whose row
tiles packing halves.

Tiles chosen on the device (``VARIANT``). At decode sizes the best tiles depend on how many
rows the call's segments hold, which only the device knows: the host then launches the kernel
twice, with light tiles (``VARIANT`` 1, few rows per segment) and heavy ones (2), and each
launch computes the call's mean rows per non-empty segment and runs every tile or none
(``api.decode_variants``).

The last round split (``SPLIT``). Where the tile count leaves the grid's last round at most half
full, that round's tiles are cut into ranges of K steps run by the idle programs; the program
that completes a tile sums the ranges' float32 partials in order and applies the epilogue
(``SPLIT_NOTE``).
"""
import triton
import triton.language as tl

from ...tiles.gemm import gemm_tile_pair, gemm_tile_pair_desc, grouped_tile
from ...tiles.split import clear_count, count_part, store_part, sum_parts


@triton.jit
def expert_layout(counts_ptr, n_src, E, cap, BLOCK_M: tl.constexpr, BLOCK_SRC: tl.constexpr,
                  BLOCK_E: tl.constexpr, PACK: tl.constexpr):
    """The rows of each (source, expert) segment and which experts are packed, as both launches
    see them: ``(c2, n_e, packed, pstart)`` with ``c2`` [BLOCK_SRC, BLOCK_E] the counts,
    ``n_e`` [BLOCK_E] each expert's rows, ``packed`` [BLOCK_E] whether they go to the packed
    buffer and ``pstart`` [BLOCK_E] where they start there. ``PACK`` 1: the experts whose
    per-source row tiles are at least twice their packed ones; 2: every expert with rows.
    Fewer tiles by a third did not pay: at a DeepSeek-like decode layout packing cut 256 tiles
    of 128 rows to 160 and the GEMM ran no faster on one H200, with the copy on top
    (``api.pack_rows``). Experts are packed in order while they fit in the buffer's ``cap``
    rows; the rest keep their per-source tiles."""
    q = tl.arange(0, BLOCK_SRC)[:, None]
    e = tl.arange(0, BLOCK_E)[None, :]
    c2 = tl.load(counts_ptr + q * E + e, mask=(q < n_src) & (e < E), other=0)
    n_e = tl.sum(c2, axis=0)
    if PACK == 2:
        want = n_e > 0
    else:
        want = (n_e > 0) & (tl.sum((c2 + BLOCK_M - 1) // BLOCK_M, axis=0)
                            >= 2 * ((n_e + BLOCK_M - 1) // BLOCK_M))
    fits = tl.cumsum(tl.where(want, n_e, 0), axis=0) <= cap  # (monotone: a prefix of `want`)
    packed = want & fits
    own = tl.where(packed, n_e, 0)
    return c2, n_e, packed, tl.cumsum(own, axis=0) - own


@triton.jit
def pack_rows_kernel(x_ptr, counts_ptr, p_ptr, map_ptr, H, n_src, E, cap, n_rows, stride_xm,
                     stride_xk, stride_pm, BLOCK_M: tl.constexpr, BLOCK_SRC: tl.constexpr,
                     BLOCK_E: tl.constexpr, PACK: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_H: tl.constexpr):
    """Copy the packed experts' rows (``expert_layout``) from ``x`` to ``p`` [cap, H], expert
    by expert and source by source inside an expert, and record each packed row's row of ``x``
    in ``row_map`` [cap]; ``BLOCK_R`` rows per step, the programs striding over them. Rows of
    ``x`` past its ``n_rows`` (counts that name more rows than ``x`` has: a caller's error) are
    not read."""
    c2, n_e, packed, pstart = expert_layout(counts_ptr, n_src, E, cap, BLOCK_M, BLOCK_SRC,
                                            BLOCK_E, PACK)
    # per segment (q, e): where it starts in x (sources in order, experts inside a source) and
    # in p (experts in order, sources inside an expert), flattened to one lane per segment
    per_q = tl.sum(c2, axis=1)
    x0 = (tl.cumsum(per_q, axis=0) - per_q)[:, None] + tl.cumsum(c2, axis=1) - c2
    p0 = pstart[None, :] + tl.cumsum(c2, axis=0) - c2
    n_seg: tl.constexpr = BLOCK_SRC * BLOCK_E
    c = tl.reshape(c2, (n_seg,))
    x0 = tl.reshape(x0, (n_seg,))
    p0 = tl.reshape(p0, (n_seg,))
    on = tl.reshape(packed[None, :] & (c2 > 0), (n_seg,))
    total = tl.sum(tl.where(packed, n_e, 0))
    offs_h = tl.arange(0, BLOCK_H)
    for r0 in range(tl.program_id(0) * BLOCK_R, total, tl.num_programs(0) * BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        live = r < total
        hit = on[None, :] & (p0[None, :] <= r[:, None]) & (r[:, None] < (p0 + c)[None, :])
        src = tl.sum(tl.where(hit, (x0 - p0)[None, :], 0), axis=1) + r  # the row of x
        tl.store(map_ptr + r, src, mask=live)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + offs_h
            m = live[:, None] & (h < H)[None, :]
            v = tl.load(x_ptr + src[:, None].to(tl.int64) * stride_xm + h[None, :] * stride_xk,
                        mask=m & (src < n_rows)[:, None], other=0.0)
            tl.store(p_ptr + r[:, None].to(tl.int64) * stride_pm + h[None, :], v, mask=m)


# (the rows of x are the caller's buffer's, fixed from call to call: not specialized on, so a
# buffer of one row compiles the same code)
@triton.jit(do_not_specialize=["n_rows"])
def expert_swiglu_kernel(
    x_ptr, wg_ptr, wu_ptr, counts_ptr, h_ptr, x_desc, wg_desc, wu_desc,
    p_ptr, p_desc, map_ptr, cap,  # the packed rows and their rows in x (PACK only)
    ws_ptr, done_ptr,  # float32 [programs, 2, BLOCK_M, BLOCK_N] partials, int32 [programs] (SPLIT)
    light_rows,  # VARIANT: the most rows per segment of the call that the light tiles take
    n_rows,  # rows of x and h: counts that are not rows of x make every segment empty
    I, H, n_seg, E, stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_hm, stride_pm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, USE_DESC: tl.constexpr, BLOCK_SEG: tl.constexpr,
    BLOCK_SRC: tl.constexpr, BLOCK_E: tl.constexpr, PACK: tl.constexpr,
    VARIANT: tl.constexpr, SPLIT: tl.constexpr,
):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    n_src = n_seg // E
    num_pid_n = tl.cdiv(I, BLOCK_N)
    segs = tl.arange(0, BLOCK_SEG)
    cnt = tl.load(counts_ptr + segs, mask=segs < n_seg, other=0)
    srcs = tl.arange(0, BLOCK_SRC)
    experts = tl.arange(0, BLOCK_E)
    packed = experts < 0  # (no expert packed unless PACK says)
    pstart = experts * 0
    if PACK:
        c2, n_e, packed, pstart = expert_layout(counts_ptr, n_src, E, cap, BLOCK_M, BLOCK_SRC,
                                                BLOCK_E, PACK)
        # an expert's row tiles: per source, or (packed) its rows' together
        tiles_e = tl.where(packed, (n_e + BLOCK_M - 1) // BLOCK_M,
                           tl.sum((c2 + BLOCK_M - 1) // BLOCK_M, axis=0))
        total = tl.sum(tiles_e) * num_pid_n
    else:
        total = tl.sum((cnt + BLOCK_M - 1) // BLOCK_M) * num_pid_n
    if VARIANT:  # one of two launches with other tiles: this one runs the call or nothing
        light = tl.sum(cnt) <= light_rows * tl.sum((cnt > 0).to(tl.int32))
        total = tl.where(light == (VARIANT == 1), total, 0)
    # counts that are not rows of x (a negative one, or more rows than x has: a caller's error)
    # run no tile, so none reads past x or stores past h (h's rows are left as they are)
    total = tl.where((tl.min(cnt) >= 0) & (tl.sum(cnt) <= n_rows), total, 0)
    # the tiles of the last, partial round of the grid, cut in `parts` ranges of K steps
    # (SPLIT_NOTE); the rounds before run whole tiles
    k_steps = tl.cdiv(H, BLOCK_K)
    parts = 1
    if SPLIT:
        parts = split_parts(total % G, G, k_steps, BLOCK_M, BLOCK_N, NUM_STAGES)
    whole = tl.where(parts > 1, total - total % G, total)
    # the walk's cursor (monotone in t): expert, its first tile, its row tiles over all sources
    # (per source, and their running sum), its tile count
    e = -1
    e_t0 = 0
    e_nt = 0
    c_e = srcs * 0
    mt_q = srcs * 0
    cum = srcs * 0
    packed_e = pid < 0
    for t in range(pid, whole, G):
        e, e_t0, e_nt, c_e, mt_q, cum, packed_e = _walk_to(
            t, e, e_t0, e_nt, c_e, mt_q, cum, packed_e, counts_ptr, packed, experts, srcs, n_src,
            E, num_pid_n, BLOCK_M, BLOCK_SRC, PACK)
        # row tile vm of the expert's sources laid end to end (grouped order: GROUP_M row
        # tiles per weight column block, so at decode sizes every source's rows of the expert
        # read a column block of its weights together, from L2 after the first)
        vm, pid_n = grouped_tile(t - e_t0, tl.sum(mt_q), num_pid_n, GROUP_M)
        g, u, rows, valid = _gated_tile(
            x_ptr, wg_ptr, wu_ptr, x_desc, wg_desc, wu_desc, p_ptr, p_desc, map_ptr, packed_e,
            pstart, experts, cnt, segs, c_e, mt_q, cum, srcs, e, vm, pid_n, 0, H, I, H, E,
            stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_pm, BLOCK_M, BLOCK_N,
            BLOCK_K, NUM_STAGES, EVEN_K, PRECISION, UPCAST, USE_DESC, PACK)
        store_swiglu(g, u, rows, valid, pid_n * BLOCK_N + tl.arange(0, BLOCK_N), h_ptr, I,
                     stride_hm)
    if SPLIT:
        if pid < (total - whole) * parts:  # this program's part of a last-round tile
            j = pid // parts
            t = whole + j
            e, e_t0, e_nt, c_e, mt_q, cum, packed_e = _walk_to(
                t, e, e_t0, e_nt, c_e, mt_q, cum, packed_e, counts_ptr, packed, experts, srcs,
                n_src, E, num_pid_n, BLOCK_M, BLOCK_SRC, PACK)
            vm, pid_n = grouped_tile(t - e_t0, tl.sum(mt_q), num_pid_n, GROUP_M)
            span = tl.cdiv(k_steps, parts) * BLOCK_K
            k_lo = (pid % parts) * span
            g, u, rows, valid = _gated_tile(
                x_ptr, wg_ptr, wu_ptr, x_desc, wg_desc, wu_desc, p_ptr, p_desc, map_ptr,
                packed_e, pstart, experts, cnt, segs, c_e, mt_q, cum, srcs, e, vm, pid_n, k_lo,
                tl.minimum(k_lo + span, H), I, H, E, stride_xm, stride_xk, stride_we, stride_wk,
                stride_wn, stride_pm, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, EVEN_K, PRECISION,
                UPCAST, USE_DESC, PACK)
            _sum_parts(g, u, rows, valid, pid_n, ws_ptr, done_ptr, pid, j, parts, h_ptr, I,
                       stride_hm, BLOCK_M, BLOCK_N)


#: SPLIT_NOTE: a persistent grid runs its tiles in rounds, one tile per program, and at decode
#: sizes each tile's K loop is long (H = 7168: 112 steps), so a last round of a few tiles costs
#: a whole tile's time while most programs idle: on one H200 a DeepSeek-like decode layout's
#: 160 packed 128 x 128 tiles took as long as 256 (two rounds each), their tensor pipes busy
#: 52 % of the elapsed cycles against 90 % of the active ones (Nsight Compute,
#: benchmarks/profile_decode_experts.py). The last round's tiles are cut into ``parts`` ranges
#: of K steps, one per idle program; each stores its float32 partials, and the program that
#: completes a tile's count sums them in the ranges' order (the same bits whichever finishes
#: last) and applies the epilogue: 162.8 -> 133.7 µs there, pack launch included. Nothing
#: waits for another program, so the interpreter runs it as it is.
#: A part reads at least SPLIT_MIN_STEPS K steps (and the pipeline's depth), and the finisher
#: reads ``parts`` partials of 8 * BLOCK_M * BLOCK_N bytes: at most SPLIT_BYTES in all.
SPLIT_MIN_STEPS = tl.constexpr(2)
SPLIT_BYTES = tl.constexpr(1 << 19)


@triton.jit
def split_parts(tail, G, k_steps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                NUM_STAGES: tl.constexpr):
    """How many ranges of K steps each of the ``tail`` tiles of the last round is cut into
    (1: none): as many as the idle programs allow, each ``SPLIT_MIN_STEPS`` steps or more (and
    the pipeline's depth), their partials together ``SPLIT_BYTES`` at most."""
    most: tl.constexpr = max(2, SPLIT_BYTES // (8 * BLOCK_M * BLOCK_N))
    min_steps: tl.constexpr = max(SPLIT_MIN_STEPS, NUM_STAGES)
    parts = tl.maximum(tl.minimum(tl.minimum(G // tl.maximum(tail, 1), k_steps // min_steps),
                                  most), 1)
    # as many as ranges of cdiv(k_steps, parts) steps take: none left empty (9 steps in 4
    # would leave the fourth range none)
    parts = tl.cdiv(k_steps, tl.cdiv(k_steps, parts))
    return tl.where(tail > 0, parts, 1)


@triton.jit
def _sum_parts(g, u, rows, valid, pid_n, ws_ptr, done_ptr, pid, j, parts, h_ptr, I, stride_hm,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Part ``pid % parts`` of last-round tile ``j``: its float32 gate and up partials into
    slot ``pid`` of ``ws``, and if it completes the tile, the slots' sum in order through the
    epilogue (``tiles.split``)."""
    tile: tl.constexpr = BLOCK_M * BLOCK_N
    store_part(ws_ptr, pid, g, 2 * tile, 0, BLOCK_M, BLOCK_N)
    store_part(ws_ptr, pid, u, 2 * tile, tile, BLOCK_M, BLOCK_N)
    last, _ = count_part(done_ptr, j, parts, True)
    if last:
        g = sum_parts(ws_ptr, j * parts, parts, 2 * tile, 0, BLOCK_M, BLOCK_N)
        u = sum_parts(ws_ptr, j * parts, parts, 2 * tile, tile, BLOCK_M, BLOCK_N)
        store_swiglu(g, u, rows, valid, pid_n * BLOCK_N + tl.arange(0, BLOCK_N), h_ptr, I,
                     stride_hm)
        clear_count(done_ptr, j)


@triton.jit
def _walk_to(t, e, e_t0, e_nt, c_e, mt_q, cum, packed_e, counts_ptr, packed, experts, srcs,
             n_src, E, num_pid_n, BLOCK_M: tl.constexpr, BLOCK_SRC: tl.constexpr,
             PACK: tl.constexpr):
    """The walk's cursor moved on to the expert of tile ``t`` (``t`` at or past the cursor's;
    the caller's tile count bounds it, so the walk stays inside the experts): ``(e, its first
    tile, its tile count, its sources' rows, their row tiles, their running sum, whether it
    is packed)``. ``e`` = -1 with no tiles: before the first expert."""
    while t >= e_t0 + e_nt:
        e += 1
        e_t0 += e_nt
        c_e = tl.load(counts_ptr + srcs * E + e, mask=srcs < n_src, other=0)
        if PACK:
            packed_e = tl.sum(tl.where(experts == e, packed.to(tl.int32), 0)) > 0
        mt_q = _row_tiles(c_e, packed_e, BLOCK_M, BLOCK_SRC)
        cum = tl.cumsum(mt_q, axis=0)
        e_nt = tl.sum(mt_q) * num_pid_n
    return e, e_t0, e_nt, c_e, mt_q, cum, packed_e


@triton.jit
def _gated_tile(x_ptr, wg_ptr, wu_ptr, x_desc, wg_desc, wu_desc, p_ptr, p_desc, map_ptr,
                packed_e, pstart, experts, cnt, segs, c_e, mt_q, cum, srcs, e, vm, pid_n, k_lo,
                k_hi, I, H, E, stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_pm,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                UPCAST: tl.constexpr, USE_DESC: tl.constexpr, PACK: tl.constexpr):
    """Row tile ``vm`` of expert ``e`` (its packed rows' tile, or its per-source tile), column
    block ``pid_n``, over the K steps ``k_lo .. k_hi``: ``(gate, up, rows of h, valid)``."""
    if PACK:
        if packed_e:
            start = tl.sum(tl.where(experts == e, pstart, 0))
            n = tl.sum(c_e)
            g, u = segment_tile_pair(p_ptr, wg_ptr, wu_ptr, p_desc, wg_desc, wu_desc, start, n,
                                     e, vm, pid_n, k_lo, k_hi, I, H, stride_pm, 1, stride_we,
                                     stride_wk, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K,
                                     NUM_STAGES, EVEN_K, PRECISION, UPCAST, USE_DESC)
            offs = vm * BLOCK_M + tl.arange(0, BLOCK_M)
            valid = offs < n
            rows = tl.load(map_ptr + start + offs, mask=valid, other=0)
        else:
            g, u, rows, valid = _source_tile(
                x_ptr, wg_ptr, wu_ptr, x_desc, wg_desc, wu_desc, cnt, segs, c_e, mt_q, cum, srcs,
                e, vm, pid_n, k_lo, k_hi, I, H, E, stride_xm, stride_xk, stride_we, stride_wk,
                stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, EVEN_K, PRECISION, UPCAST,
                USE_DESC)
    else:
        g, u, rows, valid = _source_tile(
            x_ptr, wg_ptr, wu_ptr, x_desc, wg_desc, wu_desc, cnt, segs, c_e, mt_q, cum, srcs, e,
            vm, pid_n, k_lo, k_hi, I, H, E, stride_xm, stride_xk, stride_we, stride_wk,
            stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, EVEN_K, PRECISION, UPCAST,
            USE_DESC)
    return g, u, rows, valid


@triton.jit
def _source_tile(x_ptr, wg_ptr, wu_ptr, x_desc, wg_desc, wu_desc, cnt, segs, c_e, mt_q, cum,
                 srcs, e, vm, pid_n, k_lo, k_hi, I, H, E, stride_xm, stride_xk, stride_we,
                 stride_wk, stride_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_DESC: tl.constexpr):
    """Row tile ``vm`` of expert ``e``'s per-source tiles (``mt_q`` per source, ``cum`` their
    running sum): the tile of its source's segment, ``(gate, up, rows of h, valid)``."""
    q = tl.sum((cum <= vm).to(tl.int32))  # the source whose row tiles hold vm
    pid_m = vm - tl.sum(tl.where(srcs == q, cum - mt_q, 0))
    n = tl.sum(tl.where(srcs == q, c_e, 0))
    start = tl.sum(tl.where(segs < q * E + e, cnt, 0))  # rows of the segments before (q, e)
    g, u = segment_tile_pair(x_ptr, wg_ptr, wu_ptr, x_desc, wg_desc, wu_desc, start, n, e, pid_m,
                             pid_n, k_lo, k_hi, I, H, stride_xm, stride_xk, stride_we, stride_wk,
                             stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, EVEN_K, PRECISION,
                             UPCAST, USE_DESC)
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return g, u, start + offs, offs < n


@triton.jit
def segment_tile_pair(x_ptr, wg_ptr, wu_ptr, x_desc, wg_desc, wu_desc, start, n, e, pid_m,
                      pid_n, k_lo, k_hi, I, H, stride_xm, stride_xk, stride_we, stride_wk,
                      stride_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr,
                      PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_DESC: tl.constexpr):
    """The float32 gate and up tiles (pid_m, pid_n) of the rows ``start .. start + n`` of ``x``
    (all of expert ``e``), over the K steps ``k_lo .. k_hi`` (0 .. H: the whole product).
    Pointer loads read no row outside them; descriptor loads may read rows past their end,
    whose products are never stored (so those rows need not be there yet)."""
    if USE_DESC:
        g, u = gemm_tile_pair_desc(x_desc, wg_desc, wu_desc, start + pid_m * BLOCK_M, e * H,
                                   pid_n * BLOCK_N, k_lo, k_hi, BLOCK_M, BLOCK_N, BLOCK_K,
                                   NUM_STAGES, PRECISION)
    else:
        g, u = gemm_tile_pair(x_ptr + start.to(tl.int64) * stride_xm,
                              wg_ptr + tl.cast(e, tl.int64) * stride_we,
                              wu_ptr + tl.cast(e, tl.int64) * stride_we, n, I, k_lo, k_hi,
                              stride_xm, stride_xk, stride_wk, stride_wn, pid_m, pid_n, BLOCK_M,
                              BLOCK_N, BLOCK_K, NUM_STAGES, EVEN_K, PRECISION, UPCAST)
    return g, u


@triton.jit
def swiglu_segment_tile(x_ptr, wg_ptr, wu_ptr, h_ptr, x_desc, wg_desc, wu_desc, start, n, e,
                        pid_m, pid_n, I, H, stride_xm, stride_xk, stride_we, stride_wk,
                        stride_wn, stride_hm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr,
                        PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_DESC: tl.constexpr):
    """Tile (pid_m, pid_n) of one segment: ``h[start + i, j]`` of the module docstring for
    the segment's rows ``start .. start + n`` of ``x`` (all of expert ``e``), computed
    (``segment_tile_pair``) and stored."""
    g, u = segment_tile_pair(x_ptr, wg_ptr, wu_ptr, x_desc, wg_desc, wu_desc, start, n, e, pid_m,
                             pid_n, 0, H, I, H, stride_xm, stride_xk, stride_we, stride_wk,
                             stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, EVEN_K, PRECISION,
                             UPCAST, USE_DESC)
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
def _row_tiles(c_e, packed_e, BLOCK_M: tl.constexpr, BLOCK_SRC: tl.constexpr):
    """Row tiles of one expert per source: per-source tiles, or (``packed_e``) all of the
    expert's rows in the first source's place (its tiles hold every source's rows)."""
    per_source = (c_e + BLOCK_M - 1) // BLOCK_M
    together = tl.where(tl.arange(0, BLOCK_SRC) == 0, (tl.sum(c_e) + BLOCK_M - 1) // BLOCK_M, 0)
    return tl.where(packed_e, together, per_source)
