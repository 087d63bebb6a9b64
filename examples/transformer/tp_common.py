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


def planned_on_cpu() -> bool:
    """Whether ``launch``'s ranks will run on the CPU-emulated backend: always without torchrun,
    and under torchrun where the selected backend is ``cpu`` (``PORTABLE_OVERLAP_BACKEND=cpu``,
    or no GPU). A backend that cannot be selected counts as not CPU: the ranks then report it."""
    if not under_torchrun():
        return True
    from portable_overlap.backends import get_backend
    from portable_overlap.errors import BackendUnavailable

    try:
        return get_backend().name == "cpu"
    except BackendUnavailable:
        return False


def check_dims_divide(ap, dims: dict, world_size: int) -> None:
    """``ap.error`` (usage, exit code 2) unless the world size divides the model's heads,
    key/value heads and MLP columns, which tensor parallelism splits over the ranks; checked in
    ``main`` so that the ranks never start to raise it one traceback each."""
    bad = [f"{name} {dims[key]}" for key, name in (("heads", "heads"), ("kv_heads", "kv_heads"),
                                                   ("inter", "intermediate"))
           if dims[key] % world_size]
    if bad:
        ap.error(f"world size {world_size}: the model's {', '.join(bad)} must divide by it "
                 f"(each rank holds 1/{world_size} of the heads, kv_heads and intermediate "
                 f"columns)")


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
