"""Run under ``mpiexec -n 2``: builds the World from mpirun (mpi4py), runs the fused op on the
CPU backend and prints one line per rank for tests/test_world.py to read."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("PORTABLE_OVERLAP_BACKEND", "cpu")

import torch  # noqa: E402

from portable_overlap import GemvAllReduce, World, gemv_all_reduce_reference  # noqa: E402

world = World.from_env()
ctx = GemvAllReduce(world, max_n=32, timeout_s=60.0)  # CI machines may be busy
g = torch.Generator().manual_seed(world.rank)
x, w = torch.randn(2, 8, generator=g), torch.randn(32, 8, generator=g)
y = ctx(x, w)
err = ((y - gemv_all_reduce_reference(x, w, world.group)).norm() / y.norm()).item()
ctx.close()
print(f"MPI-WORLD rank={world.rank} size={world.world_size} local={world.local_rank} "
      f"launcher={world.launcher} err={err:.1e}", flush=True)
# tear the process group down before the interpreter exits: left to the exit handlers, its
# threads may be destroyed while still joinable, which aborts the process after a clean run
world.barrier()
torch.distributed.destroy_process_group()
