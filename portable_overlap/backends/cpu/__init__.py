"""CPU-emulated backend: ranks are processes on one machine, "device memory" is a POSIX
shared-memory segment mapped into every rank.

It exists so that the real Triton kernels can run under ``TRITON_INTERPRET=1`` with several ranks
on a machine without a GPU (CI, the demo): the peer pointer table holds each peer's segment as
mapped in *this* process, so the kernels' pointer translation and remote stores run unchanged.
Copies and stream operations are synchronous (the interpreter has no streams).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import time
from typing import Optional

import torch

from ...envvars import env_float, env_int
from ...errors import PeerTimeoutError
from ..base import Allocation, Backend, DeviceFacts, HostMapped, PeerMapping

SLOTS_VAR = "PORTABLE_OVERLAP_CPU_SLOTS"
WAIT_TIMEOUT_VAR = "PORTABLE_OVERLAP_CPU_WAIT_TIMEOUT"
#: most emulated SMs: one launch has at most this many programs (``ops.context.G_MAX`` flag slots)
MAX_SLOTS = 1024

_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None


def _segment_path(name: str) -> str:
    import tempfile

    return os.path.join(_SHM_DIR or tempfile.gettempdir(), name)


class _Segment:
    """One mmapped file; ``tensor`` is a uint8 view whose data_ptr is the mapping's address."""

    def __init__(self, path: str, nbytes: int, create: bool):
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            self.mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.path = path
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.address = self.tensor.data_ptr()

    def close(self) -> None:
        self.tensor = None
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere; the OS unmaps at exit
            pass


class CpuBackend(Backend):
    name = "cpu"
    #: roughly how many flag polls a kernel makes per second (turns timeouts into poll counts)
    poll_rate_hz = 2e4

    _wait_timeout_s: Optional[float] = None  # set through ``wait_timeout_s``

    @property
    def wait_timeout_s(self) -> float:
        """How long a stream wait may block before it raises (seconds): the value set on this
        backend, else ``$PORTABLE_OVERLAP_CPU_WAIT_TIMEOUT`` (read at each wait), else 60."""
        if self._wait_timeout_s is not None:
            return self._wait_timeout_s
        return env_float(WAIT_TIMEOUT_VAR, 60.0, above=0.0)

    @wait_timeout_s.setter
    def wait_timeout_s(self, seconds: float) -> None:
        self._wait_timeout_s = seconds

    @classmethod
    def is_usable(cls) -> tuple[bool, str]:
        return True, ""

    def device_facts(self, device: torch.device) -> DeviceFacts:
        # The interpreter runs programs one after another, so a few "SMs" keep launches short.
        slots = env_int(SLOTS_VAR, 4, 1, MAX_SLOTS)
        return DeviceFacts(
            vendor="cpu", name="cpu-emulated", arch="cpu", sm_count=slots, warp_size=32,
            max_shared_bytes_per_sm=1 << 30, max_regs_per_sm=1 << 30, max_warps_per_sm=1 << 10,
        )

    def alloc_exportable(self, nbytes: int, device: torch.device) -> Allocation:
        path = _segment_path(f"portable_overlap_{os.getpid()}_{secrets.token_hex(6)}")
        seg = _Segment(path, nbytes, create=True)
        return Allocation(seg.address, nbytes, seg.tensor, torch.device("cpu"), native=seg)

    def export_handle(self, alloc: Allocation) -> bytes:
        return alloc.native.path.encode()

    def open_handle(self, handle: bytes, nbytes: int, device: torch.device) -> PeerMapping:
        seg = _Segment(handle.decode(), nbytes, create=False)
        return PeerMapping(seg.address, nbytes, native=seg)

    def close_handle(self, mapping: PeerMapping) -> None:
        mapping.native.close()

    def free(self, alloc: Allocation) -> None:
        seg = alloc.native
        seg.close()
        try:
            os.unlink(seg.path)
        except FileNotFoundError:
            pass

    def exported_everywhere(self, alloc: Allocation) -> None:
        try:
            os.unlink(alloc.native.path)
        except FileNotFoundError:
            pass

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
