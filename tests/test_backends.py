"""The backend layer: every backend implements every entry, selection and overrides fail loudly,
the vendor bindings resolve every symbol the backends call, and the CPU backend's memory, copies
and stream flags work."""
import ctypes
import inspect

import pytest
import torch

from portable_overlap.backends import ENTRIES, Backend, backend_classes, get_backend
from portable_overlap.errors import BackendEntryMissing, BackendUnavailable, PeerTimeoutError


@pytest.mark.parametrize("name", ["cuda", "rocm", "cpu"])
def test_every_backend_implements_every_entry(name):
    cls = backend_classes()[name]
    for entry in ENTRIES:
        impl = getattr(cls, entry, None)
        assert impl is not None, f"{name} lacks {entry}"
        assert impl is not getattr(Backend, entry), f"backend {name!r} does not implement {entry!r}"


def test_missing_entry_names_backend_and_entry():
    class Half(Backend):
        name = "half"

    with pytest.raises(BackendEntryMissing, match="'half' does not implement 'copy_async'"):
        Half().copy_async(0, 0, 0, None)


def test_detection_picks_cpu_without_gpu(monkeypatch):
    monkeypatch.delenv("PORTABLE_OVERLAP_BACKEND", raising=False)
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert get_backend().name == "cpu"


@pytest.mark.parametrize("name", ["cuda", "rocm"])
def test_forced_gpu_backend_without_gpu_fails_loudly(monkeypatch, name):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    monkeypatch.setenv("PORTABLE_OVERLAP_BACKEND", name)
    with pytest.raises(BackendUnavailable,
                       match=f"backend '{name}' was asked for but cannot be used"):
        get_backend()


