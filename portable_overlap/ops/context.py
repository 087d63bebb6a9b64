"""What every fused op's context shares: a symmetric heap laid out once, the status board, the
error checks, the handle registry (for torch.library ops) and planning of compiled launches."""
from __future__ import annotations

import functools
import threading
import zlib
from typing import Callable, Optional, Sequence

import torch

from ..errors import ContextBrokenError
from ..shmem.device import TAG_MASK
from ..shmem.heap import SymmetricHeap, heap_bytes
from ..shmem.status import StatusBoard
from .launch import PlannedLaunch, resident_programs

G_MAX = 1024  # most programs one launch may have (flag slots per peer)

_contexts: dict = {}
_lock = threading.Lock()


class OverlapContext:
    """Base of the ops' contexts. ``layout`` lists the heap buffers ``(attribute, shape, dtype)``;
    they are allocated in that order, so every rank gets the same offsets. Collective to create
    and to :meth:`close`; calls must come in the same order on every rank, on one stream."""

    OP = "op"
    FLAG_NAMES: dict = {}

    def __init__(self, world, layout: Sequence[tuple], timeout_s: float):
        if timeout_s <= 0:
            raise ValueError(f"{self.OP}: timeout_s must be > 0, got {timeout_s}")
        self.world = world
        self.rank = world.rank
        self.max_spins = max(1, int(timeout_s * getattr(world.backend, "poll_rate_hz", 1e6)))
        self.heap = SymmetricHeap(world, heap_bytes([(s, d) for _, s, d in layout]))
        for name, shape, dtype in layout:
            setattr(self, name, self.heap.alloc(shape, dtype))
        self.status = StatusBoard(world.backend, G_MAX)
        self._plans: dict = {}
        self._broken: Optional[str] = None
        self._sync_errors = world.backend.name == "cpu"  # the interpreter runs synchronously
        self.handle = register_context(self)

    # -- errors ----------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise if a kernel of this context reported a timeout or a mismatch. Reads host-visible
        memory only (no device sync): after ``synchronize()`` it covers every call made."""
        if self._broken is not None:
            raise ContextBrokenError(f"{self.OP} context on rank {self.rank} failed before and is "
                                     f"out of step with its peers; create a new one. First "
                                     f"error:\n{self._broken}")
        try:
            self.status.raise_if_failed(self.OP, self.rank, self.FLAG_NAMES)
        except Exception as e:
            self._broken = str(e)
            raise

    def synchronize(self) -> None:
        """Wait for this rank's queued calls, then :meth:`check`."""
        self.world.backend.synchronize(self.world.device)
        self.check()

    def close(self) -> None:
        """Collective (every rank): free the workspace once all ranks' calls have finished."""
        unregister_context(self.handle)
        self.heap.close()

    def _before_call(self) -> None:
        if self._broken is not None or self.status.failed():
            self.check()

    def _after_call(self) -> None:
        if self._sync_errors:
            self.check()

    # -- planning --------------------------------------------------------------------------------
    def _compile(self, kernel, programs: int, consts: dict,
                 make_args: Callable[[int], tuple]) -> PlannedLaunch:
        """Compile ``kernel`` for the launch's own arguments (``make_args(programs)``; the JIT
        specializes on values) and cap the grid at what is resident on the device."""
        facts = self.world.facts
        if facts.vendor == "cpu":  # the interpreter has no compiled kernel to hold on to
            return PlannedLaunch(kernel, None, programs, consts, None)
        k = kernel.warmup(*make_args(programs), grid=(programs,), **consts)
        fit = min(programs, resident_programs(k, consts["num_warps"], facts))
        if fit != programs:  # the grid size is an argument too: compile for the real one
            programs = fit
            k = kernel.warmup(*make_args(programs), grid=(programs,), **consts)
        backend, device = self.world.backend, self.world.device
        return PlannedLaunch(kernel, k, programs, consts, lambda: backend.current_stream(device))


def register_context(ctx) -> int:
    """A handle under which torch.library ops find ``ctx`` (``get_context``)."""
    with _lock:
        handle = max(_contexts, default=0) + 1
        _contexts[handle] = ctx
    return handle


def unregister_context(handle: int) -> None:
    with _lock:
        _contexts.pop(handle, None)


@functools.lru_cache(maxsize=1024)
def shape_tag(*fields) -> int:
    """The tag a call's flags carry (shmem.device): a hash of what must agree across ranks
    (shapes, dtype, tiling, grid), so a peer called or planned differently is caught. Cached:
    the per-call paths ask for it on every call."""
    return zlib.crc32(repr(fields).encode()) & TAG_MASK


def get_context(handle: int) -> OverlapContext:
    try:
        return _contexts[handle]
    except KeyError:
        raise ValueError(f"no open portable_overlap context with handle {handle}") from None


def output_tensor(op: str, out: Optional[torch.Tensor], shape: Sequence[int],
                  like: torch.Tensor) -> torch.Tensor:
    """The op's result tensor: ``out`` after checking it is a contiguous tensor of ``shape`` with
    ``like``'s dtype and device, or a new one when ``out`` is None."""
    shape = tuple(shape)
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(out.shape) != shape or out.dtype != like.dtype or out.device != like.device \
            or not out.is_contiguous():
        raise ValueError(f"{op}: out must be a contiguous {like.dtype} {list(shape)} tensor on "
                         f"{like.device}; got {out.dtype} {list(out.shape)} on {out.device}"
                         + ("" if out.is_contiguous() else " (not contiguous)"))
    return out


def align_key(*tensors: torch.Tensor) -> tuple:
    """What a compiled kernel assumes about its pointers (16-byte alignment): part of plan keys."""
    return tuple(t.data_ptr() % 16 for t in tensors)
