"""CPU-emulated backend: ranks are processes on one machine, "device memory" is an anonymous
shared-memory segment (a memfd) mapped into every rank.

It exists so that the real Triton kernels can run under ``TRITON_INTERPRET=1`` with several ranks
on a machine without a GPU (CI, the demo): the peer pointer table holds each peer's segment as
mapped in *this* process, so the kernels' pointer translation and remote stores run unchanged.
Copies and stream operations are synchronous (the interpreter has no streams).

Segments are ``backends.host_segment.HostSegment``s: no name in any file system, the owner's
memfd opened by peers through ``/proc/<owner pid>/fd/<fd>``, nothing left behind by a rank
killed at any moment (SIGKILL included). Peers must run as the same user as the owner.
"""
from __future__ import annotations

import ctypes
import os
import time
from typing import Optional

import torch

from ...envvars import env_float, env_int
from ...errors import PeerTimeoutError
from ..base import Allocation, Backend, DeviceFacts, GateWords, HostMapped, PeerMapping
from ..host_segment import HostSegment

SLOTS_VAR = "PORTABLE_OVERLAP_CPU_SLOTS"
WAIT_TIMEOUT_VAR = "PORTABLE_OVERLAP_CPU_WAIT_TIMEOUT"
#: most emulated SMs: one launch has at most this many programs (``ops.context.G_MAX`` flag slots)
MAX_SLOTS = 1024


def env_slots() -> int:
    """``$PORTABLE_OVERLAP_CPU_SLOTS``: the emulated SMs (default 4, at most ``MAX_SLOTS``)."""
    return env_int(SLOTS_VAR, 4, 1, MAX_SLOTS)


def env_wait_timeout() -> float:
    """``$PORTABLE_OVERLAP_CPU_WAIT_TIMEOUT``: seconds a stream wait may block (default 60)."""
    return env_float(WAIT_TIMEOUT_VAR, 60.0, above=0.0)


