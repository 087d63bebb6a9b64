"""Fused GEMV + AllReduce: one persistent Triton kernel, a direct all-reduce by stores in two
phases (the ``"stores"`` transport) or one (``"one_shot"``).

Output columns are cut into blocks of BLOCK_N; block ``b`` is the ``i``-th block of program
``pid = b % G`` (``i = b // G``) and is *owned* by rank ``(i + pid) % world``, so every program
owns about 1/world of its blocks and the owners are spread over the programs. Program ``pid`` of
every rank handles the same blocks, which is what makes one flag per (program, peer) enough.

On rank r, program pid:

1. computes the partial ``x_r @ W_rᵀ`` of the blocks other ranks own, first (communication-aware
   order), and stores each fp32 tile straight into the owner's ``partial[r]`` slot in the owner's
   heap (zero-copy: no staging buffer, no copy kernel);
2. signals ``ready[r][pid]`` on every peer (release, after a CTA barrier);
3. computes the blocks it owns and keeps its own partial in ``partial[r]`` of its own heap;
4. waits (acquire, bounded) for ``ready[q][pid]`` of every peer q, sums ``partial[0..world-1]``
   in that fixed order, casts, and stores the result to its output and into every peer's
   ``result`` buffer; signals ``bcast[r][pid]`` on every peer;
5. waits for ``bcast[q][pid]`` of every peer and copies the blocks peers own from ``result`` to
   the output.

Every rank ends with the same bits: each block is summed once, by its owner, in rank order.

With ``ONE_SHOT`` (the ``"one_shot"`` transport) there is no owner and no second round: program
pid of rank r stores the partial of each of its blocks into ``partial[r]`` of every rank's heap
(its own included), signals ``ready[r][pid]`` on every peer, waits for every peer's, and sums the
``world`` partials of its blocks in rank order (so every rank still ends with the same bits).
One flag round instead of two, for ``world`` times the partial stores and the reduction work:
what a latency-bound decode step on many ranks wants. The partials of consecutive calls go to
the two halves of ``partial`` by the call's parity: a peer may still be reducing call c when
this rank starts call c + 1, but it has finished call c before it signals call c + 1, which this
rank waits for before call c + 2 writes that half again (in call c + 1, or at the start of call
c + 2 where this rank refused call c + 1 on the host). A peer's refusal is read from ``bcast``,
which no one-shot call writes (``_wait_ready``).

The one-shot form can also split K (``SPLIT_K`` = ``GemvConfig.split_k`` > 1): where N has
fewer column blocks than the device has SMs, the K loop of each block is cut into ``SPLIT_K``
slices of whole ``BLOCK_K`` steps, one program each, so the grid is exactly ``n_blocks *
SPLIT_K`` programs (no persistent loop). Program pid computes slice ``s = pid % SPLIT_K`` of
block ``b = pid // SPLIT_K`` (a short K leaves the last slices empty: partials of zeros) and
stores it as slice s of ``partial[r]``, now ``[SPLIT_K, M, N]``, in every rank's heap; it
signals ``ready[r][pid]`` on every peer, and the block's other slices also set this rank's own
word ``ready[r][pid]``. The last program of the group, pid ``b * SPLIT_K + SPLIT_K - 1``, reduces
the block: it waits for the peers' flags of the group's programs and for the local flags of
its own rank's other slices (programs of its own launch: the plan only splits where the whole
grid is resident at once, and the interpreter runs programs in pid order, so the waiting
program runs last), then sums the ``world * SPLIT_K`` partials rank-major, slice after slice
(the same order, and bits, on every rank). The wait on the peers' program 0 flags before the
first store (``_half_free``), the refusal check and the end of the call are the one-shot
form's.

Written on the public device API (``portable_overlap.language``): flags carry the call number
(counted on the device, so a CUDA graph replays unchanged) and the shape tag, and every wait is
bounded and reported by the flag it waited for.
"""
import triton
import triton.language as tl

from ... import language as pol
from ...tiles.gemv import gemv_tile

#: the flags' names in timeout reports (the reports name a flag by its heap buffer)
FLAG_LABELS = {"ready": "partials-ready", "bcast": "result-broadcast"}


