"""Probe (one GPU or more, under torchrun): device memory a context leaves behind when it is
made, called once and closed, per op and transport. Per case: one cycle first (compilation,
torch's and the collective library's own first-use memory), then ``--cycles`` more; the device
memory free after each (``torch.cuda.mem_get_info`` with torch's cache emptied), and what the
cycles lost per cycle, in MiB. Prints one line per case; ``--gc`` collects Python's reference
cycles before each reading.

    timeout 300 torchrun --nproc-per-node 1 -m benchmarks.probe_context_churn --cycles 8
"""
from __future__ import annotations

import argparse
import gc

import torch

import portable_overlap as po
from portable_overlap import World
from portable_overlap.schedule.tuning import time_call
from portable_overlap.shmem import SymmetricHeap


def free_mib(dev, collect: bool) -> float:
    if collect:  # what reference cycles hold
        gc.collect()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(dev)[0] / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=8)
    p.add_argument("--gc", action="store_true", help="gc.collect() before each reading")
    p.add_argument("--only", default="", help="case names separated by \";\" (default: all)")
    args = p.parse_args()
    world = World.from_env()
    dev, dt = world.device, torch.bfloat16
    a = torch.randn(256, 1024, device=dev, dtype=dt)
    b = torch.randn(1024, 2048, device=dev, dtype=dt)
    x, w = torch.randn(4, 1024, device=dev, dtype=dt), torch.randn(2048, 1024, device=dev, dtype=dt)

    def heap():
        h = SymmetricHeap(world, 64 << 20)
        return h, lambda: h.close()

    def ctx_case(make, call):
        def run():
            c = make()
            call(c)
            return c, c.close
        return run

    cases = {"heap 64 MiB": heap}
    for t in ("stores", "one_shot", "torch_fused", "sequential", "auto"):
        cases[f"gemv_all_reduce[{t}]"] = ctx_case(
            lambda t=t: po.GemvAllReduce(world, max_n=2048, transport=t), lambda c: c(x, w))
    for mode in (False, True):
        cases[f"gemv_all_reduce[auto, graph={mode}]"] = ctx_case(
            lambda mode=mode: po.GemvAllReduce(world, max_n=2048, transport="auto", graph=mode),
            lambda c: c(x, w))
    for t in ("stores", "one_shot", "torch_fused", "sequential"):  # timed as "auto" times them
        cases[f"gemv_all_reduce[{t}] timed in a graph"] = ctx_case(
            lambda t=t: po.GemvAllReduce(world, max_n=2048, transport=t),
            lambda c: time_call(lambda: c(x, w), world, iters=5, warmup=2, graph=True))
    for t in ("stores", "copy_engine", "signal_collective", "sequential", "auto"):
        cases[f"matmul_all_reduce[{t}]"] = ctx_case(
            lambda t=t: po.MatmulAllReduce(world, 256, 2048, transport=t),
            lambda c: po.matmul_all_reduce(a, b, c))
    for t in ("stores", "copy_engine"):
        cases[f"all_gather_matmul[{t}]"] = ctx_case(
            lambda t=t: po.AllGatherMatmul(world, max_shard_elems=256 * 1024, transport=t),
            lambda c: po.all_gather_matmul(a, b, c))
    only = [n for n in args.only.split(";") if n]
    for name, run in cases.items():
        if only and name not in only:
            continue
        obj, close = run()
        close()
        del obj
        start = free_mib(dev, args.gc)
        trail = []
        for _ in range(args.cycles):
            obj, close = run()
            close()
            del obj
            trail.append(free_mib(dev, args.gc))
        if world.rank == 0:
            lost = (start - trail[-1]) / args.cycles
            print(f"{name:38s} lost {lost:7.2f} MiB per cycle; free after each: "
                  f"{' '.join(f'{start - f:.0f}' for f in trail)} MiB below the start", flush=True)


if __name__ == "__main__":
    main()
