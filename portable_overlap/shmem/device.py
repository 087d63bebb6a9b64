"""Triton device helpers over the symmetric heap: pointer translation, remote stores, signals
(release) and bounded waits (acquire).

Every rank's heap holds the same buffers at the same offsets, and ``bases_ptr`` points at an int64
table of each rank's heap base *as mapped in this process*. Translating a local address into a
peer's is then one subtraction and one addition; the result is an ordinary pointer, so stores and
loads to it are plain (zero-copy) stores over NVLink / Infinity Fabric, or plain memory writes into
another process's shared-memory mapping on the CPU-emulated backend.

Flags are int64 words holding ``(tag << 32) | epoch``: the epoch (the call's sequence number)
makes a flag from the previous call distinguishable from this one, so nothing is ever reset, and
the tag lets the waiter check that the peer called the op with the same shapes.
"""
import triton
import triton.language as tl

from ..backends.device_clock import now_ns

#: status codes written to a program's status slot
STATUS_OK = tl.constexpr(0)
STATUS_TIMEOUT = tl.constexpr(1)
STATUS_MISMATCH = tl.constexpr(2)
STATUS_PEER_FAILED = tl.constexpr(3)
STATUS_BAD_INPUT = tl.constexpr(4)  # data-dependent input a kernel found invalid (e.g. routing)
#: a timeout's ``expected`` word with this bit set is a counter's target, not a call number
#: (``language.wait_count``): the host names it as a count
REPORT_COUNT = tl.constexpr(62)

#: The tag a program signals with once it has given up on the call: the peer then reports the
#: failure instead of consuming data that was never written. Shape tags stay below it.
FAILED_TAG = tl.constexpr(0x7FFFFFFF)
#: The tag of a call refused on the host (``transports.flag_kernels.refuse_kernel``) by a rank
#: that delivered every earlier call in full. A refusal writes all of its flag words at once, so
#: it may overwrite the previous call's word before a slower peer read it: that peer, still in
#: the previous call, must take such a word as "delivered" (the data is there; the refusing rank
#: moved on only after its launches of that call), where FAILED_TAG of a later call still means
#: failure (the refusing rank had given up before). Odd, like FAILED_TAG: no shape tag.
REFUSED_TAG = tl.constexpr(0x7FFFFFFD)
TAG_MASK = 0x7FFFFFFE


@triton.jit
def peer_ptr(ptr, bases_ptr, rank, peer):
    """The address in ``peer``'s heap of the local heap pointer ``ptr`` (a scalar pointer)."""
    my_base = tl.load(bases_ptr + rank)
    peer_base = tl.load(bases_ptr + peer)
    return (ptr.to(tl.int64) - my_base + peer_base).to(ptr.dtype)


@triton.jit
def peer_buffer(ptr, bases_ptr, rank, peer):
    """``peer_ptr`` of a heap buffer's base, for tile stores: the result stays ``ptr`` plus a
    whole number of 16-byte steps, so the compiler keeps ``ptr``'s alignment and stores whole
    16-byte vectors. (A pointer rebuilt from an integer has unknown alignment, and every
    store through it is issued element by element; ``tl.multiple_of`` on it is not honoured.)
    Heap mappings are page-aligned, so the distance between two ranks' bases is a multiple of
    16 bytes. A bool element (1 bit to Triton) takes a byte in memory."""
    step: tl.constexpr = 16 // ((ptr.dtype.element_ty.primitive_bitwidth + 7) // 8)  # elements
    vectors = (tl.load(bases_ptr + peer) - tl.load(bases_ptr + rank)) // 16
    return ptr + vectors * step


@triton.jit
def flag_value(epoch, tag):
    """The word a signal writes: tag in the high half, epoch in the low half."""
    return (tl.cast(tag, tl.int64) << 32) | (tl.cast(epoch, tl.int64) & 0xFFFFFFFF)


