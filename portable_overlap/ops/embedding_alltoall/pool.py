"""The pooled row gather: ``acc[BLOCK_B, BLOCK_D]`` = sum (or mean) of the embedding rows of
BLOCK_B bags of one table, accumulated in float32.

Bag ``b`` of the tile reads ``indices[offsets[b] : offsets[b + 1]]``; row ``i`` of the table is
``weight[(row_base + i) * D : ... + D]`` (tables packed one after another in one flat buffer).
Each loop step loads the k-th and (k+1)-th index of every bag of the tile and gathers 2·BLOCK_B
D-wide rows at once: that many independent row loads in flight per program (32 KB for 32 bags of
D = 128 fp32), which is what keeps a gather bound by memory rather than by latency. Rows are
summed in bag order (as F.embedding_bag does). Address math is int64:
row · D overflows int32 past 16 M rows at D = 128.

Indices are checked before a tile is pooled: ``indices_outside`` reads the tile's index range
(one contiguous range, its bags being consecutive) against the table's row count in a coalesced
1-D pass, one unsigned compare per index, and a tile with a bad index is not pooled at all. The
data checks on the host are optional (a sync), so this is what keeps a bad index from reading
another table's rows or faulting. Measured on one H200, the lookup alone at the embedding
benchmark's shapes against no check (``benchmarks/probe_embedding_check.py``, logs in
benchmarks/results/logs/2026-11-23-h200-embedding-check): this scan costs 0.91-1.19x; folding
the check into the gather (a bad index reads row 0 and flags its bag or its program) 0.99-1.02x
at D = 64 but 1.04-2.4x at D = 128; masking bad rows in the gather 0.92-1.8x; loading the next
tile's indices during the current gather 1.1-1.8x (they stay in registers across it). In the
fused op on 2 H200 (logs in benchmarks/results/logs/2026-11-24-h200-embedding-moe), four loads per
scan step instead of one (five steps to two for 128 bags of 20) measured the same: 0.658 vs
0.656 ms fp32, 0.375 vs 0.375 ms fp16 at D = 64, so the scan's round trips are not its cost. In the
fused kernel the scan's cost is mostly registers: fp16 D = 128 goes from 48 to 64 (5 to 4
resident programs per SM), which the op wins back with a register cap (``more_resident``).

Kept in this op's folder until a second op needs it; then it moves to ``portable_overlap/tiles``.
"""
import triton
import triton.language as tl


SCAN = tl.constexpr(512)  # indices per step of the check (4 KB of int64: 4 per thread at 4 warps)


@triton.jit
def indices_outside(indices_ptr, lo, hi, n_rows):
    """How many of ``indices[lo:hi]`` lie outside ``[0, n_rows)``: one unsigned compare per
    index (a negative one is huge as unsigned) and one counter per lane, nothing else carried
    from step to step (``first_outside`` finds one of them when there are any)."""
    r = tl.arange(0, SCAN)
    n_bad = tl.zeros((SCAN,), dtype=tl.int32)
    limit = n_rows.to(tl.uint64)
    c = lo
    while c < hi:  # data-dependent trip count
        m = c + r < hi
        i = tl.load(indices_ptr + c + r, mask=m, other=0).to(tl.int64)
        n_bad += (m & (i.to(tl.uint64) >= limit)).to(tl.int32)
        c += SCAN
    return tl.sum(n_bad, axis=0)


@triton.jit
def first_outside(indices_ptr, lo, hi, n_rows):
    """The first index of ``indices[lo:hi]`` outside ``[0, n_rows)`` (0 if none): the report's
    example, read again only on the path that fails the call."""
    r = tl.arange(0, SCAN)
    limit = n_rows.to(tl.uint64)
    first = tl.zeros((), dtype=tl.int64)
    found = tl.zeros((), dtype=tl.int1)
    c = lo
    while (c < hi) & (found == 0):
        m = c + r < hi
        i = tl.load(indices_ptr + c + r, mask=m, other=0).to(tl.int64)
        out = m & (i.to(tl.uint64) >= limit)
        lane = tl.min(tl.where(out, r, SCAN), axis=0)
        if lane < SCAN:
            first = tl.sum(tl.where(r == lane, i, 0), axis=0)
            found = True
        c += SCAN
    return first


@triton.jit
def pooled_rows(weight_ptr, row_base, indices_ptr, psw_ptr, offsets_ptr, bag0, n_bags, D,
                BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
                MEAN: tl.constexpr):
    """Pool bags ``bag0 .. bag0 + n_bags - 1`` (n_bags <= BLOCK_B) of the table whose first row
    is ``row_base``; masked rows stay zero. The indices must be inside the table (checked
    before, ``indices_outside``)."""
    b = tl.arange(0, BLOCK_B)
    live_bag = b < n_bags
    start = tl.load(offsets_ptr + bag0 + b, mask=live_bag, other=0)
    n = tl.load(offsets_ptr + bag0 + b + 1, mask=live_bag, other=0) - start
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    acc = tl.zeros((BLOCK_B, BLOCK_D), dtype=tl.float32)
    longest = tl.max(n, axis=0)
    k = 0
    # Two indices of every bag per step: both gathers are issued before either is summed, so
    # 2·BLOCK_B rows are in flight instead of one index-then-row dependency chain per row.
    while k < longest:  # data-dependent trip count: the longest bag of this tile
        live0 = k < n
        live1 = k + 1 < n
        i0 = tl.load(indices_ptr + start + k, mask=live0, other=0).to(tl.int64)
        i1 = tl.load(indices_ptr + start + k + 1, mask=live1, other=0).to(tl.int64)
        # masks built 2-D (a broadcast 1-D mask trips Triton 3.6's layout pass in this loop)
        m0 = (k < n[:, None]) & col_ok[None, :]
        m1 = (k + 1 < n[:, None]) & col_ok[None, :]
        r0 = tl.load(weight_ptr + ((row_base + i0) * D)[:, None] + cols[None, :], mask=m0,
                     other=0.0).to(tl.float32)
        r1 = tl.load(weight_ptr + ((row_base + i1) * D)[:, None] + cols[None, :], mask=m1,
                     other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            w0 = tl.load(psw_ptr + start + k, mask=live0, other=0.0).to(tl.float32)
            w1 = tl.load(psw_ptr + start + k + 1, mask=live1, other=0.0).to(tl.float32)
            r0 = r0 * w0[:, None]
            r1 = r1 * w1[:, None]
        acc += r0
        acc += r1
        k += 2
    if MEAN:  # an empty bag pools to zeros, as torch.nn.functional.embedding_bag does
        acc = acc / tl.maximum(n, 1).to(tl.float32)[:, None]
    return acc