def test_detection_on_a_gpu_host_names_the_gpu_backends_reason(monkeypatch):
    """Where torch sees a GPU but its backend cannot be used (hip-python without a HIP
    runtime, two HIP runtimes in the process), detection raises that backend's reason instead
    of silently taking the CPU-emulated backend."""
    from portable_overlap import backends

    monkeypatch.delenv("PORTABLE_OVERLAP_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    classes = dict(backend_classes())
    monkeypatch.setattr(classes["rocm"], "is_usable",
                        classmethod(lambda cls: (False, "two HIP runtimes in this process")))
    with pytest.raises(BackendUnavailable,
                       match="torch sees a GPU but backend 'rocm' cannot be used: two HIP"):
        backends._detect(classes)


def test_unknown_backend_name(monkeypatch):
    monkeypatch.setenv("PORTABLE_OVERLAP_BACKEND", "tpu")
    with pytest.raises(BackendUnavailable, match="names no backend"):
        get_backend()


def test_cuda_python_symbols_resolve(cuda_driver):
    from portable_overlap.backends.cuda import SYMBOLS

    driver = cuda_driver
    missing = [s for s in SYMBOLS if not hasattr(driver, s)]
    assert not missing, f"cuda-python lacks {missing}"
    # enum members the backend names
    assert driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS is not None
    assert driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ is not None
    assert driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT is not None


def test_cuda_ipc_handle_marshalling(cuda_driver):
    from portable_overlap.backends.cuda import handle_bytes, make_ipc_handle

    driver = cuda_driver
    data = bytes(range(64))
    assert handle_bytes(make_ipc_handle(data)) == data
    with pytest.raises(ValueError, match="64 bytes"):
        make_ipc_handle(b"short")
    assert int(driver.CUdeviceptr(0x7F0000001000)) == 0x7F0000001000
    assert int(driver.CUstream(0)) == 0


class _Recorder:
    """Stands in for a vendor module: the real module's types and enums, but the named call
    records its arguments instead of reaching a driver this machine lacks."""

    def __init__(self, real, call, result):
        self._real, self._call, self._result, self.calls = real, call, result, []

    def __getattr__(self, name):
        if name == self._call:
            return lambda *args: (self.calls.append(args), self._result)[1]
        return getattr(self._real, name)


def test_cuda_copy_2d_marshalling(monkeypatch, cuda_driver):
    import portable_overlap.backends.cuda as cuda_be

    driver = cuda_driver
    rec = _Recorder(driver, "cuMemcpy2DAsync", (driver.CUresult.CUDA_SUCCESS,))
    monkeypatch.setattr(cuda_be, "driver", rec)
    be = object.__new__(cuda_be.CudaBackend)  # skips cuInit: no driver here
    dst, src = 0x7F0000004000, 0x7F0000001000
    be.copy_2d_async(dst, 4096, src, 1024, 24, 7, 0x1234)
    (p, stream), = rec.calls
    unified = driver.CUmemorytype.CU_MEMORYTYPE_UNIFIED
    assert isinstance(p, driver.CUDA_MEMCPY2D)
    assert (int(p.srcDevice), p.srcPitch, p.srcMemoryType) == (src, 1024, unified)
    assert (int(p.dstDevice), p.dstPitch, p.dstMemoryType) == (dst, 4096, unified)
    assert (p.WidthInBytes, p.Height, p.srcXInBytes, p.srcY, p.dstXInBytes, p.dstY) == \
        (24, 7, 0, 0, 0, 0)
    assert int(stream) == 0x1234


def test_hip_copy_2d_arguments(monkeypatch, hip_runtime):
    import portable_overlap.backends.rocm as rocm_be

    hip = hip_runtime
    rec = _Recorder(hip, "hipMemcpy2DAsync", (hip.hipError_t.hipSuccess,))
    monkeypatch.setattr(rocm_be, "hip", rec)
    rocm_be.RocmBackend().copy_2d_async(0x7F0000004000, 4096, 0x7F0000001000, 1024, 24, 7, None)
    assert rec.calls == [(0x7F0000004000, 4096, 0x7F0000001000, 1024, 24, 7,
                          hip.hipMemcpyKind.hipMemcpyDeviceToDevice, 0)]
    # the call's documented order: dst, dpitch, src, spitch, width, height, kind, stream
    assert hip.hipMemcpy2DAsync.__doc__.startswith(
        "hipMemcpy2DAsync(dst, size_t dpitch, src, size_t spitch, size_t width, size_t height, "
        "kind, stream)")


def test_hip_copy_arguments_keep_the_copy_off_the_cus(monkeypatch, hip_runtime):
    """A 1-D copy asks for hipMemcpyDeviceToDeviceNoCU (1024): with hipMemcpyDeviceToDevice
    the runtime hands ROCr both sides as this GPU (a peer's heap opened through IPC included)
    and ROCr copies 1 MiB and more with a blit kernel on the CUs."""
    import portable_overlap.backends.rocm as rocm_be

    hip = hip_runtime
    rec = _Recorder(hip, "hipMemcpyAsync", (hip.hipError_t.hipSuccess,))
    monkeypatch.setattr(rocm_be, "hip", rec)
    rocm_be.RocmBackend().copy_async(0x7F0000004000, 0x7F0000001000, 4 << 20, 0x1234)
    rocm_be.RocmBackend().copy_async(0x7F0000004000, 0x7F0000001000, 24, None)
    nocu = hip.hipMemcpyKind.hipMemcpyDeviceToDeviceNoCU
    assert int(nocu) == 1024
    assert rec.calls == [(0x7F0000004000, 0x7F0000001000, 4 << 20, nocu, 0x1234),
                         (0x7F0000004000, 0x7F0000001000, 24, nocu, 0)]
    # the call's documented order: dst, src, sizeBytes (bytes), kind, stream
    assert hip.hipMemcpyAsync.__doc__.startswith(
        "hipMemcpyAsync(dst, src, size_t sizeBytes, kind, stream)")


def test_hip_python_symbols_resolve(hip_runtime):
    from portable_overlap.backends.rocm import SYMBOLS

    hip = hip_runtime
    missing = [s for s in SYMBOLS if not hasattr(hip, s)]
    assert not missing, f"hip-python lacks {missing}"
    assert hip.hipDeviceAttribute_t.hipDeviceAttributeMultiprocessorCount is not None
    assert hip.hipMemcpyKind.hipMemcpyDeviceToDevice is not None


def test_hip_ipc_handle_marshalling(hip_runtime):
    from portable_overlap.backends.rocm import RocmBackend

    data = bytes(reversed(range(64)))
    h = RocmBackend.make_ipc_handle(data)
    assert bytes(h.reserved) == data


_MAPS_LINE = "7f5a00000000-7f5a00100000 r-xp 00000000 08:01 1234 {}\n"


def test_hip_python_opens_the_runtime_torch_loaded(monkeypatch, tmp_path, hip_runtime):
    """hip-python finds libamdhip64 by its own search (/opt/rocm/lib, ...), not the copy a
    ROCm wheel of torch loaded from its own directory: two HIP runtimes in one process, the
    second blind to torch's allocations and streams. The backend points hip-python's first-call
    lookup at the runtime this process has mapped (hip-python's real lookup is asked here)."""
    import importlib

    from portable_overlap.backends import rocm

    ours = "/site-packages/torch/lib/libamdhip64.so.6"
    maps = tmp_path / "maps"
    maps.write_text("".join(_MAPS_LINE.format(f) for f in (
        "/usr/bin/python3.11", "/site-packages/torch/lib/libtorch_hip.so", ours,
        ours, "/site-packages/torch/lib/libhsa-runtime64.so.1")) + _MAPS_LINE.format("[heap]"))
    assert rocm.torch_hip_runtime(str(maps)) == ours
    assert rocm.torch_hip_runtime(str(tmp_path / "none")) is None

    paths = importlib.import_module("rocm.bindings.util.paths")
    monkeypatch.setattr(paths, "get_library_path", paths.get_library_path)
    search = paths.get_library_path
    assert search("amdhip64") != ours.encode()  # hip-python's own search finds another file
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setattr(rocm, "torch_hip_runtime", lambda: ours)
    assert rocm._import_hip() is hip_runtime
    rocm._import_hip()  # a second import does not stack the lookups
    assert paths.get_library_path("amdhip64") == ours.encode()
    assert paths.get_library_path.searches is search
    assert paths.get_library_path("hiprtc") == search("hiprtc")  # other libraries: unchanged


def test_hip_python_before_rocm_bindings_opens_the_runtime_torch_loaded(monkeypatch,
                                                                        hip_runtime):
    """hip-python releases before the rocm.bindings layout name the library in the module
    global ``hip.chip.DLL`` (b"libamdhip64.so", which does not match torch's libamdhip64.so.6)."""
    import sys
    import types

    from portable_overlap.backends import rocm

    chip = types.ModuleType("hip.chip")
    chip.DLL = b"libamdhip64.so"
    monkeypatch.setitem(sys.modules, "rocm.bindings.util.paths", None)
    monkeypatch.setitem(sys.modules, "hip.chip", chip)
    rocm.pin_runtime("/site-packages/torch/lib/libamdhip64.so.6")
    assert chip.DLL == b"/site-packages/torch/lib/libamdhip64.so.6"


def test_hip_runtime_of_torch_among_several_copies(monkeypatch, tmp_path, hip_runtime):
    """Two copies mapped already: the one torch's HIP library resolves hipMalloc to; none
    where that cannot be told."""
    from portable_overlap.backends import rocm

    torch_lib, other = "/t/lib/libamdhip64.so.6", "/opt/rocm-6.4.0/lib/libamdhip64.so.6.4.43482"
    maps = tmp_path / "maps"
    maps.write_text("".join(_MAPS_LINE.format(f) for f in (
        other, "/t/lib/libtorch_hip.so", torch_lib)))
    asked = []
    monkeypatch.setattr(rocm, "_defining_file",
                        lambda lib, sym: asked.append((lib, sym)) or torch_lib)
    assert rocm.torch_hip_runtime(str(maps)) == torch_lib
    assert asked == [("/t/lib/libtorch_hip.so", "hipMalloc")]
    monkeypatch.setattr(rocm, "_defining_file", lambda lib, sym: None)
    assert rocm.torch_hip_runtime(str(maps)) is None


def test_rocm_runtime_lookup_follows_a_library_dependencies():
    """The look-up that tells torch's HIP runtime apart, on real libraries of this process:
    ``malloc`` as torch's CPU library resolves it is libc's (one of its dependencies)."""
    import os

    from portable_overlap.backends import rocm

    mapped = rocm._mapped_files()
    libc = next(f for f in mapped if os.path.basename(f).startswith("libc.so"))
    torch_cpu = next(f for f in mapped if os.path.basename(f).startswith("libtorch_cpu"))
    assert os.path.realpath(rocm._defining_file(torch_cpu, "malloc")) == os.path.realpath(libc)
    assert rocm._defining_file(torch_cpu, "no_such_symbol_here") is None


def test_hip_backend_unusable_where_hip_python_loads_no_runtime(monkeypatch, hip_runtime):
    """Importing hip-python loads no library; the backend asks the runtime for its devices, so
    a missing libamdhip64 makes the backend unusable with the loader's reason, not a failure
    at the first allocation."""
    from portable_overlap.backends import rocm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setattr(rocm, "torch_hip_runtime", lambda: None)

    class NoLibrary:
        def __getattr__(self, name):
            assert name == "hipGetDeviceCount"

            def call():
                raise RuntimeError("failed to dlopen 'libamdhip64.so'")
            return call

    monkeypatch.setattr(rocm, "hip", NoLibrary())
    ok, why = rocm.RocmBackend.is_usable()
    assert not ok and "cannot load the HIP runtime" in why and "libamdhip64" in why

    class Devices:
        hipError_t = hip_runtime.hipError_t

        def __init__(self, count):
            self.count = count

        def hipGetDeviceCount(self):
            return (hip_runtime.hipError_t.hipSuccess, self.count)

    monkeypatch.setattr(rocm, "hip", Devices(8))
    torch_lib = "/t/lib/libamdhip64.so.6"
    monkeypatch.setattr(rocm, "_mapped_files", lambda: ["/t/lib/libtorch_hip.so", torch_lib])
    assert rocm.RocmBackend.is_usable() == (True, "")
    monkeypatch.setattr(rocm, "hip", Devices(0))
    assert not rocm.RocmBackend.is_usable()[0]
    # hip-python made its first call before the backend could point it at torch's runtime
    monkeypatch.setattr(rocm, "hip", Devices(8))
    monkeypatch.setattr(rocm, "_mapped_files",
                        lambda: [torch_lib, "/opt/rocm-6.4.0/lib/libamdhip64.so.6.4.43482"])
    ok, why = rocm.RocmBackend.is_usable()
    assert not ok and why.startswith("two HIP runtimes in this process") and torch_lib in why


def test_hip_ipc_export_and_open_select_the_device(monkeypatch, hip_runtime):
    """hipIpcGetMemHandle and hipIpcOpenMemHandle act on the current device (CLR's IpcCreate /
    IpcAttach take hip::getCurrentDevice()): both select the allocation's device first. The
    handle travels as its 64 bytes and opens with hipIpcMemLazyEnablePeerAccess, the only flag
    the runtime takes."""
    from portable_overlap.backends import rocm

    hip, calls = hip_runtime, []
    data = bytes(range(64))

    class Ipc:
        def __getattr__(self, name):
            return getattr(hip, name)

        def hipSetDevice(self, idx):
            calls.append(("hipSetDevice", idx))
            return (hip.hipError_t.hipSuccess,)

        def hipIpcGetMemHandle(self, ptr):
            calls.append(("hipIpcGetMemHandle", ptr))
            return (hip.hipError_t.hipSuccess, rocm.RocmBackend.make_ipc_handle(data))

        def hipIpcOpenMemHandle(self, handle, flags):
            calls.append(("hipIpcOpenMemHandle", bytes(handle.reserved), flags))
            return (hip.hipError_t.hipSuccess, 0x7F0000100000)

    monkeypatch.setattr(rocm, "hip", Ipc())
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    be, dev = rocm.RocmBackend(), torch.device("cuda", 3)
    alloc = rocm.Allocation(0x7F0000002000, 4096, None, dev, native=0x7F0000002000)
    assert be.export_handle(alloc) == data
    mapping = be.open_handle(data, 4096, dev)
    assert mapping.address == 0x7F0000100000 and mapping.nbytes == 4096
    assert calls == [("hipSetDevice", 3), ("hipIpcGetMemHandle", 0x7F0000002000),
                     ("hipSetDevice", 3), ("hipIpcOpenMemHandle", data, 1)]
    assert hip.hipIpcMemLazyEnablePeerAccess == 1


def test_cpu_backend_memory_copy_and_flags():
    be = backend_classes()["cpu"]()
    a = be.alloc_exportable(4096, torch.device("cpu"))
    peer = be.open_handle(be.export_handle(a), 4096, torch.device("cpu"))  # a second mapping
    try:
        src = torch.randn(256)
        be.copy_async(peer.address + 1024, src.data_ptr(), 1024, be.current_stream(None))
        assert torch.equal(a.tensor[1024:2048].view(torch.float32), src)  # same memory
        be.stream_write_value(None, peer.address, 7)
        assert ctypes.c_int32.from_address(a.address).value == 7
        be.stream_wait_value(None, a.address, 7)  # already there: returns
        be.wait_timeout_s = 0.05
        with pytest.raises(PeerTimeoutError, match="timed out"):
            be.stream_wait_value(None, a.address, 8)
        hm = be.alloc_host_mapped(64)
        assert hm.device_address == hm.tensor.data_ptr()
        facts = be.device_facts(torch.device("cpu"))
        assert facts.sm_count >= 1 and facts.vendor == "cpu"
    finally:
        be.close_handle(peer)
        be.free(a)


def test_cpu_backend_copy_2d():
    """A column block of one row-major matrix into a column block of another (the 2-D
    AllGather+GEMM pieces), across two mappings of one segment; bytes beside the block stay."""
    be = backend_classes()["cpu"]()
    a = be.alloc_exportable(4096, torch.device("cpu"))
    peer = be.open_handle(be.export_handle(a), 4096, torch.device("cpu"))
    try:
        src = torch.randn(5, 11, dtype=torch.float64)  # pitch 88 bytes
        dst = a.tensor[:5 * 9 * 8].view(torch.float64).view(5, 9)  # pitch 72 bytes
        dst.fill_(-1.0)
        block = src[:, 3:7]
        be.copy_2d_async(peer.address + 2 * 8, 9 * 8, block.data_ptr(), 11 * 8, 4 * 8, 5,
                         be.current_stream(None))
        want = torch.full((5, 9), -1.0, dtype=torch.float64)
        want[:, 2:6] = block
        assert torch.equal(dst, want)
        be.copy_2d_async(0, 8, 0, 8, 8, 0, None)  # no rows: touches nothing
    finally:
        be.close_handle(peer)
        be.free(a)


def test_backend_entries_are_documented():
    for entry in ENTRIES:
        assert inspect.getdoc(getattr(Backend, entry)), f"Backend.{entry} has no docstring"


def test_hip_device_limits_come_from_the_runtime(monkeypatch, hip_runtime):
    """The ROCm facts take the CU count and the LDS per workgroup from hipDeviceGetAttribute
    (160 KiB on gfx950, where a constant 64 KiB was assumed), with hip-python's real attribute
    enum and a stand-in for the runtime's answers."""
    from portable_overlap.backends import rocm

    for arch, cus, lds in (("gfx942", 304, 64 * 1024), ("gfx950", 256, 160 * 1024)):
        _check_rocm_facts(monkeypatch, hip_runtime, rocm, arch, cus, lds)


def _check_rocm_facts(monkeypatch, hip_runtime, rocm, arch, cus, lds):
    attr = hip_runtime.hipDeviceAttribute_t
    answers = {attr.hipDeviceAttributeMultiprocessorCount: cus,
               attr.hipDeviceAttributeMaxSharedMemoryPerBlock: lds,
               attr.hipDeviceAttributeMaxSharedMemoryPerMultiprocessor: lds,
               attr.hipDeviceAttributeMaxThreadsPerMultiProcessor: 2048}
    asked = []

    class FakeHip:
        hipDeviceAttribute_t = attr

        @staticmethod
        def hipSetDevice(idx):
            return (0,)

        @staticmethod
        def hipDeviceGetAttribute(a, idx):
            asked.append(a)
            return (0, answers[a])

    class Props:
        name, gcnArchName = f"AMD {arch}", f"{arch}:sramecc+:xnack-"

    monkeypatch.setattr(rocm, "hip", FakeHip)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    facts = rocm.RocmBackend().device_facts(torch.device("cuda", 0))
    assert (facts.arch, facts.sm_count, facts.warp_size) == (arch, cus, 64)
    assert facts.shared_per_program == lds and facts.max_shared_bytes_per_sm == lds
    assert facts.max_warps_per_sm == 32
    assert facts.gate_programs == 1  # the blit-kernel wait spins on a CU
    assert set(answers) <= set(asked)


# --- the ROCm gates: which form of stream wait the backend queues ---------------------------------

class _GateHip:
    """hip-python's real enums and constants with stand-in answers for the calls the gates make:
    the capability, the capture status, the allocations, and the queued waits and writes
    (recorded)."""

    def __init__(self, real, capable=True, capturing=False):
        self._real, self.capable, self.capturing = real, capable, capturing
        self.calls = []
        self.signal_memory = []  # host buffers standing in for 8-byte signal allocations

    def __getattr__(self, name):
        return getattr(self._real, name)

    def hipSetDevice(self, idx):
        return (self._real.hipError_t.hipSuccess,)

    def hipDeviceGetAttribute(self, attr, idx):
        assert attr == self._real.hipDeviceAttribute_t.hipDeviceAttributeCanUseStreamWaitValue
        self.calls.append(("attribute", attr, idx))
        return (self._real.hipError_t.hipSuccess, int(self.capable))

    def hipStreamIsCapturing(self, stream):
        st = self._real.hipStreamCaptureStatus
        if self.capturing == "unanswered":  # what hip-python does where the call fails: the
            return (self._real.hipError_t.hipErrorStreamCaptureImplicit,  # status it builds
                    st(7))  # from the unwritten word raises (ValueError)
        return (self._real.hipError_t.hipSuccess,
                st.hipStreamCaptureStatusActive if self.capturing
                else st.hipStreamCaptureStatusNone)

    def hipStreamWaitValue32(self, *args):
        self.calls.append(("hipStreamWaitValue32",) + args)
        return (self._real.hipError_t.hipSuccess,)

    def hipStreamWriteValue32(self, *args):
        self.calls.append(("hipStreamWriteValue32",) + args)
        return (self._real.hipError_t.hipSuccess,)

    def hipExtMallocWithFlags(self, nbytes, flags):
        self.calls.append(("hipExtMallocWithFlags", nbytes, flags))
        buf = torch.ones(nbytes // 8, dtype=torch.int64)  # the runtime starts a signal at 1
        self.signal_memory.append(buf)
        return (self._real.hipError_t.hipSuccess, buf.data_ptr())

    def hipFree(self, ptr):
        self.calls.append(("hipFree", ptr))
        return (self._real.hipError_t.hipSuccess,)


@pytest.mark.parametrize("value, on", [
    ("1", True), ("true", True), ("2", True), (" 1", True), ("-1", True), ("3x", True),
    ("0", False), ("", False), ("false", False), ("yes", False), ("on", False),
    ("TRUE", False), ("True", False), (" true", False)])
def test_cp_wait_reads_the_variable_as_the_runtime_does(monkeypatch, value, on):
    """GPU_STREAMOPS_CP_WAIT as ROCm's runtime parses a boolean flag: exactly "true", or a
    non-zero leading integer (atoi). "yes" and "on" turned the command-processor path on here
    while the runtime kept it off, and "2" the other way round."""
    from portable_overlap.backends import rocm

    monkeypatch.setenv(rocm.CP_WAIT_VAR, value)
    assert rocm.cp_wait() is on


@pytest.fixture
def gate_backend(monkeypatch, hip_runtime):
    """A RocmBackend over ``_GateHip`` on this CPU: the kernel gate's launches are recorded
    instead of run, and "device" tensors are host tensors."""
    from portable_overlap.backends import rocm

    def make(capable=True, capturing=False, cp_wait=False):
        fake = _GateHip(hip_runtime, capable, capturing)
        monkeypatch.setattr(rocm, "hip", fake)
        if cp_wait:
            monkeypatch.setenv(rocm.CP_WAIT_VAR, "1")
        else:
            monkeypatch.delenv(rocm.CP_WAIT_VAR, raising=False)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        keep = []

        def host_tensor(array, device):
            addr = array.__cuda_array_interface__["data"][0]
            nbytes = array.__cuda_array_interface__["shape"][0]
            keep.append(array)
            buf = (ctypes.c_uint8 * nbytes).from_address(addr)
            return torch.frombuffer(buf, dtype=torch.uint8)

        monkeypatch.setattr(rocm, "_device_tensor", host_tensor)
        monkeypatch.setattr(rocm, "_device_zeros",
                            lambda n, device: torch.zeros(n, dtype=torch.int32))
        monkeypatch.setattr(rocm, "_device_table",
                            lambda addrs, device: torch.tensor(addrs, dtype=torch.int64))
        be = rocm.RocmBackend()
        monkeypatch.setattr(be, "_load_gate_kernels",
                            lambda words: fake.calls.append(("load gate kernels",)))
        monkeypatch.setattr(be, "_on_stream",
                            lambda stream, launch: launch(_KernelGate(fake, stream)))
        return be, fake

    return make


class _KernelGate:
    """Stands in for ``backends.gate_kernels``: records the launches and the stream."""

    def __init__(self, fake, stream):
        self.fake, self.stream = fake, stream

    def launch_wait(self, address, value):
        self.fake.calls.append(("kernel wait", self.stream, address, value))

    def launch_write(self, address, value):
        self.fake.calls.append(("kernel write", self.stream, address, value))


def _queued(fake):
    return [c for c in fake.calls if c[0] not in ("attribute", "load gate kernels")]


def test_hip_gate_is_the_runtime_wait_where_it_serves(gate_backend):
    """Capable device, no capture, no CP_WAIT: hipStreamWaitValue32(stream, word, value, Gte,
    full mask), and the reset through hipStreamWriteValue32."""
    be, fake = gate_backend()
    words = be.alloc_gate_words(4, torch.device("cuda", 0))
    assert not words.indirect and words.kernel_arg is words.words
    assert words.words.dtype == torch.int32 and words.words.shape == (4,)
    assert not words.values().any()
    addr = words.address(2)
    assert addr == words.words.data_ptr() + 8
    be.stream_wait_value(0x1234, addr, 7)
    be.stream_write_value(0x1234, addr, 0)
    hip = fake._real
    assert _queued(fake) == [
        ("hipStreamWaitValue32", 0x1234, addr, 7, hip.hipStreamWaitValueGte, 0xFFFFFFFF),
        ("hipStreamWriteValue32", 0x1234, addr, 0, 0)]
    assert ("load gate kernels",) in fake.calls  # loaded before any capture can begin


def test_hip_gate_without_the_capability_is_the_kernel_gate(gate_backend):
    be, fake = gate_backend(capable=False)
    words = be.alloc_gate_words(2, torch.device("cuda", 0))
    be.stream_wait_value(0x1234, words.address(0), 3)
    assert _queued(fake) == [("kernel wait", 0x1234, words.address(0), 3)]
    attr = fake._real.hipDeviceAttribute_t.hipDeviceAttributeCanUseStreamWaitValue
    assert ("attribute", attr, 0) in fake.calls


def test_hip_gate_under_capture_is_the_kernel_gate(gate_backend):
    """Older ROCm runs stream value operations at capture time instead of recording them: both
    the wait and the counter's reset become kernels while the stream is captured."""
    be, fake = gate_backend(capturing=True)
    words = be.alloc_gate_words(2, torch.device("cuda", 0))
    be.stream_wait_value(0x1234, words.address(1), 5)
    be.stream_write_value(0x1234, words.address(1), 0)
    assert _queued(fake) == [("kernel wait", 0x1234, words.address(1), 5),
                             ("kernel write", 0x1234, words.address(1), 0)]


def test_hip_gate_where_the_capture_query_fails_is_the_kernel_gate(gate_backend):
    """hipStreamIsCapturing failing (the null stream while another stream captures): hip-python
    raised ValueError from the status it builds of an unwritten word, out of the wait itself,
    where the kernel gate serves."""
    be, fake = gate_backend(capturing="unanswered")
    words = be.alloc_gate_words(2, torch.device("cuda", 0))
    be.stream_wait_value(0x1234, words.address(1), 5)
    assert _queued(fake) == [("kernel wait", 0x1234, words.address(1), 5)]


def test_hip_gate_with_cp_wait_uses_signal_memory(gate_backend):
    """GPU_STREAMOPS_CP_WAIT=1: a gate word comes from hipExtMallocWithFlags(8,
    hipMallocSignalMemory), zeroed (the runtime starts a signal at 1), and the command processor
    waits on it."""
    be, fake = gate_backend(cp_wait=True)
    word = be.alloc_gate_words(1, torch.device("cuda", 0))
    hip = fake._real
    assert ("hipExtMallocWithFlags", 8, hip.hipMallocSignalMemory) in fake.calls
    assert word.address(0) == fake.signal_memory[0].data_ptr()
    assert word.n == 1 and word.values().tolist() == [0] and int(fake.signal_memory[0][0]) == 0
    be.stream_wait_value(0x1234, word.address(0), 2)
    assert _queued(fake)[-1] == ("hipStreamWaitValue32", 0x1234, word.address(0), 2,
                                 hip.hipStreamWaitValueGte, 0xFFFFFFFF)


def test_hip_gate_with_cp_wait_gives_every_word_its_own_signal_memory(gate_backend):
    """GPU_STREAMOPS_CP_WAIT=1 and n > 1 words (the signal GEMM's group counters): n signal
    allocations of 8 bytes (the runtime hands out no more per allocation, so contiguous words
    could not be signal memory) and a device table of their addresses for the kernels; every
    word's wait and reset are the runtime's (the command processor waits), none the kernel gate;
    close frees each allocation once."""
    be, fake = gate_backend(cp_wait=True)
    hip = fake._real
    words = be.alloc_gate_words(5, torch.device("cuda", 0))
    mallocs = [c for c in fake.calls if c[0] == "hipExtMallocWithFlags"]
    assert mallocs == [("hipExtMallocWithFlags", 8, hip.hipMallocSignalMemory)] * 5
    bufs = [m.data_ptr() for m in fake.signal_memory]
    assert words.n == 5 and words.indirect and words.kernel_arg is words.table
    assert [words.address(g) for g in range(5)] == bufs
    assert words.table.dtype == torch.int64 and words.table.tolist() == bufs
    assert words.values().tolist() == [0] * 5
    assert all(int(m[0]) == 0 for m in fake.signal_memory)  # both halves of each signal
    for g in range(5):
        be.stream_wait_value(0x1234, words.address(g), g + 1)
        be.stream_write_value(0x1234, words.address(g), 0)
    assert _queued(fake)[5:] == [c for g in range(5) for c in (
        ("hipStreamWaitValue32", 0x1234, bufs[g], g + 1, hip.hipStreamWaitValueGte, 0xFFFFFFFF),
        ("hipStreamWriteValue32", 0x1234, bufs[g], 0, 0))]
    fake.capturing = True  # under capture the kernel gate still serves (and is recorded)
    be.stream_wait_value(0x1234, words.address(3), 1)
    assert _queued(fake)[-1] == ("kernel wait", 0x1234, bufs[3], 1)
    assert not [c for c in fake.calls if c[0] == "hipFree"]
    words.close()
    words.close()
    assert sorted(c[1] for c in fake.calls if c[0] == "hipFree") == sorted(bufs)


def test_hip_gate_words_without_signal_memory_are_contiguous(gate_backend):
    """A signal allocation that fails part way frees the words made before it, and the words
    fall back to contiguous ordinary memory (the kernel gate waits on them) with a warning; on a
    device without the capability no signal memory is asked for at all."""
    be, fake = gate_backend(cp_wait=True)
    real = fake.hipExtMallocWithFlags

    def third_fails(nbytes, flags):
        if len(fake.signal_memory) == 2:
            return (fake._real.hipError_t.hipErrorInvalidValue, 0)
        return real(nbytes, flags)

    fake.hipExtMallocWithFlags = third_fails
    fake.hipGetErrorName = lambda e: (fake._real.hipError_t.hipSuccess, b"hipErrorInvalidValue")
    with pytest.warns(UserWarning, match="no signal memory.*hipErrorInvalidValue"):
        words = be.alloc_gate_words(4, torch.device("cuda", 0))
    assert sorted(c[1] for c in fake.calls if c[0] == "hipFree") == sorted(
        m.data_ptr() for m in fake.signal_memory)
    assert not words.indirect and words.n == 4
    be.stream_wait_value(0x1234, words.address(1), 2)
    assert _queued(fake)[-1] == ("kernel wait", 0x1234, words.address(1), 2)

    be, fake = gate_backend(cp_wait=True, capable=False)
    words = be.alloc_gate_words(4, torch.device("cuda", 0))
    assert not words.indirect and not fake.signal_memory


def test_hip_gate_kernels_load_before_any_capture(gate_backend, monkeypatch):
    """alloc_gate_words runs the kernel gate's wait and write and the separate words' zeroing
    once, then synchronizes: every kernel a gate needs is loaded before any capture."""
    from portable_overlap.backends import gate_kernels, rocm

    be, fake = gate_backend(cp_wait=True)
    words = be.alloc_gate_words(3, torch.device("cuda", 0))
    ran = []
    monkeypatch.setattr(gate_kernels, "launch_write", lambda a, v: ran.append(("write", a, v)))
    monkeypatch.setattr(gate_kernels, "launch_wait", lambda a, v: ran.append(("wait", a, v)))
    monkeypatch.setattr(gate_kernels, "launch_zero", lambda t, n: ran.append(("zero", t, n)))

    class Stream:
        def synchronize(self):
            ran.append(("sync",))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    rocm.RocmBackend._load_gate_kernels(be, words)
    first = words.address(0)
    assert ran == [("write", first, 0), ("wait", first, 0), ("zero", words.table, 3), ("sync",)]


def test_hip_errors_name_the_error(monkeypatch, hip_runtime):
    """A failed call's message names the error as text: hip-python's hipGetErrorName answers a
    (hipError_t, bytes) tuple, which the message printed as such."""
    from portable_overlap.backends import rocm

    err = hip_runtime.hipError_t.hipErrorInvalidValue

    class Named:
        hipError_t = hip_runtime.hipError_t

        @staticmethod
        def hipGetErrorName(e):
            return (hip_runtime.hipError_t.hipSuccess, b"hipErrorInvalidValue")

    monkeypatch.setattr(rocm, "hip", Named)
    with pytest.raises(RuntimeError) as info:
        rocm.check((err, None))
    assert str(info.value) == "HIP call failed: hipErrorInvalidValue (1)"
    with pytest.raises(RuntimeError, match=r"^hipIpcOpenMemHandle failed: hipErrorInvalidValue"):
        rocm.check((err, None), "hipIpcOpenMemHandle")

    try:  # what hip-python (rocm.bindings layout) really returns: a CStr, not bytes
        from rocm.bindings.util.types import CStr
    except ImportError:
        CStr = None
    if CStr is not None:
        class CStrName(Named):
            @staticmethod
            def hipGetErrorName(e):
                return (hip_runtime.hipError_t.hipSuccess, CStr(b"hipErrorInvalidValue"))

        monkeypatch.setattr(rocm, "hip", CStrName)
        assert rocm.error_name(err) == "hipErrorInvalidValue (1)"

    class NoRuntime(Named):  # no libamdhip64: the runtime answers no name
        @staticmethod
        def hipGetErrorName(e):
            return (hip_runtime.hipError_t.hipSuccess, None)

    monkeypatch.setattr(rocm, "hip", NoRuntime)
    with pytest.raises(RuntimeError, match=r"^HIP call failed: hipErrorInvalidValue \(1\)$"):
        rocm.check((err,))


def test_hip_failed_calls_name_the_call(monkeypatch, hip_runtime):
    """Each HIP call that fails says which call it was (and the arguments that tell it apart),
    not only the error: "HIP call failed: hipErrorInvalidValue" did not say which of a dozen
    calls it was."""
    from portable_overlap.backends import rocm

    class Failing:
        """hip-python's enums; every call answers hipErrorInvalidValue."""

        def __getattr__(self, name):
            if name.startswith("hip") and callable(getattr(hip_runtime, name)) and not \
                    isinstance(getattr(hip_runtime, name), type):
                return lambda *args: (hip_runtime.hipError_t.hipErrorInvalidValue, None)
            return getattr(hip_runtime, name)

    monkeypatch.setattr(rocm, "hip", Failing())
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    be = rocm.RocmBackend()
    dev = torch.device("cuda", 1)
    mapping = rocm.PeerMapping(0x7F0000001000, 64, native=0x7F0000001000)
    alloc = rocm.Allocation(0x7F0000002000, 64, None, dev, native=0x7F0000002000)
    for call, want in [
        (lambda: be.alloc_exportable(4096, dev), r"^hipSetDevice\(1\) failed"),
        (lambda: be.close_handle(mapping), r"^hipIpcCloseMemHandle failed"),
        (lambda: be.free(alloc), r"^hipFree failed"),
        (lambda: be.can_access_peer(torch.device("cuda", 0), dev),
         r"^hipDeviceCanAccessPeer\(0, 1\) failed"),
        (lambda: be.copy_async(0x7F0000004000, 0x7F0000001000, 24, None),
         r"^hipMemcpyAsync\(0x7f0000004000 <- 0x7f0000001000, 24 bytes\) failed"),
        (lambda: be.copy_2d_async(0x7F0000004000, 64, 0x7F0000001000, 32, 24, 7, None),
         r"^hipMemcpy2DAsync\(0x7f0000004000 <- 0x7f0000001000, 7 rows of 24 bytes\) failed"),
        (lambda: be._capable(),
         r"^hipDeviceGetAttribute\(hipDeviceAttributeCanUseStreamWaitValue, 0\) failed"),
    ]:
        with pytest.raises(RuntimeError, match=want + r": hipErrorInvalidValue \(1\)$"):
            call()


def test_rocm_extra_facts_ask_torch_for_rocshmem(monkeypatch):
    """The rocSHMEM fact is torch's answer (its shmem backend, named "NVSHMEM" on ROCm too),
    not a fixed sentence."""
    import torch.distributed._symmetric_memory as symm_mem
    from portable_overlap.backends import rocm

    key = "rocshmem (torch shmem backend)"
    for answer, want in ((True, "available"), (False, "not available")):
        monkeypatch.setattr(symm_mem, "is_nvshmem_available", lambda: answer, raising=False)
        facts = rocm.RocmBackend().extra_facts()
        assert facts[key].startswith(want) and (answer or "not" in facts[key])
        assert not any("not integrated" in str(v) for v in facts.values())
    assert "rocshmem Triton bindings" in facts and "stream value waits" in facts


def test_rocm_extra_facts_report_the_hardware_queues(monkeypatch):
    """The runtime shares a hardware queue among the streams of a priority past
    GPU_MAX_HW_QUEUES (4 by default), and the streams of one queue run in turn: env says how
    many there are and what to set."""
    from portable_overlap.backends import rocm

    key = "hardware queues per priority"
    monkeypatch.delenv(rocm.HW_QUEUES_VAR, raising=False)
    assert rocm.hw_queues() == 4
    fact = rocm.RocmBackend().extra_facts()[key]
    assert fact.startswith("4 (GPU_MAX_HW_QUEUES unset)") and "GPU_MAX_HW_QUEUES=16" in fact
    monkeypatch.setenv(rocm.HW_QUEUES_VAR, "24")
    assert rocm.hw_queues() == 24
    fact = rocm.RocmBackend().extra_facts()[key]
    assert fact.startswith("24 (GPU_MAX_HW_QUEUES)") and "set" not in fact.split(":", 1)[1]


def test_device_facts_of_a_device_without_index_are_the_current_devices(monkeypatch):
    """``torch.device("cuda")`` means the current device (torch's convention): the backend is
    asked about ``cuda:<current>``, never handed an index-less device (making it current
    raised ValueError), and both spellings share one cache entry."""
    import portable_overlap.backends as backends

    asked = []

    class Recording:
        def device_facts(self, device):
            asked.append(device)
            return ("facts of", str(device))

    monkeypatch.setattr(backends, "_facts", {})
    monkeypatch.setattr(backends, "get_backend", lambda: Recording())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert backends.device_facts(torch.device("cuda")) == ("facts of", "cuda:3")
    assert backends.device_facts("cuda:3") == ("facts of", "cuda:3")
    assert backends.device_facts(torch.device("cpu")) == ("facts of", "cpu")
    assert asked == [torch.device("cuda", 3), torch.device("cpu")]