@triton.jit
def signal_peer(flag_ptr, value, bases_ptr, rank, peer):
    """Set the flag at ``flag_ptr`` (a local heap address) in ``peer``'s heap to ``value`` with
    release semantics at system scope, after this program's earlier stores.

    The caller puts a ``tl.debug_barrier()`` before the first signal so that the stores of every
    thread of the program are ordered before the one thread's release (release is cumulative)."""
    tl.atomic_xchg(peer_ptr(flag_ptr, bases_ptr, rank, peer), value, sem="release", scope="sys")


@triton.jit
def call_deadline(clock_ptr, epoch, timeout_us):
    """The time (ns, ``now_ns`` modulo 2**51) after which every wait of call ``epoch`` gives
    up: ``timeout_us`` after the first wait of the call that had to spin began. One deadline
    per call, shared by every program and every launch of the call: a program that starts late
    (a grid larger than the device, the interpreter running programs one after another, the
    call's second kernel) does not get a fresh timeout, so a missing peer costs one timeout
    per call, not one per program. ``in_time`` compares it with the clock.

    ``clock_ptr[0]`` (the context's heap) holds ``(start mod 2**32) << 32 | (epoch mod
    2**32)``, the start in units of 2**20 ns (1.05 ms; a shift, where a division cost the K
    split's GEMV tile a spill on sm_90), so the deadline may come up to 1.05 ms early. The
    first program whose epoch differs from the stamp replaces it (compare-and-swap); the others
    read the winner's start. The stamp holds as many bits of the epoch as the flags do: a stamp
    left by a wait of an earlier call is taken for this call's only if that call is a multiple
    of 2**32 calls back. (Fewer bits would not do: with 16, a rank whose waits found their
    flags there for 65536 calls, the last rank to arrive call after call, takes the stamp of
    the call that many calls back, whose start is long past: its first wait that spins gives up
    at once, and the context breaks.) Only waits that find their flag missing ask for it, so a
    call whose flags are already there pays no atomic and no clock read for it.

    Inlined, and kept small (the spin's entry runs while a wait's words are in registers): the
    start's high bits are not rebuilt from the clock, the deadline and the clock are compared
    modulo 2**51 instead. A deadline rebuilt in full made GEMV's two-shot tile spill on sm_90;
    a helper not inlined cost the one-shot GEMV + AllReduce 0.5 us a call on one H100, called
    or not."""
    v = tl.atomic_add(clock_ptr, 0, sem="relaxed", scope="gpu")
    if v.to(tl.int32) != epoch.to(tl.int32):  # the low halves: the stamp's call
        mine = ((now_ns() >> 20) << 32) | (epoch.to(tl.int64) & 0xFFFFFFFF)
        old = tl.atomic_cas(clock_ptr, v, mine, sem="relaxed", scope="gpu")
        v = tl.where(old == v, mine, old)
    return ((v >> 32) << 20) + tl.cast(timeout_us, tl.int64) * 1000


@triton.jit
def in_time(deadline):
    """Whether the clock has not reached ``deadline`` (``call_deadline``), modulo 2**51 ns (26
    days): the two are within ``MAX_TIMEOUT_S`` of each other, far less."""
    return ((deadline - now_ns()) & 0x7FFFFFFFFFFFF) < 0x4000000000000


@triton.jit
def live(clock_ptr):
    """Whether no wait of this context has timed out on this rank (``clock_ptr[1]`` is 0, else
    the epoch of the call that timed out). A rank whose wait timed out is out of step with its
    peers (one of them skipped or lost a call): every later call gives up at once and says so in
    its flags, on the device too, before the host has seen the error. Other failures (a peer
    gave up, shapes differ, bad routing, a call refused on the host) leave the ranks in step."""
    return tl.atomic_add(clock_ptr + 1, 0, sem="relaxed", scope="gpu") == 0


@triton.jit
def reached(v, epoch):
    """Whether the flag word ``v`` holds ``epoch`` or a later one (32-bit wrap-around order).
    A later epoch counts: a rank writes each flag word in call order and moves on only after
    delivering the call, so a word that went past ``epoch`` was written for ``epoch`` first
    (a call given up on the host writes every flag at once, possibly over the previous call's
    word before a peer read it)."""
    return ((v - epoch.to(tl.int64)) & 0xFFFFFFFF) < 0x80000000


