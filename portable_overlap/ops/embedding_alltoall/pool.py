"""The pooled row gather: ``acc[BLOCK_B, BLOCK_D]`` = sum (or mean) of the embedding rows of
BLOCK_B bags of one table, accumulated in float32.

Bag ``b`` of the tile reads ``indices[offsets[b] : offsets[b + 1]]``; row ``i`` of the table is
``weight[(row_base + i) * D : ... + D]`` (tables packed one after another in one flat buffer).
Each loop step loads the k-th and (k+1)-th index of every bag of the tile and gathers 2·BLOCK_B
D-wide rows at once: that many independent row loads in flight per program (32 KB for 32 bags of
D = 128 fp32), which is what keeps a gather bound by memory rather than by latency. Rows are
summed in bag order (as F.embedding_bag does). Address math is int64:
row · D overflows int32 past 16 M rows at D = 128.

Every index is checked against the table's row count before its row is loaded (one unsigned
compare per index, folded into the row load's mask, plus two selects to remember it; no extra
memory traffic next to the D-wide row): an index outside the table reads nothing and is returned
to the caller, which reports it. The data checks on the host are optional (a sync), so this is
what keeps a bad index from reading another table's rows or faulting.

Kept in this op's folder until a second op needs it; then it moves to ``portable_overlap/tiles``.
"""
import triton
import triton.language as tl


@triton.jit
def pooled_rows(weight_ptr, row_base, n_rows, indices_ptr, psw_ptr, offsets_ptr, bag0, n_bags,
                D, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
                MEAN: tl.constexpr):
    """Pool bags ``bag0 .. bag0 + n_bags - 1`` (n_bags <= BLOCK_B) of a table of ``n_rows`` rows
    starting at row ``row_base``; masked rows stay zero. Returns ``(acc, n_bad, bad)``:
    ``n_bad`` indices were outside ``[0, n_rows)`` (not read), ``bad`` is one of them."""
    b = tl.arange(0, BLOCK_B)
    live_bag = b < n_bags
    start = tl.load(offsets_ptr + bag0 + b, mask=live_bag, other=0)
    n = tl.load(offsets_ptr + bag0 + b + 1, mask=live_bag, other=0) - start
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    acc = tl.zeros((BLOCK_B, BLOCK_D), dtype=tl.float32)
    longest = tl.max(n, axis=0)
    n_bad = tl.zeros((BLOCK_B,), dtype=tl.int32)  # per bag: indices outside the table
    bad = tl.zeros((BLOCK_B,), dtype=tl.int64)  # per bag: the last of them
    k = 0
    # Two indices of every bag per step: both gathers are issued before either is summed, so
    # 2·BLOCK_B rows are in flight instead of one index-then-row dependency chain per row.
    while k < longest:  # data-dependent trip count: the longest bag of this tile
        live0 = k < n
        live1 = k + 1 < n
        i0 = tl.load(indices_ptr + start + k, mask=live0, other=0).to(tl.int64)
        i1 = tl.load(indices_ptr + start + k + 1, mask=live1, other=0).to(tl.int64)
        # one unsigned compare per index (a negative one is huge); masked-off lanes hold 0,
        # inside (every table has a row)
        in0 = i0.to(tl.uint64) < n_rows.to(tl.uint64)
        in1 = i1.to(tl.uint64) < n_rows.to(tl.uint64)
        n_bad += (~in0).to(tl.int32) + (~in1).to(tl.int32)
        bad = tl.where(in1, tl.where(in0, bad, i0), i1)
        # masks built 2-D (a broadcast 1-D mask trips Triton 3.6's layout pass in this loop)
        m0 = (k < n[:, None]) & col_ok[None, :] & in0[:, None]
        m1 = (k + 1 < n[:, None]) & col_ok[None, :] & in1[:, None]
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
    first = tl.min(tl.where(n_bad > 0, b, BLOCK_B), axis=0)  # the first bag with one
    return acc, tl.sum(n_bad, axis=0), tl.sum(tl.where(b == first, bad, 0), axis=0)