def require_interpreter(what: str) -> None:
    """Raise BackendUnavailable unless Triton runs kernels in its interpreter in this process:
    the CPU backend has no compiled target (without it the first launch fails with Triton's
    "0 active drivers"). The switch is read when Triton is imported, so it must be in the
    environment before Python starts."""
    import triton

    knobs = getattr(triton, "knobs", None)
    on = (knobs.runtime.interpret if knobs is not None else
          os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
    if not on:
        from ...errors import BackendUnavailable

        raise BackendUnavailable(
            f"{what}: the CPU backend runs the kernels in Triton's interpreter, which is off in "
            f"this process; start Python with TRITON_INTERPRET=1 in the environment (for "
            f"example `TRITON_INTERPRET=1 torchrun --nproc-per-node 2 script.py`), or use "
            f"`python -m portable_overlap demo`, which sets it for its ranks")
    from .interpreter_compat import install

    install()


class CpuBackend(Backend):
    name = "cpu"

    _wait_timeout_s: Optional[float] = None  # set through ``wait_timeout_s``

    def __init__(self):
        # every kernel of a rank on this backend runs in the interpreter: make it work with
        # the numpy installed before the first launch (see interpreter_compat)
        from .interpreter_compat import install

        install()

    @property
    def wait_timeout_s(self) -> float:
        """How long a stream wait may block before it raises (seconds): the value set on this
        backend, else ``$PORTABLE_OVERLAP_CPU_WAIT_TIMEOUT`` (read at each wait), else 60."""
        if self._wait_timeout_s is not None:
            return self._wait_timeout_s
        return env_wait_timeout()

    @wait_timeout_s.setter
    def wait_timeout_s(self, seconds: float) -> None:
        self._wait_timeout_s = seconds

    @classmethod
    def is_usable(cls) -> tuple[bool, str]:
        if not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"):
            return False, "needs Linux (os.memfd_create and /proc/<pid>/fd for shared segments)"
        return True, ""

    def device_facts(self, device: torch.device) -> DeviceFacts:
        # The interpreter runs programs one after another, so a few "SMs" keep launches short.
        slots = env_slots()
        return DeviceFacts(
            vendor="cpu", name="cpu-emulated", arch="cpu", sm_count=slots, warp_size=32,
            max_shared_bytes_per_sm=1 << 30, max_regs_per_sm=1 << 30, max_warps_per_sm=1 << 10,
            uid=f"cpu-process-{os.getpid()}",  # each emulated rank stands for a GPU of its own
        )

    def alloc_exportable(self, nbytes: int, device: torch.device) -> Allocation:
        """A segment of ``nbytes``; more than the machine's memory is a ``MemoryError``: the
        memfd and its mapping take no memory until touched, so such a size would not fail
        here, and the heap's zeroing of every page would run the machine out of memory."""
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if nbytes > total:
            raise MemoryError(f"cpu backend: a segment of {nbytes} bytes is more than this "
                              f"machine's memory ({total} bytes)")
        seg = HostSegment.create(nbytes)
        return Allocation(seg.address, nbytes, seg.tensor, torch.device("cpu"), native=seg)

    def export_handle(self, alloc: Allocation) -> tuple:
        """``(pid, fd, name)``: where peers open the segment (``/proc/<pid>/fd/<fd>``) and the
        name they check it has."""
        return alloc.native.handle()

    def open_handle(self, handle: tuple, nbytes: int, device: torch.device) -> PeerMapping:
        """Map a peer's segment. Raises ValueError for a handle that is not a live segment of
        this backend (malformed, another file, another memfd, a process that exited) and for a
        segment smaller than ``nbytes``."""
        seg = HostSegment.open(handle, nbytes, "cpu backend")
        return PeerMapping(seg.address, nbytes, native=seg)

    def close_handle(self, mapping: PeerMapping) -> None:
        mapping.native.close()

    def free(self, alloc: Allocation) -> None:
        alloc.tensor = None  # the segment unmaps now unless views of it are still alive
        alloc.native.close()

    def can_access_peer(self, device: torch.device, peer: torch.device) -> bool:
        return True

    def enable_peer_access(self, device: torch.device, peer: torch.device) -> None:
        return None

    def copy_async(self, dst: int, src: int, nbytes: int, stream: Optional[int]) -> None:
        ctypes.memmove(dst, src, nbytes)

    def copy_2d_async(self, dst: int, dst_pitch: int, src: int, src_pitch: int,
                      width_bytes: int, height: int, stream: Optional[int]) -> None:
        # no copy engine here: one memmove per row does what the GPU's 2-D DMA does in one call
        for i in range(height):
            ctypes.memmove(dst + i * dst_pitch, src + i * src_pitch, width_bytes)

    def alloc_gate_words(self, n: int, device: torch.device) -> GateWords:
        # the waits below poll from the host: any memory of this process will do
        return GateWords(torch.zeros(n, dtype=torch.int32, device=device))

    def stream_wait_value(self, stream: Optional[int], address: int, value: int) -> None:
        timeout_s = self.wait_timeout_s
        word = ctypes.c_int32.from_address(address)
        deadline = time.monotonic() + timeout_s
        while word.value < value:
            if time.monotonic() > deadline:
                raise PeerTimeoutError(
                    f"cpu backend: stream wait on address {address:#x} for value >= {value} "
                    f"timed out after {timeout_s} s (last value {word.value})")
            time.sleep(1e-4)

    def stream_write_value(self, stream: Optional[int], address: int, value: int) -> None:
        ctypes.c_int32.from_address(address).value = value

    def alloc_host_mapped(self, nbytes: int) -> HostMapped:
        t = torch.zeros((nbytes + 7) // 8, dtype=torch.int64)
        return HostMapped(t, t.data_ptr())

    def current_stream(self, device: torch.device) -> Optional[int]:
        return None

    def synchronize(self, device: torch.device) -> None:
        return None
