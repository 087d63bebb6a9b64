"""AMD backend over hip-python (``from hip import hip``).

The same design as the CUDA backend: ``hipMalloc`` memory exported through HIP IPC handles, opened
with lazy peer access; ``hipMemcpyAsync`` / ``hipMemcpy2DAsync`` for copies (docs/amd.md says
which of them the runtime runs on SDMA and which as blit kernels on the CUs); pinned host memory
from torch, whose device address ``hipHostGetDevicePointer`` returns.

Stream-ordered flags (the gates) take one of two forms, chosen per call here, never by the ops:

- ``hipStreamWaitValue32`` (where the device reports ``hipDeviceAttributeCanUseStreamWaitValue``,
  an attribute of the waits only) / ``hipStreamWriteValue32`` (any device), where the stream is
  not being captured. The runtime waits with a spinning blit kernel (one workgroup on a CU)
  by default; with ``GPU_STREAMOPS_CP_WAIT=1`` the command processor waits instead (no CU), but
  only on words from ``hipMallocSignalMemory`` (anything else: hipErrorInvalidValue). Signal
  memory comes 8 bytes per allocation, so there every gate word is its own allocation and the
  kernels reach them through a table of their addresses (``GateWords``).
- the kernel gate (``backends/gate_kernels.py``): a one-program Triton wait / write, where the
  runtime's form would not do: under graph capture (older ROCm releases run stream value
  operations at capture time instead of recording them), for waits on a device without the
  capability, and, with ``GPU_STREAMOPS_CP_WAIT=1``, on a word that is not signal memory (none of
  :meth:`RocmBackend.alloc_gate_words`'s).

Not run on AMD hardware in this project so far: CI imports this module and checks that every HIP
symbol below resolves in hip-python and that argument objects are built the way the calls take
them; the first real call needs ``libamdhip64.so``.
"""
from __future__ import annotations

import ctypes
import importlib
import os
import re
import warnings
import weakref

from typing import Optional

import torch

from ..base import Allocation, Backend, DeviceFacts, GateWords, HostMapped, PeerMapping
from .._native import DeviceArray, lazy_module

#: The HIP symbols this backend calls; the CPU test suite checks that each resolves.
SYMBOLS = (
    "hipSetDevice", "hipDeviceGetAttribute", "hipDeviceAttribute_t", "hipMalloc", "hipFree",
    "hipIpcGetMemHandle", "hipIpcOpenMemHandle", "hipIpcCloseMemHandle", "hipIpcMemHandle_t",
    "hipIpcMemLazyEnablePeerAccess", "hipDeviceCanAccessPeer", "hipDeviceEnablePeerAccess",
    "hipMemcpyAsync", "hipMemcpy2DAsync", "hipMemcpyKind", "hipStreamWaitValue32",
    "hipStreamWaitValueGte", "hipStreamWriteValue32", "hipHostGetDevicePointer", "hipGetErrorName",
    "hipError_t", "hipExtMallocWithFlags", "hipMallocSignalMemory", "hipStreamIsCapturing",
    "hipStreamCaptureStatus", "hipGetDeviceCount",
)

#: the runtime's switch to command-processor stream waits (read by the runtime at start-up)
CP_WAIT_VAR = "GPU_STREAMOPS_CP_WAIT"
#: bytes of one signal-memory allocation: the runtime takes exactly 8 (one HSA signal value)
SIGNAL_BYTES = 8
#: the runtime's cap on hardware queues per device and priority (read at start-up, default 4)
HW_QUEUES_VAR = "GPU_MAX_HW_QUEUES"


def _import_hip():
    from hip import hip

    if torch.version.hip is not None:
        path = torch_hip_runtime()
        if path is not None:
            pin_runtime(path)
    return hip


def _is_runtime(path: str) -> bool:
    """Whether ``path`` names a HIP runtime library (``libamdhip64.so``, ``.so.6``, ...)."""
    base = os.path.basename(path)
    return base.startswith("libamdhip64") and ".so" in base


def _mapped_files(maps: str = "/proc/self/maps") -> list:
    """The files mapped into this process (each once), from ``maps``."""
    files = []
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    path = fields[5].rstrip("\n")
                    if not path.endswith(" (deleted)") and path not in files:
                        files.append(path)
    except OSError:
        pass
    return files


