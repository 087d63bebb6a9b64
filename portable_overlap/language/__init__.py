"""Device functions for writing fused compute + communication kernels in Triton, over a
:class:`portable_overlap.Workspace`'s symmetric heap.

    import portable_overlap.language as pol

    @triton.jit
    def my_kernel(ctx, x_ptr, inbox_ptr, ready_ptr, n, BLOCK: tl.constexpr):
        call = pol.begin_call(ctx)              # this launch's number, the same on every rank
        me, world = pol.rank(ctx), pol.num_ranks(ctx)
        ...
        pol.put_signal(ctx, inbox_ptr + offs, tile, peer, ready_ptr + me, call, mask)
        ok = pol.wait(ctx, ready_ptr + peer, call, peer)   # bounded: a missing peer is an error
        ...
        pol.end_call(ctx, call)                 # every program, last thing

``ctx`` is the workspace's descriptor (``ws.ctx``, an int64 tensor passed as the kernel's first
argument): this rank, the world size, every rank's heap base as mapped in this process, the
call counter, the deadline clock, the timeout and the host-visible status board. Every
function here takes it first, so a kernel needs no other argument to reach its peers.

Rules (what makes a kernel of these functions correct; the tutorials in ``docs/tutorials``
follow them):

- **Heap addresses.** ``remote_ptr`` and every function that reaches a peer take addresses in
  this rank's copy of the workspace's heap (``ws.tensor`` / ``ws.flags``): the same buffer sits
  at the same offset on every rank. In a ``Workspace(shmem=True)`` only the flags are in the
  heap; its tensors are the SHMEM library's symmetric memory, which :func:`shmem_put` and
  :func:`shmem_get` reach and ``remote_ptr`` does not.
- **Calls.** Every program calls :func:`begin_call` before its first signal or wait and
  :func:`end_call` as its last step; the workspace counts calls on the device (no host state),
  so a kernel replays correctly in a CUDA graph. A flag holds the number of the call that set
  it: waits compare against ``call`` and nothing is ever reset.
- **Counters** (:func:`notify` / :func:`wait_count`) accumulate across calls: if a call adds
  ``n`` to a counter, wait for ``call * n``.
- **Reuse of a receive buffer.** A rank may start call ``c + 1`` while a peer still reads what
  it sent in call ``c``. Before overwriting a peer's buffer, wait until the peer has read the
  previous call's data (:func:`wait_consumed`, which its :func:`end_call_consumed` signals),
  or until it has entered this call (:func:`wait_free` / :func:`announce_call`), or alternate
  between two buffers by ``call % 2``.
- **Bounded waits.** :func:`wait`, :func:`wait_count` and :func:`barrier` give up at the call's
  deadline (``timeout_s`` after its first wait that had to spin); the program's report names
  the flag and the peer, and the host raises :class:`~portable_overlap.PeerTimeoutError` at its
  next check. A timeout leaves the ranks out of step: later waits of the workspace return
  False at once and the workspace must be closed.
- **Waiting on the same launch.** A program may wait for another program of its own launch (a
  producer/consumer counter) only if every program of the grid is resident at once (at most
  ``ws.sm_count`` programs of a kernel that fits one per SM), and never under the CPU
  interpreter, which runs programs one after another. Waits on peers' flags are always fine.

Signals are release stores at system scope after a barrier of the program's threads, so every
thread's earlier stores are visible to whoever acquires the flag; waits are acquire loads at
system scope followed by a barrier, so every thread of the waiting program sees the data. One
source serves NVIDIA and AMD GPUs and the CPU-emulated ranks (``TRITON_INTERPRET=1``).
"""
import triton
import triton.language as tl

from ..backends.proxy_fence import async_proxy_fence
from ..shmem import device as _shmem
from ..shmem.providers import device as _provider

# Layout of the descriptor (``ws.ctx``), int64 words. The first two are the call counter (the
# finished calls from bit ``shmem.device.CALL_SHIFT`` up, the current call's programs counted
# out below it: ``end_call``) and ``end_call_last``'s ticket, the next two the call's deadline
# stamp and the epoch of a call that timed out (``shmem.device.call_deadline`` / ``live``).
CTX_EPOCH = tl.constexpr(0)
CTX_CLOCK = tl.constexpr(2)
CTX_RANK = tl.constexpr(4)
CTX_WORLD = tl.constexpr(5)
CTX_TIMEOUT_US = tl.constexpr(6)
CTX_STATUS = tl.constexpr(7)
CTX_HEAP = tl.constexpr(8)
CTX_HEAP_BYTES = tl.constexpr(9)  # the heap's size: remote_ptr's range check
CTX_BASES = tl.constexpr(16)  # then one word per rank: its heap base as mapped here
#: status-board slots; a program beyond the last reports in the last
STATUS_SLOTS = tl.constexpr(1024)
#: a report's flag is ``heap offset | 1 << REPORT_OFFSET`` (the host names it, ``host.py``)
REPORT_OFFSET = tl.constexpr(62)
#: the report kind of a peer rank outside ``0 .. num_ranks - 1`` (``remote_ptr``; ``host.py``)
BAD_PEER_KIND = tl.constexpr(998)
#: the report kind of a pointer outside this rank's heap given to ``remote_ptr`` (``host.py``)
BAD_POINTER_KIND = tl.constexpr(997)
# whether kernels run in Triton's interpreter (emulated ranks), where remote_ptr checks its
# peer; read as Triton reads it when a kernel is defined, as these are here
_INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))

