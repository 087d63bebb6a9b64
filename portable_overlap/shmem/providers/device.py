"""The device functions of this process's SHMEM provider, bound once at import.

Triton resolves a kernel's callees when it compiles, and a function cannot travel as a launch
argument through a library launcher that records its arguments (torch's NVSHMEM launcher
serializes them), so kernels that put through the provider call these names directly.
``LIBRARY`` names the provider ("nvshmem", "rocshmem") or is None where there is none (the CPU
backend, or a torch build without the bindings); then the functions are None and such kernels
are not compiled. ``put_rows``: a tile's rows to slots (MoE combine); ``put_strided``: a tile's
rows to a strided destination (embedding slices); ``put``: ``n`` contiguous elements to a peer's
symmetric buffer (``portable_overlap.language.shmem_put``); ``get``: ``n`` contiguous elements
from a peer's symmetric buffer, complete on return (``shmem_get``); ``flush``: completion of
every put of the program before a signal (``shmem_quiet``).
"""
from __future__ import annotations

from ...backends import get_backend

LIBRARY = None
put_rows = put_strided = put = get = flush = None
try:
    _name = get_backend().name
except Exception:  # no usable backend at import: no provider
    _name = None
if _name == "cuda":
    from . import nvshmem as _p
    if _p._nv is not None:
        LIBRARY, put_rows, put_strided, put, get, flush = (
            "nvshmem", _p.put_rows, _p.put_strided, _p.put, _p.get, _p.flush)
elif _name == "rocm":
    from . import rocshmem as _p
    if _p._rs is not None:
        LIBRARY, put_rows, put_strided, put, get, flush = (
            "rocshmem", _p.put_rows, _p.put_strided, _p.put, _p.get, _p.flush)
