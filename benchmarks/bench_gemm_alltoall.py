"""Benchmark of dense GEMM + equal-split All-to-All (issue 3's dense variant) against cuBLAS +
NCCL, by the protocol in benchmarks/harness.py. Run under torchrun:

    torchrun --nproc-per-node 2 benchmarks/bench_gemm_alltoall.py --out results.jsonl \\
        --device-kind nvidia-h200-x2

Shapes are (M, N, K) per rank: every rank computes c = a @ b ([M, N]) and sends rows
[d*M/W, (d+1)*M/W) to rank d. Impls: ``fused`` (persistent Triton kernel storing tiles into the
destination's heap), ``copy_engine`` (BLAS in row blocks + DMA on a side stream), ``sequential``
(torch.matmul then NCCL all_to_all_single), ``compute`` (torch.matmul), ``compute_triton`` (the
Triton persistent matmul the fused kernel is built on, alone), ``comm`` (all_to_all_single).
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from benchmarks.harness import ResultWriter, time_op
from portable_overlap import World
from portable_overlap.ops.gemm_alltoall import GemmAllToAll, gemm_all_to_all_reference
from portable_overlap.ops.matmul import persistent_matmul

SHAPES = [(8192, 4096, 4096), (16384, 7168, 2048), (4096, 4096, 14336)]
OP = "gemm_alltoall"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device-kind", default="unknown")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--shapes", default="")
    ap.add_argument("--pieces", default="4", help="comma list: copy-engine row blocks per rank")
    ap.add_argument("--graph", default="0,1", help="comma list of 0 (plain) / 1 (graph)")
    args = ap.parse_args()
    world = World.from_env()
    dev, W = world.device, world.world_size
    writer = ResultWriter(args.out, args.device_kind, W)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",") if s] or SHAPES
    max_elems = max(m * n for m, n, _ in shapes)
    pieces = [int(p) for p in args.pieces.split(",")]
    graphs = [bool(int(g)) for g in args.graph.split(",")]
    stores = GemmAllToAll(world, max_elems)
    ce = {p: GemmAllToAll(world, max_elems, transport="copy_engine", pieces=p) for p in pieces}
    gen = torch.Generator(device=dev).manual_seed(world.rank)
    table = []
    for M, N, K in shapes:
        shape = {"M": M, "N": N, "K": K}
        a = torch.randn(M, K, generator=gen, device=dev).bfloat16()
        b = torch.randn(K, N, generator=gen, device=dev).bfloat16()
        out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        c = torch.empty_like(out)
        ref = gemm_all_to_all_reference(a, b, world.group)
        impls = {"fused": lambda: stores(a, b, out=out)}
        for p, ctx in ce.items():
            impls[f"copy_engine_p{p}" if len(ce) > 1 else "copy_engine"] = \
                lambda ctx=ctx: ctx(a, b, out=out)
        impls.update({
            "sequential": lambda: dist.all_to_all_single(out, torch.matmul(a, b, out=c)),
            "compute": lambda: torch.matmul(a, b, out=c),
            "compute_triton": lambda: persistent_matmul(a, b, out=c),
            "comm": lambda: dist.all_to_all_single(out, c),
        })
        errs = {}
        for name in [n for n in impls if n.startswith(("fused", "copy_engine"))]:
            out.fill_(float("nan"))
            try:
                impls[name]()
                torch.cuda.synchronize()
                for ctx in (stores, *ce.values()):
                    ctx.check()
                errs[name] = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
            except Exception as e:
                print(f"rank {world.rank}: {name} failed at {M}x{N}x{K}: {type(e).__name__}: "
                      f"{str(e)[-300:]}", flush=True)
                errs[name] = float("inf")
        moved = M * N * 2 * (W - 1) // W  # bytes each rank sends (real rows only)
        row = {"shape": f"{M}x{N}x{K}", "errs": errs}
        for graph in graphs:
            for name, fn in impls.items():
                try:
                    r = time_op(fn, world, graph=graph, iters=args.iters, warmup=10)
                except Exception as e:
                    if world.rank == 0:
                        print(f"{name} graph={graph} failed: {type(e).__name__}: {e}", flush=True)
                    continue
                row[(name, graph)] = r["median_ms"]
                if world.rank == 0:
                    err = errs.get(name)
                    writer.write(op=OP, shape=shape, dtype="bf16", impl=name, graph=graph,
                                 bytes_sent_per_rank=moved if name not in
                                 ("compute", "compute_triton") else 0,
                                 correct=None if err is None else bool(err < 2e-2), rel_err=err,
                                 **{k: round(v, 5) for k, v in r.items()})
        table.append(row)
        if world.rank == 0:
            for graph in graphs:
                t = {n: row.get((n, graph)) for n in impls}
                if None in (t["sequential"], t["compute"], t["comm"]):
                    continue
                ideal = max(t["compute"], t["comm"])
                for name in [n for n in impls if n.startswith(("fused", "copy_engine"))]:
                    if t[name] is None:
                        continue
                    writer.write(op=OP + "_summary", shape=shape, dtype="bf16", graph=graph,
                                 impl=name, ideal_ms=round(ideal, 5), fused_ms=round(t[name], 5),
                                 sequential_ms=round(t["sequential"], 5),
                                 speedup=round(t["sequential"] / t[name], 3),
                                 fraction_of_ideal=round((t["sequential"] - t[name])
                                                         / (t["sequential"] - ideal), 3)
                                 if t["sequential"] > ideal else None)
    stores.close()
    for ctx in ce.values():
        ctx.close()
    if world.rank == 0:
        names = list(impls)
        print("\nms, slowest rank's median; frac = (seq - impl) / (seq - max(compute, comm))")
        for graph in graphs:
            print(f"-- {'graph replay' if graph else 'plain launches'}")
            print(f"{'M x N x K':>18} " + " ".join(f"{n[:14]:>14}" for n in names) + "  frac(best)")
            for r in table:
                t = {n: r.get((n, graph), float("nan")) for n in names}
                ideal = max(t["compute"], t["comm"])
                best = min((t[n] for n in names if n.startswith(("fused", "copy_engine"))))
                frac = (t["sequential"] - best) / (t["sequential"] - ideal)
                print(f"{r['shape']:>18} " + " ".join(f"{t[n]:14.3f}" for n in names)
                      + f"  {frac:9.2f}")
        print("rel errors:", {r["shape"]: {k: f"{v:.1e}" for k, v in r["errs"].items()}
                              for r in table})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
