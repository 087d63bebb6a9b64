"""Benchmark of AllGather + GEMM over copy engines (FiCCO schedules) against all_gather + cuBLAS
and torch's fused_all_gather_matmul, by the protocol in benchmarks/harness.py:

    torchrun --nproc-per-node 2 benchmarks/bench_allgather_gemm.py --out r.jsonl \\
        --device-kind nvidia-h200-x2

Shapes (M, N, K) of the whole layer: the gathered A is [M, K] (each rank holds M / W rows) and
each rank holds its N / W columns of the column-parallel B ([K, N / W]).
Impls: ``fused`` (the heuristic's schedule), one ``fused[<schedule>]`` per schedule, ``sequential``
(all_gather_into_tensor then torch.matmul), ``compute``, ``comm``, ``torch_fused``.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from benchmarks.harness import ResultWriter, time_op
from portable_overlap import World
from portable_overlap.ops.allgather_gemm import (SCHEDULES, AllGatherMatmul,
                                                 all_gather_matmul_reference, pick_schedule)

# the last has M < K, where the paper's heuristic would pick its 2-D schedule (pieces along K)
SHAPES = [(8192, 8192, 8192), (16384, 8192, 8192), (8192, 11008, 4096), (8192, 28672, 8192),
          (4096, 8192, 16384)]
OP = "allgather_gemm"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device-kind", default="unknown")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--shapes", default="")
    args = ap.parse_args()
    world = World.from_env()
    dev, W = world.device, world.world_size
    writer = ResultWriter(args.out, args.device_kind, W)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",") if s] or SHAPES
    ctx = AllGatherMatmul(world, max_shard_elems=max(M // W * K for M, _, K in shapes))
    group_name = dist.group.WORLD.group_name
    gen = torch.Generator(device=dev).manual_seed(world.rank)
    table = []
    for M, N, K in shapes:
        m = M // W
        shape = {"M": M, "N": N, "K": K}
        a = torch.randn(m, K, generator=gen, device=dev).bfloat16()
        b = torch.randn(K, N // W, generator=gen, device=dev).bfloat16()
        full = torch.empty(M, K, device=dev, dtype=torch.bfloat16)
        out = torch.empty(M, N // W, device=dev, dtype=torch.bfloat16)
        ref = all_gather_matmul_reference(a, b, world.group)
        pick = pick_schedule(M, N // W, K, 2, world.facts.arch)
        impls = {"fused": lambda: ctx(a, b, out)}
        for s in SCHEDULES:
            impls[f"fused[{s}]"] = lambda s=s: ctx(a, b, out, schedule=s)
        impls.update({
            "sequential": lambda: (dist.all_gather_into_tensor(full, a),
                                   torch.matmul(full, b, out=out)),
            "compute": lambda: torch.matmul(full, b, out=out),
            "comm": lambda: dist.all_gather_into_tensor(full, a),
        })
        try:
            import torch.distributed._symmetric_memory as symm_mem

            a_sym = symm_mem.empty(m, K, dtype=torch.bfloat16, device=dev)
            symm_mem.rendezvous(a_sym, group_name)
            a_sym.copy_(a)
            impls["torch_fused"] = lambda: torch.ops.symm_mem.fused_all_gather_matmul(
                a_sym, [b], gather_dim=0, group_name=group_name)
        except Exception as e:
            if world.rank == 0:
                print(f"torch_fused unavailable: {type(e).__name__}: {e}", flush=True)
        errs = {}
        for name in [n for n in impls if n.startswith("fused")]:
            out.fill_(float("nan"))
            impls[name]()
            ctx.synchronize()
            errs[name] = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        row = {"shape": f"{M}x{N}x{K}", "pick": pick, "errs": errs}
        for graph in (False, True):
            for name, fn in impls.items():
                try:
                    r = time_op(fn, world, graph=graph, iters=args.iters, warmup=5)
                except Exception as e:
                    if world.rank == 0:
                        print(f"{name} graph={graph} failed: {type(e).__name__}: {e}", flush=True)
                    continue
                row[(name, graph)] = r["median_ms"]
                if world.rank == 0:
                    writer.write(op=OP, shape=shape, dtype="bf16", impl=name, graph=graph,
                                 schedule=pick if name == "fused" else None,
                                 rel_err=errs.get(name),
                                 **{k: round(v, 5) for k, v in r.items()})
        table.append(row)
    ctx.close()
    if world.rank == 0:
        names = ["fused", *[f"fused[{s}]" for s in SCHEDULES], "sequential", "torch_fused",
                 "compute", "comm"]
        print("\nms, graph replay, slowest rank's median; frac = (seq - fused) / (seq - ideal)")
        # the schedule alone names a fused[...] column: cut to 16 characters, the 1-D and 2-D
        # names of a schedule would look the same
        print(f"{'M x N x K':>18} {'pick':>18} "
              + " ".join(f"{n[6:-1] if n.startswith('fused[') else n:>17}" for n in names)
              + "   frac")
        for row in table:
            t = {n: row.get((n, True), float("nan")) for n in names}
            ideal = max(t["compute"], t["comm"])
            frac = (t["sequential"] - t["fused"]) / (t["sequential"] - ideal)
            print(f"{row['shape']:>18} {row['pick']:>18} " + " ".join(f"{t[n]:17.3f}"
                                                                      for n in names)
                  + f" {frac:6.2f}")
        print("rel errors:", {r["shape"]: {k: f"{v:.1e}" for k, v in r["errs"].items()}
                              for r in table})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
