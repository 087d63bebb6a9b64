"""The benchmark protocol of the project (see README "Benchmarks"):

CUDA events around each iteration, a barrier before each one, warm-up, the median of at least 50,
once with plain launches and once replaying a CUDA graph; the slowest rank's median counts.
The barrier is on the stream by default (``World.stream_barrier``), and the stream is held while
the host queues the next iterations (``schedule.tuning.queue_ahead``): every rank's iteration
starts when the barrier ends on its GPU, as a call in a model starts when the collective before
it ends, whatever each host is doing.
With the host barrier (``barrier="host"``, the benchmarks' ``--barrier host``) each rank's host
wakes up and launches on its own, and an op that waits for its peers counts the gap between the
hosts: on 4 H200s it made NCCL's 16 KiB all-reduce time 0.038-0.064 ms.
Results are JSON lines with keys op, shape, dtype, world, device, impl, graph, median_ms, p10_ms,
p90_ms, date, commit (benchmarks/rows.py); benchmarks/runner.py runs the check-then-time loop and
benchmarks/cli.py holds the shared command line.
"""
from __future__ import annotations

import statistics
from typing import Callable

import torch

from benchmarks.rows import ResultWriter  # noqa: F401  (also importable from here)
from portable_overlap.ops.torch_fused import enable_group
from portable_overlap.schedule.tuning import timed_runs


def _quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


BARRIERS = ("device", "host")


def check_and_time(fn: Callable[[], object], out: torch.Tensor, ref: torch.Tensor, world, *,
                   tol: float, iters: int, warmup: int) -> tuple:
    """A probe's step for one variant: ``out`` poisoned (NaN), ``fn`` run once and its ``out``
    compared with ``ref`` (relative Frobenius error; a ``RuntimeError`` past ``tol``, NaN
    included), then timed as CUDA-graph replays (:func:`time_op`). Returns ``(rel_err,
    timing)``."""
    out.fill_(float("nan"))
    fn()
    torch.cuda.synchronize()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    if not err < tol:
        raise RuntimeError(f"wrong result, rel_err {err:.2e}")
    return err, time_op(fn, world, graph=True, iters=iters, warmup=warmup)


def time_op(fn: Callable[[], object], world, *, graph: bool, iters: int = 100, warmup: int = 20,
            barrier: str = "device") -> dict:
    """Median / p10 / p90 milliseconds of ``fn`` on this rank, then the slowest rank's numbers.

    With ``graph``, ``fn`` is captured once into a CUDA graph (after 3 plain runs) and each
    iteration replays it. ``barrier``: before each iteration, ``"device"`` a barrier on the
    stream (the host runs ahead), ``"host"`` a host barrier (module docstring). The runs are
    ``schedule.tuning.timed_runs``'s, the planner's protocol."""
    if barrier not in BARRIERS:
        raise ValueError(f"barrier must be one of {BARRIERS}, got {barrier!r}")
    ms, _ = timed_runs(fn, world, iters=iters, warmup=3 if graph else warmup, graph=graph,
                       replay_warmup=warmup if graph else 0, barrier=barrier)
    mine = {"median_ms": statistics.median(ms), "p10_ms": _quantile(ms, 0.1),
            "p90_ms": _quantile(ms, 0.9)}
    everyone = world.all_gather_object(mine)
    return max(everyone, key=lambda d: d["median_ms"])


def hbm_read_bandwidth(device, gib: float = 2.0, iters: int = 20) -> float:
    """GB/s of torch.sum over a ``gib`` GiB bf16 tensor (bytes read / median time)."""
    t = torch.randn(int(gib * 2**30) // 2, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        t.sum()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t.sum()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    del t
    return gib * 2**30 / (statistics.median(times) * 1e-3) / 1e9


def torch_fused_matmul_reduce_scatter(world, a, b, ref_fn, tol: float = 2e-2):
    """torch's ``symm_mem.fused_matmul_reduce_scatter`` of ``a @ b`` (rows scattered) as a
    callable for ``time_op``, after checking, the same way on every rank, that it runs here and
    agrees with ``ref_fn(a, b, group)`` within ``tol`` (relative); raises otherwise (the
    benchmarks print the reason and leave torch's op out)."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    group_name = dist.group.WORLD.group_name
    enable_group(symm_mem, group_name)

    def fn():
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group_name)

    got = fn()
    torch.cuda.synchronize()
    ref = ref_fn(a, b, world.group).double()
    err = max(world.all_gather_object(((got.double() - ref).norm() / ref.norm()).item()))
    if not err < tol:
        raise RuntimeError(f"disagrees with the reference: rel_err={err:.2e}")
    return fn