__all__ = ["rank", "num_ranks", "program", "num_programs", "begin_call", "end_call",
           "end_call_last", "is_live",
           "remote_ptr", "load_remote", "store_remote", "put", "get", "signal", "signal_all",
           "put_signal", "wait", "wait_reached", "notify", "wait_count", "barrier",
           "announce_call", "wait_free", "fence_bulk_reads", "peer_at", "wait_peers",
           "wait_peers_reached", "wait_program_peers", "refresh_words",
           "wait_consumed", "wait_consumed_once", "end_call_consumed", "shmem_put", "shmem_get",
           "shmem_quiet"]


# -- who and where -------------------------------------------------------------------------------
@triton.jit
def rank(ctx):
    """This rank (int32)."""
    return tl.load(ctx + CTX_RANK).to(tl.int32)


@triton.jit
def num_ranks(ctx):
    """The number of ranks of the workspace (int32)."""
    return tl.load(ctx + CTX_WORLD).to(tl.int32)


@triton.jit
def program():
    """This program's index over the whole grid (up to three axes, axis 0 fastest)."""
    rest = tl.program_id(1) + tl.num_programs(1) * tl.program_id(2)
    return tl.program_id(0) + tl.num_programs(0) * rest


@triton.jit
def num_programs():
    """The number of programs of the launch (every axis)."""
    return tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)


@triton.jit
def peer_at(step, me, world):
    """The peer a rank talks to at ``step`` of a rotation: ``(me + step) % world``. When every
    rank walks steps 1 .. world-1 in order, each link is used by one sender at a time and all
    links are busy at once; step 0 is the rank itself."""
    return (me + step) % world


# -- calls ---------------------------------------------------------------------------------------
@triton.jit
def begin_call(ctx, COUNTED: tl.constexpr = False):
    """The number of this launch among the workspace's calls (1, 2, ...; int64), the same on
    every rank. Call it before the first signal or wait; it is what flags carry. ``COUNTED``:
    the call was counted before the launch, on the stream (copy-engine transfers of the same
    call, whose flag kernels carry the count, advance it first): the count is this call's
    number, and :func:`end_call` must not advance it again."""
    if COUNTED:
        call = _shmem.calls_done(ctx + CTX_EPOCH)
    else:
        call = _shmem.begin_call(ctx + CTX_EPOCH)
    return call


@triton.jit
def end_call(ctx, call, COUNTED: tl.constexpr = False):
    """Count this program out of call ``call``: when every program of the launch has, the
    workspace's call counter stands at ``call`` for the next launch (``COUNTED``: it already
    does, see :func:`begin_call`). Every program calls it once, as its last step. No program
    learns whether it was the last, so none waits for the counter's reply: where the last
    program has something left to do, use :func:`end_call_last`."""
    if not COUNTED:
        _shmem.count_out(ctx + CTX_EPOCH, program(), num_programs())


@triton.jit
def end_call_last(ctx, call, COUNTED: tl.constexpr = False):
    """:func:`end_call` that returns whether this program was the launch's last, from a ticket
    every program takes and waits for (a round trip to one word at each program's end, about
    a microsecond of a short call on an H200). The last program advances the counter."""
    return _shmem.take_ticket(ctx + CTX_EPOCH, call, num_programs(), not COUNTED)


@triton.jit
def is_live(ctx):
    """Whether no wait of this workspace has timed out on this rank. After a timeout the
    ranks are out of step: every later wait returns False at once."""
    return _shmem.live(ctx + CTX_CLOCK)


# -- data ----------------------------------------------------------------------------------------
@triton.jit
def remote_ptr(ctx, ptr, peer, mask=None):
    """The address in ``peer``'s heap of ``ptr`` (a scalar or block of pointers into this
    rank's heap). Plain loads and stores through it reach the peer's memory (NVLink /
    Infinity Fabric on GPUs, the shared mapping on emulated ranks). The result keeps ``ptr``'s
    alignment, so tile stores stay vectorized: translate the base and add the offsets, or
    translate the block, either works.

    ``peer`` is a scalar. On emulated ranks one outside ``0 .. num_ranks - 1``, or a ``ptr``
    outside this workspace's heap (a copy of a heap tensor, another workspace's tensor; with
    ``mask``, the access's, only its lanes that are on), is reported (the host raises
    ``InvalidInputError`` naming it) and the address is this rank's own ``ptr``; on a GPU a
    debug build (``TRITON_DEBUG=1``) stops at a device assertion for the peer, and the pointer
    is not checked (the check's registers, in the ops' hot epilogues)."""
    me = rank(ctx)
    # A peer past the world reads a word beyond the descriptor's bases as a heap base, and a
    # pointer outside the heap is moved by the distance between two heaps: either access then
    # lands at an arbitrary address (a crash, or another buffer of the process overwritten
    # with no error: seen on emulated ranks). Checked on emulated ranks; compiled, the peer
    # check's registers made the GEMV and GEMM epilogues spill, so there it is a
    # device_assert (kept in a debug build only).
    if _INTERPRETED:
        bad = (peer >= num_ranks(ctx)) | (peer < 0)  # (a tensor first: peer may be a literal)
        if bad:
            _report_bad_peer(ctx, peer)
        outside = bad  # (this rank's own address may be any memory it writes)
        if (peer != me) & (bad == 0):
            outside = _outside_heap(ctx, ptr, mask)
        peer = tl.where(bad | outside, me, peer)
    else:
        tl.device_assert((peer >= 0) & (peer < num_ranks(ctx)),
                         "pol.remote_ptr: a peer rank outside 0 .. num_ranks - 1")
    return _shmem.peer_buffer(ptr, ctx + CTX_BASES, me, peer)


