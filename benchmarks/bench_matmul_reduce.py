"""Benchmark of GEMM + ReduceScatter / AllReduce over copy engines against cuBLAS + NCCL and
torch's fused_matmul_reduce_scatter, by the protocol in benchmarks/harness.py:

    torchrun --nproc-per-node 2 benchmarks/bench_matmul_reduce.py --out r.jsonl \\
        --device-kind nvidia-h200-x2

Shapes (M, N, K) of the whole layer with K split: each rank holds a [M, K/W] and b [K/W, N]
(b a transposed [N, K/W] weight, as a row-parallel linear holds it). Impls per mode: ``fused``
(default pieces and put lanes), ``fused[p=<n>]`` (other piece counts), ``fused[lanes=<n>]``
(other put-lane counts), ``sequential`` (torch.matmul, then
reduce_scatter_tensor / all_reduce), ``compute``, ``comm``, and for reduce_scatter
``torch_fused`` (torch.ops.symm_mem.fused_matmul_reduce_scatter; skipped with the reason printed
where it fails).
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from benchmarks.harness import ResultWriter, time_op, torch_fused_matmul_reduce_scatter
from portable_overlap import World
from portable_overlap.ops.matmul_reduce import (MatmulReduce, matmul_all_reduce_reference,
                                                matmul_reduce_scatter_reference)

# the K-split shapes, then the MLP down projections at S = 8192 (M, N=H, K=I)
SHAPES = [(4096, 8192, 8192), (8192, 8192, 8192), (16384, 8192, 8192),
          (8192, 4096, 11008), (8192, 4096, 14336), (8192, 8192, 28672)]
OP = {"reduce_scatter": "gemm_reduce_scatter", "all_reduce": "gemm_all_reduce"}
REF = {"reduce_scatter": matmul_reduce_scatter_reference, "all_reduce": matmul_all_reduce_reference}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device-kind", default="unknown")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--shapes", default="", help="MxNxK,... (default: the issue's six)")
    ap.add_argument("--modes", default="reduce_scatter,all_reduce")
    ap.add_argument("--pieces", default="4", help="piece counts; the first is 'fused'")
    ap.add_argument("--put-lanes", default="0",
                    help="put-lane counts (0: the default, one per peer); the first is 'fused'")
    ap.add_argument("--no-plain", action="store_true", help="graph replay only")
    args = ap.parse_args()
    world = World.from_env()
    dev, W = world.device, world.world_size
    writer = ResultWriter(args.out, args.device_kind, W)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",") if s] or SHAPES
    pieces = [int(p) for p in args.pieces.split(",")]
    modes = args.modes.split(",")
    max_elems = max(M * N for M, N, _ in shapes)
    lanes = [int(n) for n in args.put_lanes.split(",")]
    variants = {"fused": (pieces[0], lanes[0])}
    variants.update({f"fused[p={p}]": (p, lanes[0]) for p in pieces[1:]})
    variants.update({f"fused[lanes={n}]": (pieces[0], n) for n in lanes[1:]})
    ctxs = {name: MatmulReduce(world, max_elems, pieces=p, put_lanes=n or None)
            for name, (p, n) in variants.items()}
    gen = torch.Generator(device=dev).manual_seed(world.rank)
    table = []
    for M, N, K in shapes:
        shape = {"M": M, "N": N, "K": K}
        k = K // W
        a = torch.randn(M, k, generator=gen, device=dev).bfloat16()
        b = torch.randn(N, k, generator=gen, device=dev).bfloat16().t()
        c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        for mode in modes:
            rows = M // W if mode == "reduce_scatter" else M
            out = torch.empty(rows, N, device=dev, dtype=torch.bfloat16)
            rs_out = torch.empty(M // W, N, device=dev, dtype=torch.bfloat16)
            impls = {}
            for name, ctx in ctxs.items():
                impls[name] = lambda ctx=ctx: getattr(ctx, mode)(a, b, out)
            if mode == "reduce_scatter":
                coll = lambda: dist.reduce_scatter_tensor(rs_out, c)  # noqa: E731
            else:
                coll = lambda: dist.all_reduce(c)  # noqa: E731
            impls["sequential"] = lambda: (torch.matmul(a, b, out=c), coll())
            impls["compute"] = lambda: torch.matmul(a, b, out=c)
            impls["comm"] = coll
            if mode == "reduce_scatter":
                try:
                    impls["torch_fused"] = torch_fused_matmul_reduce_scatter(world, a, b,
                                                                               REF[mode])
                except Exception as e:
                    if world.rank == 0:
                        print(f"torch_fused unavailable: {type(e).__name__}: {str(e)[:200]}",
                              flush=True)
            ref = REF[mode](a, b, world.group)
            errs = {}
            for name in [n for n in impls if n.startswith("fused")]:
                out.fill_(float("nan"))
                impls[name]()
                for ctx in ctxs.values():
                    ctx.synchronize()
                errs[name] = max(world.all_gather_object(
                    ((out.double() - ref.double()).norm() / ref.double().norm()).item()))
            row = {"shape": f"{M}x{N}x{K}", "mode": mode, "errs": errs}
            for graph in ((True,) if args.no_plain else (False, True)):
                for name, fn in impls.items():
                    try:
                        r = time_op(fn, world, graph=graph, iters=args.iters, warmup=5)
                    except Exception as e:
                        if world.rank == 0:
                            print(f"{mode} {name} graph={graph} failed: {type(e).__name__}: "
                                  f"{str(e)[:200]}", flush=True)
                        continue
                    row[(name, graph)] = r["median_ms"]
                    if world.rank == 0:
                        writer.write(op=OP[mode], shape=shape, dtype="bf16", impl=name,
                                     graph=graph, transport="copy_engine"
                                     if name.startswith("fused") else None,
                                     rel_err=errs.get(name),
                                     **{k: round(v, 5) for k, v in r.items()})
            table.append(row)
            if world.rank == 0:
                t = {n: row.get((n, True), float("nan")) for n in impls}
                print(f"{mode} {M}x{N}x{K}: " + ", ".join(f"{n} {v:.3f}" for n, v in t.items()),
                      flush=True)
    for ctx in ctxs.values():
        ctx.close()
    if world.rank == 0:
        names = [*variants, "sequential", "torch_fused", "compute", "comm"]
        print("\nms, graph replay, slowest rank's median; ideal = max(compute, comm); "
              "frac = (seq - fused) / (seq - ideal)")
        print(f"{'mode':>14} {'M x N x K':>18} " + " ".join(f"{n[:11]:>11}" for n in names)
              + "  speedup   frac  vs torch")
        for row in table:
            t = {n: row.get((n, True), float("nan")) for n in names}
            ideal = max(t["compute"], t["comm"])
            frac = (t["sequential"] - t["fused"]) / (t["sequential"] - ideal)
            print(f"{row['mode']:>14} {row['shape']:>18} "
                  + " ".join(f"{t[n]:11.3f}" for n in names)
                  + f"  {t['sequential'] / t['fused']:7.2f} {frac:6.2f} "
                  f"{t['torch_fused'] / t['fused']:8.2f}")
        print("rel errors:", {f"{r['mode']} {r['shape']}": {k: f"{v:.1e}"
                                                            for k, v in r["errs"].items()}
                              for r in table})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
