"""Backend selection: by device, or forced with ``PORTABLE_OVERLAP_BACKEND=cuda|rocm|cpu``.

A forced backend that cannot be used raises :class:`BackendUnavailable` naming what is missing;
it never falls back silently.
"""
from __future__ import annotations

import os
from typing import Optional

from ..errors import BackendUnavailable
from .base import ENTRIES, Allocation, Backend, DeviceFacts, HostMapped, PeerMapping

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
    name = name or os.environ.get(ENV_VAR) or None
    if name is not None:
        if name not in classes:
            raise BackendUnavailable(
                f"{ENV_VAR}={name!r} names no backend; choose one of {sorted(classes)}")
        usable, why = classes[name].is_usable()
        if not usable:
            raise BackendUnavailable(f"backend {name!r} was asked for but cannot be used: {why}")
    else:
        name = next(n for n in ("cuda", "rocm", "cpu") if classes[n].is_usable()[0])
    if name not in _cache:
        _cache[name] = classes[name]()
    return _cache[name]


_facts: dict = {}


def device_facts(device) -> DeviceFacts:
    """The selected backend's facts about ``device``, read once per process and backend choice:
    they never change, and reading them costs several driver calls (too many for an op call)."""
    key = (os.environ.get(ENV_VAR), str(device))
    facts = _facts.get(key)
    if facts is None:
        facts = _facts[key] = get_backend().device_facts(device)
    return facts


__all__ = ["ENTRIES", "Allocation", "Backend", "DeviceFacts", "HostMapped", "PeerMapping",
           "backend_classes", "get_backend", "device_facts", "ENV_VAR"]
