"""Tiles split into ranges of K steps: the parts' float32 partials in a workspace slot each, a
count per tile, and the program that completes the count sums the parts.

A persistent grid runs its tiles in rounds, one tile per program; where a call has fewer tiles
than programs (a small M x N over a long K: a decode step's GEMM) or leaves a last round mostly
empty, the idle programs would wait for a few long K loops. Cut into ``parts`` ranges of K
steps, a tile is computed by ``parts`` programs side by side. Each stores its partial in its
own slot (``store_part``) and counts itself done on the tile (``count_part``: acquire-release
at GPU scope, after a CTA barrier, so the count's release carries every thread's stores); the
part that completes the count reads the tile's slots in the ranges' order (``sum_parts``), so
the bits do not depend on which part finished last, and zeroes the count for the next call.
A part that gives up on a call (a peer failed) still counts itself, marked, so the count is
whole for the next call and the part that completes it knows the sum is not.
No program waits for another, so the CPU interpreter, which runs programs one after another,
runs it as it is.
"""
import triton
import triton.language as tl


#: what a part that did not compute its range adds to the count beside its 1
_FAILED = tl.constexpr(1 << 16)


@triton.jit
def store_part(ws_ptr, slot, x, SLOT: tl.constexpr, OFFSET,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The float32 [BLOCK_M, BLOCK_N] tile ``x`` into slot ``slot`` of ``ws`` (slots of
    ``SLOT`` elements; the tile at ``OFFSET`` elements in it: a slot may hold several tiles)."""
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(ws_ptr + tl.cast(slot, tl.int64) * SLOT + OFFSET + offs, x)


@triton.jit
def count_part(done_ptr, j, parts, ok):
    """Count one part of tile ``j`` done (``done[j]``), ``ok`` whether it computed its range
    (a part that gave up on the call counts too, so the count is whole for the next call).
    Returns ``(last, whole)``: whether this part completed the tile, and whether every part
    of it computed its range. Call it after the part's ``store_part`` calls; the last part
    must call ``clear_count`` once it has read the slots."""
    tl.debug_barrier()  # every thread's stores before the (cumulative) release
    n = tl.atomic_add(done_ptr + j, tl.where(ok, 1, 1 + _FAILED), sem="acq_rel", scope="gpu")
    last = (n & (_FAILED - 1)) == parts - 1
    if last:
        tl.debug_barrier()  # the acquiring thread's view becomes the program's
    return last, ok & (n < _FAILED)


@triton.jit
def sum_parts(ws_ptr, first, parts, SLOT: tl.constexpr, OFFSET,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The sum of the tiles at ``OFFSET`` in slots ``first, first + 1, ... first + parts - 1``
    of ``ws``, in that order (float32)."""
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for p in range(0, parts):  # (slots written by other processors: read past L1)
        src = ws_ptr + tl.cast(first + p, tl.int64) * SLOT + OFFSET
        total += tl.load(src + offs, cache_modifier=".cg")
    return total


@triton.jit
def clear_count(done_ptr, j):
    """Zero tile ``j``'s count for the next call (the last part, after its ``sum_parts``)."""
    tl.atomic_xchg(done_ptr + j, 0, sem="relaxed", scope="gpu")
