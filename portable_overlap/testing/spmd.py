"""Run one function on every rank, wherever the script was started: under torchrun or mpirun
on the GPUs of this world, otherwise on CPU-emulated ranks (the tutorials and examples start
the same way on a laptop and on a GPU node)."""
from __future__ import annotations

import os
from typing import Callable, Optional

from ..envvars import env_int


def launched() -> bool:
    """Whether a launcher (torchrun, mpirun) started this process as one of several ranks."""
    return "RANK" in os.environ or any(
        v in os.environ for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"))


def env_emulated_ranks() -> int:
    """``$PORTABLE_OVERLAP_EMULATED_RANKS``: the CPU-emulated ranks of a script started without
    a launcher (default 2)."""
    from .emulated import MAX_RANKS

    return env_int("PORTABLE_OVERLAP_EMULATED_RANKS", 2, 1, MAX_RANKS)


def run_on_ranks(fn: Callable, *args, ranks: Optional[int] = None,
                 timeout: float = 600.0) -> list:
    """``fn(world, *args)`` on every rank. Under a launcher: on this process's world (NCCL and
    the GPU when there is one), returning ``[this rank's result]``; otherwise on ``ranks``
    CPU-emulated ranks (default: ``$PORTABLE_OVERLAP_EMULATED_RANKS``, else 2; spawned
    processes, the Triton interpreter), returning every rank's result in rank order. ``fn``
    must be a module-level function (the emulated ranks import it), and kernels it launches
    module-level too, so they are made in interpreter mode there."""
    if launched():
        import torch.distributed as dist

        from ..world import World

        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        world = World.from_env()
        try:
            return [fn(world, *args)]
        finally:
            dist.destroy_process_group()
    from .emulated import EmulatedWorld

    if ranks is None:
        ranks = env_emulated_ranks()
    with EmulatedWorld(ranks) as ew:
        return ew.run(fn, *args, timeout=timeout)


def report(world, headline: str, ok: bool, times: dict, rate: Optional[Callable] = None,
           graph: bool = False) -> int:
    """Collective: rank 0 prints whether ``ok`` held on every rank (``"<headline> right on every
    rank: True"``) and each path's time in ``times`` ({name: ms}, the slowest rank's median),
    with ``rate(ms)`` after it where given (", 784 TFLOP/s"). Returns 0 if every rank was
    right, else 1: the script's exit code."""
    oks = world.all_gather_object(bool(ok))
    if world.rank == 0:
        print(f"{headline} right on every rank: {all(oks)}")
        how = "slowest rank's median" + (", graph replay" if graph else "")
        for name, t in times.items():
            print(f"  {name}: {t:.3f} ms{rate(t) if rate else ''} ({how})")
    return 0 if all(oks) else 1
