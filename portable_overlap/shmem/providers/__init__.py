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


def agreed_put_provider(world, op: str, transport: str):
    """Collective, before anything is allocated: the provider an op's ``transport`` needs, for
    ops whose ranks already agree on the transport. None for a transport other than
    ``"shmem"``. With ``"shmem"``, every rank tells the others whether it can have a provider,
    and if any cannot (no library: the CPU backend, a torch build without the bindings,
    NVSHMEM not found; or a world of one rank, whose rendezvous of the library's memory torch
    refuses) every rank raises ``ShmemUnavailable`` naming those ranks and why, instead of
    leaving the others waiting in the library's collective allocation."""
    if transport != "shmem":
        return None
    provider, why = provider_or_reason(world)
    failed = [f"rank {r}: {w}" for r, w in enumerate(world.all_gather_object(why)) if w]
    if failed:
        raise ShmemUnavailable(
            f"{op}: transport='shmem' needs a usable SHMEM library (NVSHMEM on NVIDIA, ROC_SHMEM "
            f"on AMD) on every rank. Not usable on " + "; ".join(failed) + ". Use "
            "transport='stores' (zero-copy stores through the heap)")
    return provider


def provider_or_reason(world) -> tuple:
    """``(provider, None)`` where this rank can put through a SHMEM library, else ``(None,
    why)``: a world of one rank (torch's rendezvous of the library's memory refuses it), no
    library, or a world the provider cannot serve (not the default group). Not collective: the
    callers exchange the reasons so that every rank raises together."""
    if world.world_size < 2:
        return None, "a world of one rank (the library's symmetric memory needs two or more)"
    try:
        return get_provider(world), None
    except ShmemUnavailable as e:
        return None, str(e)
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"


def select_torch_backend(device, backend: str, library: str) -> None:
    """Make ``backend`` the one torch's symmetric memory allocates from in this process, before
    a provider allocates anything. torch fixes its backend at the first symmetric allocation
    of the process, and refuses to change it after (even to the same name), so the call is
    made once per provider and only where another backend is selected. A process that already
    allocated from another backend (torch's own IPC heap: torch's fused ops, or any other user
    of torch's symmetric memory) cannot reach ``library``'s puts: that is
    :class:`ShmemUnavailable`, raised before anything is allocated."""
    import torch.distributed._symmetric_memory as symm_mem

    current = symm_mem.get_backend(device)
    if current == backend:
        return
    try:
        symm_mem.set_backend(backend)
    except RuntimeError as e:
        raise ShmemUnavailable(
            f"torch's symmetric memory in this process already allocates from its {current!r} "
            f"backend (torch keeps the backend of its first symmetric tensor: torch's fused ops, "
            f"transport='torch_fused', or any other user of torch's symmetric memory), and "
            f"{library}'s puts cannot address that memory. Make the transport='shmem' contexts "
            f"before anything else allocates torch symmetric memory, or use transport='stores'. "
            f"torch said: {e}") from e


def torch_shmem_backend_bound(device) -> bool:
    """Whether torch's symmetric memory in this process allocates from its SHMEM backend
    ("NVSHMEM", torch's one name for NVSHMEM and rocSHMEM) on ``device``: a SHMEM provider
    selected it (:func:`select_torch_backend`), and torch keeps it for the process. False where
    this torch cannot say."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        return symm_mem.get_backend(device) == "NVSHMEM"
    except Exception:  # an older torch without get_backend, or no device to ask about
        return False


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