@triton.jit
def peer_failed(v, this_call):
    """Whether the flag word ``v`` (which ``reached`` the awaited call; ``this_call``: its epoch
    is that call's) says the peer will not deliver the call: the failure tag, or a refusal of
    this very call. A refusal of a later call means the awaited one was delivered (REFUSED_TAG)."""
    tag = v >> 32
    return (tag == FAILED_TAG) | ((tag == REFUSED_TAG) & this_call)


@triton.jit
def wait_flag(flag_ptr, want, call, clock_ptr, timeout_us):
    """Poll (acquire, system scope) until the local flag holds epoch ``want`` or a later one in
    its low half, or call ``call``'s deadline passes (``call_deadline``). Returns
    (the word last read, arrived)."""
    v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    if not reached(v, want):
        deadline = call_deadline(clock_ptr, call, timeout_us)
        while (not reached(v, want)) & in_time(deadline):
            v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    return v, reached(v, want)


@triton.jit
def _pending(v, lanes, want, STOP_ON_FAILURE: tl.constexpr):
    """How many of ``lanes`` have not reached ``want`` in the words ``v``; 0 once a lane's word
    says its peer gave up on ``want`` (``STOP_ON_FAILURE``)."""
    n = tl.sum((lanes & ~reached(v, want)).to(tl.int32))
    if STOP_ON_FAILURE:
        gave_up = lanes & reached(v, want) & peer_failed(
            v, (v & 0xFFFFFFFF) == (want.to(tl.int64) & 0xFFFFFFFF))
        n = tl.where(tl.sum(gave_up.to(tl.int32)) > 0, 0, n)
    return n


@triton.jit
def poll_flags(flag_ptrs, lanes, ACQUIRE: tl.constexpr = True):
    """One load (system scope; acquire, else relaxed) of every lane's local flag word; 0 where
    no lane."""
    zero = tl.zeros(flag_ptrs.shape, tl.int64)
    if ACQUIRE:
        v = tl.atomic_add(flag_ptrs, zero, mask=lanes, sem="acquire", scope="sys")
    else:
        v = tl.atomic_add(flag_ptrs, zero, mask=lanes, sem="relaxed", scope="sys")
    return tl.where(lanes, v, 0)


@triton.jit
def wait_flags(flag_ptrs, lanes, want, call, clock_ptr, timeout_us, STOP_ON_FAILURE: tl.constexpr):
    """``wait_flag`` of a block of local flags at once (``lanes``: which of ``flag_ptrs`` to
    wait for), one acquire load of every lane per poll: a wait for several peers then takes one
    load round trip per poll instead of one per peer. With ``STOP_ON_FAILURE`` the polling ends
    as soon as a lane's word says its peer will not deliver call ``want`` (``peer_failed``), as
    a wait for the peers one by one would stop at that peer. Returns (the words last read,
    0 where no lane; which lanes arrived)."""
    v = poll_flags(flag_ptrs, lanes)
    pending = _pending(v, lanes, want, STOP_ON_FAILURE)
    if pending > 0:
        deadline = call_deadline(clock_ptr, call, timeout_us)
        while (pending > 0) & in_time(deadline):
            v = poll_flags(flag_ptrs, lanes)
            pending = _pending(v, lanes, want, STOP_ON_FAILURE)
    return v, lanes & reached(v, want)


@triton.jit
def outside_grid(v, g, lanes, want, tag):
    """The lanes whose flag word ``v`` (a program's word of call ``want``) has not come while
    the same peer's program-0 word ``g`` shows that it never will: ``g`` holds call ``want``
    with a shape tag other than ``tag`` (its launch of the call was planned otherwise; a
    failure or a refusal is not judged here: it comes to every word the peer's launch writes),
    or a later call (its launch of ``want`` ended without writing ``v``). Either way the peer's
    grid in that call has no such program: a mismatch of the call, not a peer gone missing."""
    this_call = (g & 0xFFFFFFFF) == (want.to(tl.int64) & 0xFFFFFFFF)
    g_tag = g >> 32
    shape = (g_tag != FAILED_TAG) & (g_tag != REFUSED_TAG) & (g_tag != tag)
    return lanes & ~reached(v, want) & reached(g, want) & (~this_call | shape)


