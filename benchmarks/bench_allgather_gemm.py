"""Benchmark of AllGather + GEMM over copy engines (FiCCO schedules) against all_gather + cuBLAS
and torch's fused_all_gather_matmul, by the protocol in benchmarks/harness.py:

    torchrun --nproc-per-node 2 benchmarks/bench_allgather_gemm.py --out r.jsonl \\
        --device-kind nvidia-h200-x2

Shapes (M, N, K) of the whole layer: the gathered A is [M, K] (each rank holds M / W rows) and
each rank holds its N / W columns of the column-parallel B ([K, N / W]).
Impls: ``fused`` (the heuristic's schedule), one ``fused[<schedule>]`` per schedule, ``sequential``
(all_gather_into_tensor then torch.matmul), ``compute``, ``comm``, ``torch_fused``.
The shared options (shapes, dtypes, worlds, graph modes, checks) are in benchmarks/cli.py.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from benchmarks.cli import BenchParser
from benchmarks.runner import Case, rel_err, run_main, torch_dtype
from portable_overlap.ops.allgather_gemm import (SCHEDULES, AllGatherMatmul,
                                                 all_gather_matmul_reference, pick_schedule)

# the last has M < K, where the paper's heuristic would pick its 2-D schedule (pieces along K)
SHAPES = [(8192, 8192, 8192), (16384, 8192, 8192), (8192, 11008, 4096), (8192, 28672, 8192),
          (4096, 8192, 16384)]
OP = "allgather_gemm"


def parser() -> BenchParser:
    return BenchParser(__doc__, dims=("M", "N", "K"), shapes=SHAPES, dtypes=("bf16",),
                       allowed_dtypes=("bf16", "fp16"), iters=30, warmup=5)


def body(bench) -> int:
    world, args = bench.world, bench.args
    dev, W = world.device, world.world_size
    shapes = [(s["M"], s["N"], s["K"]) for s in args.shapes]
    ctx = AllGatherMatmul(world, max_shard_elems=max(M // W * K for M, _, K in shapes))
    group_name = dist.group.WORLD.group_name
    gen = torch.Generator(device=dev).manual_seed(world.rank)
    for dname in args.dtypes:
        dt = torch_dtype(dname)
        for M, N, K in shapes:
            m = M // W
            a = torch.randn(m, K, generator=gen, device=dev).to(dt)
            b = torch.randn(K, N // W, generator=gen, device=dev).to(dt)
            full = torch.empty(M, K, device=dev, dtype=dt)
            out = torch.empty(M, N // W, device=dev, dtype=dt)
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

                a_sym = symm_mem.empty(m, K, dtype=dt, device=dev)
                symm_mem.rendezvous(a_sym, group_name)
                a_sym.copy_(a)
                impls["torch_fused"] = lambda: torch.ops.symm_mem.fused_all_gather_matmul(
                    a_sym, [b], gather_dim=0, group_name=group_name)
            except Exception as e:
                bench.say(f"torch_fused unavailable: {type(e).__name__}: {e}")
            ref = all_gather_matmul_reference(a, b, world.group)

            def check(name):
                out.fill_(float("nan"))
                impls[name]()
                ctx.synchronize()
                return rel_err(out, ref)

            bench.run(Case(
                op=OP, shape={"M": M, "N": N, "K": K}, dtype=dname, impls=impls, check=check,
                fields=lambda name: {"schedule": pick if name == "fused" else None},
                notes={"pick": pick}, label=f"{M}x{N}x{K} {dname}"))
    ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(run_main(parser(), body))
