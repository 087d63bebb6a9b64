"""The symmetric heap: one exportable allocation per rank, opened by every peer, carved into
buffers at the same offsets on every rank."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from ..errors import PeerSetupError, RankMismatchError

_ALIGN = 256  # bytes; keeps every buffer aligned for 16-byte vector stores and TMA


class SymmetricHeap:
    """``nbytes`` of device memory on every rank of ``world``; rank r's kernels reach rank q's
    heap through ``bases`` (an int64 device tensor of every rank's base address as mapped here).

    Buffers are handed out by :meth:`alloc` in call order, so ranks that make the same calls get the
    same offsets; the sizes are checked across ranks when the heap is made (host-side, once).

    Making a heap is collective. If it fails on any rank (an allocation, a peer's handle that does
    not open, a peer that died), every rank frees what it had allocated and mapped and raises;
    :class:`~portable_overlap.errors.PeerSetupError` when the ranks could still tell each other."""

    def __init__(self, world, nbytes: int, owner: str = ""):
        self.world = world
        self.backend = world.backend
        self.device = world.device
        nbytes = int(math.ceil(nbytes / _ALIGN) * _ALIGN)
        # which heap of the world each rank makes, and for whom: heaps pair by the order they
        # are made in, so two made in other orders on two ranks (workspaces "A" then "B" on
        # one, "B" then "A" on the other, of one size) paired A with B, and the ranks' stores
        # landed in each other's other buffers with no error until close
        made = world.all_gather_object((nbytes, world.heaps_made, owner))
        sizes = [m[0] for m in made]
        if len(set(sizes)) != 1:
            raise RankMismatchError(f"symmetric heap: ranks asked for different sizes {sizes}")
        if len(set(made)) != 1:
            raise RankMismatchError(
                "symmetric heap: ranks made different heaps at once (contexts or workspaces "
                "made in other orders, or on some ranks only; every rank must make the same "
                "ones in the same order): " + "; ".join(
                    f"rank {r}: heap {n} for {o or 'an unnamed owner'!r}"
                    for r, (_, n, o) in enumerate(made)))
        self.nbytes = nbytes
        self._alloc = None
        self._peers: dict = {}
        self._top = 0
        self._closed = False
        try:
            self.addresses: Sequence[int] = self._map_every_rank()
            self.bases = torch.tensor(self.addresses, dtype=torch.int64,
                                      device=self._alloc.tensor.device)
        except BaseException:
            self._release()
            raise
        # which of the world's heaps this is, the same number on every rank (heaps are made
        # collectively, in the same order): close checks that the ranks close the same one
        self.serial = world.heaps_made
        world.heaps_made += 1

    def _map_every_rank(self) -> tuple:
        """Collective: allocate, zero and export this rank's heap, open every peer's; every
        rank's base address as mapped here. Each step ends with every rank telling the others
        how it went (:func:`_agree`), so a step that fails on one rank raises on all of them
        instead of leaving them waiting in the next collective."""
        handle, error = _attempt(self._alloc_and_export)
        handles = _agree(self.world, "allocate its heap", handle, error)
        _, error = _attempt(lambda: self._open_peers(handles))
        # the last agreement is also the barrier: every rank has zeroed and mapped its heap
        # before any rank stores to a peer
        _agree(self.world, "map its peers' heaps", None, error)
        self.backend.exported_everywhere(self._alloc)
        return tuple(self._alloc.address if r == self.world.rank else self._peers[r].address
                     for r in range(self.world.world_size))

    def _alloc_and_export(self):
        self._alloc = self.backend.alloc_exportable(self.nbytes, self.device)
        self._alloc.tensor.zero_()
        return self.backend.export_handle(self._alloc)

    def _open_peers(self, handles: Sequence) -> None:
        for r, h in enumerate(handles):
            if r != self.world.rank:
                self._peers[r] = self.backend.open_handle(h, self.nbytes, self.device)
        self.backend.synchronize(self.device)  # the zeroing is done before peers may store

    def _release(self) -> None:
        """Unmap the peers' heaps and free this rank's (local: :meth:`close` makes it safe for
        the peers). Every step is tried even if one fails; the first failure is raised."""
        errors = self._unmap_peers()
        alloc, self._alloc = self._alloc, None
        if alloc is not None:
            errors.append(_attempt(lambda: self.backend.free(alloc))[1])
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def _unmap_peers(self) -> list:
        """Close every peer mapping (each tried); the errors, None for those that closed."""
        peers, self._peers = list(self._peers.values()), {}
        return [_attempt(lambda m=m: self.backend.close_handle(m))[1] for m in peers]

    def set_up(self, owner: str, fn):
        """Collective: ``fn()``, this rank's set-up of what lives on the heap (its views, host
        buffers, descriptors), then every rank's outcome. Where it failed on any rank, every
        rank closes the heap (together: the close is collective) and raises
        :class:`~portable_overlap.errors.PeerSetupError` naming the ranks and their errors
        (``owner``: what was being made), instead of the failing rank alone leaving, or closing
        the heap into whatever collective its peers meet next. Returns ``fn()``'s value."""
        value, error = _attempt(fn)
        try:
            _agree(self.world, "set it up", None, error, subject=owner)
        except PeerSetupError:
            _attempt(self.close)  # (the agreement's error says what went wrong)
            raise
        return value

    def alloc(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed tensor in the heap at the same offset on every rank."""
        if self._alloc is None:
            raise RuntimeError("symmetric heap: alloc after close; make a new heap")
        numel = math.prod(shape)
        size = numel * torch.empty((), dtype=dtype).element_size()
        start = int(math.ceil(self._top / _ALIGN) * _ALIGN)
        if start + size > self.nbytes:
            raise MemoryError(f"symmetric heap of {self.nbytes} bytes is full "
                              f"(asked {size} more at offset {start})")
        self._top = start + size
        return self._alloc.tensor[start:start + size].view(dtype).view(shape)

    def offset_of(self, t: torch.Tensor) -> int:
        off = t.data_ptr() - self._alloc.address
        if not 0 <= off < self.nbytes:
            raise ValueError("tensor is not in this symmetric heap")
        return off

    def peer_address(self, t: torch.Tensor, peer: int) -> int:
        """Where ``t`` (a heap tensor) lives in ``peer``'s heap, as mapped in this process."""
        return self.addresses[peer] + self.offset_of(t)

    def close(self) -> None:
        """Collective: waits until every rank's queued kernels are done before unmapping, so
        no peer can still be storing into this heap, and until every rank has unmapped the
        others' heaps before freeing its own."""
        if self._closed:
            return
        self._closed = True
        self.backend.synchronize(self.device)
        # the exchange is also the barrier: every rank's launches are done before any unmaps
        closing = self.world.all_gather_object((self.serial, self.nbytes))
        if any(c != closing[0] for c in closing):
            # Contexts closed in other orders on other ranks: a peer closing another heap now
            # still maps this one, and freeing an allocation another process has open is
            # undefined on HIP. Nothing is unmapped or freed (the heap stays allocated until
            # the process ends); every rank raises, naming what each closed.
            raise RankMismatchError(
                "ranks closed different symmetric heaps at once (contexts closed in other "
                "orders, or closed on some ranks only; every rank must close the same "
                "contexts in the same order): " + "; ".join(
                    f"rank {r}: heap {n} of {b} bytes" for r, (n, b) in enumerate(closing))
                + ". This heap is left allocated")
        # every rank unmaps the others' heaps before any rank frees its own: HIP leaves freeing
        # an exported allocation that another process still has open undefined
        errors = self._unmap_peers()
        self.world.barrier()
        errors.append(_attempt(self._release)[1])
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first


def _attempt(fn):
    """``(fn(), None)``, or ``(None, the exception)`` if it raised one."""
    try:
        return fn(), None
    except Exception as e:
        return None, e


def _agree(world, what: str, value, error: Optional[Exception],
           subject: str = "symmetric heap") -> list:
    """Collective: every rank's ``value``; raises PeerSetupError on every rank if any rank could
    not ``what`` (its ``error`` not None), chained to this rank's own error. ``subject``: what
    was being made, in the message."""
    gathered = world.all_gather_object(
        (value, None if error is None else f"{type(error).__name__}: {error}"))
    failed = [f"rank {r} could not {what}: {e}" for r, (_, e) in enumerate(gathered) if e]
    if failed:
        raise PeerSetupError(f"{subject} of {world.world_size} ranks not made: "
                             + "; ".join(failed) + ". Every rank freed what it had set up; fix "
                             f"the cause on the ranks named and make the {subject} again") \
            from error
    return [v for v, _ in gathered]


def heap_bytes(buffers: Sequence[tuple[Sequence[int], torch.dtype]]) -> int:
    """The heap size that holds ``buffers`` (shape, dtype) allocated in this order."""
    top = 0
    for shape, dtype in buffers:
        top = int(math.ceil(top / _ALIGN) * _ALIGN)
        top += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return int(math.ceil(top / _ALIGN) * _ALIGN) + _ALIGN
