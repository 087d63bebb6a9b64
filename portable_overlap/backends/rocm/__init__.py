"""AMD backend over hip-python (``from hip import hip``).

The same design as the CUDA backend: ``hipMalloc`` memory exported through HIP IPC handles, opened
with lazy peer access; ``hipMemcpyAsync`` / ``hipMemcpy2DAsync`` on the SDMA engines;
``hipStreamWaitValue32`` / ``hipStreamWriteValue32`` for stream-ordered flags; pinned host memory
from torch, whose device address ``hipHostGetDevicePointer`` returns.

Not run on AMD hardware in this project so far: CI imports this module and checks that every HIP
symbol below resolves in hip-python and that argument objects are built the way the calls take
them; the first real call needs ``libamdhip64.so``.
"""
from __future__ import annotations

import ctypes

from typing import Optional

import torch

from ..base import Allocation, Backend, DeviceFacts, HostMapped, PeerMapping
from .._native import DeviceArray, lazy_module

#: The HIP symbols this backend calls; the CPU test suite checks that each resolves.
SYMBOLS = (
    "hipSetDevice", "hipDeviceGetAttribute", "hipDeviceAttribute_t", "hipMalloc", "hipFree",
    "hipIpcGetMemHandle", "hipIpcOpenMemHandle", "hipIpcCloseMemHandle", "hipIpcMemHandle_t",
    "hipIpcMemLazyEnablePeerAccess", "hipDeviceCanAccessPeer", "hipDeviceEnablePeerAccess",
    "hipMemcpyAsync", "hipMemcpy2DAsync", "hipMemcpyKind", "hipStreamWaitValue32",
    "hipStreamWaitValueGte", "hipStreamWriteValue32", "hipHostGetDevicePointer", "hipGetErrorName",
    "hipError_t",
)


def _import_hip():
    from hip import hip

    return hip


hip = lazy_module(_import_hip)


