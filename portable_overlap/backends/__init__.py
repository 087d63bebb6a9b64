"""Backend selection: by device, or forced with ``PORTABLE_OVERLAP_BACKEND=cuda|rocm|cpu``.

A forced backend that cannot be used raises :class:`BackendUnavailable` naming what is missing;
it never falls back silently.
"""
from __future__ import annotations

from typing import Optional

from ..envvars import env_str
from ..errors import BackendUnavailable
from .base import (ENTRIES, Allocation, Backend, DeviceFacts, GateWords, HostMapped,
                   PeerMapping)

ENV_VAR = "PORTABLE_OVERLAP_BACKEND"


def backend_classes() -> dict:
    from .cpu import CpuBackend
    from .cuda import CudaBackend
    from .rocm import RocmBackend

    return {"cuda": CudaBackend, "rocm": RocmBackend, "cpu": CpuBackend}


_cache: dict = {}


def get_backend(name: Optional[str] = None) -> Backend:
    """The backend named by ``name``, else by ``$PORTABLE_OVERLAP_BACKEND``, else detected from
    the devices torch sees (an NVIDIA GPU: cuda; an AMD GPU: rocm; none: cpu)."""
    classes = backend_classes()
    asked = f"backend {name!r}" if name is not None else None
    if name is None:
        name = env_str(ENV_VAR)
        asked = f"{ENV_VAR}={name!r}"
    if name is not None:
        if name not in classes:
            raise BackendUnavailable(f"{asked} names no backend; choose one of {sorted(classes)}")
        usable, why = classes[name].is_usable()
        if not usable:
            raise BackendUnavailable(f"backend {name!r} was asked for but cannot be used: {why}")
    else:
        name = _detect(classes)
    if name not in _cache:
        _cache[name] = classes[name]()
    return _cache[name]


def _detect(classes: dict) -> str:
    """The first usable of cuda, rocm, cpu; never cpu where torch sees a GPU (the emulated
    backend would run the ops on host memory beside the GPU tensors): there the GPU backend's
    reason is raised instead."""
    import torch

    why = {}
    for name in ("cuda", "rocm", "cpu"):
        if name == "cpu" and torch.cuda.is_available():
            gpu = "rocm" if torch.version.hip is not None else "cuda"
            raise BackendUnavailable(
                f"torch sees a GPU but backend {gpu!r} cannot be used: {why[gpu]}; set "
                f"{ENV_VAR}=cpu to run the CPU-emulated backend anyway")
        usable, why[name] = classes[name].is_usable()
        if usable:
            return name
    raise BackendUnavailable("no backend can be used here: " + "; ".join(
        f"{n}: {w}" for n, w in why.items()))


_facts: dict = {}


def device_facts(device) -> DeviceFacts:
    """The selected backend's facts about ``device``, read once per process and backend choice:
    they never change, and reading them costs several driver calls (too many for an op call).
    A GPU device without an index (``torch.device("cuda")``) means the current device, as in
    torch's own calls."""
    import torch

    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, torch.get_device_module(device.type).current_device())
    key = (env_str(ENV_VAR), str(device))
    facts = _facts.get(key)
    if facts is None:
        facts = _facts[key] = get_backend().device_facts(device)
    return facts


__all__ = ["ENTRIES", "Allocation", "Backend", "DeviceFacts", "GateWords", "HostMapped",
           "PeerMapping", "backend_classes", "get_backend", "device_facts", "ENV_VAR"]
