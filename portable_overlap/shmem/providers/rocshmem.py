"""ROC_SHMEM provider (AMD): torch's symmetric memory for allocation, torch's rocSHMEM Triton
bindings (ROCm builds of torch) for device-initiated puts. The same transport as the NVSHMEM
provider, call for call. Never run: no AMD GPU or ROCm torch build was available; the kernels it
plugs into are compiled for gfx942 in CI with the zero-copy transport in its place."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

try:
    from torch.distributed._symmetric_memory import _rocshmem_triton as _rs
except ImportError:  # CUDA or CPU builds of torch
    _rs = None


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


class RocshmemProvider:
    name = "rocshmem"

    @staticmethod
    def available() -> tuple[bool, str]:
        if _rs is None:
            return False, "this torch build has no rocSHMEM Triton bindings (needs a ROCm build)"
        try:
            _rs.RocshmemLibFinder.find_device_library()
        except Exception as e:
            return False, f"ROC_SHMEM unavailable: {e}"
        return True, ""

    def __init__(self, world):
        import torch.distributed as dist

        if world.group is not None and world.group != dist.group.WORLD:
            raise ValueError("rocshmem provider: the world must be the default process group")
        self.world = world
        self.store_rows, self.flush = put_rows, flush

    def symmetric_empty(self, nbytes: int) -> torch.Tensor:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        t = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.world.device)
        symm_mem.rendezvous(t, dist.group.WORLD.group_name)
        return t

    def wrap(self, kernel):
        return _rs.requires_rocshmem(kernel)
