"""NVIDIA backend over cuda-python's driver bindings (``cuda.bindings.driver``).

Memory for the symmetric heap comes from ``cuMemAlloc`` and travels between processes as a legacy
IPC handle (``cuIpcGetMemHandle`` / ``cuIpcOpenMemHandle`` with lazy peer access), which works for
the one-process-per-GPU layout torchrun gives. Copies go through ``cuMemcpyAsync`` and
``cuMemcpy2DAsync`` (copy engine, unified addressing), stream flags through
``cuStreamWaitValue32`` / ``cuStreamWriteValue32``.
"""
from __future__ import annotations

import ctypes

from typing import Optional

import torch

from ..base import Allocation, Backend, DeviceFacts, GateWords, HostMapped, PeerMapping
from .._native import DeviceArray, lazy_module

#: The driver symbols this backend calls; the CPU test suite checks that each resolves.
SYMBOLS = (
    "cuInit", "cuDeviceGet", "cuDeviceGetAttribute", "cuMemAlloc", "cuMemFree", "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle", "cuIpcCloseMemHandle", "CUipcMemHandle", "cuDeviceCanAccessPeer",
    "cuDevicePrimaryCtxRetain", "cuCtxEnablePeerAccess", "cuMemcpyAsync", "cuMemcpy2DAsync",
    "CUDA_MEMCPY2D", "CUmemorytype", "cuStreamWaitValue32",
    "cuStreamWriteValue32", "cuMemHostGetDevicePointer", "CUstream", "CUdeviceptr",
    "CUipcMem_flags", "CUstreamWaitValue_flags", "CUstreamWriteValue_flags", "CUdevice_attribute",
    "CUresult",
)


def _import_driver():
    try:
        from cuda.bindings import driver  # cuda-python >= 12.6
    except ImportError:  # older layout
        from cuda import cuda as driver  # type: ignore[no-redef]
    return driver


driver = lazy_module(_import_driver)


