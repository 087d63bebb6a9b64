"""Device-initiated communication libraries, seen by the ops through one interface.

A provider gives an op what its device-shmem transport needs: symmetric memory the library can
put into, Triton device functions that move a tile's rows into a peer's buffer (``store_rows``,
same signature as the zero-copy transport's) and complete them before a signal (``flush``), and a
way to launch a kernel that calls them (the library must set up each compiled module). NVSHMEM on
NVIDIA (through torch's NVSHMEM Triton bindings), ROC_SHMEM on AMD (torch's rocSHMEM bindings
where the torch build has them). On NVLink the puts travel by load/store like the zero-copy path;
across nodes the same kernels would go over RDMA, which is what this transport is for.
"""
from __future__ import annotations

from ...errors import PortableOverlapError


class ShmemUnavailable(PortableOverlapError):
    """No device-initiated communication library is usable here (says why)."""


def put_provider(world, transport: str):
    """The provider an op's ``transport`` needs: ``get_provider(world)`` for ``"shmem"`` on two
    or more ranks, else None (the op's store kernel). One rank has no peer to put to, and the
    SHMEM libraries' collective set-up needs two or more."""
    if transport != "shmem" or world.world_size < 2:
        return None
    return get_provider(world)


def get_provider(world):
    """The device-shmem provider for ``world``'s backend, or raise ``ShmemUnavailable``."""
    name = world.backend.name
    if name == "cuda":
        from .nvshmem import NvshmemProvider as P
    elif name == "rocm":
        from .rocshmem import RocshmemProvider as P
    else:
        raise ShmemUnavailable(f"no device-initiated communication library on the {name!r} "
                               f"backend (NVSHMEM needs NVIDIA GPUs, ROC_SHMEM AMD GPUs)")
    ok, why = P.available()
    if not ok:
        raise ShmemUnavailable(why)
    return P(world)
