"""Benchmark of GEMM + ReduceScatter / AllReduce over copy engines against cuBLAS + NCCL and
torch's fused_matmul_reduce_scatter, by the protocol in benchmarks/harness.py:

    torchrun --nproc-per-node 2 -m benchmarks.bench_matmul_reduce --out r.jsonl \\
        --device-kind nvidia-h200-x2

Shapes (M, N, K) of the whole layer with K split: each rank holds a [M, K/W] and b [K/W, N]
(b a transposed [N, K/W] weight, as a row-parallel linear holds it). Impls per mode: ``fused``
(the copy-engine transport, default pieces and put lanes), ``fused[p=<n>]`` (other piece
counts), ``fused[lanes=<n>]`` (other put-lane counts), ``fused[stores]`` (the SM-store
transport; ``--no-stores`` skips it), ``auto`` (``transport="auto"``, called without
``out`` as torch's op is; the row's ``pick``: the transport it chose for plain and for
captured calls),
``sequential`` (torch.matmul, then
reduce_scatter_tensor / all_reduce), ``compute``, ``comm``, and for reduce_scatter
``torch_fused`` (torch.ops.symm_mem.fused_matmul_reduce_scatter; skipped with the reason printed
where it fails). The shared options (shapes, dtypes, worlds, graph modes, checks) are in
benchmarks/cli.py.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from benchmarks.cli import BenchParser, int_list, parse_ints
from benchmarks.harness import torch_fused_matmul_reduce_scatter
from benchmarks.runner import Case, auto_contexts, auto_fields, rel_err, run_main, torch_dtype
import portable_overlap as po
from portable_overlap import collectives
from portable_overlap.ops.matmul_reduce import (MatmulReduce, matmul_all_reduce_reference,
                                                matmul_reduce_scatter_reference)

# the K-split shapes, then the MLP down projections at S = 8192 (M, N=H, K=I)
SHAPES = [(4096, 8192, 8192), (8192, 8192, 8192), (16384, 8192, 8192),
          (8192, 4096, 11008), (8192, 4096, 14336), (8192, 8192, 28672)]
OP = {"reduce_scatter": "gemm_reduce_scatter", "all_reduce": "gemm_all_reduce"}
REF = {"reduce_scatter": matmul_reduce_scatter_reference, "all_reduce": matmul_all_reduce_reference}


def parser() -> BenchParser:
    ap = BenchParser(__doc__, dims=("M", "N", "K"),
                     split_dims=("M", "K"), shapes=SHAPES, dtypes=("bf16",),
                     allowed_dtypes=("bf16", "fp16"), iters=50, warmup=5,
                     shapes_help="the issue's six ")
    ap.add_choices("--modes", ("reduce_scatter", "all_reduce"),
                   "reduce_scatter,all_reduce")
    ap.add_argument("--pieces", default="4", type=int_list(1, empty=False),
                    help="piece counts; the first is 'fused'")
    ap.add_argument("--put-lanes", default="0", type=int_list(0, empty=False),
                    help="put-lane counts (0: the default, one per peer); the first is 'fused'")
    ap.add_argument("--no-stores", action="store_true",
                    help="do not time the 'stores' transport (fused[stores])")
    return ap


def body(bench) -> int:
    world, args = bench.world, bench.args
    dev, W = world.device, world.world_size
    shapes = [(s["M"], s["N"], s["K"]) for s in args.shapes]
    pieces, lanes = parse_ints(args.pieces), parse_ints(args.put_lanes)
    modes = [m for m in args.modes.split(",") if m]
    max_elems = max(M * N for M, N, _ in shapes)
    variants = {"fused": (pieces[0], lanes[0])}
    variants.update({f"fused[p={p}]": (p, lanes[0]) for p in pieces[1:]})
    variants.update({f"fused[lanes={n}]": (pieces[0], n) for n in lanes[1:]})
    ctxs = {name: MatmulReduce(world, max_elems, pieces=p, put_lanes=n or None)
            for name, (p, n) in variants.items()}
    max_m, max_n = max(M for M, _, _ in shapes), max(N for _, N, _ in shapes)
    stores = {mode: make(world, max_m, max_n, transport="stores")
              for mode, make in (("reduce_scatter", po.MatmulReduceScatter),
                                 ("all_reduce", po.MatmulAllReduce))
              if not args.no_stores and mode in modes}
    autos = {mode: auto_contexts(lambda make=make, **kw: make(world, max_m, max_n, **kw))
             for mode, make in (("reduce_scatter", po.MatmulReduceScatter),
                                ("all_reduce", po.MatmulAllReduce)) if mode in modes}
    every = (*ctxs.values(), *stores.values(), *(c for a in autos.values() for c in a.values()))
    gen = torch.Generator(device=dev).manual_seed(world.rank)
    for dname in args.dtypes:
        dt = torch_dtype(dname)
        for M, N, K in shapes:
            k = K // W
            a = torch.randn(M, k, generator=gen, device=dev).to(dt)
            b = torch.randn(N, k, generator=gen, device=dev).to(dt).t()
            # random, not empty: "comm" alone reduces it without a product first
            c = torch.randn(M, N, generator=gen, device=dev).to(dt)
            for mode in modes:
                rows = M // W if mode == "reduce_scatter" else M
                out = torch.empty(rows, N, device=dev, dtype=dt)
                rs_out = torch.empty(M // W, N, device=dev, dtype=dt)
                impls = {name: (lambda ctx=ctx: getattr(ctx, mode)(a, b, out))
                         for name, ctx in ctxs.items()}
                if mode in stores:
                    impls["fused[stores]"] = lambda st=stores[mode]: st(a, b, out=out)
                for n, actx in autos[mode].items():  # without out, as torch's op is called
                    impls[n] = lambda c=actx: c(a, b)
                if mode == "reduce_scatter":
                    coll = lambda: collectives.reduce_scatter(rs_out, c)  # noqa: E731
                else:
                    coll = lambda: dist.all_reduce(c)  # noqa: E731
                impls["sequential"] = lambda: (torch.matmul(a, b, out=c), coll())
                impls["compute"] = lambda: torch.matmul(a, b, out=c)
                impls["comm"] = coll
                if mode == "reduce_scatter":
                    try:
                        impls["torch_fused"] = torch_fused_matmul_reduce_scatter(
                            world, a, b, REF[mode])
                    except Exception as e:
                        bench.say(f"torch_fused unavailable: {type(e).__name__}: "
                                  f"{str(e)[:200]}")
                ref = REF[mode](a, b, world.group)

                def check(name, mode=mode, out=out, rs_out=rs_out, ref=ref):
                    # the sequential baseline's result: the reduced product in place (c), or
                    # this rank's rows of it (rs_out)
                    seq_out = rs_out if mode == "reduce_scatter" else c
                    (seq_out if name == "sequential" else out).fill_(float("nan"))
                    y = impls[name]()
                    for ctx in every:
                        ctx.synchronize()
                    if name == "sequential":
                        y = seq_out
                    elif name not in autos[mode] and name != "torch_fused":
                        y = out
                    return rel_err(y, ref)

                bench.run(Case(
                    op=OP[mode], shape={"M": M, "N": N, "K": K}, dtype=dname, impls=impls,
                    check=check, tol=2e-2, label=f"{mode} {M}x{N}x{K} {dname}",
                    # the baselines too: every speedup divides by them
                    checked=[n for n in impls if n.startswith(("fused", "auto"))
                             or n in ("sequential", "torch_fused")],
                    fields=lambda name, mode=mode, out=out: {
                        "transport": ("stores" if name == "fused[stores]" else "copy_engine")
                        if name.startswith("fused") else None,
                        **(auto_fields(autos[mode][name], a, b)
                           if name in autos[mode] else {})}))
    for ctx in every:
        ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(run_main(parser(), body))
