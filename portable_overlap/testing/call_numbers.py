"""Moving a context's call numbers on without making the calls, for the tests of what happens
far from call 0 (the CPU suite's ``tests/test_call_orders.py`` and the GPU checks' refresh).

A context counts its finished calls in a counter word (the bits from ``CALL_SHIFT`` up of
``ws.ctx[0]``, a descriptor's, or of an op's ``ctl[0]``), and every flag word a kernel writes
holds the low 32 bits of its call's number in its low half (its shape tag in the high half).
:func:`move_on` adds ``n`` to both, as if the context had made ``n`` more calls whose launches
wrote those words: the next call's kernels then run with the call number the test wants (the
every-``REFRESH_CALLS``-th call that refreshes the words a grid does not write, call ``2**31``
past a word's last write).

Works on the tensors where they live (CPU or a GPU) with torch ops. Each rank moves the words
of its own heap, on every rank, between calls: the caller synchronizes the device and meets
its peers at a barrier before (the peers' last signals into this heap have landed) and after
(no peer's next call reads a word not moved yet). Move a context on only after its first
call: a word still 0 does not move (it reads as no call), and a fresh context's ``consumed``
words are 0 for "call 0 is done"; moved on before any call, its first call waits for them
until it times out."""
from __future__ import annotations

from typing import Sequence, Union

import torch

from ..language.host import CALL_SHIFT, calls_counted

#: the bits of a flag word that hold its call's number
CALL_MASK = 0xFFFFFFFF

Counters = Union[torch.Tensor, Sequence[torch.Tensor]]


def calls_done(counter: torch.Tensor) -> int:
    """The finished calls the counter word ``counter[0]`` holds (a host read: a device sync
    where it lives on a GPU)."""
    return calls_counted(counter)


def call_of(word: torch.Tensor) -> int:
    """The call number (its low 32 bits) a flag word holds (one element, read on the host)."""
    return int(word.reshape(-1)[0]) & CALL_MASK


def _counters(counters: Counters) -> list:
    return [counters] if isinstance(counters, torch.Tensor) else list(counters)


def move_on(counters: Counters, n: int, words: Sequence[torch.Tensor]) -> None:
    """Move a context ``n`` calls on, as if it had made them with a small grid: the call
    counter of each of ``counters`` (its first element: ``ws.ctx``, an op's ``ctl``, or a
    view at a launch's own counter such as ``ctl[2:]``; between calls its low bits, the
    programs still running, are 0), and the flag words ``words`` (views of its flag arrays: the
    words such calls write). A word still 0 (never written) stays 0: it reads as no call."""
    if n < 0:
        raise ValueError(f"move_on: n must be >= 0, got {n}")
    for counter in _counters(counters):
        flat = counter.view(-1)
        flat[0] = (calls_done(flat) + n) << CALL_SHIFT
    for word in words:
        # the tag stays; the call number wraps at 32 bits, as the kernels' words do
        moved = (word & ~CALL_MASK) | ((word + n) & CALL_MASK)
        word.copy_(torch.where(word != 0, moved, word))


def move_to(counters: Counters, call: int, words: Sequence[torch.Tensor]) -> None:
    """:func:`move_on` so that the context's next call is number ``call`` (counted by the
    first of ``counters``, which the others follow): every word that holds a call moves on by
    as many calls. ``call`` must be past the calls made."""
    first = _counters(counters)[0]
    move_on(counters, call - 1 - calls_done(first), words)


def unrefreshed(checked: Sequence[tuple], call: int) -> list:
    """The rows of ``checked`` (``(name, row)``: flag words in this rank's heap) with words that
    do not hold ``call``'s number, each as ``"name: n words, first i holds 0x..."``."""
    stale = []
    for name, row in checked:
        bad = ((row & CALL_MASK) != call & CALL_MASK).nonzero().flatten()
        if bad.numel():
            stale.append(f"{name}: {bad.numel()} words, first {int(bad[0])} holds "
                         f"{call_of(row[bad[0]]):#x}")
    return stale


def _in_step(world) -> None:
    """Every rank's device idle and every rank here: no kernel reads or writes a flag word."""
    world.backend.synchronize(world.device)
    world.barrier()


def calls_at_numbers(world, numbers: dict, moves: Sequence[tuple], checked: Sequence[tuple],
                     calls: Sequence):
    """Make ``calls`` (functions of no argument) in order, the ranks meeting before each (the
    peers' last writes into this heap have landed); call ``i`` of ``numbers`` as call number
    ``numbers[i]``: before it, each ``(counters, words)`` of ``moves`` (a context's) moves
    there (:func:`move_to`), and the ranks meet again (every rank's words moved before any call
    reads them). Yields ``(i, what call i returned, stale)``: ``stale`` is, for the calls of
    ``numbers``, :func:`unrefreshed` of ``checked`` once every rank's call has ended (the words
    it or its refresh wrote), else None."""
    for i, call in enumerate(calls):
        _in_step(world)
        if i in numbers:
            for counters, words in moves:
                move_to(counters, numbers[i], words)
            _in_step(world)
        value = call()
        stale = None
        if i in numbers:
            _in_step(world)
            stale = unrefreshed(checked, numbers[i])
        yield i, value, stale