@triton.jit
def wait_flags_grid(flag_ptrs, first_ptrs, lanes, want, call, tag, clock_ptr, timeout_us):
    """``wait_flags`` (stopping at a peer that gave up) of one program's flag of every peer
    (``flag_ptrs``) in a launch whose grid may differ from rank to rank (it follows the call's
    shape): while it spins it also reads the same peers' program-0 flags (``first_ptrs``,
    every grid has a program 0) and stops at a peer whose launch has no such program
    (``outside_grid``), instead of waiting until the deadline for a flag no one writes.

    The first poll reads the awaited flags alone, so a wait that finds them set costs what
    ``wait_flags`` costs. In the spin the program-0 words are read relaxed, before the awaited
    ones, so the two loads are in flight together; a verdict from that pair is read again in
    order (the program-0 words acquired, then the awaited ones) before it stands: a later
    call's program-0 word proves the awaited word absent only for a load of it made after that
    word was seen, since the peer wrote the awaited word first. Returns (the words last read,
    which lanes arrived, which lanes are outside the peer's grid, the program-0 words last
    read)."""
    v = poll_flags(flag_ptrs, lanes)
    g = v
    gone = lanes & (v != v)
    pending = _pending(v, lanes, want, True)
    if pending > 0:
        deadline = call_deadline(clock_ptr, call, timeout_us)
        while (pending > 0) & in_time(deadline):
            g = poll_flags(first_ptrs, lanes, False)
            v = poll_flags(flag_ptrs, lanes)
            pending = _pending(v, lanes, want, True)
            if tl.sum(outside_grid(v, g, lanes, want, tag).to(tl.int32)) > 0:
                g = poll_flags(first_ptrs, lanes)
                v = poll_flags(flag_ptrs, lanes)
                gone = outside_grid(v, g, lanes, want, tag)
                n_gone = tl.sum(gone.to(tl.int32))
                pending = tl.where(n_gone > 0, 0, _pending(v, lanes, want, True))
    return v, lanes & reached(v, want), gone, g


@triton.jit
def await_word(flag_ptr, want, call, tag, clock_ptr, timeout_us, status_addr, pid, peer, what,
               ok, CHECK_TAG: tl.constexpr):
    """``wait_flag``, then judge the word: a timeout, the peer's failure tag, or (CHECK_TAG, the
    word of epoch ``want`` itself) another shape tag is reported on the status board as program
    ``pid``'s reason (``what`` names the flag). The slot's last word holds ``want`` for a
    timeout; this program's tag in its high half and ``want`` in its low half when the peer
    gave up; the peer's tag and this program's (high, low half) for another shape tag, so the
    host can tell what each rank passed. A timeout also marks the context out of step
    (``live``). Returns ``ok`` and-ed with the outcome; does not wait once ``ok`` is false."""
    if ok:
        v, arrived = wait_flag(flag_ptr, want, call, clock_ptr, timeout_us)
        if not arrived:
            report(status_addr, pid, STATUS_TIMEOUT, peer, what, want)
            tl.atomic_xchg(clock_ptr + 1, call.to(tl.int64), sem="relaxed", scope="gpu")
            ok = False
        elif CHECK_TAG:
            this_call = (v & 0xFFFFFFFF) == (want.to(tl.int64) & 0xFFFFFFFF)
            if peer_failed(v, this_call):
                report(status_addr, pid, STATUS_PEER_FAILED, peer, what,
                       (tl.cast(tag, tl.int64) << 32) | (want.to(tl.int64) & 0xFFFFFFFF))
                ok = False
            elif this_call & ((v >> 32) != tag):
                report(status_addr, pid, STATUS_MISMATCH, peer, what,
                       ((v >> 32) << 32) | tl.cast(tag, tl.int64))
                ok = False
    return ok