@triton.jit
def _outside_heap(ctx, ptr, mask=None):
    """Whether any of ``ptr`` (a pointer or a block of them; with ``mask``, its lanes that are
    on: a masked lane may point past the heap, as past any tensor) lies outside this rank's
    heap, reported (the lowest such offset) where one does. Emulated ranks only."""
    off = ptr.to(tl.int64, bitcast=True) - tl.load(ctx + CTX_HEAP)
    # (a block of one lane beside it: a scalar pointer reduces as a block does)
    lanes = tl.zeros((1,), tl.int64) + off
    out = (lanes < 0) | (lanes >= tl.load(ctx + CTX_HEAP_BYTES))
    if mask is not None:
        out = out & mask
    outside = tl.max(out.to(tl.int32), axis=None) > 0
    if outside:
        _report_bad_pointer(ctx, tl.min(tl.where(out, lanes, 1 << 62), axis=None))
    return outside


@triton.jit
def load_remote(ctx, ptr, peer, mask=None, other=None):
    """``tl.load`` of ``peer``'s copy of ``ptr`` (a pull)."""
    return tl.load(remote_ptr(ctx, ptr, peer, mask), mask=mask, other=other)


@triton.jit
def store_remote(ctx, ptr, value, peer, mask=None):
    """``tl.store`` of ``value`` into ``peer``'s copy of ``ptr`` (a push, zero-copy)."""
    tl.store(remote_ptr(ctx, ptr, peer, mask), value, mask=mask)


