"""NVSHMEM provider (NVIDIA): torch's symmetric memory with its NVSHMEM backend for allocation,
torch's NVSHMEM Triton bindings for device-initiated puts."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

try:
    from torch.distributed._symmetric_memory import _nvshmem_triton as _nv
except ImportError:  # a torch build without the bindings
    _nv = None


if _nv is not None:
    @triton.jit
    def put_rows(combine_ptr, bases_ptr, stage_ptr, slots_ptr, row0, n_rows, col0, max_slots,
                 rank, peer, slot, cols, y, keep, H, pid,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Rows for this rank: plain stores. Rows for a peer: the tile goes to this program's
        staging tile, then one block-wide put per row into the peer's combine buffer at the
        row's slot (``combine_ptr`` is symmetric: the same address names the peer's copy)."""
        if peer == rank:
            offs = slot[:, None].to(tl.int64) * H + cols[None, :]
            tl.store(combine_ptr + offs, y, mask=keep[:, None] & (cols[None, :] < H))
        else:
            stage = stage_ptr + tl.cast(pid, tl.int64) * (BLOCK_M * BLOCK_N)
            r = tl.arange(0, BLOCK_M)
            c = tl.arange(0, BLOCK_N)
            tl.store(stage + r[:, None] * BLOCK_N + c[None, :], y)
            tl.debug_barrier()  # the whole tile is staged before any thread's put reads it
            ncols = tl.minimum(H - col0, BLOCK_N)
            for i in range(0, n_rows):
                s = tl.load(slots_ptr + row0 + i)
                if (s >= 0) & (s < max_slots):
                    _nv.put(combine_ptr + s.to(tl.int64) * H + col0, stage + i * BLOCK_N, ncols,
                            peer)
            tl.debug_barrier()  # puts have read the staging tile before the next tile's stores

    @triton.jit
    def put_strided(recv_ptr, bases_ptr, rank, peer, offs, y, mask, stage_ptr, pid, row0,
                    row_stride, col0, n_rows, ncols, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr):
        """Rows ``row0 .. row0 + n_rows`` of a strided destination (``row_stride`` elements
        apart, ``ncols`` from column ``col0``) in ``peer``'s symmetric ``recv``: the tile is
        staged, then one block-wide put per row."""
        stage = stage_ptr + tl.cast(pid, tl.int64) * (BLOCK_R * BLOCK_C)
        r = tl.arange(0, BLOCK_R)
        c = tl.arange(0, BLOCK_C)
        tl.store(stage + r[:, None] * BLOCK_C + c[None, :], y)
        tl.debug_barrier()
        for i in range(0, n_rows):
            _nv.put(recv_ptr + (tl.cast(row0, tl.int64) + i) * row_stride + col0,
                    stage + i * BLOCK_C, ncols, peer)
        tl.debug_barrier()

    @triton.jit
    def flush():
        """Every put of this program has completed at its destination."""
        _nv.quiet()

    @triton.jit
    def put(dst, src, n, peer):
        """``n`` elements of ``dst``'s type from ``src`` (local memory of the same type) to
        ``peer``'s copy of the symmetric ``dst``, by the calling program: a block-wide put
        (``nvshmemx_putmem_block``), so every thread of the program calls it with the same
        arguments, which Triton's scalar code does. The bindings take a byte count as int64
        and the PE as int32; the casts let a caller pass any int."""
        _nv.put(dst, src, tl.cast(n, tl.int64), tl.cast(peer, tl.int32))

    @triton.jit
    def get(dst, src, n, peer):
        """``n`` elements of ``dst``'s type from ``peer``'s copy of the symmetric ``src`` to
        local ``dst``, by the calling program (``nvshmemx_getmem_block``, every thread with the
        same arguments); the data is in ``dst`` when it returns."""
        _nv.get(dst, src, tl.cast(n, tl.int64), tl.cast(peer, tl.int32))


class NvshmemProvider:
    name = "nvshmem"

    @staticmethod
    def available() -> tuple[bool, str]:
        if _nv is None:
            return False, "this torch build has no NVSHMEM Triton bindings"
        try:
            import torch.distributed._symmetric_memory as symm_mem

            if not symm_mem.is_nvshmem_available():
                return False, "torch reports NVSHMEM unavailable"
            _nv.NvshmemLibFinder.find_device_library()
        except Exception as e:  # no device library, no symmetric memory
            return False, f"NVSHMEM unavailable: {e}"
        return True, ""

    def __init__(self, world):
        import torch.distributed as dist

        if world.group is not None and world.group != dist.group.WORLD:
            raise ValueError("nvshmem provider: the world must be the default process group "
                             "(NVSHMEM numbers PEs by global rank)")
        from . import select_torch_backend

        select_torch_backend(world.device, "NVSHMEM", "NVSHMEM")
        self.world = world
        self.store_rows, self.flush = put_rows, flush

    def symmetric_empty(self, nbytes: int) -> torch.Tensor:
        """Collective: ``nbytes`` of NVSHMEM symmetric memory on every rank (uint8), from the
        backend the constructor selected."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        t = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.world.device)
        symm_mem.rendezvous(t, dist.group.WORLD.group_name)
        return t

    def wrap(self, kernel):
        """``kernel`` launched as ``wrapped[grid](...)`` with the NVSHMEM device library linked and
        each compiled module initialised for NVSHMEM."""
        return _nv.requires_nvshmem(kernel)