@triton.jit
def poll_count(counter_ptr, target, call, clock_ptr, timeout_us, SCOPE: tl.constexpr):
    """Poll (acquire, ``SCOPE``) until the counter at ``counter_ptr`` reaches ``target`` or call
    ``call``'s deadline passes (``call_deadline``). Returns the count last read."""
    v = tl.atomic_add(counter_ptr, 0, sem="acquire", scope=SCOPE)
    if v < target:
        deadline = call_deadline(clock_ptr, call, timeout_us)
        while (v < target) & in_time(deadline):
            v = tl.atomic_add(counter_ptr, 0, sem="acquire", scope=SCOPE)
    return v


@triton.jit
def await_count(counter_ptr, target, epoch, clock_ptr, timeout_us, status_addr, pid, peer, what,
                ok):
    """``poll_count`` at device scope on a counter of this device; a timeout is reported
    (``what`` names the counter) and marks the context out of step, as ``await_word``'s. For
    counts that programs of one launch raise for each other: only a persistent kernel whose grid
    is resident may wait for them. Returns ``(ok and-ed with the outcome, the count last
    read)``; does not wait once ``ok`` is false."""
    v = tl.zeros((), tl.int32)
    if ok:
        v = poll_count(counter_ptr, target, epoch, clock_ptr, timeout_us, "gpu")
        if v < target:
            report(status_addr, pid, STATUS_TIMEOUT, peer, what, tl.cast(target, tl.int64))
            tl.atomic_xchg(clock_ptr + 1, epoch.to(tl.int64), sem="relaxed", scope="gpu")
            ok = False
    return ok, v


@triton.jit
def await_flags(flags_ptr, n, epoch, tag, clock_ptr, timeout_us, status_addr, pid, peer, what0,
                ok, BLOCK: tl.constexpr):
    """``await_flag`` for the ``n`` flags ``flags_ptr[0:n]`` of one peer at once, BLOCK per
    acquire: every lane polls one flag, so the wait costs one round trip per BLOCK flags while
    they are there, where one flag after another costs one each. The MoE combine waits for
    every program of the peer's GEMM (132 on an H200): polled one by one, that chain cost the
    fused op 40-50 us per call at (8192 tokens, H 2048, 8 experts, top-2) on 2 H200 (0.349 ->
    0.302 ms; the same kernels on one rank, with no peer to wait for, within 3 %). A missing
    flag is reported as ``await_flag`` reports it, with ``what0 + i`` naming flag i; the
    lowest failing flag of a block is the one reported."""
    lanes = tl.arange(0, BLOCK)
    for c in range(0, n, BLOCK):
        if ok:
            m = c + lanes < n
            v = tl.atomic_add(flags_ptr + c + lanes, 0, mask=m, sem="acquire", scope="sys")
            v = tl.where(m, v, epoch.to(tl.int64))
            if tl.sum((~reached(v, epoch)).to(tl.int32)) > 0:
                deadline = call_deadline(clock_ptr, epoch, timeout_us)
                waiting = ~reached(v, epoch)
                while (tl.sum(waiting.to(tl.int32)) > 0) & in_time(deadline):
                    again = tl.atomic_add(flags_ptr + c + lanes, 0, mask=waiting, sem="acquire",
                                          scope="sys")
                    v = tl.where(waiting, again, v)
                    waiting = ~reached(v, epoch)
            late = ~reached(v, epoch)
            this_call = (v & 0xFFFFFFFF) == (epoch.to(tl.int64) & 0xFFFFFFFF)
            failed = m & peer_failed(v, this_call)
            other = m & this_call & ((v >> 32) != tag)
            if tl.sum(late.to(tl.int32)) > 0:
                i = tl.min(tl.where(late, lanes, BLOCK))
                report(status_addr, pid, STATUS_TIMEOUT, peer, what0 + c + i, epoch)
                tl.atomic_xchg(clock_ptr + 1, epoch.to(tl.int64), sem="relaxed", scope="gpu")
                ok = False
            elif tl.sum(failed.to(tl.int32)) > 0:
                i = tl.min(tl.where(failed, lanes, BLOCK))
                report(status_addr, pid, STATUS_PEER_FAILED, peer, what0 + c + i,
                       (tl.cast(tag, tl.int64) << 32) | (epoch.to(tl.int64) & 0xFFFFFFFF))
                ok = False
            elif tl.sum(other.to(tl.int32)) > 0:
                i = tl.min(tl.where(other, lanes, BLOCK))
                seen = tl.sum(tl.where(lanes == i, v, 0))
                report(status_addr, pid, STATUS_MISMATCH, peer, what0 + c + i,
                       ((seen >> 32) << 32) | tl.cast(tag, tl.int64))
                ok = False
    return ok


