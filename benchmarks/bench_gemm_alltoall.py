"""Benchmark of dense GEMM + equal-split All-to-All (issue 3's dense variant) against cuBLAS +
NCCL, by the protocol in benchmarks/harness.py. Run under torchrun:

    torchrun --nproc-per-node 2 -m benchmarks.bench_gemm_alltoall --out results.jsonl \\
        --device-kind nvidia-h200-x2

Shapes are (M, N, K) per rank: every rank computes c = a @ b ([M, N]) and sends rows
[d*M/W, (d+1)*M/W) to rank d. Impls: ``fused`` (persistent Triton kernel storing tiles into the
destination's heap), ``copy_engine`` (BLAS in row blocks + DMA on a side stream; one
``copy_engine_p<n>`` per piece count when ``--pieces`` lists several), ``sequential``
(torch.matmul then NCCL all_to_all_single), ``compute`` (torch.matmul), ``compute_triton`` (the
Triton persistent matmul the fused kernel is built on, alone), ``comm`` (all_to_all_single).
The shared options (shapes, dtypes, worlds, graph modes, checks) are in benchmarks/cli.py.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from benchmarks.cli import BenchParser, int_list, parse_ints
from benchmarks.runner import Case, rel_err, run_main, torch_dtype
from portable_overlap.ops.gemm_alltoall import GemmAllToAll, gemm_all_to_all_reference
from portable_overlap.ops.matmul import persistent_matmul

SHAPES = [(8192, 4096, 4096), (16384, 7168, 2048), (4096, 4096, 14336)]
OP = "gemm_alltoall"


def parser() -> BenchParser:
    ap = BenchParser(__doc__, dims=("M", "N", "K"), shapes=SHAPES, dtypes=("bf16",),
                     allowed_dtypes=("bf16", "fp16"), iters=50, warmup=10)
    ap.add_argument("--pieces", default="4", type=int_list(1, empty=False),
                    help="comma list: copy-engine row blocks per rank")
    return ap


def body(bench) -> int:
    world, args = bench.world, bench.args
    dev, W = world.device, world.world_size
    shapes = [(s["M"], s["N"], s["K"]) for s in args.shapes]
    max_elems = max(m * n for m, n, _ in shapes)
    pieces = parse_ints(args.pieces)
    stores = GemmAllToAll(world, max_elems)
    ce = {p: GemmAllToAll(world, max_elems, transport="copy_engine", pieces=p) for p in pieces}
    gen = torch.Generator(device=dev).manual_seed(world.rank)
    for dname in args.dtypes:
        dt = torch_dtype(dname)
        for M, N, K in shapes:
            a = torch.randn(M, K, generator=gen, device=dev).to(dt)
            b = torch.randn(K, N, generator=gen, device=dev).to(dt)
            out = torch.empty(M, N, device=dev, dtype=dt)
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
            ours = [n for n in impls if n.startswith(("fused", "copy_engine"))]

            def check(name):
                out.fill_(float("nan"))
                impls[name]()
                torch.cuda.synchronize()
                for ctx in (stores, *ce.values()):
                    ctx.check()
                return rel_err(out, ref)

            moved = M * N * out.element_size() * (W - 1) // W  # bytes each rank sends
            bench.run(Case(
                op=OP, shape={"M": M, "N": N, "K": K}, dtype=dname, impls=impls, check=check,
                checked=ours, tol=2e-2, summarize=ours, label=f"{M}x{N}x{K} {dname}",
                fields=lambda name: {"bytes_sent_per_rank": 0 if name.startswith("compute")
                                     else moved}))
    stores.close()
    for ctx in ce.values():
        ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(run_main(parser(), body))
