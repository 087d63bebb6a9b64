"""One-program kernels that order copy-engine transfers between ranks: they sit on a stream
between DMA copies, so a transfer starts only once its data exists and its destination is free,
and the host never polls.

They use the heap's epoch/tag flags (shmem.device): the call counter ``ctl[0]`` holds the current
call's epoch (``shmem.device.calls_in``), advanced by ``epoch_kernel`` at the start of each call
on the producing stream, so CUDA-graph replays see a new epoch each time (a host counter would
be frozen into the graph).
"""
import triton
import triton.language as tl

from ..shmem.device import (CALL_ONE, CALL_SHIFT, FAILED_TAG, REFUSED_TAG, STATUS_TIMEOUT,
                            await_word, calls_done, calls_in, flag_value, live, peer_ptr,
                            poll_count, read_board, report, signal_peer)


@triton.jit
def read_status(status_addr):
    """The status board's header word (set by any kernel of this rank that gave up), read past
    every cache (``shmem.device.read_board``)."""
    return read_board(status_addr.to(tl.pointer_type(tl.int64)))


@triton.jit
def epoch_kernel(ctl_ptr):
    """Start a call: count one more on ``ctl[0]`` (stream-ordered before every signal and wait
    of the call)."""
    tl.atomic_add(ctl_ptr, CALL_ONE, sem="release", scope="gpu")


# Launched with varying flag addresses, peers, slots and tags through one compiled kernel each
# (ops.launch.PlannedLaunch): no argument may be specialized on its value or alignment.
_SIGNAL_ARGS = ["flag_ptr", "bases_ptr", "rank", "peer", "ctl_ptr", "back", "tag", "clock_ptr",
                "status_addr"]
_WAIT_ARGS = ["flag_ptr", "peer", "ctl_ptr", "back", "tag", "clock_ptr", "timeout_us",
              "status_addr", "slot", "what"]


@triton.jit(do_not_specialize=_SIGNAL_ARGS, do_not_specialize_on_alignment=_SIGNAL_ARGS)
def signal_kernel(flag_ptr, bases_ptr, rank, peer, ctl_ptr, back, tag, clock_ptr, status_addr):
    """Set the flag at local heap address ``flag_ptr`` in ``peer``'s heap to (the epoch
    ``ctl[0] - back``, ``tag``), or to the failure tag once any wait of this rank has given up
    (the status board's header word, or the context's out-of-step mark), so the peer does not
    take unwritten data for results. Launched after the DMA it announces, on the same stream: a
    stream starts a kernel only once the copy before it has completed, and the release store
    publishes it system-wide."""
    epoch = calls_done(ctl_ptr) - back
    failed = (read_status(status_addr) != 0) | (live(clock_ptr) == 0)
    signal_peer(flag_ptr, flag_value(epoch, tl.where(failed, FAILED_TAG, tag)), bases_ptr, rank,
                peer)


_LANDED_ARGS = ["flags_ptr", "n", "ctl_ptr", "tag", "clock_ptr", "status_addr"]


@triton.jit(do_not_specialize=_LANDED_ARGS, do_not_specialize_on_alignment=_LANDED_ARGS)
def landed_kernel(flags_ptr, n, ctl_ptr, tag, clock_ptr, status_addr, BLOCK: tl.constexpr):
    """Set ``n`` consecutive flags of this rank's heap to (the epoch ``ctl[0]``, ``tag``), or to
    the failure tag once any wait of this rank has given up: what a copy queued before it on
    the same stream brought in (a pull from a peer, a local copy) has landed, for a kernel of
    this rank that waits for those rows. Release at system scope, as ``signal_kernel``."""
    epoch = calls_done(ctl_ptr)
    failed = (read_status(status_addr) != 0) | (live(clock_ptr) == 0)
    value = flag_value(epoch, tl.where(failed, FAILED_TAG, tag))
    offs = tl.arange(0, BLOCK)
    for i in range(0, n, BLOCK):
        tl.atomic_xchg(flags_ptr + i + offs, tl.full((BLOCK,), value, tl.int64),
                       mask=i + offs < n, sem="release", scope="sys")