@triton.jit
def _refresh_words(ctx, ready_ptr, bcast_ptr, G, call, tag, G_MAX: tl.constexpr,
                   ONE_SHOT: tl.constexpr):
    """``pol.refresh_words`` of the flag words no program of the grid writes: this rank's
    ``ready`` and ``bcast`` words of programs ``G`` and up (``ready`` in its own heap too: the
    K split's slices wait there), and with ``ONE_SHOT`` its ``bcast`` words of every program
    (no one-shot call writes them). Without it a shape of 4 programs called again after 2**31
    calls of a shape of 1 summed partials its peer had not stored yet."""
    pol.refresh_words(ctx, ready_ptr, G, G_MAX, call, tag, OWN=True)
    if ONE_SHOT:
        pol.refresh_words(ctx, bcast_ptr, 0, G_MAX, call, tag)
    else:
        pol.refresh_words(ctx, bcast_ptr, G, G_MAX, call, tag)


@triton.jit
def _signal_peers(ctx, flags_ptr, pid, rank, call, ok, tag, G_MAX: tl.constexpr):
    """Set ``flags[rank][pid]`` in every peer's heap (a ``[world, G_MAX]`` flag array), every
    peer at once (``pol.signal_all``)."""
    pol.signal_all(ctx, flags_ptr + rank * G_MAX + pid, call, ok, tag)


@triton.jit
def _wait_peers(ctx, flags_ptr, pid, call, ok, tag, G_MAX: tl.constexpr):
    """Wait for ``flags[q][pid]`` of every peer q, all at once; ``ok`` and-ed with the outcome.
    Nothing is waited for once ``ok`` is false. The grid follows N (and the tiling), so a peer
    called with another N may have no program pid: ``pol.wait_program_peers`` then reports the
    mismatch from the peer's program 0 flag instead of timing out, and the context stays
    usable."""
    if ok:
        ok = pol.wait_program_peers(ctx, flags_ptr, pid, G_MAX, call, tag, LIVE_READ=True)
    return ok


