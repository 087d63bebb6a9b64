"""Copy-engine transport: DMA copies into peers' heaps, ordered on a side stream.

The producer (any kernel or library call on the caller's stream) computes a piece; the side stream
waits for it (an event), waits until the destination's receive buffer is free, copies the piece
into the destination's heap on the copy engine (no SM), then a one-program kernel sets the
destination's ready flag. The receiver's side stream waits for the ready flag (a one-program,
bounded wait) and copies the piece where it belongs. Nothing polls on the host, every wait is
bounded (a timeout is recorded on the status board and raised by the context's next check), and
every flag carries the call's epoch from the heap, so CUDA-graph replays stay correct.

Flags (heap, int64, ``(tag << 32) | epoch`` as in shmem.device):
``ready[q][k]``  set by rank q once its k-th transfer into this rank landed (this call's epoch);
``consumed[d]``  set by rank d once it copied out everything this rank sent it, or pulled what
                 this rank offered (that call's epoch): a sender waits for
                 ``consumed[d] == epoch - 1`` before its first copy into d. An op whose ranks
                 copy into their peers sets it only once its own copies of the call, into every
                 peer, have landed too: a rank that failed a call waits for every peer's word
                 of it before its next call (``OverlapContext.settle_late_stores``), so a late
                 peer's copies of the failed call cannot land inside the next call's data.
"""
from __future__ import annotations

import contextlib

import torch

from .flag_kernels import epoch_kernel, landed_kernel, signal_kernel, wait_kernel

#: the wait kernels' "what" words: (kind << 32) | index, named in errors
KIND_READY, KIND_CONSUMED = 1, 2
FLAG_NAMES = {KIND_READY: "piece-ready", KIND_CONSUMED: "recv-consumed"}


