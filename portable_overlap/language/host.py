"""The host side of the device API's descriptor: filling it, and naming the flags a kernel's
reports point at. Shared by :class:`portable_overlap.Workspace` and the ops' contexts."""
from __future__ import annotations

from typing import Sequence

import torch

from . import (BAD_PEER_KIND, BAD_POINTER_KIND, CTX_BASES, CTX_HEAP, CTX_HEAP_BYTES, CTX_RANK,
               CTX_STATUS, CTX_TIMEOUT_US, CTX_WORLD, REPORT_OFFSET)
from . import CTX_CLOCK as _CLOCK
from ..shmem.device import CALL_SHIFT as _SHIFT

#: words before the per-rank heap bases
CTX_WORDS = int(CTX_BASES.value)
#: the first of the two deadline-clock words (``shmem.device.call_deadline`` / ``live``)
CTX_CLOCK = int(_CLOCK.value)
_OFFSET_BIT = int(REPORT_OFFSET.value)
#: report kinds given to the flag arrays named from offsets (above any op's own flag kinds)
FIRST_OFFSET_KIND = 1000
#: the bit from which a call counter word counts finished calls (``shmem.device.CALL_SHIFT``)
CALL_SHIFT = int(_SHIFT.value)


def calls_counted(counter: torch.Tensor) -> int:
    """The finished calls a call counter word holds (``ctx[0]`` of a descriptor, ``ctl[0]``
    of an op's context), read on the host: the word's bits from ``CALL_SHIFT`` up. The bits
    below count the programs of a call still running; they are 0 between calls."""
    return int(counter.reshape(-1)[0]) >> CALL_SHIFT


def descriptor_words(world_size: int) -> int:
    """The int64 words of a descriptor for ``world_size`` ranks."""
    return CTX_WORDS + world_size


def fill_descriptor(ctx: torch.Tensor, heap, rank: int, timeout_us: int,
                    status_address: int) -> None:
    """Write a descriptor (``ctx``: int64 heap words, zeroed) for this rank: the call counter
    and the deadline clock stay 0; rank, world size, timeout, status board, this rank's heap
    base and every rank's heap base as mapped in this process."""
    addresses = list(heap.addresses)
    words = [0] * CTX_WORDS
    words[int(CTX_RANK.value)] = rank
    words[int(CTX_WORLD.value)] = len(addresses)
    words[int(CTX_TIMEOUT_US.value)] = timeout_us
    words[int(CTX_STATUS.value)] = status_address
    words[int(CTX_HEAP.value)] = addresses[rank]
    words[int(CTX_HEAP_BYTES.value)] = heap.nbytes
    ctx.copy_(torch.tensor(words + addresses, dtype=torch.int64))


def name_offset_reports(status, regions: Sequence[tuple]) -> dict:
    """Rewrite every report whose flag is a heap offset (``language._report``) as
    ``(kind << 32) | flat index`` of the region holding it; ``regions``: ``(heap offset,
    nbytes, label)`` of the flag arrays. Returns the labels by kind, for the status board's
    messages (an offset outside every region is named as such)."""
    names = {FIRST_OFFSET_KIND - 1: "unknown (not a flag of this workspace)",
             int(BAD_PEER_KIND.value): "peer rank (not in 0 .. world size - 1)",
             int(BAD_POINTER_KIND.value): "pointer given to remote_ptr outside this rank's "
                                          "heap (the value: its byte offset from the heap's "
                                          "base; a copy of a heap tensor, or another "
                                          "workspace's?)"}
    for i, (_, _, label) in enumerate(regions):
        names[FIRST_OFFSET_KIND + i] = label
    words = status.words
    for pid in words[:, 0].nonzero().flatten().tolist():
        what = int(words[pid, 2])
        if not (what >> _OFFSET_BIT) & 1:
            continue  # the op's own (kind, index) form
        where = what & ((1 << _OFFSET_BIT) - 1)
        kind, index = FIRST_OFFSET_KIND - 1, where
        for i, (off, size, _) in enumerate(regions):
            if off <= where < off + size:
                kind, index = FIRST_OFFSET_KIND + i, (where - off) // 8
                break
        words[pid, 2] = (kind << 32) | (index & 0xFFFFFFFF)
    return names
