"""The symmetric heap: one exportable allocation per rank, opened by every peer, carved into
buffers at the same offsets on every rank."""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ..errors import RankMismatchError

_ALIGN = 256  # bytes; keeps every buffer aligned for 16-byte vector stores and TMA


class SymmetricHeap:
    """``nbytes`` of device memory on every rank of ``world``; rank r's kernels reach rank q's
    heap through ``bases`` (an int64 device tensor of every rank's base address as mapped here).

    Buffers are handed out by :meth:`alloc` in call order, so ranks that make the same calls get the
    same offsets; the sizes are checked across ranks when the heap is made (host-side, once)."""

    def __init__(self, world, nbytes: int):
        self.world = world
        self.backend = world.backend
        self.device = world.device
        nbytes = int(math.ceil(nbytes / _ALIGN) * _ALIGN)
        sizes = world.all_gather_object(nbytes)
        if len(set(sizes)) != 1:
            raise RankMismatchError(f"symmetric heap: ranks asked for different sizes {sizes}")
        self.nbytes = nbytes
        self._alloc = self.backend.alloc_exportable(nbytes, self.device)
        self._alloc.tensor.zero_()
        handles = world.all_gather_object(self.backend.export_handle(self._alloc))
        self._peers = {}
        addresses = []
        for r, h in enumerate(handles):
            if r == world.rank:
                addresses.append(self._alloc.address)
            else:
                m = self.backend.open_handle(h, nbytes, self.device)
                self._peers[r] = m
                addresses.append(m.address)
        self.addresses: Sequence[int] = tuple(addresses)
        self.bases = torch.tensor(addresses, dtype=torch.int64, device=self._alloc.tensor.device)
        self._top = 0
        self._closed = False
        self.backend.synchronize(self.device)
        world.barrier()  # every rank has zeroed and mapped before anyone stores to a peer
        self.backend.exported_everywhere(self._alloc)

    def alloc(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed tensor in the heap at the same offset on every rank."""
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
        no peer can still be storing into this heap."""
        if self._closed:
            return
        self._closed = True
        self.backend.synchronize(self.device)
        self.world.barrier()
        for m in self._peers.values():
            self.backend.close_handle(m)
        self._peers.clear()
        self.backend.free(self._alloc)



def heap_bytes(buffers: Sequence[tuple[Sequence[int], torch.dtype]]) -> int:
    """The heap size that holds ``buffers`` (shape, dtype) allocated in this order."""
    top = 0
    for shape, dtype in buffers:
        top = int(math.ceil(top / _ALIGN) * _ALIGN)
        top += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return int(math.ceil(top / _ALIGN) * _ALIGN) + _ALIGN