class CopyEngineLinks:
    """The copy-engine links of one context's rank to its peers. ``ready`` is a heap int64
    ``[world, slots]`` tensor, ``consumed`` ``[world]`` and ``ctl`` ``[1]`` (the epoch)."""

    def __init__(self, ctx, ready: torch.Tensor, consumed: torch.Tensor, ctl: torch.Tensor,
                 lanes: int = 1):
        self.ctx = ctx
        self.world = ctx.world
        self.backend = ctx.world.backend
        self.rank = ctx.rank
        self.ready, self.consumed, self.ctl = ready, consumed, ctl
        self.slots = ready.shape[1]
        ctx.call_protocol(ctl, call_flags=(ready,), free_flags=(consumed,))
        dev = self.world.device
        self._mod = torch.get_device_module(dev)
        # the interpreter runs everything in program order: no side stream there. Lanes are
        # independent side streams: a transfer waiting for a peer on one does not hold the
        # transfers queued on another. High priority: their flag kernels are one program each and
        # gate whole transfers, so they should take the next free SM slot ahead of the GEMM's
        # next tiles rather than after them.
        self._lanes = [self._mod.Stream(priority=-1) if dev.type != "cpu" else None
                       for _ in range(lanes)]
        self.side = self._lanes[0]
        self._followed: set = set()  # lanes forked from the caller's stream in this call
        self._launch = {}
        one = dict(num_warps=1, num_stages=1)
        tag0 = 1
        st = ctx.status.address
        self._launch["epoch"] = ctx._compile(epoch_kernel, 1, one, lambda g: (ctl,))
        clock = ctx.call_clock
        self._launch["signal"] = ctx._compile(
            signal_kernel, 1, one,
            lambda g: (consumed, ctx.heap.bases, self.rank, (self.rank + 1) % self.world.world_size,
                       ctl, 0, tag0, clock, st))
        self._launch["landed"] = ctx._compile(
            landed_kernel, 1, dict(one, BLOCK=128),
            lambda g: (ready, 1, ctl, tag0, clock, st))
        for check in (True, False):
            self._launch[("wait", check)] = ctx._compile(
                wait_kernel, 1, dict(one, CHECK_TAG=check),
                lambda g: (consumed, 0, ctl, 0, tag0, clock, ctx.timeout_us, st, 0, 1 << 33))

    @property
    def lanes(self) -> int:
        """How many side streams (lanes) the links have."""
        return len(self._lanes)

    # -- streams ---------------------------------------------------------------------------------
    def begin(self) -> None:
        """Start a call on the caller's stream (advances the epoch)."""
        self._followed = set()
        self._launch["epoch"]((self.ctl,))

    def follow(self, lane: int = 0) -> None:
        """Side stream ``lane`` waits for what the caller's stream has queued so far."""
        if self._lanes[lane] is not None:
            self._lanes[lane].wait_stream(self._mod.current_stream())
            self._followed.add(lane)

    def rejoin(self) -> None:
        """The caller's stream waits for everything queued on the side streams this call forked
        (``follow``). A lane the call never forked holds none of its work, and waiting on it
        would break a CUDA-graph capture: the capture would depend on a stream outside it (on
        one rank there are no peers, so no lane is forked at all)."""
        for lane in sorted(self._followed):
            self._mod.current_stream().wait_stream(self._lanes[lane])
        self._followed = set()

    @contextlib.contextmanager
    def on_side(self, lane: int = 0):
        if self._lanes[lane] is None:
            yield
        else:
            with self._mod.stream(self._lanes[lane]):
                yield

    # -- transfers (call inside on_side) ---------------------------------------------------------
    def wait_consumed(self, d: int) -> None:
        """Hold until rank d has copied out what this rank sent it in the previous call."""
        what = (KIND_CONSUMED << 32) | d
        self._launch[("wait", False)]((self.consumed[d:], d, self.ctl, 1, 0, self.ctx.call_clock,
                                       self.ctx.timeout_us, self.ctx.status.address, d, what))

    def put(self, d: int, dst: torch.Tensor, src: torch.Tensor, slot: int, tag: int) -> None:
        """Copy ``src`` (local) into ``dst``'s place (a local heap view) in rank d's heap, then set
        ``ready[rank][slot]`` there. Both contiguous, or both 2-D strided views with contiguous
        rows (see ``_copy``)."""
        self._copy(dst, src, dst_peer=d)
        self.notify(d, slot, tag)

    def wait_ready(self, q: int, slot: int, tag: int) -> None:
        """Hold until rank q's transfer ``slot`` of this call has landed here (and q's tag
        matches this rank's)."""
        what = (KIND_READY << 32) | (q * self.slots + slot)
        self._launch[("wait", True)]((self.ready[q, slot:], q, self.ctl, 0, tag,
                                      self.ctx.call_clock, self.ctx.timeout_us,
                                      self.ctx.status.address, q * self.slots + slot, what))

    def pull(self, q: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src``'s place (a local heap view) in rank q's heap into ``dst`` (local,
        contiguous): the receiver's copy engine reads over the link, so a peer's result lands
        where the caller wants it with no staging copy on this side."""
        self._copy(dst, src, src_peer=q)

    def notify(self, d: int, slot: int, tag: int) -> None:
        """Set ``ready[rank][slot]`` on rank d with no copy (what d pulls is ready here)."""
        self._signal(self.ready[self.rank, slot:], d, 0, tag)

    def copy_local(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._copy(dst, src)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, *, dst_peer: int | None = None,
              src_peer: int | None = None) -> None:
        """``src``'s elements into ``dst`` on the current stream's copy engine; a tensor with a
        peer named stands for its place (a heap view) in that peer's heap. Both contiguous: one
        1-D copy of the bytes. Otherwise both must be 2-D views of one shape whose rows are
        contiguous (``stride(1) == 1``, any ``stride(0)``), e.g. a column block of a row-major
        matrix: one 2-D copy (``height`` rows of ``width`` bytes, each side's row pitch
        ``stride(0)`` elements). Nothing for an empty piece (whose view may sit at the heap's
        end, where it has no peer address)."""
        if not src.numel():
            return
        heap, es = self.ctx.heap, src.element_size()
        dst_addr = dst.data_ptr() if dst_peer is None else heap.peer_address(dst, dst_peer)
        src_addr = src.data_ptr() if src_peer is None else heap.peer_address(src, src_peer)
        stream = self.backend.current_stream(self.world.device)
        if src.is_contiguous() and dst.is_contiguous():
            self.backend.copy_async(dst_addr, src_addr, src.numel() * es, stream)
            return
        if src.dim() != 2 or dst.shape != src.shape or dst.element_size() != es or not all(
                t.stride(1) == 1 or t.shape[1] == 1 for t in (src, dst)):
            raise ValueError(
                f"copy engine: a strided copy needs two 2-D views of one shape with contiguous "
                f"rows; got {tuple(src.shape)} strides {src.stride()} into {tuple(dst.shape)} "
                f"strides {dst.stride()}")
        height, width = src.shape[0], src.shape[1] * es
        # a single row's pitch is never used, but the 2-D copies reject a pitch below the width
        dst_pitch, src_pitch = ((t.stride(0) * es if height > 1 else width) for t in (dst, src))
        self.backend.copy_2d_async(dst_addr, dst_pitch, src_addr, src_pitch, width, height,
                                   stream)

    def landed(self, flags: torch.Tensor, tag: int) -> None:
        """Set the local heap flags ``flags`` (a contiguous int64 view) to this call's epoch and
        ``tag`` once what was queued before on the current stream is done: rows a copy brought
        in, for a kernel of this rank that waits for them."""
        self._launch["landed"]((flags, flags.numel(), self.ctl, tag, self.ctx.call_clock,
                                self.ctx.status.address))

    def release(self, q: int) -> None:
        """Tell rank q that this rank has copied out everything q sent it in this call."""
        self._signal(self.consumed[self.rank:], q, 0, 0)

    def _signal(self, flag: torch.Tensor, peer: int, back: int, tag: int) -> None:
        self._launch["signal"]((flag, self.ctx.heap.bases, self.rank, peer, self.ctl, back, tag,
                                self.ctx.call_clock, self.ctx.status.address))
