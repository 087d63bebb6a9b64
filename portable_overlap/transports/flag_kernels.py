"""One-program kernels that order copy-engine transfers between ranks: they sit on a stream
between DMA copies, so a transfer starts only once its data exists and its destination is free,
and the host never polls.

They use the heap's epoch/tag flags (shmem.device): ``ctl[0]`` holds the current call's epoch,
advanced by ``epoch_kernel`` at the start of each call on the producing stream, so CUDA-graph
replays see a new epoch each time (a host counter would be frozen into the graph).
"""
import triton
import triton.language as tl

from ..shmem.device import STATUS_MISMATCH, STATUS_PEER_FAILED, STATUS_TIMEOUT, flag_value, \
    report, signal_peer, wait_flag, FAILED_TAG


@triton.jit
def epoch_kernel(ctl_ptr):
    """Start a call: ``ctl[0] += 1`` (stream-ordered before every signal and wait of the call)."""
    tl.atomic_add(ctl_ptr, 1, sem="release", scope="gpu")


# Launched with varying flag addresses, peers, slots and tags through one compiled kernel each
# (ops.launch.PlannedLaunch): no argument may be specialized on its value or alignment.
_SIGNAL_ARGS = ["flag_ptr", "bases_ptr", "rank", "peer", "ctl_ptr", "back", "tag", "status_addr"]
_WAIT_ARGS = ["flag_ptr", "peer", "ctl_ptr", "back", "tag", "max_spins", "status_addr", "slot",
              "what"]


@triton.jit(do_not_specialize=_SIGNAL_ARGS, do_not_specialize_on_alignment=_SIGNAL_ARGS)
def signal_kernel(flag_ptr, bases_ptr, rank, peer, ctl_ptr, back, tag, status_addr):
    """Set the flag at local heap address ``flag_ptr`` in ``peer``'s heap to (the epoch
    ``ctl[0] - back``, ``tag``), or to the failure tag once any wait of this rank has given up
    (the status board's header word), so the peer does not take unwritten data for results.
    Launched after the DMA it announces, on the same stream: a stream starts a kernel only once
    the copy before it has completed, and the release store publishes it system-wide."""
    epoch = tl.atomic_add(ctl_ptr, 0, sem="acquire", scope="gpu") - back
    failed = tl.load(status_addr.to(tl.pointer_type(tl.int64)), volatile=True) != 0
    signal_peer(flag_ptr, flag_value(epoch, tl.where(failed, FAILED_TAG, tag)), bases_ptr, rank,
                peer)


@triton.jit(do_not_specialize=_WAIT_ARGS, do_not_specialize_on_alignment=_WAIT_ARGS)
def wait_kernel(flag_ptr, peer, ctl_ptr, back, tag, max_spins, status_addr, slot, what,
                CHECK_TAG: tl.constexpr):
    """Hold the stream until the local flag holds the epoch ``ctl[0] - back`` (and ``tag`` when
    CHECK_TAG), at most ``max_spins`` polls; on a timeout, a peer's failure tag or another tag,
    record it in status slot ``slot`` (the host raises at its next check) and return, so a
    stream is never held forever."""
    epoch = tl.atomic_add(ctl_ptr, 0, sem="acquire", scope="gpu") - back
    v, arrived = wait_flag(flag_ptr, epoch, max_spins)
    if not arrived:
        report(status_addr, slot, STATUS_TIMEOUT, peer, what, epoch)
    elif CHECK_TAG:
        if (v >> 32) == FAILED_TAG:
            report(status_addr, slot, STATUS_PEER_FAILED, peer, what, epoch)
        elif (v >> 32) != tag:
            report(status_addr, slot, STATUS_MISMATCH, peer, what, v >> 32)
