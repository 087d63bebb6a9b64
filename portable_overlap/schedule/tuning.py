"""Tuning decisions shared by the ranks: a cache per (op, shape, dtype, world, device, versions),
rank 0 decides, every rank uses rank 0's choice, and ranks whose caches disagree are caught.

Also the calibration the wave-group predictor needs: a collective's time against message size
(``measure_comm_curve``), timed the way the benchmarks time (slowest rank's median).
"""
from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import RankMismatchError


def cache_key(op: str, shape: dict, dtype, world_size: int, device: str) -> str:
    """What a decision depends on: the op, its shape, dtype, world size, the device's name, and
    the versions of torch, Triton and this library."""
    import triton

    from .. import __version__

    return json.dumps({"op": op, "shape": shape, "dtype": str(dtype), "world": world_size,
                       "device": device, "torch": torch.__version__,
                       "triton": triton.__version__, "portable_overlap": __version__},
                      sort_keys=True)


class TuningCache:
    """A JSON file of decisions (default: ``$PORTABLE_OVERLAP_TUNING_CACHE`` or
    ``~/.cache/portable_overlap/tuning.json``), one per rank process."""

    def __init__(self, path: Optional[str] = None):
        self.path = path or os.environ.get("PORTABLE_OVERLAP_TUNING_CACHE") or os.path.join(
            os.path.expanduser("~"), ".cache", "portable_overlap", "tuning.json")
        try:
            with open(self.path) as f:
                self.entries = json.load(f)
        except (OSError, ValueError):
            self.entries = {}

    def get(self, key: str) -> Any:
        return self.entries.get(key)

    def put(self, key: str, value: Any) -> None:
        self.entries[key] = value
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.entries, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)


def decide(world, key: str, compute: Callable[[], Any],
           cache: Optional[TuningCache] = None) -> Any:
    """Collective: the decision for ``key``. When every rank's cache holds one they must be the
    same (else ``RankMismatchError``: a rank tuned on another build or device, or a stale file);
    otherwise every rank runs ``compute`` (measurements are collective) and every rank records
    and uses rank 0's result."""
    cache = cache or TuningCache()
    mine = cache.get(key)
    held = world.all_gather_object(mine)
    known = {json.dumps(v, sort_keys=True) for v in held if v is not None}
    if len(known) > 1:
        raise RankMismatchError(
            f"tuning caches disagree for {key}: " + ", ".join(
                f"rank {r}: {v}" for r, v in enumerate(held)) + " (remove the stale cache files)")
    if known and all(v is not None for v in held):
        return mine
    value = compute()  # collective if the measurement is: every rank takes part
    value = world.broadcast_object(value)
    cache.put(key, value)
    return value


def _now(device) -> Callable[[], float]:
    if device.type == "cpu":
        return time.perf_counter
    mod = torch.get_device_module(device)

    def now():
        mod.synchronize(device)
        return time.perf_counter()

    return now


def time_call(fn: Callable[[], Any], world, *, iters: int = 20, warmup: int = 3,
              graph: bool = False) -> float:
    """Collective: the slowest rank's median milliseconds of ``fn`` over ``iters`` runs, a
    barrier before each (the benchmark protocol, in the library so tuners time alike). Device
    events around each run; with ``graph``, ``fn`` is captured once into a device graph (after
    ``warmup`` plain runs on a side stream, which also load its kernels) and each run replays
    it. On the CPU the host clock times plain runs."""
    dev = world.device
    if dev.type == "cpu":
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            world.barrier()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return max(world.all_gather_object(statistics.median(times)))
    mod = torch.get_device_module(dev)
    run = fn
    if graph:
        side = mod.Stream(device=dev)
        side.wait_stream(mod.current_stream(dev))
        with mod.stream(side):  # warm-up outside the capture: compiles, plans, comms
            for _ in range(warmup):
                fn()
        mod.current_stream(dev).wait_stream(side)
        mod.synchronize(dev)
        world.barrier()
        g = mod.CUDAGraph()  # torch's name on both vendors (HIP graphs on ROCm builds)
        with mod.graph(g):
            fn()
        run = g.replay
    else:
        for _ in range(warmup):
            fn()
    mod.synchronize(dev)
    events = [(mod.Event(enable_timing=True), mod.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        world.barrier()
        start.record()
        run()
        end.record()
    mod.synchronize(dev)
    return max(world.all_gather_object(statistics.median(s.elapsed_time(e) for s, e in events)))


def measure_comm_curve(world, collective: str, sizes: Sequence[int], dtype=torch.bfloat16,
                       iters: int = 20) -> tuple:
    """Collective: ``((bytes, ms), ...)`` of ``collective`` ("all_reduce", "reduce_scatter",
    "all_to_all") over the world's group for each message size in bytes (the bytes each rank
    contributes), slowest rank's median of ``iters`` after a barrier each."""
    dev, W = world.device, world.world_size
    elem = torch.empty((), dtype=dtype).element_size()
    now = _now(dev)
    curve = []
    for nbytes in sizes:
        n = max(W, nbytes // elem // W * W)
        x = torch.ones(n, dtype=dtype, device=dev)
        y = torch.empty(n // W if collective == "reduce_scatter" else n, dtype=dtype, device=dev)
        if collective == "all_reduce":
            run = lambda: dist.all_reduce(x, group=world.group)  # noqa: E731
        elif collective == "reduce_scatter":
            run = lambda: dist.reduce_scatter_tensor(y, x, group=world.group)  # noqa: E731
        elif collective == "all_to_all":
            run = lambda: dist.all_to_all_single(y, x, group=world.group)  # noqa: E731
        else:
            raise ValueError(f"unknown collective {collective!r}")
        run()
        times = []
        for _ in range(iters):
            world.barrier()
            t0 = now()
            run()
            times.append((now() - t0) * 1e3)
        slowest = max(world.all_gather_object(statistics.median(times)))
        curve.append((n * elem, slowest))
    return tuple(curve)
