"""Small helpers shared by the GPU backends (vendor-neutral)."""
from __future__ import annotations

from typing import Callable


class DeviceArray:
    """A raw device allocation seen as a uint8 array through ``__cuda_array_interface__``, so
    ``torch.as_tensor`` can wrap it without copying (ROCm builds of torch read the same
    protocol)."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3,
            "strides": None,
        }


class lazy_module:
    """Import a vendor module on first attribute access, so importing a backend never needs the
    vendor runtime (CI imports every backend on a CPU-only machine)."""

    def __init__(self, importer: Callable):
        self._importer = importer
        self._mod = None

    def __getattr__(self, name):
        if self._mod is None:
            self._mod = self._importer()
        return getattr(self._mod, name)