@triton.jit
def _copy(dst, src, n, BLOCK: tl.constexpr):
    for i in range(0, n, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


@triton.jit
def _in_heap_count(ctx, ptr, n, peer):
    """``n``, or 0 where the ``n`` elements from ``ptr`` run past the end of the heap on a
    peer (reported, as ``remote_ptr`` reports its first): emulated ranks only. ``remote_ptr``
    checks the address it is given, and a copy from a pointer inside the heap ran past it
    unseen (a crash of both ranks, or another buffer's bytes returned with no error)."""
    if _INTERPRETED:
        if (peer != rank(ctx)) & (n > 0) & (peer >= 0) & (peer < num_ranks(ctx)):
            if _outside_heap(ctx, ptr + (n - 1)):
                n = 0
    return n


@triton.jit
def put(ctx, dst, src, n, peer, BLOCK: tl.constexpr):
    """Copy ``n`` elements from ``src`` (any memory this rank reads) to ``peer``'s copy of
    ``dst`` (a heap address), by this program, ``BLOCK`` elements per step."""
    _copy(remote_ptr(ctx, dst, peer), src, _in_heap_count(ctx, dst, n, peer), BLOCK)


@triton.jit
def get(ctx, dst, src, n, peer, BLOCK: tl.constexpr):
    """Copy ``n`` elements from ``peer``'s copy of ``src`` (a heap address) to ``dst`` (any
    memory this rank writes), by this program, ``BLOCK`` elements per step."""
    _copy(dst, remote_ptr(ctx, src, peer), _in_heap_count(ctx, src, n, peer), BLOCK)


# -- signals -------------------------------------------------------------------------------------
@triton.jit
def signal(ctx, flag_ptr, peer, call, ok=True, tag=0):
    """Set ``peer``'s copy of the flag ``flag_ptr`` to call ``call``, after every store this
    program made before (release at system scope). ``peer`` may be this rank. With ``ok``
    False the flag says this rank gave up on the call: the waiter's :func:`wait` returns False
    and reports that the peer failed, instead of reading data that was never written. ``tag``
    (0 .. 2^31 - 4, e.g. a hash of the call's shapes) travels with the flag: a waiter that
    expects another tag reports a mismatch (:func:`wait`). The odd tags above are the
    library's: 2^31 - 3 and 2^31 - 1 read as "gave up", whatever ``ok`` says."""
    _words(flag_ptr)
    tl.debug_barrier()  # every thread's stores before the one thread's (cumulative) release
    value = _shmem.call_flag(call, tag, ok)
    tl.atomic_xchg(remote_ptr(ctx, flag_ptr, peer), value, sem="release", scope="sys")


#: peers :func:`signal_all` signals at once (more ranks take more rounds of as many)
_SIGNAL_LANES = tl.constexpr(8)


@triton.jit
def signal_all(ctx, flag_ptr, call, ok=True, tag=0):
    """:func:`signal` ``flag_ptr`` in every peer's heap (not this rank's), all peers at once:
    one lane per peer, each lane's release its own, so the program waits for one round trip
    over the links instead of one per peer (an atomic waits for its old value) on the critical
    path of every call that signals its peers."""
    _words(flag_ptr)
    me = rank(ctx)
    world = num_ranks(ctx)
    tl.debug_barrier()  # every thread's stores before the lanes' (cumulative) releases
    value = _shmem.call_flag(call, tag, ok)
    live_ptr = True
    if _INTERPRETED:  # (remote_ptr's check of the pointer)
        live_ptr = not _outside_heap(ctx, flag_ptr)
    for first in range(1, world, _SIGNAL_LANES):
        steps = first + tl.arange(0, _SIGNAL_LANES)
        peers = (me + steps) % world
        tl.atomic_xchg(_shmem.peer_buffer(flag_ptr, ctx + CTX_BASES, me, peers),
                       tl.full((_SIGNAL_LANES,), 0, tl.int64) + value,
                       mask=(steps < world) & live_ptr, sem="release", scope="sys")


@triton.jit
def put_signal(ctx, ptr, value, peer, flag_ptr, call, mask=None):
    """Store the tile ``value`` at ``peer``'s copy of ``ptr``, then :func:`signal` ``peer``'s
    copy of ``flag_ptr`` with call ``call``: the peer that waits for the flag sees the tile."""
    store_remote(ctx, ptr, value, peer, mask)
    signal(ctx, flag_ptr, peer, call)


@triton.jit
def notify(ctx, counter_ptr, peer, count=1):
    """Add ``count`` to ``peer``'s copy of the counter ``counter_ptr`` (release at system
    scope, after this program's earlier stores). ``peer`` may be this rank: a producer tile
    telling its consumers on the same GPU."""
    _words(counter_ptr)
    tl.debug_barrier()
    tl.atomic_add(remote_ptr(ctx, counter_ptr, peer), tl.cast(count, tl.int64), sem="release",
                  scope="sys")


@triton.jit
def _words(ptr):
    """Refuse a flag or counter pointer to anything but int64 words (a ``Workspace.tensor`` of
    int32 given as flags): the words carry a call number and a tag in 64 bits, and the polls
    and atomics below are int64 ones. At compile time on a GPU; at the call under the
    interpreter."""
    tl.static_assert(ptr.dtype.element_ty == tl.int64,
                     "portable_overlap.language: flags and counters are int64 words "
                     "(Workspace.flags); this pointer points to another dtype")


@triton.jit
def _check_waited_peer(ctx, peer, NONE_OK: tl.constexpr = False):
    """On emulated ranks, report a ``peer`` (who a wait expects to signal, for its report)
    outside ``0 .. num_ranks - 1`` (with ``NONE_OK``, -1 is allowed: nobody in particular):
    without it a wrong rank reads as "rank 5 never arrived" at the timeout, or passes unseen
    where the flag comes."""
    if _INTERPRETED:
        low = -1 if NONE_OK else 0
        if (peer >= num_ranks(ctx)) | (peer < low):
            _report_bad_peer(ctx, peer)


@triton.jit
def _report(ctx, code, peer, flag_ptr, expected):
    """Record on the status board why this program gave up: ``code``, the peer, the flag (as
    its byte offset in the heap, which the host turns into a name and an index) and what was
    expected."""
    slot = tl.minimum(program(), STATUS_SLOTS - 1)
    where = flag_ptr.to(tl.int64) - tl.load(ctx + CTX_HEAP)
    where = where | (tl.full((), 1, tl.int64) << REPORT_OFFSET)
    # a program's first report is the cause; a later wait of the same call that failed
    # because of it (the peer gave up in turn) must not overwrite it
    _shmem.report_first(tl.load(ctx + CTX_STATUS), slot, code, peer, where, expected)


@triton.jit
def _report_bad_peer(ctx, peer):
    """Record that this program addressed rank ``peer``, which is not in the world."""
    slot = tl.minimum(program(), STATUS_SLOTS - 1)
    _shmem.report_first(tl.load(ctx + CTX_STATUS), slot, _shmem.STATUS_BAD_INPUT, -1,
                        tl.full((), BAD_PEER_KIND, tl.int64) << 32, tl.cast(peer, tl.int64))


@triton.jit
def _report_bad_pointer(ctx, off):
    """Record that this program gave ``remote_ptr`` a pointer ``off`` bytes from this rank's
    heap base, outside the heap."""
    slot = tl.minimum(program(), STATUS_SLOTS - 1)
    _shmem.report_first(tl.load(ctx + CTX_STATUS), slot, _shmem.STATUS_BAD_INPUT, -1,
                        tl.full((), BAD_POINTER_KIND, tl.int64) << 32, tl.cast(off, tl.int64))


@triton.jit
def _timed_out(ctx, peer, flag_ptr, expected, call):
    """Report a wait of call ``call`` that ran past the deadline, and mark the workspace out of
    step on this rank (:func:`is_live`): a peer skipped or lost a call."""
    _report(ctx, _shmem.STATUS_TIMEOUT, peer, flag_ptr, expected)
    tl.atomic_xchg(ctx + CTX_CLOCK + 1, call.to(tl.int64), sem="relaxed", scope="gpu")


@triton.jit
def _refused_word(ctx, peer, flag_ptr, v, want, tag, failed):
    """Report flag word ``v`` of call ``want``, which arrived but fails the call: its peer gave
    up (``failed``), else it called with another shape tag than ``tag``."""
    if failed:
        _report(ctx, _shmem.STATUS_PEER_FAILED, peer, flag_ptr,
                (tl.cast(tl.maximum(tag, 0), tl.int64) << 32) | (want.to(tl.int64) & 0xFFFFFFFF))
    else:
        _report(ctx, _shmem.STATUS_MISMATCH, peer, flag_ptr,
                ((v >> 32) << 32) | tl.cast(tag, tl.int64))


@triton.jit
def wait(ctx, flag_ptr, call, peer, tag=-1):
    """Wait until this rank's flag ``flag_ptr`` holds call ``call`` (or a later one), set by
    ``peer``'s :func:`signal`. Bounded by the call's deadline: on a timeout the program's report
    names the flag and ``peer`` and the host raises ``PeerTimeoutError``. With ``tag`` >= 0 a
    flag of this call with another tag is reported as a mismatch (``RankMismatchError``: the
    peer called with other shapes). Returns whether the flag arrived, the peer did not give up
    and the tags agree; the data the peer stored before its signal is then visible to every
    thread of this program."""
    _words(flag_ptr)
    _check_waited_peer(ctx, peer)
    clock = ctx + CTX_CLOCK
    ok = is_live(ctx)
    if ok:
        v, arrived = _shmem.wait_flag(flag_ptr, call, call, clock, tl.load(ctx + CTX_TIMEOUT_US))
        if not arrived:
            _timed_out(ctx, peer, flag_ptr, call, call)
            ok = False
        else:
            failed = _shmem.peer_failed(v, (v & 0xFFFFFFFF) == (call & 0xFFFFFFFF))
            if failed | ((tag >= 0) & ((v & 0xFFFFFFFF) == (call & 0xFFFFFFFF))
                         & ((v >> 32) != tag)):
                _refused_word(ctx, peer, flag_ptr, v, call, tag, failed)
                ok = False
    tl.debug_barrier()  # the acquiring thread's view becomes the whole program's
    return ok


@triton.jit
def wait_reached(ctx, flag_ptr, epoch, call, peer):
    """Wait until this rank's flag ``flag_ptr`` holds call ``epoch`` or a later one, whatever
    the word says of that call (a failure or a refusal included): ``peer`` got that far. For a
    protocol that must know a peer is past an earlier call (e.g. done reading a buffer it
    signalled for later) without judging that call again. Bounded by call ``call``'s deadline
    (a timeout is reported as :func:`wait` reports it). Returns whether it arrived."""
    _words(flag_ptr)
    _check_waited_peer(ctx, peer)
    ok = is_live(ctx)
    if ok:
        v, arrived = _shmem.wait_flag(flag_ptr, epoch, call, ctx + CTX_CLOCK,
                                      tl.load(ctx + CTX_TIMEOUT_US))
        if not arrived:
            _timed_out(ctx, peer, flag_ptr, epoch, call)
            ok = False
    return ok


@triton.jit
def wait_count(ctx, counter_ptr, target, call, peer):
    """Wait until this rank's counter ``counter_ptr`` reaches ``target`` (counters accumulate
    over calls: ``target = call * per_call``); ``peer`` (or -1) is who is expected to count, for
    the report. Bounded like :func:`wait`; returns whether the count arrived."""
    _words(counter_ptr)
    _check_waited_peer(ctx, peer, NONE_OK=True)
    clock = ctx + CTX_CLOCK
    ok = is_live(ctx)
    if ok:
        target = tl.cast(target, tl.int64)
        v = _shmem.poll_count(counter_ptr, target, call, clock, tl.load(ctx + CTX_TIMEOUT_US),
                              "sys")
        if v < target:
            # marked as a count: the host would name the target as the call awaited
            _timed_out(ctx, peer, counter_ptr,
                       target | (tl.full((), 1, tl.int64) << _shmem.REPORT_COUNT), call)
            ok = False
    tl.debug_barrier()
    return ok


@triton.jit
def barrier(ctx, flags_ptr, call):
    """Every rank's program reaches this point of call ``call`` before any goes on (bounded).
    ``flags_ptr``: a ``[num_ranks]`` flag array of the workspace that this barrier alone uses
    (one per program that calls it, and one per barrier of a call). Returns whether every peer
    arrived."""
    me = rank(ctx)
    world = num_ranks(ctx)
    for step in range(1, world):
        signal(ctx, flags_ptr + me, peer_at(step, me, world), call)
    ok = is_live(ctx)
    for step in range(1, world):
        q = peer_at(world - step, me, world)
        ok = ok & wait(ctx, flags_ptr + q, call, q)
    return ok


# -- reuse across calls ----------------------------------------------------------------------
@triton.jit
def announce_call(ctx, free_ptr, call):
    """Tell every peer that this rank has entered call ``call``: its stream has run everything
    queued before this launch, including whatever read the previous call's results, so peers
    may write into its buffers again (:func:`wait_free`). ``free_ptr``: a ``[num_ranks]`` flag
    array of the workspace. Called by one program of the launch (e.g. program 0), first."""
    signal_all(ctx, free_ptr + rank(ctx), call)


@triton.jit
def wait_free(ctx, free_ptr, peer, call):
    """Wait until ``peer`` has entered call ``call`` (:func:`announce_call`), before the first
    store into its buffers in this call; returns at once for this rank itself. Bounded like
    :func:`wait`."""
    ok = is_live(ctx)
    if peer != rank(ctx):
        ok = wait(ctx, free_ptr + peer, call, peer)
    return ok


@triton.jit
def fence_bulk_reads():
    """Order the acquire of an earlier :func:`wait` before this thread's later bulk tensor
    copies (loads through a tensor descriptor, TMA on Hopper) of data a peer stored: without
    it a descriptor load may read as if the wait had not happened. Nothing on targets without
    an asynchronous copy proxy (AMD, the interpreter). Plain ``tl.load`` needs no fence."""
    async_proxy_fence()


# -- every peer's flag; buffers read until the end of a call -----------------------------------
@triton.jit
def wait_peers(ctx, flags_ptr, stride, call, tag=-1, ARRIVED_ONLY: tl.constexpr = False,
               LIVE_READ: tl.constexpr = False):
    """:func:`wait` for one flag of every peer q, at ``flags_ptr + q * stride``: the flag
    that q's ``signal_all(ctx, flags_ptr + q * stride, call, ok, tag)`` set here (e.g.
    ``flags[q][program]`` of a ``[num_ranks, slots]`` array: ``flags_ptr = flags + program``,
    ``stride = slots``). Every peer at once, one lane per peer: each poll is one load round trip
    whatever the number of peers, where a :func:`wait` per peer makes a chain of atomics per
    peer on the critical path of a latency-bound call (1-1.7 us of a 45 us GEMV + AllReduce on
    4 H200s).
    Reports as :func:`wait` does: the first peer in rotation order (:func:`peer_at`) that gave
    up or called with other shapes, else the first whose flag did not come; polling stops at the
    first peer that gave up, and missing peers cost one timeout in all. ``ARRIVED_ONLY``: no
    waiting; only the peers whose flag already holds ``call`` or a later one are judged (flags a
    peer sets for a call only when it gives up on it). ``LIVE_READ``: the program read
    :func:`is_live` in this launch and waits only while it was true, so this wait does not read
    it again (one round trip to the device's memory before the first poll, on the critical
    path of a short call; a wait of the same call that timed out meanwhile has passed the
    call's one deadline, so the first poll is the last).
    Returns whether every flag arrived, no peer gave up and the tags agree."""
    return _wait_all(ctx, flags_ptr, flags_ptr, flags_ptr, stride, call, call, tag, 0, False,
                     ARRIVED_ONLY, LIVE_READ, False, 1, False, False)


@triton.jit
def wait_peers_reached(ctx, flags_ptr, stride, epoch, call, LIVE_READ: tl.constexpr = False):
    """:func:`wait_reached` for one flag of every peer at once (the flags as in
    :func:`wait_peers`): every peer got to call ``epoch`` or a later one, whatever its flags
    say of that call (e.g. it is done reading a buffer it signalled for). Bounded by call
    ``call``'s deadline; returns whether every flag arrived. ``LIVE_READ`` as in
    :func:`wait_peers`."""
    return _wait_all(ctx, flags_ptr, flags_ptr, flags_ptr, stride, epoch, call, -1, 0, True,
                     False, LIVE_READ, False, 1, False, False)


@triton.jit
def wait_program_peers(ctx, flags_ptr, first, stride, call, tag, refusals_ptr=None,
                       PROGRAMS: tl.constexpr = 1, OWN: tl.constexpr = False,
                       LIVE_READ: tl.constexpr = False):
    """:func:`wait_peers` for the flags of programs ``first`` to ``first + PROGRAMS - 1``
    of every peer, in a launch whose grid follows the call's shape (so ranks called with other
    shapes run other grids): ``flags_ptr`` is a ``[num_ranks, stride]`` array with one word per
    program (peer q's program p sets ``flags[q][p]`` with ``signal_all``), and ``tag`` (>= 0)
    carries the grid. With ``OWN`` this rank's own words of those programs too (set with
    :func:`signal` by programs of this launch: the caller must be persistent, with a resident
    grid), but for the calling program's own (:func:`program`). Every word is polled at once,
    one load round trip per poll for up to 8 ranks, where a wait per program and rank makes a
    chain of them.

    A peer whose launch has no such program never sets the awaited word; its program 0's word,
    which every grid has, then holds this call with another tag (or a later call): the wait
    stops there and reports a mismatch (``RankMismatchError``, the ranks still in step)
    instead of waiting until the deadline and leaving the workspace out of step. That word is
    read only while the wait spins, beside the awaited ones.

    ``refusals_ptr``: a flag array of the same layout that no call of the protocol writes and a
    refusal on the host does (``refuse_kernel`` writes every flag array of the workspace). A
    peer that refused this call waited for nothing and may already have set the awaited word
    to its next call, which reads as "this call delivered"; where a word is past ``call`` the
    same peers' words there are judged too (as :func:`wait_peers` with ``ARRIVED_ONLY``
    judges them): one more load round trip, only then. ``LIVE_READ`` as in
    :func:`wait_peers`."""
    if refusals_ptr is None:
        ok = _wait_all(ctx, flags_ptr + first, flags_ptr, flags_ptr, stride, call, call, tag,
                       program() - first, False, False, LIVE_READ, True, PROGRAMS, OWN, False)
    else:
        ok = _wait_all(ctx, flags_ptr + first, flags_ptr, refusals_ptr + first, stride, call,
                       call, tag, program() - first, False, False, LIVE_READ, True, PROGRAMS,
                       OWN, True)
    return ok


#: the period of :func:`refresh_words` in calls (``shmem.device.REFRESH_CALLS``)
REFRESH_CALLS = _shmem.REFRESH_CALLS


@triton.jit
def refresh_words(ctx, flags_ptr, first, stride, call, tag, OWN: tl.constexpr = False,
                  PEERS: tl.constexpr = True):
    """Write call ``call`` with shape tag ``tag`` (failed once the workspace is out of step,
    :func:`is_live`) into this rank's words ``flags[rank][first:stride]`` of a ``[num_ranks,
    stride]`` flag array, in every peer's heap (not with ``PEERS`` false; with ``OWN`` in this
    rank's too), the words
    shared out over the launch's programs. For a launch whose grid follows the call's shape
    (:func:`wait_program_peers`): at every ``REFRESH_CALLS``-th call, ``if (call &
    (REFRESH_CALLS - 1)) == 0``, as its last step before :func:`end_call`, for the words no
    program of its grid writes in that call (``first``: how many it does). Without it a word
    past a small grid that no call wrote for 2**31 calls reads as a later call's
    (``shmem.device.refresh_words`` says why, and why this call's own word is safe)."""
    _words(flags_ptr)
    _shmem.refresh_words(flags_ptr, ctx + CTX_BASES, first, program(), num_programs(),
                         rank(ctx), num_ranks(ctx), _shmem.call_flag(call, tag, is_live(ctx)),
                         stride, OWN, PEERS)


@triton.constexpr_function
def _pow2_at_least(n):
    return triton.next_power_of_2(n)


@triton.jit
def _wait_all(ctx, flag_ptr, first_ptr, confirm_ptr, stride, want, call, tag, skip,
              REACHED_ONLY: tl.constexpr, ARRIVED_ONLY: tl.constexpr, LIVE_READ: tl.constexpr,
              GRID: tl.constexpr, PROGRAMS: tl.constexpr, OWN: tl.constexpr,
              CONFIRM: tl.constexpr):
    """The waits on every peer's flag words, ``PROGRAMS`` consecutive words per peer from
    ``flag_ptr + q * stride`` (with ``OWN`` this rank's too, but for its word ``skip``), polled
    together: one load round trip per poll for up to ``_SIGNAL_LANES`` ranks. ``CONFIRM``: a
    word past ``want`` has the same lane's word at ``confirm_ptr`` judged too (a refusal
    recorded there, ``wait_program_peers``). Returns whether every word arrived and was judged
    good."""
    _words(flag_ptr)
    _words(confirm_ptr)
    me = rank(ctx)
    world = num_ranks(ctx)
    if LIVE_READ:
        ok = me >= 0  # true, as a value the loop below may set to false
    else:
        ok = is_live(ctx)
    PER_RANK: tl.constexpr = _pow2_at_least(PROGRAMS)  # (a block's lanes: a power of two)
    idx = tl.arange(0, _SIGNAL_LANES * PER_RANK)
    offs = idx % PER_RANK  # a lane's word of its rank's PROGRAMS
    for first in range(0 if OWN else 1, world, _SIGNAL_LANES):
        if ok:
            steps = first + idx // PER_RANK
            peers = (me + steps) % world
            ptrs = flag_ptr + peers.to(tl.int64) * stride + offs
            lanes = (steps < world) & (offs < PROGRAMS)
            if OWN:
                lanes = lanes & ((steps != 0) | (offs != skip))
            if ARRIVED_ONLY:
                seen = tl.atomic_add(ptrs, tl.zeros(ptrs.shape, tl.int64), mask=lanes,
                                     sem="acquire", scope="sys")
                lanes = lanes & _shmem.reached(tl.where(lanes, seen, 0), want)
            if GRID:  # a peer whose launch has no such program is a mismatch, found early
                v, arrived, gone, g = _shmem.wait_flags_grid(
                    ptrs, first_ptr + peers.to(tl.int64) * stride, lanes, want, call, tag,
                    ctx + CTX_CLOCK, tl.load(ctx + CTX_TIMEOUT_US))
            else:
                v, arrived = _shmem.wait_flags(ptrs, lanes, want, call, ctx + CTX_CLOCK,
                                               tl.load(ctx + CTX_TIMEOUT_US), not REACHED_ONLY)
                gone = arrived & ~arrived
                g = v
            missing = lanes & ~arrived & ~gone
            this_call = (v & 0xFFFFFFFF) == (want.to(tl.int64) & 0xFFFFFFFF)
            if REACHED_ONLY:  # nothing judged but the arrival
                failed = arrived & ~arrived
                other = failed
            else:
                failed = arrived & _shmem.peer_failed(v, this_call)
                other = (arrived & (tag >= 0) & this_call & ((v >> 32) != tag)) | gone
                v = tl.where(gone, g, v)  # (the report of such a peer: its program 0's tag)
            if CONFIRM:
                # a word past the call: the peer's refusal of it may lie under the next call's
                # word; its record at confirm_ptr stays (judged as ARRIVED_ONLY judges)
                past = arrived & ~this_call & ~gone
                if tl.sum(past.to(tl.int32)) > 0:
                    seen = _shmem.poll_flags(confirm_ptr + peers.to(tl.int64) * stride + offs, past)
                    seen_call = (seen & 0xFFFFFFFF) == (want.to(tl.int64) & 0xFFFFFFFF)
                    judged = past & _shmem.reached(seen, want)
                    r_failed = judged & _shmem.peer_failed(seen, seen_call)
                    r_other = judged & (tag >= 0) & seen_call & ((seen >> 32) != tag)
                    failed = failed | r_failed
                    other = other | r_other
                    v = tl.where(r_failed | r_other, seen, v)
            bad = missing | failed | other
            if tl.sum(bad.to(tl.int32)) > 0:
                # the first peer in rotated order that gave up or called with other shapes,
                # else the first missing one: polling stopped at a peer that gave up, when
                # others may not have signalled yet (not a timeout, which would leave the
                # workspace out of step for good)
                given_up = failed | other
                if tl.sum(given_up.to(tl.int32)) > 0:
                    bad = given_up
                order = steps * PER_RANK + offs  # one lane: the first bad one in that order
                pick = order == tl.min(tl.where(bad, order, world * PER_RANK))
                peer = tl.sum(tl.where(pick, peers, 0))
                word = tl.sum(tl.where(pick, v, 0))
                ptr = flag_ptr + peer.to(tl.int64) * stride + tl.sum(tl.where(pick, offs, 0))
                if tl.sum((pick & missing).to(tl.int32)) > 0:
                    _timed_out(ctx, peer, ptr, want, call)
                else:
                    _refused_word(ctx, peer, ptr, word, want, tag,
                                  tl.sum((pick & failed).to(tl.int32)) > 0)
                ok = False
    tl.debug_barrier()  # the acquiring lanes' view becomes the whole program's
    return ok


@triton.jit
def wait_consumed(ctx, consumed_ptr, peer, call):
    """Wait until ``peer`` has read everything that was stored into its buffers in the previous
    call: its :func:`end_call_consumed` of call ``call - 1`` set ``consumed_ptr[peer]`` here
    (``consumed_ptr``: a ``[num_ranks]`` flag array of the workspace). Call it before the
    first store into ``peer``'s buffers in call ``call``; returns at once for this rank itself.
    Bounded like :func:`wait` (by call ``call``'s deadline); returns whether it arrived."""
    _words(consumed_ptr)
    _check_waited_peer(ctx, peer)
    ok = is_live(ctx)
    if ok & (peer != rank(ctx)):
        flag = consumed_ptr + peer
        v, arrived = _shmem.wait_flag(flag, call - 1, call, ctx + CTX_CLOCK,
                                      tl.load(ctx + CTX_TIMEOUT_US))
        if not arrived:
            _timed_out(ctx, peer, flag, call - 1, call)
            ok = False
    return ok


@triton.jit
def wait_consumed_once(ctx, consumed_ptr, peer, call, waited, ok):
    """:func:`wait_consumed` where a program stores into many peers' buffers, tile after tile:
    it waits for ``peer`` only the first time in the call. ``waited`` (an int64, 0 at the
    start of the call) has bit q set once the program waited for q < 64; a peer past 63 is
    waited for at each call of this (a flag read once it is there), not aliased to another's
    bit. ``ok``: the program's state so far (once False, nothing is waited for). Returns ``(ok
    and-ed with the outcome, waited with bit peer set)``."""
    kept = peer < 64
    bit = tl.where(kept, tl.full((), 1, tl.int64) << (peer & 63), 0)
    if (waited & bit) == 0:
        if ok:
            ok = wait_consumed(ctx, consumed_ptr, peer, call)
        waited = waited | bit
    return ok, waited


@triton.jit
def end_call_consumed(ctx, call, consumed_ptr, COUNTED: tl.constexpr = False):
    """:func:`end_call` of a launch whose peers store into this rank's buffers: the last
    program out also sets ``consumed_ptr[rank]`` to ``call`` in every peer's heap (what the
    peers' :func:`wait_consumed` of the next call waits for). A barrier orders this program's
    reads of the received data before its ticket, so when the last program signals, no program
    of the launch reads the buffers any more. Every program calls it once, as its last step;
    returns whether this program was the last. ``COUNTED`` as in :func:`begin_call`."""
    tl.debug_barrier()
    last = end_call_last(ctx, call, COUNTED)
    if last:
        signal_all(ctx, consumed_ptr + rank(ctx), call)
    return last


# -- puts and gets through the SHMEM library (a Workspace(shmem=True) kernel only) ----------------
@triton.jit
def _no_library_put(dst, src, n, peer):
    tl.static_assert(False, "pol.shmem_put: this process has no SHMEM library (NVSHMEM / "
                            "ROC_SHMEM) bound; call it only in a kernel launched by "
                            "Workspace(shmem=True), under `if VIA_SHMEM:`")


@triton.jit
def _no_library_get(dst, src, n, peer):
    tl.static_assert(False, "pol.shmem_get: this process has no SHMEM library (NVSHMEM / "
                            "ROC_SHMEM) bound; call it only in a kernel launched by "
                            "Workspace(shmem=True), under `if VIA_SHMEM:`")


@triton.jit
def _no_library_quiet():
    tl.static_assert(False, "pol.shmem_quiet: this process has no SHMEM library (NVSHMEM / "
                            "ROC_SHMEM) bound; call it only in a kernel launched by "
                            "Workspace(shmem=True), under `if VIA_SHMEM:`")


# Bound once here (shmem/providers/device.py chose the process's library): a kernel names its
# callees when it compiles. Without a library the stand-ins fail that compile with a message,
# and a branch on a constexpr False that calls them is never compiled.
_library_put = _provider.put if _provider.put is not None else _no_library_put
_library_get = _provider.get if _provider.get is not None else _no_library_get
_library_quiet = _provider.flush if _provider.flush is not None else _no_library_quiet


@triton.jit
def shmem_put(dst, src, n, peer):
    """Copy ``n`` elements of ``dst``'s type from ``src`` (memory of this rank, same element
    type) to ``peer``'s copy of ``dst``, through the SHMEM library (NVSHMEM on NVIDIA,
    ROC_SHMEM on AMD), by the whole program (every thread takes part). ``dst`` is a scalar
    address in a tensor of a ``Workspace(shmem=True)`` (``ws.tensor``: the library's symmetric
    memory). Valid only in a kernel launched by such a workspace, whose launch links the
    library; elsewhere it does not compile. The data is complete at ``peer`` only after
    :func:`shmem_quiet`. ``peer`` may be this rank."""
    _library_put(dst, src, n, peer)


@triton.jit
def shmem_get(dst, src, n, peer):
    """Copy ``n`` elements of ``dst``'s type from ``peer``'s copy of ``src`` (a scalar address
    in a tensor of a ``Workspace(shmem=True)``) to ``dst`` (memory of this rank, same element
    type), through the SHMEM library, by the whole program; the data is in ``dst`` when it
    returns (no :func:`shmem_quiet` needed). Wait for the flag that says ``peer``'s ``src`` is
    written before the get, and tell ``peer`` when it may write there again (a pull: the
    reader decides when the bytes move, e.g. a ring of K/V blocks). Valid only in a kernel
    launched by such a workspace. ``peer`` may be this rank."""
    _library_get(dst, src, n, peer)


@triton.jit
def shmem_quiet():
    """Every :func:`shmem_put` of this program has completed at its destination. Call it
    before the :func:`signal` that tells the receiver, so the flag's release covers the data::

        if VIA_SHMEM:                      # VIA_SHMEM: tl.constexpr = ws.shmem
            pol.shmem_put(dst, src, n, peer)
            pol.shmem_quiet()
        else:
            pol.put(ctx, dst, src, n, peer, BLOCK)
        pol.signal(ctx, flag, peer, call)

    Valid only in a kernel launched by a ``Workspace(shmem=True)``."""
    _library_quiet()
