"""Device memory a context keeps from one call to the next, made outside CUDA-graph memory pools.

A context makes some of what it keeps at the first call of a shape: a plan's index tables, a
staging buffer that grows, a launch's scratch. While torch's CUDA-graph trees
(``torch.compile(mode="reduce-overhead")``) run a function's warm-up calls, every allocation of
the calling thread (of its stream, in older torch) goes to the trees' private pool, and a
tensor of that pool still alive after the call is an error there ("tensors in the cudagraph
pool not tracked as outputs"); a kept tensor in it would also be memory the trees hand out
again. :func:`kept` makes such a tensor on a worker thread of its own, whose allocations no pool
takes, and synchronizes the device's default stream there before handing it over (its memory
may have been another tensor's, freed on that stream, and a fill runs there). A kept tensor's
memory returns to that stream's cache when the tensor is dropped: the contexts synchronize the
device in ``close`` first (``ops.context.ContextBase.close``).

Under stream capture the tensor is made as any is, by the caller (a capture cannot wait for
another thread's work), except a copy from the host (:func:`kept_tensor`), which is refused
with a message that says to make the shape's first call eagerly."""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch

_WORKER: Optional[ThreadPoolExecutor] = None
_LOCK = threading.Lock()


def _forget_worker() -> None:
    """In a forked child: the parent's worker thread does not exist there, and an executor
    whose thread is gone would queue work nothing runs."""
    global _WORKER
    _WORKER = None


os.register_at_fork(after_in_child=_forget_worker)


def _worker() -> ThreadPoolExecutor:
    global _WORKER
    with _LOCK:
        if _WORKER is None:
            _WORKER = ThreadPoolExecutor(1, thread_name_prefix="portable_overlap-kept")
        return _WORKER


def kept(make: Callable[[], torch.Tensor], device: torch.device) -> torch.Tensor:
    """``make()`` (a tensor on ``device``), made outside any CUDA-graph memory pool, its
    contents complete when it returns. On a CPU device, or while the caller's stream is being
    captured, ``make()`` itself. Never an inference tensor: a call under
    ``torch.inference_mode()`` (a serving loop's, or a graph captured under it) may be the
    one that makes it, and torch refuses the in-place writes of every later call outside that
    mode to an inference tensor."""
    device = torch.device(device)

    def normal() -> torch.Tensor:
        with torch.inference_mode(False):
            return make()

    if device.type == "cpu":
        return normal()
    module = torch.get_device_module(device)
    if module.is_current_stream_capturing():
        return normal()

    def run() -> torch.Tensor:
        with module.device(device):
            t = normal()
            module.current_stream(device).synchronize()
        return t

    return _worker().submit(run).result()


def kept_empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, kept (:func:`kept`)."""
    return kept(lambda: torch.empty(shape, dtype=dtype, device=device), device)


def kept_zeros(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``, kept (:func:`kept`)."""
    return kept(lambda: torch.zeros(shape, dtype=dtype, device=device), device)


def kept_tensor(data, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype, device=device)``, kept (:func:`kept`). Under stream
    capture, a ``RuntimeError`` that says what to do: the copy from the host is one a capture
    cannot take (torch refuses it with a message about pinned memory)."""
    device = torch.device(device)
    if device.type != "cpu" and torch.get_device_module(device).is_current_stream_capturing():
        raise RuntimeError("the first call with these shapes plans them, copying the plan's "
                           "tables to the device, which CUDA-graph capture does not allow: make "
                           "one eager call with these shapes before capturing")
    return kept(lambda: torch.tensor(data, dtype=dtype, device=device), device)


class GrowingBuffer:
    """A buffer kept from one call to the next that grows when a call needs more: ``get(n)``
    is a view of its first ``n`` elements, made at the first call and again only when a call
    needs more than it holds (no allocation on later calls of that size or smaller).

    Growth at least doubles, so calls of slowly growing sizes make a logarithmic number of
    buffers, not one per size. The buffers it outgrew are kept (``outgrown``) as long as it
    lives: a CUDA graph captured over a smaller call replays into their addresses, which,
    freed, the allocator would hand to other tensors that each replay would then overwrite.
    What it holds stays under four times the largest call's need. ``zero``: each buffer is
    zero-filled when made (for contents a kernel leaves as it found them, such as counts it
    zeroes after use, or a prefix sum's leading 0)."""

    def __init__(self, device, dtype: torch.dtype = torch.uint8, zero: bool = False):
        self.device, self.dtype, self.zero = torch.device(device), dtype, zero
        self.buffer: Optional[torch.Tensor] = None
        self.outgrown: list = []

    def get(self, numel: int) -> torch.Tensor:
        buf = self.buffer
        if buf is None or buf.numel() < numel:
            size = max(numel, 1)
            if buf is not None:
                self.outgrown.append(buf)
                size = max(numel, 2 * buf.numel())
            make = kept_zeros if self.zero else kept_empty
            buf = self.buffer = make(size, self.dtype, self.device)
        return buf[:numel]
