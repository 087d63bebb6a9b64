"""Which copies the copy-engine transports ask the backend for, on CPU-emulated ranks.

On ROCm a 1-D ``hipMemcpyAsync`` of kind ``hipMemcpyDeviceToDeviceNoCU`` (the backend's) runs
on an SDMA engine at any size, but every device-to-device ``hipMemcpy2DAsync`` runs as a blit
kernel on the CUs (docs/amd.md, "Copy engines: SDMA or blit kernels"). So a piece that
is contiguous on both sides must reach the backend as one 1-D copy, and only the column blocks
of AllGather + GEMM's 2-D schedules, whose rows are strided, as 2-D copies. These tests record
the backend calls of every copy-engine schedule and of GEMM + ReduceScatter / AllReduce."""
import pytest
import torch

from portable_overlap.ops.allgather_gemm import SCHEDULES, AllGatherMatmul
from portable_overlap.ops.matmul_reduce import MatmulAllReduce, MatmulReduceScatter


def _recording(world):
    """Wrap the rank's backend copies; returns the list they append to."""
    calls, be = [], world.backend
    copy_1d, copy_2d = be.copy_async, be.copy_2d_async

    def one_d(dst, src, nbytes, stream):
        calls.append(("1d", nbytes))
        return copy_1d(dst, src, nbytes, stream)

    def two_d(dst, dst_pitch, src, src_pitch, width, height, stream):
        calls.append(("2d", dst_pitch, src_pitch, width, height))
        return copy_2d(dst, dst_pitch, src, src_pitch, width, height, stream)

    be.copy_async, be.copy_2d_async = one_d, two_d
    return calls


def _allgather_calls(world, m, N, K):
    calls = _recording(world)
    ctx = AllGatherMatmul(world, max_shard_elems=m * K, transport="copy_engine", pieces=2)
    seen = {}
    try:
        g = torch.Generator().manual_seed(world.rank)
        a, b = torch.randn(m, K, generator=g), torch.randn(K, N, generator=g)
        for sched in SCHEDULES:
            del calls[:]
            ctx(a, b, schedule=sched)
            ctx.synchronize()
            seen[sched] = list(calls)
    finally:
        ctx.close()
        del world.backend.copy_async, world.backend.copy_2d_async
    return seen


def test_allgather_pieces_are_1d_copies_except_the_2d_schedules_column_blocks(world2):
    m, N, K = 6, 5, 8
    for seen in world2.run(_allgather_calls, m, N, K):
        for sched, calls in seen.items():
            assert calls, f"{sched}: no copy reached the backend"
            two_d = [c for c in calls if c[0] == "2d"]
            if sched.endswith("1d"):
                assert not two_d, (sched, two_d)
                continue
            # a column block: all the shard's rows, part of its columns, strided on both sides
            assert two_d, (sched, calls)
            for _, dst_pitch, src_pitch, width, height in two_d:
                assert height == m and 0 < width < K * 4, (sched, two_d)
                assert dst_pitch > width or src_pitch > width, (sched, two_d)


def _reduction_calls(world, cls, M, N, K):
    calls = _recording(world)
    ctx = cls(world, M, N, transport="copy_engine")
    try:
        g = torch.Generator().manual_seed(world.rank)
        ctx(torch.randn(M, K, generator=g), torch.randn(K, N, generator=g))
        ctx.synchronize()
    finally:
        ctx.close()
        del world.backend.copy_async, world.backend.copy_2d_async
    return calls


@pytest.mark.parametrize("cls", [MatmulReduceScatter, MatmulAllReduce],
                         ids=["reduce_scatter", "all_reduce"])
def test_reduction_pieces_are_1d_copies(world2, cls):
    for calls in world2.run(_reduction_calls, cls, 10, 7, 5):
        assert calls and all(c[0] == "1d" for c in calls), calls
