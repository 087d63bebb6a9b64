"""The ROC_SHMEM provider against a stand-in of torch's symmetric-memory module: it selects
torch's shmem backend before allocating, asks torch whether that backend exists, and does not
take torch's rocSHMEM bindings module for rocSHMEM where torch is not a ROCm build (the module
imports on every build)."""
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from portable_overlap.shmem.providers import rocshmem

BINDINGS = "torch.distributed._symmetric_memory._rocshmem_triton"


def _bindings(device_functions=True, lib_error=None):
    """A stand-in for torch's rocSHMEM Triton bindings module."""
    m = types.ModuleType(BINDINGS)

    class Finder:
        @staticmethod
        def find_device_library():
            if lib_error:
                raise RuntimeError(lib_error)
            return "/opt/rocm/lib/librocshmem_device_gfx942.bc"

    m.RocshmemLibFinder = Finder
    if device_functions:
        m.put = m.quiet = m.requires_rocshmem = lambda *a, **k: None
    return m


def test_the_fallback_fires_where_torch_is_not_a_rocm_build():
    # this CPU build of torch imports the bindings module fine (without device functions)
    assert torch.version.hip is None
    assert rocshmem._rs is None
    ok, why = rocshmem.RocshmemProvider.available()
    assert not ok and "ROCm" in why


def test_the_bindings_count_only_on_a_rocm_build_with_device_functions(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "7.1.0", raising=False)
    monkeypatch.setitem(sys.modules, BINDINGS, _bindings(device_functions=False))
    monkeypatch.setattr(symm_mem, "_rocshmem_triton", sys.modules[BINDINGS], raising=False)
    mod, why = rocshmem._load_bindings()
    assert mod is None and "device functions" in why
    good = _bindings()
    monkeypatch.setitem(sys.modules, BINDINGS, good)
    monkeypatch.setattr(symm_mem, "_rocshmem_triton", good, raising=False)
    assert rocshmem._load_bindings() == (good, "")
    monkeypatch.setattr(torch.version, "hip", None)
    mod, why = rocshmem._load_bindings()
    assert mod is None and "ROCm" in why


@pytest.mark.parametrize("torch_says", [False, True])
def test_available_asks_torch_for_its_shmem_backend(monkeypatch, torch_says):
    monkeypatch.setattr(rocshmem, "_rs", _bindings())
    monkeypatch.setattr(symm_mem, "is_nvshmem_available", lambda: torch_says)
    ok, why = rocshmem.RocshmemProvider.available()
    assert ok == torch_says
    if not torch_says:
        assert "unavailable" in why


def test_available_needs_the_device_bitcode(monkeypatch):
    monkeypatch.setattr(rocshmem, "_rs", _bindings(lib_error="librocshmem_device_gfx942.bc "
                                                             "not found"))
    monkeypatch.setattr(symm_mem, "is_nvshmem_available", lambda: True)
    ok, why = rocshmem.RocshmemProvider.available()
    assert not ok and "librocshmem_device" in why


@pytest.mark.parametrize("selected", [None, "CUDA", "NVSHMEM"])
def test_allocation_selects_the_shmem_backend_first(monkeypatch, selected):
    calls = []
    state = {"backend": selected}

    def set_backend(name):
        calls.append(("set_backend", name))
        state["backend"] = name

    def empty(*shape, dtype, device):
        calls.append(("empty", state["backend"]))
        return torch.empty(*shape, dtype=dtype)

    monkeypatch.setattr(symm_mem, "get_backend", lambda device: state["backend"])
    monkeypatch.setattr(symm_mem, "set_backend", set_backend)
    monkeypatch.setattr(symm_mem, "empty", empty)
    monkeypatch.setattr(symm_mem, "rendezvous", lambda t, g: calls.append(("rendezvous", g)))
    monkeypatch.setattr(dist, "group", types.SimpleNamespace(WORLD=types.SimpleNamespace(
        group_name="0")))
    monkeypatch.setattr(rocshmem, "put_rows", None, raising=False)
    monkeypatch.setattr(rocshmem, "flush", None, raising=False)
    world = types.SimpleNamespace(group=None, device=torch.device("cpu"))
    t = rocshmem.RocshmemProvider(world).symmetric_empty(256)
    assert t.numel() == 256 and t.dtype == torch.uint8
    # the tensor comes from torch's shmem backend ("NVSHMEM" names rocSHMEM on ROCm builds)
    assert ("empty", "NVSHMEM") in calls and calls[-1] == ("rendezvous", "0")
    assert calls.index(("empty", "NVSHMEM")) < calls.index(("rendezvous", "0"))
    # selected once: torch refuses to switch backends after the first allocation
    assert calls.count(("set_backend", "NVSHMEM")) == (selected != "NVSHMEM")


@pytest.mark.parametrize("provider", ["rocshmem", "nvshmem"])
def test_a_backend_fixed_by_another_user_is_refused_before_allocating(monkeypatch, provider):
    """torch keeps the backend of the first symmetric tensor of the process: after torch's
    fused ops allocated from its IPC heap, a SHMEM provider cannot be made. Its constructor
    says so (ShmemUnavailable, naming the way out) and allocates nothing; the callers turn
    that into the same error on every rank (``agreed_put_provider``)."""
    from portable_overlap.shmem.providers import ShmemUnavailable, nvshmem

    calls = []

    def set_backend(name):
        calls.append(name)
        raise RuntimeError("Backend can not be changed after use.")

    monkeypatch.setattr(symm_mem, "get_backend", lambda device: "CUDA")
    monkeypatch.setattr(symm_mem, "set_backend", set_backend)
    monkeypatch.setattr(symm_mem, "empty", lambda *a, **k: calls.append("empty"))
    world = types.SimpleNamespace(group=None, device=torch.device("cpu"))
    cls = rocshmem.RocshmemProvider if provider == "rocshmem" else nvshmem.NvshmemProvider
    with pytest.raises(ShmemUnavailable) as e:
        cls(world)
    msg = str(e.value)
    assert "'CUDA'" in msg and "transport='stores'" in msg and "can not be changed" in msg
    assert calls == ["NVSHMEM"]  # tried once, nothing allocated