@triton.jit(do_not_specialize=_WAIT_ARGS, do_not_specialize_on_alignment=_WAIT_ARGS)
def wait_kernel(flag_ptr, peer, ctl_ptr, back, tag, clock_ptr, timeout_us, status_addr, slot,
                what, CHECK_TAG: tl.constexpr):
    """Hold the stream until the local flag holds the epoch ``ctl[0] - back`` (and ``tag`` when
    CHECK_TAG), until the call's deadline at most (``timeout_us`` after the call's first wait
    began); on a timeout, a peer's failure tag or another tag, record it in status slot
    ``slot`` (the host raises at its next check) and return, so a stream is never held
    forever."""
    call = calls_done(ctl_ptr)
    await_word(flag_ptr, call - back, call, tag, clock_ptr, timeout_us, status_addr, slot, peer,
               what, live(clock_ptr), CHECK_TAG)


_COUNTER_ARGS = ["rank", "peer", "slot", "what"]


@triton.jit(do_not_specialize=_COUNTER_ARGS, do_not_specialize_on_alignment=_COUNTER_ARGS)
def counter_wait_kernel(ctl_ptr, bases_ptr, rank, peer, clock_ptr, timeout_us, status_addr, slot,
                        what):
    """Hold the stream until ``peer``'s call counter (its copy of ``ctl[0]``, read through the
    heap) has counted as many calls as this rank's: every kernel of ``peer`` up to that call
    has ended (its programs count out with a release at system scope after their stores, or
    it refused the call), so nothing of it lands here any more. Bounded by the call's deadline
    as ``wait_kernel``; a timeout is recorded in status slot ``slot`` (``what`` names the
    counter) and marks the context out of step."""
    want = calls_done(ctl_ptr)
    seen = poll_count(peer_ptr(ctl_ptr, bases_ptr, rank, peer), want << CALL_SHIFT, want,
                      clock_ptr, timeout_us, "sys")
    if calls_in(seen) < want:
        report(status_addr, slot, STATUS_TIMEOUT, peer, what, want)
        tl.atomic_xchg(clock_ptr + 1, want, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["n_slots", "rank", "clean"])
def refuse_kernel(ctl_ptr, flags_ptr, n_slots, bases_ptr, rank, world, status_addr, clock_ptr,
                  clean, ADVANCE: tl.constexpr, FREE: tl.constexpr, BLOCK: tl.constexpr):
    """Stand in for a call this rank gave up on the host (bad input found before any launch),
    so its peers' waits for that call end at once and no later call is paired with the wrong
    one. ADVANCE: count the call on ``ctl[0]`` (the epoch a finished call leaves there).
    Then, with that epoch, either set this rank's words of a ``[world, n_slots]`` flag array in
    every peer's heap to a failure tag (the call's results will not come), or (FREE) this
    rank's word of a ``[world]`` "consumed" array (nothing of the call is left to read here,
    so peers may write into this rank's buffers for the next call).

    The words are written at once, possibly over the previous call's words before a slower
    peer read them (that peer still waits in the previous call). The tag tells it what it
    lost: REFUSED_TAG when this rank delivered the previous calls in full (``clean``: none
    raised on the host; the status board clean and no timeout here, for a failure the host
    has not seen yet), which that peer takes as its word; else FAILED_TAG, a failure for it
    too."""
    if ADVANCE:
        epoch = calls_in(tl.atomic_add(ctl_ptr, CALL_ONE, sem="acq_rel", scope="gpu")) + 1
    else:
        epoch = calls_done(ctl_ptr)
    delivered = (clean != 0) & (read_status(status_addr) == 0) & live(clock_ptr)
    value = flag_value(epoch, 0 if FREE else tl.where(delivered, REFUSED_TAG, FAILED_TAG))
    offs = tl.arange(0, BLOCK)
    for q in range(0, world):
        if q != rank:
            if FREE:
                signal_peer(flags_ptr + rank, value, bases_ptr, rank, q)
            else:
                for s0 in range(0, n_slots, BLOCK):
                    dst = peer_ptr(flags_ptr + rank * n_slots + s0, bases_ptr, rank, q)
                    tl.atomic_xchg(dst + offs, tl.full((BLOCK,), value, tl.int64),
                                   mask=s0 + offs < n_slots, sem="release", scope="sys")