def check(result):
    """Unpack a cuda-python ``(CUresult, *values)`` tuple, raising on error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(f"CUDA driver call failed: {name.decode() if name else int(err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


_IPC_HANDLE_BYTES = 64  # sizeof(CUipcMemHandle)


def handle_bytes(handle) -> bytes:
    """The 64 bytes of a CUipcMemHandle. Read through its address: cuda-python 13.4 dropped the
    ``reserved`` accessor that 13.3 had, ``getPtr`` is in both."""
    return ctypes.string_at(handle.getPtr(), _IPC_HANDLE_BYTES)


def make_ipc_handle(data: bytes):
    """A CUipcMemHandle holding ``data`` (what :func:`handle_bytes` returned in another process)."""
    if len(data) != _IPC_HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC handle has {_IPC_HANDLE_BYTES} bytes, got {len(data)}")
    h = driver.CUipcMemHandle()
    ctypes.memmove(h.getPtr(), data, _IPC_HANDLE_BYTES)
    return h


def make_memcpy2d(dst: int, dst_pitch: int, src: int, src_pitch: int, width_bytes: int,
                  height: int):
    """The CUDA_MEMCPY2D of a strided copy between two addresses. Both sides are described as
    unified addresses (CU_MEMORYTYPE_UNIFIED): the driver then works out for itself whether an
    address is this device's memory, a peer's heap opened through IPC or mapped host memory, as
    cuMemcpyAsync does; CU_MEMORYTYPE_DEVICE would claim the local device for a peer's address.
    Offsets (X, Y) stay 0: the addresses already point at the first byte to move."""
    unified = driver.CUmemorytype.CU_MEMORYTYPE_UNIFIED
    p = driver.CUDA_MEMCPY2D()
    p.srcMemoryType, p.srcDevice, p.srcPitch = unified, driver.CUdeviceptr(src), src_pitch
    p.dstMemoryType, p.dstDevice, p.dstPitch = unified, driver.CUdeviceptr(dst), dst_pitch
    p.WidthInBytes, p.Height = width_bytes, height
    return p


class CudaBackend(Backend):
    name = "cuda"
    process_group_backend = "nccl"

    def __init__(self):
        check(driver.cuInit(0))

    @classmethod
    def is_usable(cls) -> tuple[bool, str]:
        if not torch.cuda.is_available() or torch.version.hip is not None:
            return False, "torch sees no NVIDIA GPU"
        try:
            _import_driver()
        except ImportError as e:
            return False, f"cuda-python is not installed ({e}); pip install 'portable_overlap[cuda]'"
        return True, ""

    @staticmethod
    def _dev(device: torch.device):
        """Make ``device`` current (its primary context for this thread's driver calls) and
        return its driver handle. Only for the rank's own device: see ``_handle``."""
        torch.cuda.set_device(device)
        torch.cuda.init()
        return check(driver.cuDeviceGet(device.index if device.index is not None else 0))

    @staticmethod
    def _handle(device: torch.device):
        """The driver handle of any device, leaving the current device alone (making a peer
        current would send later collectives of the process group to the wrong GPU)."""
        torch.cuda.init()
        return check(driver.cuDeviceGet(device.index if device.index is not None else 0))

    def device_facts(self, device: torch.device) -> DeviceFacts:
        dev = self._dev(device)
        attr = driver.CUdevice_attribute
        sms = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))
        major = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
        minor = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
        smem = check(driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, dev))
        smem_block = check(driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev))
        regs = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR, dev))
        threads = check(driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, dev))
        return DeviceFacts(
            vendor="nvidia", name=torch.cuda.get_device_name(device), arch=f"sm_{major}{minor}",
            sm_count=int(sms), warp_size=32, max_shared_bytes_per_sm=int(smem),
            max_regs_per_sm=int(regs), max_warps_per_sm=int(threads) // 32,
            tensor_descriptors=int(major) >= 9, register_cap=True,
            register_files=4 if int(major) >= 7 else 1,
            max_shared_bytes_per_program=int(smem_block),
            uid=str(torch.cuda.get_device_properties(device).uuid),
        )

    def alloc_exportable(self, nbytes: int, device: torch.device) -> Allocation:
        self._dev(device)
        ptr = check(driver.cuMemAlloc(nbytes))
        addr = int(ptr)
        tensor = torch.as_tensor(DeviceArray(addr, nbytes), device=device)
        return Allocation(addr, nbytes, tensor, device, native=ptr)

    def export_handle(self, alloc: Allocation) -> bytes:
        return handle_bytes(check(driver.cuIpcGetMemHandle(alloc.native)))

    def open_handle(self, handle: bytes, nbytes: int, device: torch.device) -> PeerMapping:
        self._dev(device)
        h = make_ipc_handle(handle)
        flags = driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        ptr = check(driver.cuIpcOpenMemHandle(h, flags))
        return PeerMapping(int(ptr), nbytes, native=ptr)

    def close_handle(self, mapping: PeerMapping) -> None:
        check(driver.cuIpcCloseMemHandle(mapping.native))

    def free(self, alloc: Allocation) -> None:
        alloc.tensor = None
        check(driver.cuMemFree(alloc.native))

    def can_access_peer(self, device: torch.device, peer: torch.device) -> bool:
        if device == peer:
            return True
        return bool(check(driver.cuDeviceCanAccessPeer(self._handle(device), self._handle(peer))))

    def enable_peer_access(self, device: torch.device, peer: torch.device) -> None:
        if device == peer:
            return
        peer_ctx = check(driver.cuDevicePrimaryCtxRetain(self._handle(peer)))
        self._dev(device)
        err, = driver.cuCtxEnablePeerAccess(peer_ctx, 0)
        if int(err) not in (0, int(driver.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)):
            check((err,))

    def copy_async(self, dst: int, src: int, nbytes: int, stream: Optional[int]) -> None:
        check(driver.cuMemcpyAsync(driver.CUdeviceptr(dst), driver.CUdeviceptr(src), nbytes,
                                   driver.CUstream(stream or 0)))

    def copy_2d_async(self, dst: int, dst_pitch: int, src: int, src_pitch: int,
                      width_bytes: int, height: int, stream: Optional[int]) -> None:
        check(driver.cuMemcpy2DAsync(
            make_memcpy2d(dst, dst_pitch, src, src_pitch, width_bytes, height),
            driver.CUstream(stream or 0)))

    def alloc_gate_words(self, n: int, device: torch.device) -> GateWords:
        # cuStreamWaitValue32 waits on any device memory, in the GPU's front end (no SM):
        # contiguous words, which the kernels count into directly
        return GateWords(torch.zeros(n, dtype=torch.int32, device=device))

    def stream_wait_value(self, stream: Optional[int], address: int, value: int) -> None:
        check(driver.cuStreamWaitValue32(
            driver.CUstream(stream or 0), driver.CUdeviceptr(address), value,
            driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ))

    def stream_write_value(self, stream: Optional[int], address: int, value: int) -> None:
        check(driver.cuStreamWriteValue32(
            driver.CUstream(stream or 0), driver.CUdeviceptr(address), value,
            driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT))

    def alloc_host_mapped(self, nbytes: int) -> HostMapped:
        t = torch.zeros((nbytes + 7) // 8, dtype=torch.int64, pin_memory=True)
        dptr = check(driver.cuMemHostGetDevicePointer(t.data_ptr(), 0))
        return HostMapped(t, int(dptr))

    def extra_facts(self) -> dict:
        facts = {}
        try:
            import torch.distributed._symmetric_memory as symm_mem

            ok = getattr(symm_mem, "is_nvshmem_available", lambda: False)()
            facts["nvshmem (torch symmetric memory backend)"] = "available" if ok else "not available"
        except Exception as e:  # torch without symmetric memory
            facts["nvshmem (torch symmetric memory backend)"] = f"not available ({e})"
        try:
            import importlib.util

            spec = importlib.util.find_spec("nvidia.nvshmem")
            facts["nvshmem python package"] = "installed" if spec else "not installed"
        except Exception:
            facts["nvshmem python package"] = "not installed"
        return facts

    def current_stream(self, device: torch.device) -> Optional[int]:
        # the raw-handle getter skips building a torch.cuda.Stream object (on the launch path)
        return torch._C._cuda_getCurrentRawStream(device.index)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)