@triton.jit
def await_flag(flag_ptr, epoch, tag, clock_ptr, timeout_us, status_addr, pid, peer, what, ok,
               CHECK_TAG: tl.constexpr):
    """``await_word`` for this call's own flag (epoch ``epoch``, which is also the call)."""
    return await_word(flag_ptr, epoch, epoch, tag, clock_ptr, timeout_us, status_addr, pid, peer,
                      what, ok, CHECK_TAG)


@triton.jit
def report(status_addr, pid, code, peer, what, expected):
    """Record why program ``pid`` gave up, in its own 4-word slot of the host-visible status board,
    and raise the board's header word, which the host polls (plain stores: host memory over PCIe
    does not take every atomic; every writer of the header writes the same 1)."""
    board = status_addr.to(tl.pointer_type(tl.int64))
    slot = board + (pid + 1) * 4
    tl.store(slot + 1, peer)
    tl.store(slot + 2, what)
    tl.store(slot + 3, expected)
    tl.store(slot + 0, code)
    tl.store(board, 1)


@triton.jit
def read_board(word_ptr):
    """A word of the status board (host memory, written by any kernel of this rank), read past
    every cache: an acquire atomic at system scope, which the compiler turns into a load
    (``ld.global.sys.acquire`` on sm_90, ``global_load ... sc0 sc1`` then ``buffer_inv sc0
    sc1`` on gfx942 / gfx950), so host memory over PCIe sees no read-modify-write.
    ``tl.load(volatile=True)`` would not do on AMD: Triton's AMD backend drops ``volatile``
    and the load may hit a stale line."""
    return tl.atomic_add(word_ptr, 0, sem="acquire", scope="sys")


@triton.jit
def report_first(status_addr, pid, code, peer, what, expected):
    """``report``, unless program ``pid``'s slot already holds a report: where a later kernel
    of the call only finds the consequence of what an earlier one reported in that slot (rows
    missing because a sender found its input bad), the cause is kept."""
    board = status_addr.to(tl.pointer_type(tl.int64))
    if read_board(board + (pid + 1) * 4) == 0:
        report(status_addr, pid, code, peer, what, expected)


#: A call counter word (``ctl[0]``) holds the finished calls above this bit and, below it, the
#: part of the current call's count that its programs added so far (``count_out``): a grid of
#: fewer than ``2**20`` programs, and ``2**43`` calls before it wraps.
CALL_SHIFT = tl.constexpr(20)
CALL_ONE = tl.constexpr(1 << 20)  # one call's weight on the counter


@triton.jit
def calls_in(word):
    """The finished calls a call counter word holds (its bits from ``CALL_SHIFT`` up)."""
    return word >> CALL_SHIFT


@triton.jit
def calls_done(ctl_ptr):
    """The finished calls of the counter at ``ctl_ptr`` (acquire: what the kernels that counted
    them published is visible)."""
    return calls_in(tl.atomic_add(ctl_ptr, 0, sem="acquire", scope="gpu"))


@triton.jit
def begin_call(ctl_ptr):
    """The epoch of this call: one more than the last finished call's (read by every program
    before any of them can finish, see ``end_call``)."""
    return calls_in(tl.atomic_add(ctl_ptr, 0, sem="relaxed", scope="gpu")) + 1