def _defining_file(library: str, symbol: str) -> Optional[str]:
    """The file that defines ``symbol`` as ``library`` (already loaded) resolves it: the
    library's own dependency order, through ``dlsym`` on its handle and ``dladdr``."""
    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    try:
        lib = ctypes.CDLL(library, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        address = ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
        libc = ctypes.CDLL(None)
        info = DlInfo()
        if not address or not libc.dladdr(ctypes.c_void_p(address), ctypes.byref(info)):
            return None
        return os.fsdecode(info.dli_fname) if info.dli_fname else None
    except (OSError, AttributeError):
        return None


def torch_hip_runtime(maps: str = "/proc/self/maps") -> Optional[str]:
    """The file of the HIP runtime that torch calls, where this process has it mapped.

    hip-python opens ``libamdhip64`` by its own search (a ``rocm_sdk`` wheel, ``ROCM_PATH``,
    ``/opt/rocm/lib``, then the bare name), not the copy a ROCm wheel of torch carries in its
    own directory. Two copies make two HIP runtimes in one process: the second knows none of
    torch's allocations (``getMemoryObject`` misses them: copies of them go wrong, stream waits
    on them answer hipErrorInvalidValue) and none of torch's streams (hipErrorContextIsDestroyed
    for every stream the ops pass). Where several copies are mapped already, the one torch's
    HIP library resolves ``hipMalloc`` to."""
    mapped = _mapped_files(maps)
    runtimes = [p for p in mapped if _is_runtime(p)]
    if len(runtimes) <= 1:
        return runtimes[0] if runtimes else None
    real = {os.path.realpath(p): p for p in runtimes}
    for lib in (p for p in mapped if os.path.basename(p).startswith("libtorch_hip")):
        got = _defining_file(lib, "hipMalloc")
        if got is not None and os.path.realpath(got) in real:
            return real[os.path.realpath(got)]
    return None


def pin_runtime(path: str) -> None:
    """Make hip-python open the HIP runtime at ``path`` on its first call (``dlopen`` of a
    file this process has loaded already returns that same library). hip-python looks the
    path up at its first call: through ``rocm.bindings.util.paths.get_library_path`` (the
    releases laid out as ``rocm.bindings``, whose ``hip`` package re-exports them), or the
    module global ``hip.chip.DLL`` (the earlier ``hip`` package, ``b"libamdhip64.so"``). A
    hip-python that has made its first call already keeps its library."""
    try:
        paths = importlib.import_module("rocm.bindings.util.paths")
    except ImportError:
        paths = None
    if paths is not None:
        search = getattr(paths.get_library_path, "searches", paths.get_library_path)

        def get_library_path(shortname, *args, **kwargs):
            if shortname == "amdhip64":
                return os.fsencode(path)
            return search(shortname, *args, **kwargs)

        get_library_path.searches = search
        paths.get_library_path = get_library_path
        return
    try:
        chip = importlib.import_module("hip.chip")
    except ImportError:
        return
    if hasattr(chip, "DLL"):
        chip.DLL = os.fsencode(path)


hip = lazy_module(_import_hip)


def check(result, call: str = "HIP call"):
    """Unpack a hip-python ``(hipError_t, *values)`` tuple, raising on error; the message
    names ``call`` (the HIP function, with what it was asked where that tells more)."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{call} failed: {error_name(err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _device_uid(props) -> str:
    """The GPU's identity from torch's device properties: its UUID, else its PCI address (a
    torch without ``uuid`` on ROCm), else "" (unknown)."""
    uuid = getattr(props, "uuid", None)
    if uuid is not None and str(uuid).strip("0-"):
        return str(uuid)
    pci = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
    return "pci-{}:{}:{}".format(*pci) if None not in pci else ""


def error_name(err) -> str:
    """``hipErrorInvalidValue (1)`` for a hipError_t. hip-python's ``hipGetErrorName`` answers
    a ``(hipError_t, name)`` tuple, the name a ``CStr`` (``str()`` decodes it; older releases:
    bytes); where the runtime cannot answer (no libamdhip64), the enum's own name stands in."""
    code = int(err)
    try:
        got = hip.hipGetErrorName(err)
        name = got[-1] if isinstance(got, tuple) else got
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
    except Exception:
        name = None
    if not name:
        name = getattr(err, "name", None) or "unknown HIP error"
    return f"{name} ({code})"


#: what C's ``atoi`` reads of a string: blanks, a sign, digits (the rest is ignored)
_ATOI = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")


def cp_wait() -> bool:
    """Whether the runtime waits in the command processor: ``GPU_STREAMOPS_CP_WAIT`` read as
    the runtime reads a boolean flag (``rocclr/utils/flags.cpp``): exactly ``true``, or a
    value whose leading integer (C's ``atoi``) is not 0. Where this and the runtime disagree,
    the gate words are plain memory that the runtime's command processor wait refuses
    (``2`` is true to the runtime), or signal memory taken for nothing (``yes``, ``on`` and
    ``TRUE`` are false to it)."""
    raw = os.environ.get(CP_WAIT_VAR)
    if raw is None:
        return False
    lead = _ATOI.match(raw)
    return raw == "true" or (lead is not None and int(lead.group(1)) != 0)


def _sdma_kind():
    """The copy kind that keeps a device-to-device copy off the CUs (hip-python of ROCm 6.1
    on; a hip-python without it gets ``hipMemcpyDeviceToDevice``)."""
    kinds = hip.hipMemcpyKind
    return getattr(kinds, "hipMemcpyDeviceToDeviceNoCU", kinds.hipMemcpyDeviceToDevice)


def hw_queues() -> int:
    """``GPU_MAX_HW_QUEUES`` as the runtime reads it (C's ``atoi``; 4 when unset).

    The runtime gives a new stream its own hardware (AQL) queue only until a priority has this
    many; later streams of that priority share the least-used queue, and every packet carries
    the barrier bit, so the streams of one queue run their work in turn: a spinning wait (the
    runtime's blit-kernel wait, the kernel gate, a flag kernel waiting for a peer) queued on
    one of them holds everything queued after it on the others. The copy lanes (one
    high-priority stream per peer) share queues from the fifth peer on, 8 ranks and more;
    torch builds that create their whole stream pool at once share them earlier."""
    lead = _ATOI.match(os.environ.get(HW_QUEUES_VAR, ""))
    return int(lead.group(1)) if lead is not None else 4


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else 0


def _device_tensor(array: DeviceArray, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over a raw allocation (keeps ``array`` alive as long as any view)."""
    return torch.as_tensor(array, device=device)


def _device_zeros(n: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int32, device=device)


def _device_table(addresses: list, device: torch.device) -> torch.Tensor:
    """The int64 tensor of ``addresses`` on ``device`` (a GateWords address table)."""
    return torch.tensor(addresses, dtype=torch.int64, device=device)


def _free_signal(ptr, addr: int, words: set) -> None:
    words.discard(addr)
    try:
        hip.hipFree(ptr)
    except Exception:  # at interpreter exit the runtime may be gone already
        pass


class RocmBackend(Backend):
    name = "rocm"
    process_group_backend = "nccl"  # torch's name for RCCL on ROCm builds

    def __init__(self):
        self._can_wait: dict = {}  # device index -> hipDeviceAttributeCanUseStreamWaitValue
        self._signal_words: set = set()  # addresses of live signal-memory gate words

    @classmethod
    def is_usable(cls) -> tuple[bool, str]:
        if not torch.cuda.is_available() or torch.version.hip is None:
            return False, "torch sees no AMD GPU (needs a ROCm build of torch)"
        try:
            _import_hip()
        except Exception as e:  # ImportError
            return False, f"hip-python is not usable ({e}); pip install 'portable_overlap[rocm]'"
        try:  # the import loads no library: the first call does (and fails without one)
            err, count = hip.hipGetDeviceCount()
        except Exception as e:
            return False, f"hip-python cannot load the HIP runtime ({e})"
        if int(err) != 0 or count < 1:
            return False, f"hip-python sees no AMD GPU (hipGetDeviceCount: {error_name(err)})"
        runtimes = sorted({os.path.realpath(p) for p in _mapped_files() if _is_runtime(p)})
        if len(runtimes) > 1:  # hip-python had loaded its own before it could be pointed
            return False, (f"two HIP runtimes in this process ({', '.join(runtimes)}): "
                           f"hip-python made its first call before this backend could point "
                           f"it at torch's; let the backend make hip-python's first call")
        return True, ""

    def _set(self, device: torch.device) -> int:
        torch.cuda.set_device(device)
        check(hip.hipSetDevice(_index(device)), f"hipSetDevice({_index(device)})")
        return _index(device)

    def device_facts(self, device: torch.device) -> DeviceFacts:
        idx = self._set(device)
        attr = hip.hipDeviceAttribute_t

        def get(name):
            return int(check(hip.hipDeviceGetAttribute(getattr(attr, name), idx),
                             f"hipDeviceGetAttribute({name}, {idx})"))

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
            max_regs_per_sm=512 * 64 * 4, register_files=4,
            max_warps_per_sm=get("hipDeviceAttributeMaxThreadsPerMultiProcessor") // 64 or 32,
            max_shared_bytes_per_program=lds_block,
            # the default blit-kernel wait and the kernel gate (under capture) spin on a CU;
            # only command-processor waits outside capture take none, and a plan serves both
            gate_programs=1,
            uid=_device_uid(props),
        )

    def alloc_exportable(self, nbytes: int, device: torch.device) -> Allocation:
        self._set(device)
        ptr = check(hip.hipMalloc(nbytes), f"hipMalloc({nbytes})")
        addr = int(ptr)
        tensor = torch.as_tensor(DeviceArray(addr, nbytes), device=device)
        return Allocation(addr, nbytes, tensor, device, native=ptr)

    def export_handle(self, alloc: Allocation) -> bytes:
        # the runtime exports the allocation's memory on the current device (IpcCreate)
        self._set(alloc.device)
        handle = check(hip.hipIpcGetMemHandle(alloc.native), "hipIpcGetMemHandle")
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
                                            hip.hipIpcMemLazyEnablePeerAccess),
                    "hipIpcOpenMemHandle")
        return PeerMapping(int(ptr), nbytes, native=ptr)

    def close_handle(self, mapping: PeerMapping) -> None:
        check(hip.hipIpcCloseMemHandle(mapping.native), "hipIpcCloseMemHandle")

    def free(self, alloc: Allocation) -> None:
        alloc.tensor = None
        check(hip.hipFree(alloc.native), "hipFree")

    def can_access_peer(self, device: torch.device, peer: torch.device) -> bool:
        if device == peer:
            return True
        return bool(check(hip.hipDeviceCanAccessPeer(_index(device), _index(peer)),
                          f"hipDeviceCanAccessPeer({_index(device)}, {_index(peer)})"))

    def enable_peer_access(self, device: torch.device, peer: torch.device) -> None:
        if device == peer:
            return
        self._set(device)
        err, = hip.hipDeviceEnablePeerAccess(_index(peer), 0)
        # hipErrorPeerAccessAlreadyEnabled (704): it was on already
        if int(err) not in (0, int(hip.hipError_t.hipErrorPeerAccessAlreadyEnabled)):
            check((err,), f"hipDeviceEnablePeerAccess({_index(peer)})")

    def copy_async(self, dst: int, src: int, nbytes: int, stream: Optional[int]) -> None:
        """``hipMemcpyDeviceToDeviceNoCU`` (ROCm 6.1 on): the runtime asks ROCr for an SDMA
        engine (``force_copy_on_sdma``). With ``hipMemcpyDeviceToDevice`` it hands ROCr both
        sides as this GPU (a peer's heap opened through IPC counts as this GPU's memory), and
        ROCr runs such a copy as a blit kernel on the CUs from ``HSA_FORCE_SDMA_SIZE`` (1 MiB)
        up, which breaks this entry's promise of no CUs."""
        check(hip.hipMemcpyAsync(dst, src, nbytes, _sdma_kind(), stream or 0),
              f"hipMemcpyAsync({dst:#x} <- {src:#x}, {nbytes} bytes)")

    def copy_2d_async(self, dst: int, dst_pitch: int, src: int, src_pitch: int,
                      width_bytes: int, height: int, stream: Optional[int]) -> None:
        # device-to-device: a peer's heap is device memory opened through IPC. The runtime runs
        # a 2-D copy between device buffers as a blit kernel whatever the kind (its DMA path
        # takes only 2-D copies with host memory on one side), so NoCU would change nothing
        check(hip.hipMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width_bytes, height,
                                   hip.hipMemcpyKind.hipMemcpyDeviceToDevice, stream or 0),
              f"hipMemcpy2DAsync({dst:#x} <- {src:#x}, {height} rows of {width_bytes} bytes)")

    # -- gates ---------------------------------------------------------------------------------
    def alloc_gate_words(self, n: int, device: torch.device) -> GateWords:
        """Where ``GPU_STREAMOPS_CP_WAIT`` is set, ``n`` words of signal memory, each its own
        allocation (the runtime hands out signal memory 8 bytes, one HSA signal, per
        allocation), with the device table of their addresses that kernels count through: the
        command processor waits on every one of them. Else ``n`` contiguous words of ordinary
        device memory, which the runtime's blit-kernel wait takes; so too on a device without
        ``hipDeviceAttributeCanUseStreamWaitValue`` (every wait is the kernel gate there), and
        where the runtime refuses signal memory (a warning says why: the waits then take the
        kernel gate, slower but correct). ``close`` frees the signal memory (``hipFree`` each).
        Loads the kernel gate (and the words' zeroing kernel) now, outside any capture (a first
        launch inside one would compile and load a module)."""
        self._set(device)
        words = None
        if cp_wait() and self._capable():
            try:
                words = self._signal_words_of(n, device)
            except RuntimeError as e:
                warnings.warn(f"{CP_WAIT_VAR}=1 but no signal memory for the gate words ({e}): "
                              f"their waits take the kernel gate (one CU each while waiting)")
        if words is None:
            words = GateWords(_device_zeros(n, device))
        try:
            self._load_gate_kernels(words)
        except BaseException:
            words.close()
            raise
        return words

    def _signal_words_of(self, n: int, device: torch.device) -> GateWords:
        """``n`` separate signal-memory words and their address table."""
        views, frees = [], []

        def release():
            for free in frees:
                free()  # a finalizer runs once: the owners' own finalization then does nothing

        try:
            for _ in range(n):
                view, free = self._signal_word(device)
                views.append(view)
                frees.append(free)
            table = _device_table([v.data_ptr() for v in views], device)
        except BaseException:
            release()
            raise
        return GateWords(views=views, table=table, release=release)

    def _signal_word(self, device: torch.device):
        """One signal-memory word as an int32 tensor of 1, and the finalizer that frees it."""
        ptr = check(hip.hipExtMallocWithFlags(SIGNAL_BYTES, hip.hipMallocSignalMemory),
                    "hipExtMallocWithFlags(8, hipMallocSignalMemory)")
        addr = int(ptr)
        owner = DeviceArray(addr, SIGNAL_BYTES)
        # the tensor keeps ``owner`` alive; the memory goes back at ``GateWords.close`` or when
        # the last view is gone, whichever comes first
        free = weakref.finalize(owner, _free_signal, ptr, addr, self._signal_words)
        self._signal_words.add(addr)
        raw = _device_tensor(owner, device)
        # the runtime starts a signal at 1; the word is the low half of the 64-bit value (the
        # waits mask with 0xFFFFFFFF), and both halves start at 0 like any gate word
        raw.view(torch.int64).zero_()
        return raw.view(torch.int32)[:1], free

    def _load_gate_kernels(self, words: GateWords) -> None:
        """Compile and load the kernel gate, and the zeroing of separate words, by running them
        once on words already at 0."""
        from .. import gate_kernels as gate

        gate.launch_write(words.address(0), 0)
        gate.launch_wait(words.address(0), 0)
        words.zero_()
        device = (words.table if words.indirect else words.words).device
        torch.cuda.current_stream(device).synchronize()

    def _capable(self) -> bool:
        """``hipDeviceAttributeCanUseStreamWaitValue`` of the current device (read once)."""
        idx = torch.cuda.current_device()
        ok = self._can_wait.get(idx)
        if ok is None:
            attr = hip.hipDeviceAttribute_t.hipDeviceAttributeCanUseStreamWaitValue
            ok = self._can_wait[idx] = bool(check(
                hip.hipDeviceGetAttribute(attr, idx),
                f"hipDeviceGetAttribute(hipDeviceAttributeCanUseStreamWaitValue, {idx})"))
        return ok

    @staticmethod
    def _capturing(stream: Optional[int]) -> bool:
        """Whether ``stream`` is being captured. A stream the runtime cannot answer for counts as
        captured (hipErrorStreamCaptureImplicit: the null stream while another captures): the
        kernel gate is right in both cases, the runtime's wait only in one. hip-python builds
        the status enum from the output word whether or not the call wrote it: where the call
        fails the runtime leaves it unwritten, and a value outside the enum raises ValueError
        inside the binding (hip.pyx ``hipStreamIsCapturing``; CLR ``hipStreamIsCapturing_common``
        returns the error without writing the status)."""
        try:
            err, status = hip.hipStreamIsCapturing(stream or 0)
        except ValueError:
            return True
        if int(err) != 0:
            return True
        return int(status) != int(hip.hipStreamCaptureStatus.hipStreamCaptureStatusNone)

    def gate_form(self, stream: Optional[int], address: int, write: bool = False) -> str:
        """``"runtime"`` or ``"kernel"``: how a wait (or, with ``write``, a write) on ``address``
        in ``stream`` is queued now (module docstring)."""
        if self._capturing(stream):
            return "kernel"
        if write:
            return "runtime"
        if not self._capable():
            return "kernel"
        if cp_wait() and address not in self._signal_words:
            return "kernel"
        return "runtime"

    def stream_wait_value(self, stream: Optional[int], address: int, value: int) -> None:
        if self.gate_form(stream, address) == "kernel":
            self._on_stream(stream, lambda g: g.launch_wait(address, value))
            return
        check(hip.hipStreamWaitValue32(stream or 0, address, value, hip.hipStreamWaitValueGte,
                                       0xFFFFFFFF),
              f"hipStreamWaitValue32({address:#x} >= {value})")

    def stream_write_value(self, stream: Optional[int], address: int, value: int) -> None:
        if self.gate_form(stream, address, write=True) == "kernel":
            self._on_stream(stream, lambda g: g.launch_write(address, value))
            return
        check(hip.hipStreamWriteValue32(stream or 0, address, value, 0),
              f"hipStreamWriteValue32({address:#x} = {value})")

    def _on_stream(self, stream: Optional[int], launch) -> None:
        """Run ``launch(gate)`` with ``stream`` current (Triton launches on the current stream)."""
        from .. import gate_kernels as gate

        device = torch.cuda.current_device()
        if stream == self.current_stream(torch.device("cuda", device)):
            launch(gate)
            return
        s = (torch.cuda.ExternalStream(stream, device=device) if stream
             else torch.cuda.default_stream(device))
        with torch.cuda.stream(s):
            launch(gate)

    def alloc_host_mapped(self, nbytes: int) -> HostMapped:
        t = torch.zeros((nbytes + 7) // 8, dtype=torch.int64, pin_memory=True)
        dptr = check(hip.hipHostGetDevicePointer(t.data_ptr(), 0), "hipHostGetDevicePointer")
        return HostMapped(t, int(dptr))

    def extra_facts(self) -> dict:
        import importlib.util

        facts = {"rocshmem (torch shmem backend)": _torch_shmem(),
                 "rocshmem Triton bindings": _rocshmem_bindings(),
                 "hip-python": "installed" if importlib.util.find_spec("hip") else "not installed"}
        queues = hw_queues()
        facts["hardware queues per priority"] = (
            f"{queues} ({HW_QUEUES_VAR}{'' if HW_QUEUES_VAR in os.environ else ' unset'}): "
            f"streams past that many share a queue and run in turn"
            + ("" if queues >= 16 else f"; set {HW_QUEUES_VAR}=16 or more before the process "
               f"starts, so the copy lanes and side streams run side by side"))
        facts["stream value waits"] = (
            f"{CP_WAIT_VAR}=1: command processor (every gate word its own signal-memory "
            f"allocation); kernel gate under graph capture" if cp_wait() else
            "runtime blit kernel (one CU while waiting); kernel gate under graph capture")
        return facts

    def current_stream(self, device: torch.device) -> Optional[int]:
        # the raw-handle getter skips building a torch.cuda.Stream object (on the launch path)
        return torch._C._cuda_getCurrentRawStream(device.index)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)


def _torch_shmem() -> str:
    """Whether torch's shmem backend can be used here. torch names it "NVSHMEM" on both vendors;
    a ROCm build of torch puts rocSHMEM behind that name."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        ok = getattr(symm_mem, "is_nvshmem_available", None)
        if ok is None:
            return "not available (this torch has no shmem backend query)"
        return "available" if ok() else "not available (torch reports no rocSHMEM)"
    except Exception as e:  # torch without symmetric memory
        return f"not available ({type(e).__name__}: {e})"


def _rocshmem_bindings() -> str:
    """Whether torch ships the rocSHMEM Triton bindings and finds rocSHMEM's device library."""
    try:
        from torch.distributed._symmetric_memory import _rocshmem_triton as rs
    except Exception as e:
        return f"not available ({type(e).__name__}: {e})"
    try:
        return f"device library at {rs.RocshmemLibFinder.find_device_library()}"
    except Exception as e:
        return f"no device library ({type(e).__name__}: {e})"