def check(result):
    """Unpack a hip-python ``(hipError_t, *values)`` tuple, raising on error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"HIP call failed: {hip.hipGetErrorName(err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else 0


class RocmBackend(Backend):
    name = "rocm"
    process_group_backend = "nccl"  # torch's name for RCCL on ROCm builds

    @classmethod
    def is_usable(cls) -> tuple[bool, str]:
        if not torch.cuda.is_available() or torch.version.hip is None:
            return False, "torch sees no AMD GPU (needs a ROCm build of torch)"
        try:
            _import_hip()
        except Exception as e:  # ImportError, or the loader failing without libamdhip64
            return False, f"hip-python is not usable ({e}); pip install 'portable_overlap[rocm]'"
        return True, ""

    def _set(self, device: torch.device) -> int:
        torch.cuda.set_device(device)
        check(hip.hipSetDevice(_index(device)))
        return _index(device)

    def device_facts(self, device: torch.device) -> DeviceFacts:
        idx = self._set(device)
        attr = hip.hipDeviceAttribute_t
        def get(name):
            return int(check(hip.hipDeviceGetAttribute(getattr(attr, name), idx)))

        props = torch.cuda.get_device_properties(device)
        arch = getattr(props, "gcnArchName", "gfx").split(":")[0]
        # limits from the runtime, not constants: the LDS is 64 KiB on gfx942, 160 KiB on gfx950
        lds_block = get("hipDeviceAttributeMaxSharedMemoryPerBlock")
        return DeviceFacts(
            vendor="amd", name=props.name, arch=arch,
            sm_count=get("hipDeviceAttributeMultiprocessorCount"), warp_size=64,
            max_shared_bytes_per_sm=get("hipDeviceAttributeMaxSharedMemoryPerMultiprocessor")
            or lds_block,
            # 512 VGPRs per lane x 64 lanes x 4 SIMDs per CU (CDNA3); HIP's register attribute
            # counts per block, which is not what the residency count needs
            max_regs_per_sm=512 * 64 * 4,
            max_warps_per_sm=get("hipDeviceAttributeMaxThreadsPerMultiProcessor") // 64 or 32,
            max_shared_bytes_per_program=lds_block,
        )

    def alloc_exportable(self, nbytes: int, device: torch.device) -> Allocation:
        self._set(device)
        ptr = check(hip.hipMalloc(nbytes))
        addr = int(ptr)
        tensor = torch.as_tensor(DeviceArray(addr, nbytes), device=device)
        return Allocation(addr, nbytes, tensor, device, native=ptr)

    def export_handle(self, alloc: Allocation) -> bytes:
        handle = check(hip.hipIpcGetMemHandle(alloc.native))
        return ctypes.string_at(handle.as_c_void_p().value, handle.c_sizeof())

    @staticmethod
    def make_ipc_handle(data: bytes):
        """Rebuild a hipIpcMemHandle_t from the bytes :meth:`export_handle` returned (its
        ``reserved`` field is read-only in hip-python, so the bytes go in through its address)."""
        h = hip.hipIpcMemHandle_t()
        if len(data) != h.c_sizeof():
            raise ValueError(f"a HIP IPC handle has {h.c_sizeof()} bytes, got {len(data)}")
        ctypes.memmove(h.as_c_void_p().value, data, len(data))
        return h

    def open_handle(self, handle: bytes, nbytes: int, device: torch.device) -> PeerMapping:
        self._set(device)
        ptr = check(hip.hipIpcOpenMemHandle(self.make_ipc_handle(handle),
                                            hip.hipIpcMemLazyEnablePeerAccess))
        return PeerMapping(int(ptr), nbytes, native=ptr)

    def close_handle(self, mapping: PeerMapping) -> None:
        check(hip.hipIpcCloseMemHandle(mapping.native))

    def free(self, alloc: Allocation) -> None:
        alloc.tensor = None
        check(hip.hipFree(alloc.native))

    def can_access_peer(self, device: torch.device, peer: torch.device) -> bool:
        if device == peer:
            return True
        return bool(check(hip.hipDeviceCanAccessPeer(_index(device), _index(peer))))

    def enable_peer_access(self, device: torch.device, peer: torch.device) -> None:
        if device == peer:
            return
        self._set(device)
        err, = hip.hipDeviceEnablePeerAccess(_index(peer), 0)
        # 0 = success; hipErrorPeerAccessAlreadyEnabled (704) means it was on already
        if int(err) not in (0, 704):
            check((err,))

    def copy_async(self, dst: int, src: int, nbytes: int, stream: Optional[int]) -> None:
        check(hip.hipMemcpyAsync(dst, src, nbytes, hip.hipMemcpyKind.hipMemcpyDeviceToDevice,
                                 stream or 0))

    def copy_2d_async(self, dst: int, dst_pitch: int, src: int, src_pitch: int,
                      width_bytes: int, height: int, stream: Optional[int]) -> None:
        # device-to-device like copy_async: a peer's heap is device memory opened through IPC
        check(hip.hipMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width_bytes, height,
                                   hip.hipMemcpyKind.hipMemcpyDeviceToDevice, stream or 0))

    def stream_wait_value(self, stream: Optional[int], address: int, value: int) -> None:
        check(hip.hipStreamWaitValue32(stream or 0, address, value, hip.hipStreamWaitValueGte,
                                       0xFFFFFFFF))

    def stream_write_value(self, stream: Optional[int], address: int, value: int) -> None:
        check(hip.hipStreamWriteValue32(stream or 0, address, value, 0))

    def alloc_host_mapped(self, nbytes: int) -> HostMapped:
        t = torch.zeros((nbytes + 7) // 8, dtype=torch.int64, pin_memory=True)
        dptr = check(hip.hipHostGetDevicePointer(t.data_ptr(), 0))
        return HostMapped(t, int(dptr))

    def extra_facts(self) -> dict:
        import importlib.util

        return {"rocshmem": "not integrated yet (device-initiated puts are NVSHMEM-only so far)",
                "hip-python": "installed" if importlib.util.find_spec("hip") else "not installed"}

    def current_stream(self, device: torch.device) -> Optional[int]:
        # the raw-handle getter skips building a torch.cuda.Stream object (on the launch path)
        return torch._C._cuda_getCurrentRawStream(device.index)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)