@triton.jit
def count_out(ctl_ptr, pid, G, SYSTEM: tl.constexpr = True):
    """Count program ``pid`` of a grid of ``G`` out of the current call, with an add whose
    result it does not wait for: program 0 adds ``2**CALL_SHIFT - (G - 1)``, every other one
    1, so the word reaches the next multiple of ``2**CALL_SHIFT`` when the last of them is
    out, and until then every program still reads the call's number (``begin_call``). A
    ticket whose reply decides who is last costs each program that round trip to the word at
    its very end (1.2-1.5 us of a bare GEMV tile's call on an H200, where this add costs
    0.0-0.3). Release after the stores of every thread of the program, at system scope
    (``SYSTEM``, the default: a peer that reads the word through the heap,
    ``flag_kernels.counter_wait_kernel``, sees them once it sees the count) or at device
    scope."""
    weight = tl.where(pid == 0, CALL_ONE - (G - 1), 1).to(tl.int64)
    # one thread adds: the barrier puts every thread's stores before its (cumulative) release
    tl.debug_barrier()
    if SYSTEM:
        tl.atomic_add(ctl_ptr, weight, sem="release", scope="sys")
    else:
        tl.atomic_add(ctl_ptr, weight, sem="release", scope="gpu")


@triton.jit
def take_ticket(ctl_ptr, epoch, G, ADVANCE: tl.constexpr):
    """Count this program of a grid of ``G`` out on the ticket ``ctl[1]`` and wait for the
    reply; the last one resets it and (``ADVANCE``) publishes ``epoch`` on the counter
    ``ctl[0]`` for the next call. Safe because every program read the epoch before taking its
    ticket. Returns whether this program was the last (what ``count_out`` does not tell, for
    its price)."""
    ticket = tl.atomic_add(ctl_ptr + 1, 1, sem="acq_rel", scope="gpu")
    last = ticket == G - 1
    tl.atomic_xchg(ctl_ptr + 1, 0, mask=last, sem="relaxed", scope="gpu")
    if ADVANCE:
        tl.atomic_xchg(ctl_ptr, epoch.to(tl.int64) << CALL_SHIFT, mask=last, sem="release",
                       scope="gpu")
    return last


@triton.jit
def end_call(ctl_ptr, epoch):
    """Count this program out; the last one of the launch (a 1-D grid) publishes ``epoch`` for
    the next call (``take_ticket``). Returns whether this program was the last."""
    return take_ticket(ctl_ptr, epoch, tl.num_programs(0), True)


@triton.jit
def wait_peers(flags_ptr, kind: tl.constexpr, pid, rank, world, epoch, tag, clock_ptr,
               timeout_us, status_addr, ok, G_MAX: tl.constexpr):
    """Wait for ``flags[q][pid]`` (a ``[world, G_MAX]`` flag array in the local heap) of every
    peer q to hold this epoch and ``tag``; report a timeout or a tag mismatch (flag ``kind``) and
    return ``ok`` and-ed with the outcome. After a failure it stops waiting, so a missing peer
    costs one timeout, not one per flag."""
    for q in range(0, world):
        if q != rank:
            what = (q * G_MAX + pid).to(tl.int64) + (kind << 32)
            ok = await_flag(flags_ptr + q * G_MAX + pid, epoch, tag, clock_ptr, timeout_us,
                            status_addr, pid, q, what, ok, True)
    tl.debug_barrier()  # the acquiring thread's view becomes the whole program's
    return ok


@triton.jit
def call_flag(epoch, tag, ok):
    """The word a program signals with: its shape tag while it is on track, FAILED_TAG once it
    has given up (so peers do not take unwritten data for results)."""
    return flag_value(epoch, tl.where(ok, tag, FAILED_TAG))


@triton.jit
def signal_peers(flags_ptr, bases_ptr, pid, rank, world, value, G_MAX: tl.constexpr):
    """Set ``flags[rank][pid]`` to ``value`` in every peer's heap, after this program's stores."""
    tl.debug_barrier()  # every thread's stores before the (cumulative) release
    for q in range(0, world):
        if q != rank:
            signal_peer(flags_ptr + rank * G_MAX + pid, value, bases_ptr, rank, q)


