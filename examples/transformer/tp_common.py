"""What the transformer examples share: the model shapes and the launcher (torchrun on GPUs,
CPU-emulated ranks without). The examples run as scripts, so this file is imported from their
own folder (the script's folder is first on ``sys.path``, also in the spawned emulated ranks)."""
from __future__ import annotations

import os

import torch

from portable_overlap import World

LLAMA3_8B = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=14336)
TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, inter=128)


def under_torchrun() -> bool:
    return "RANK" in os.environ


def planned_world_size(emulated_ranks: int = 2) -> int:
    """The world size ``launch`` will run on: torchrun's ``WORLD_SIZE``, else
    ``emulated_ranks`` (its default): what a script checks its arguments against before the
    ranks start."""
    return int(os.environ.get("WORLD_SIZE", "1")) if under_torchrun() else emulated_ranks


def launch(run, report, args, emulated_ranks: int = 2, timeout: float = 900) -> int:
    """``result = run(world, args)`` on every rank, then ``report(world_size, args, result,
    device_type)`` with rank 0's result on rank 0, whose return value is the exit code.

    Under torchrun (``RANK`` set) one process per GPU; otherwise ``emulated_ranks`` spawned
    CPU ranks (the kernels in the Triton interpreter). ``run`` must be a module-level function
    (it is pickled into the emulated ranks)."""
    if under_torchrun():
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (DESIGN.md)
        world = World.from_env()
        result = run(world, args)
        code = report(world.world_size, args, result, world.device.type) \
            if world.rank == 0 else 0
        torch.distributed.destroy_process_group()
        return code
    from portable_overlap.testing import EmulatedWorld

    with EmulatedWorld(emulated_ranks) as ew:
        result = ew.run(run, args, timeout=timeout)[0]
    return report(emulated_ranks, args, result, "cpu")
