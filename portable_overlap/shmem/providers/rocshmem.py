"""ROC_SHMEM provider (AMD): torch's symmetric memory with its shmem backend for allocation,
torch's rocSHMEM Triton bindings (ROCm builds of torch) for device-initiated puts. The same
transport as the NVSHMEM provider, call for call. Never run: no AMD GPU or ROCm torch build was
available. Its put kernels are not in the compile matrix: they call rocSHMEM's device bitcode
(``librocshmem_device_<arch>.bc``), and without it LLVM's AMDGPU backend cannot size the kernel
(it aborts on the undefined callee's resource symbols); no wheel on PyPI ships that bitcode
(docs/amd.md)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

#: torch's one name for its shmem backend: NVSHMEM on CUDA builds, rocSHMEM on ROCm builds
TORCH_SHMEM_BACKEND = "NVSHMEM"


def _load_bindings():
    """``(torch's rocSHMEM Triton bindings, "")`` on a ROCm build of torch whose bindings define
    the device functions, else ``(None, why)``. The bindings module imports on every torch
    build (CUDA and CPU builds ship it too), and defines ``put`` / ``quiet`` only where torch
    finds a GPU Triton can compile for, so neither the import nor the module says whether
    rocSHMEM is there: the build and the device functions do."""
    if getattr(torch.version, "hip", None) is None:
        return None, "this torch is not a ROCm build (rocSHMEM needs one)"
    try:
        from torch.distributed._symmetric_memory import _rocshmem_triton as bindings
    except ImportError as e:
        return None, f"this ROCm build of torch has no rocSHMEM Triton bindings ({e})"
    if not all(hasattr(bindings, f) for f in ("put", "quiet", "requires_rocshmem")):
        return None, ("torch's rocSHMEM Triton bindings have no device functions here (torch "
                      "defines them only where Triton finds a GPU)")
    return bindings, ""


_rs, _why_not = _load_bindings()


if _rs is not None:
    @triton.jit
    def put_rows(combine_ptr, bases_ptr, stage_ptr, slots_ptr, row0, n_rows, col0, max_slots,
                 rank, peer, slot, cols, y, keep, H, pid,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """As nvshmem.put_rows: own rows by stores, a peer's rows staged then put row by row
        (work-group-wide puts)."""
        if peer == rank:
            offs = slot[:, None].to(tl.int64) * H + cols[None, :]
            tl.store(combine_ptr + offs, y, mask=keep[:, None] & (cols[None, :] < H))
        else:
            stage = stage_ptr + tl.cast(pid, tl.int64) * (BLOCK_M * BLOCK_N)
            r = tl.arange(0, BLOCK_M)
            c = tl.arange(0, BLOCK_N)
            tl.store(stage + r[:, None] * BLOCK_N + c[None, :], y)
            tl.debug_barrier()
            ncols = tl.minimum(H - col0, BLOCK_N)
            for i in range(0, n_rows):
                s = tl.load(slots_ptr + row0 + i)
                if (s >= 0) & (s < max_slots):
                    _rs.put(combine_ptr + s.to(tl.int64) * H + col0, stage + i * BLOCK_N, ncols,
                            peer)
            tl.debug_barrier()

    @triton.jit
    def put_strided(recv_ptr, bases_ptr, rank, peer, offs, y, mask, stage_ptr, pid, row0,
                    row_stride, col0, n_rows, ncols, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr):
        """Rows ``row0 .. row0 + n_rows`` of a strided destination (``row_stride`` elements
        apart, ``ncols`` from column ``col0``) in ``peer``'s symmetric ``recv``: the tile is
        staged, then one work-group-wide put per row."""
        stage = stage_ptr + tl.cast(pid, tl.int64) * (BLOCK_R * BLOCK_C)
        r = tl.arange(0, BLOCK_R)
        c = tl.arange(0, BLOCK_C)
        tl.store(stage + r[:, None] * BLOCK_C + c[None, :], y)
        tl.debug_barrier()
        for i in range(0, n_rows):
            _rs.put(recv_ptr + (tl.cast(row0, tl.int64) + i) * row_stride + col0,
                    stage + i * BLOCK_C, ncols, peer)
        tl.debug_barrier()

    @triton.jit
    def flush():
        _rs.quiet()

    @triton.jit
    def put(dst, src, n, peer):
        """As nvshmem.put: ``n`` elements from local ``src`` to ``peer``'s copy of the
        symmetric ``dst``, a work-group-wide put (``rocshmem_putmem_wg``)."""
        _rs.put(dst, src, tl.cast(n, tl.int64), tl.cast(peer, tl.int32))

    @triton.jit
    def get(dst, src, n, peer):
        """As nvshmem.get: ``n`` elements from ``peer``'s copy of the symmetric ``src`` to
        local ``dst``, a work-group-wide get (``rocshmem_getmem_wg``), complete on return."""
        _rs.get(dst, src, tl.cast(n, tl.int64), tl.cast(peer, tl.int32))


class RocshmemProvider:
    name = "rocshmem"

    @staticmethod
    def available() -> tuple[bool, str]:
        """Whether this process can put through rocSHMEM: a ROCm build of torch with the Triton
        bindings, torch's own answer that its shmem backend (rocSHMEM here) is built in and
        usable, and rocSHMEM's device bitcode for this GPU."""
        if _rs is None:
            return False, _why_not
        try:
            import torch.distributed._symmetric_memory as symm_mem

            if not symm_mem.is_nvshmem_available():
                return False, ("torch reports its shmem backend (rocSHMEM on ROCm) unavailable: "
                               "built without it, or rocSHMEM older than 3.3")
            _rs.RocshmemLibFinder.find_device_library()
        except Exception as e:  # no device bitcode, no symmetric memory
            return False, f"ROC_SHMEM unavailable: {e}"
        return True, ""

    def __init__(self, world):
        import torch.distributed as dist

        if world.group is not None and world.group != dist.group.WORLD:
            raise ValueError("rocshmem provider: the world must be the default process group "
                             "(rocSHMEM numbers PEs by global rank)")
        from . import select_torch_backend

        select_torch_backend(world.device, TORCH_SHMEM_BACKEND, "rocSHMEM")
        self.world = world
        self.store_rows, self.flush = put_rows, flush

    def symmetric_empty(self, nbytes: int) -> torch.Tensor:
        """Collective: ``nbytes`` of rocSHMEM symmetric memory on every rank (uint8), from the
        backend the constructor selected (torch's default, its own IPC heap, is memory
        rocSHMEM's puts cannot address)."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        t = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.world.device)
        symm_mem.rendezvous(t, dist.group.WORLD.group_name)
        return t

    def wrap(self, kernel):
        """``kernel`` launched with rocSHMEM's device bitcode linked and each compiled module
        initialised for rocSHMEM."""
        return _rs.requires_rocshmem(kernel)