#: every this many calls a launch whose grid follows the call's shape writes the flag words its
#: grid does not write (``refresh_words``): half of the 2**31 calls past which a word that no
#: launch wrote reads as a later call's (``reached``)
REFRESH_CALLS = tl.constexpr(1 << 30)


@triton.jit
def refresh_words(flags_ptr, bases_ptr, first, pid, G, rank, world, value, G_MAX: tl.constexpr,
                  OWN: tl.constexpr = False, PEERS: tl.constexpr = True):
    """Set ``flags[rank][s]`` of a ``[world, G_MAX]`` flag array to ``value`` (the call's
    ``call_flag``) in every peer's heap (not with ``PEERS`` false), and with ``OWN`` in this
    rank's too, for every word s from ``first`` on: program ``pid`` of a grid of ``G`` takes
    s = ``first + pid``, ``first + pid + G``, ... A launch calls it, at every
    ``REFRESH_CALLS``-th call, for the words that no program of its grid writes in that call
    (``first``: how many it does write), into every heap where they are read, as its programs
    signal them.

    Why: a flag word carries the low 32 bits of its call's number, and a waiter takes a word
    that reads as up to 2**31 calls past its own call for a later call (``reached``). Where the
    grid follows the call's shape, the words of programs past a small grid are not written
    while only small-grid calls run; after 2**31 of them a call of a larger grid took those
    old words for the current call's and read data its peer had not stored yet (a wrong result
    with no error, seen on 2 emulated ranks). Written every 2**30 calls, no word is that old.
    The word of this very call is safe: a peer that runs this call with a larger grid reads it
    as this call's with another shape tag, a mismatch (``RankMismatchError``, the ranks still
    in step); a later call reads it as an earlier call's and waits for the real word.
    Called at a kernel's end, where the tiles' registers are free (a branch at the start made
    the GEMV tile spill on sm_90)."""
    for s in range(first + pid, G_MAX, G):
        if PEERS:
            signal_peers(flags_ptr, bases_ptr, s, rank, world, value, G_MAX)
        if OWN:
            tl.atomic_xchg(flags_ptr + rank * G_MAX + s, value, sem="release", scope="sys")


@triton.jit
def await_free(consumed_ptr, d, epoch, clock_ptr, timeout_us, status_addr, pid, kind, ok):
    """Wait until rank d has read what this rank sent it in the previous call
    (``consumed[d]`` holds ``epoch - 1`` or later, set by d), before overwriting it; flag
    ``kind`` names it in a timeout report. Returns ``ok`` and-ed with the outcome."""
    return await_word(consumed_ptr + d, epoch - 1, epoch, 0, clock_ptr, timeout_us, status_addr,
                      pid, d, tl.cast(d, tl.int64) + (kind << 32), ok, False)


@triton.jit
def await_free_once(consumed_ptr, d, cleared, epoch, clock_ptr, timeout_us, status_addr, pid,
                    kind, ok):
    """``await_free`` for rank d, once per call and program: bit d of ``cleared`` (an int64, so
    at most 64 ranks) records that this program already waited for d in this call. Returns
    ``(ok, cleared)`` with bit d set."""
    if ((cleared >> d) & 1) == 0:
        ok = await_free(consumed_ptr, d, epoch, clock_ptr, timeout_us, status_addr, pid, kind,
                        ok)
        cleared = cleared | (tl.full((), 1, tl.int64) << d)
    return ok, cleared


@triton.jit
def end_call_free(ctl_ptr, epoch, consumed_ptr, bases_ptr, rank, world):
    """``end_call`` of a launch whose peers write into this rank's heap: the last program out
    also sets ``consumed[rank]`` to ``epoch`` in every peer's heap (``await_free`` waits for
    it), after a barrier that orders this program's reads of the received data before its
    ticket. Every program has taken its ticket only after its own reads, so when the last one
    signals, no program of this launch reads the buffers any more."""
    tl.debug_barrier()
    if end_call(ctl_ptr, epoch):
        for q in range(0, world):
            if q != rank:
                signal_peer(consumed_ptr + rank, flag_value(epoch, 0), bases_ptr, rank, q)