@triton.jit
def gemv_allreduce_kernel(
    x_ptr, w_ptr, out_ptr,  # user tensors: x [M, K], w [N, K], out [M, N]
    partial_ptr, result_ptr,  # heap: fp32 [world, M, N] partials, [M, N] results (out dtype)
    ready_ptr, bcast_ptr, ctx,  # heap: int64 flags [world, G_MAX] x2; the device API's ctx
    M, N, K, stride_xm, stride_wn, n_blocks, G, tag,
    half_elems,  # the one-shot form's half of ``partial``: world x 64 x max_n, fixed per context
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, G_MAX: tl.constexpr,
    ONE_SHOT: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pid = tl.program_id(0)  # G == the grid size (an argument: loop bounds must not depend on
    #                         program_id, which the interpreter keeps as a 1-element array)
    call = pol.begin_call(ctx)
    rank = pol.rank(ctx)
    world = pol.num_ranks(ctx)
    # read once per launch: every wait below runs only while it holds (``LIVE_READ``: they do
    # not read it again)
    ok = pol.is_live(ctx)
    n_rounds = tl.cdiv(n_blocks, G)  # program pid takes blocks pid, pid + G, ... < n_blocks
    offs_m = tl.arange(0, BLOCK_M)
    offs_nb = tl.arange(0, BLOCK_N)
    m_mask = offs_m[:, None] < M
    MN = M * N
    tile_off = offs_m[:, None] * N + offs_nb[None, :]

    if SPLIT_K > 1:  # one-shot only (api._plan): one (column block, K slice) per program
        _one_shot_split(x_ptr, w_ptr, out_ptr, partial_ptr, ready_ptr, bcast_ptr, ctx, M, N, K,
                        stride_xm, stride_wn, tag, half_elems, pid, call, rank, world, ok,
                        offs_nb, m_mask, MN, tile_off, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES,
                        EVEN_K, EVEN_N, PRECISION, UPCAST, G_MAX, SPLIT_K)
    elif ONE_SHOT:
        _one_shot(x_ptr, w_ptr, out_ptr, partial_ptr, ready_ptr, bcast_ptr, ctx, M, N, K,
                  stride_xm, stride_wn, n_blocks, G, tag, half_elems, pid, call, rank, world, ok,
                  n_rounds, offs_nb, m_mask, MN, tile_off, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES,
                  EVEN_K, EVEN_N, PRECISION, UPCAST, G_MAX)
    else:
        _two_shot(x_ptr, w_ptr, out_ptr, partial_ptr, result_ptr, ready_ptr, bcast_ptr, ctx, M,
                  N, K, stride_xm, stride_wn, n_blocks, G, tag, pid, call, rank, world, ok,
                  n_rounds, offs_nb, m_mask, MN, tile_off, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES,
                  EVEN_K, EVEN_N, PRECISION, UPCAST, G_MAX)
    # the call counter, which each program advances after its stores (release at system scope)
    # and no program waits on: a peer that did not deliver the call reads it through the heap
    # before its next call reuses the buffers (OverlapContext.settle_late_stores). The words
    # no program of the grid writes, every 2**30 calls: at the end, where the tiles' registers
    # are free (at the start, the branch made the GEMV tile spill on sm_90)
    if (call & (pol.REFRESH_CALLS - 1)) == 0:
        _refresh_words(ctx, ready_ptr, bcast_ptr, G, call, tag, G_MAX, ONE_SHOT)
    pol.end_call(ctx, call)


@triton.jit
def _two_shot(x_ptr, w_ptr, out_ptr, partial_ptr, result_ptr, ready_ptr, bcast_ptr, ctx, M, N, K,
              stride_xm, stride_wn, n_blocks, G, tag, pid, call, rank, world, ok, n_rounds,
              offs_nb, m_mask, MN, tile_off, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr,
              EVEN_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
              G_MAX: tl.constexpr):
    """Steps 1-5 of the module docstring: partials to the owners, owners reduce and store the
    result into every rank."""
    # 1. blocks that peers own: compute first, store into the owner's partial[rank] (not once
    #    the context is out of step: ``ok`` only masks the stores, so the tile's loads do not
    #    wait for the atomic that reads it)
    for i in range(0, n_rounds):
        owner = (i + pid) % world
        if (owner != rank) & (pid + i * G < n_blocks):
            n0 = (pid + i * G) * BLOCK_N
            acc = gemv_tile(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, n0, BLOCK_M, BLOCK_N,
                            BLOCK_K, NUM_STAGES, EVEN_K, EVEN_N, PRECISION, UPCAST)
            pol.store_remote(ctx, partial_ptr + rank * MN + n0 + tile_off, acc, owner,
                             m_mask & ((n0 + offs_nb)[None, :] < N) & ok)
    # 2. tell every peer this program's partials for it have landed
    _signal_peers(ctx, ready_ptr, pid, rank, call, ok, tag, G_MAX)

    # 3. blocks this rank owns: own partial into the local slot (read back in step 4)
    for i in range(0, n_rounds):
        owner = (i + pid) % world
        if (owner == rank) & (pid + i * G < n_blocks):
            n0 = (pid + i * G) * BLOCK_N
            acc = gemv_tile(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, n0, BLOCK_M, BLOCK_N,
                            BLOCK_K, NUM_STAGES, EVEN_K, EVEN_N, PRECISION, UPCAST)
            dst = partial_ptr + rank * MN + n0
            tl.store(dst + tile_off, acc, mask=m_mask & ((n0 + offs_nb)[None, :] < N))

    # 4. reduce owned blocks in rank order, store locally and into every peer's result buffer
    ok = _wait_peers(ctx, ready_ptr, pid, call, ok, tag, G_MAX)
    if ok:
        for i in range(0, n_rounds):
            owner = (i + pid) % world
            if (owner == rank) & (pid + i * G < n_blocks):
                n0 = (pid + i * G) * BLOCK_N
                mask = m_mask & ((n0 + offs_nb)[None, :] < N)
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for q in range(0, world):
                    total += tl.load(partial_ptr + q * MN + n0 + tile_off, mask=mask, other=0.0)
                y = total.to(out_ptr.dtype.element_ty)
                tl.store(out_ptr + n0 + tile_off, y, mask=mask)
                for step in range(1, world):
                    pol.store_remote(ctx, result_ptr + n0 + tile_off, y,
                                     pol.peer_at(step, rank, world), mask)
    _signal_peers(ctx, bcast_ptr, pid, rank, call, ok, tag, G_MAX)

    # 5. blocks peers own: their reduced tiles arrived in result; copy them to the output
    ok = _wait_peers(ctx, bcast_ptr, pid, call, ok, tag, G_MAX)
    if ok:
        for i in range(0, n_rounds):
            owner = (i + pid) % world
            if (owner != rank) & (pid + i * G < n_blocks):
                n0 = (pid + i * G) * BLOCK_N
                mask = m_mask & ((n0 + offs_nb)[None, :] < N)
                y = tl.load(result_ptr + n0 + tile_off, mask=mask)
                tl.store(out_ptr + n0 + tile_off, y, mask=mask)


@triton.jit
def _wait_ready(ctx, ready_ptr, bcast_ptr, first, call, ok, tag, G_MAX: tl.constexpr,
                PROGRAMS: tl.constexpr, OWN: tl.constexpr):
    """The one-shot form's wait for the partials of programs ``first`` to ``first + PROGRAMS
    - 1`` of every peer (with ``OWN``, of this rank's other programs of them too: the K split's
    slices), ``ok`` and-ed with the outcome. A peer that refused the call on the host set its
    words of both flag arrays (``refuse_kernel``) and waited for nothing, so its next call may
    set the ``ready`` word before this rank read the refusal there: a later call's flag, which
    reads as "call delivered", and this rank would sum partials the peer never stored, with no
    error (seen on emulated ranks). No one-shot call writes ``bcast``: a refusal stays there,
    and where a ``ready`` word is past the call the wait judges the peers' ``bcast`` words too
    (``refusals_ptr``; one more load round trip, only then: a word that holds the call itself
    was set by the peer's launch of it)."""
    if ok:
        ok = pol.wait_program_peers(ctx, ready_ptr, first, G_MAX, call, tag, bcast_ptr,
                                    PROGRAMS=PROGRAMS, OWN=OWN, LIVE_READ=True)
    return ok


@triton.jit
def _half_free(ctx, ready_ptr, call, ok, G_MAX: tl.constexpr):
    """Wait until every peer is done reading this call's half of the one-shot partials, which
    call - 2 used: a peer's ready flag of call - 1 says so (its launch of call - 1 began after
    its launch of call - 2 ended: one stream). Program 0's flag, which every grid has (the
    grids of calls may differ). Waited for in call - 1 already, unless this rank refused call
    - 1 on the host, which waits for nothing (a late peer then summed this call's partials as
    call - 2's, with no error: seen on emulated ranks). ``ok`` and-ed with the outcome."""
    if ok:
        ok = pol.wait_peers_reached(ctx, ready_ptr, G_MAX, call - 1, call, LIVE_READ=True)
    return ok


@triton.jit
def _push_partial(ctx, dst, acc, rank, world, mask, ok):
    """Store a partial tile at ``dst`` of this rank's heap and of every peer's (peers in
    rotated order: every link busy at once); the peers' stores only while ``ok``."""
    tl.store(dst, acc, mask=mask)
    for step in range(1, world):
        pol.store_remote(ctx, dst, acc, pol.peer_at(step, rank, world), mask & ok)


@triton.jit
def _sum_partials(tile_ptr, slot, MN, world, mask, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  SPLIT_K: tl.constexpr):
    """The float32 sum of a block's ``world * SPLIT_K`` partials, ``tile_ptr`` pointing at
    rank 0's first (rank q's slice j at ``q * slot + j * MN``): rank-major, then K slice, the
    same order, and so the same bits, on every rank."""
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for q in range(0, world):
        for j in range(0, SPLIT_K):
            total += tl.load(tile_ptr + q * slot + j * MN, mask=mask, other=0.0)
    return total


@triton.jit
def _one_shot(x_ptr, w_ptr, out_ptr, partial_ptr, ready_ptr, bcast_ptr, ctx, M, N, K, stride_xm,
              stride_wn, n_blocks, G, tag, half_elems, pid, call, rank, world, ok, n_rounds,
              offs_nb, m_mask, MN, tile_off, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr,
              EVEN_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
              G_MAX: tl.constexpr):
    """The one-shot all-reduce of the module docstring: every partial to every rank, one flag
    round, every rank reduces all of its program's blocks."""
    # this call's half of the partials: halves of a fixed size, not of this call's, which
    # would let a call of fewer partials write into the last call's half, where a peer may
    # still be reading them
    half = partial_ptr + (call % 2) * half_elems
    for i in range(0, n_rounds):
        if pid + i * G < n_blocks:
            n0 = (pid + i * G) * BLOCK_N
            mask = m_mask & ((n0 + offs_nb)[None, :] < N)
            acc = gemv_tile(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, n0, BLOCK_M, BLOCK_N,
                            BLOCK_K, NUM_STAGES, EVEN_K, EVEN_N, PRECISION, UPCAST)
            # before the first store into this call's half (every program has a block: G <=
            # n_blocks), after the first tile's W stream, which the wait's round trips then
            # overlap instead of delaying
            if i == 0:
                ok = _half_free(ctx, ready_ptr, call, ok, G_MAX)
            _push_partial(ctx, half + rank * MN + n0 + tile_off, acc, rank, world, mask, ok)
    _signal_peers(ctx, ready_ptr, pid, rank, call, ok, tag, G_MAX)
    ok = _wait_ready(ctx, ready_ptr, bcast_ptr, pid, call, ok, tag, G_MAX, 1, False)
    if ok:
        for i in range(0, n_rounds):
            if pid + i * G < n_blocks:
                n0 = (pid + i * G) * BLOCK_N
                mask = m_mask & ((n0 + offs_nb)[None, :] < N)
                total = _sum_partials(half + n0 + tile_off, MN, MN, world, mask, BLOCK_M,
                                      BLOCK_N, 1)
                tl.store(out_ptr + n0 + tile_off, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _one_shot_split(x_ptr, w_ptr, out_ptr, partial_ptr, ready_ptr, bcast_ptr, ctx, M, N, K,
                    stride_xm, stride_wn, tag, half_elems, pid, call, rank, world, ok, offs_nb,
                    m_mask, MN, tile_off, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr,
                    EVEN_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                    G_MAX: tl.constexpr, SPLIT_K: tl.constexpr):
    """The one-shot all-reduce with K split ``SPLIT_K`` ways (module docstring): the grid is
    ``n_blocks * SPLIT_K`` programs, program pid computes K slice ``pid % SPLIT_K`` of column
    block ``pid // SPLIT_K``, and the last program of each block's group reduces the block."""
    S_MN = SPLIT_K * MN  # a rank's slot: [SPLIT_K, M, N]
    half = partial_ptr + (call % 2) * half_elems  # this call's half (fixed size: _one_shot)
    b = pid // SPLIT_K
    s = pid % SPLIT_K
    n0 = b * BLOCK_N
    mask = m_mask & ((n0 + offs_nb)[None, :] < N)
    # K slices of whole BLOCK_K steps: slice s is [s * kc, min(K, (s + 1) * kc)), empty for the
    # last slices of a short K (a partial of zeros). Every slice but the last non-empty one is
    # a multiple of BLOCK_K long, and that one is where K is, so EVEN_K (K % BLOCK_K == 0)
    # holds for every slice
    kc = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k0 = s * kc
    k_len = tl.maximum(tl.minimum(K - k0, kc), 0)
    acc = gemv_tile(x_ptr + k0, w_ptr + k0, M, N, k_len, stride_xm, stride_wn, n0, BLOCK_M,
                    BLOCK_N, BLOCK_K, NUM_STAGES, EVEN_K, EVEN_N, PRECISION, UPCAST)
    ok = _half_free(ctx, ready_ptr, call, ok, G_MAX)  # after the tile, as in _one_shot
    _push_partial(ctx, half + rank * S_MN + s * MN + n0 + tile_off, acc, rank, world, mask, ok)
    _signal_peers(ctx, ready_ptr, pid, rank, call, ok, tag, G_MAX)
    first = b * SPLIT_K
    if s < SPLIT_K - 1:
        # the block's reducer of this rank reads this partial too: this rank's own word of the
        # flag array, which no peer and no refusal writes
        pol.signal(ctx, ready_ptr + rank * G_MAX + pid, rank, call, ok, tag)
    else:
        # The reducer waits for programs of its own launch (the block's other K slices). It
        # may: the grid is no larger than what is resident on the device at once (api._plan
        # refuses the split otherwise), and the interpreter runs programs one after another in
        # pid order, so this program, the highest of its group, runs after the ones it waits for.
        # Every word of the group, the peers' and this rank's other slices', polled at once:
        # one round trip per poll, not a chain of 2 * SPLIT_K - 1 waits (one per slice and
        # rank) on the critical path of the call's end. A peer planned with another grid
        # (another split, a per-call config on one rank only) never sets the words of
        # programs past its own: the wait tells that from its program 0 word.
        ok = _wait_ready(ctx, ready_ptr, bcast_ptr, first, call, ok, tag, G_MAX, SPLIT_K, True)
        if ok:
            total = _sum_partials(half + n0 + tile_off, S_MN, MN, world, mask, BLOCK_M, BLOCK_N,
                                  SPLIT_K)
            tl.store(out_ptr + n0 + tile_off, total.to(out_ptr.dtype.element_ty), mask=mask)
