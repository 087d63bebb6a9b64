"""Probe (one GPU): the device time of each fused GEMM op's kernel against the GEMM core's on
the same operands, so what an op adds to its tiles (flag rounds, epilogue, end-of-call ticket)
can be told from host or launch costs. On a world of one, for each shape (bf16, plain launches
under ``torch.profiler``, the mean over ``--calls`` calls after a warm-up): ``persistent_matmul``,
GEMM + All-to-All, GEMM + ReduceScatter and GEMM + AllReduce over ``"stores"``, each op's
kernels by name with their mean device time. Prints one line per op and shape; rows to --out.

    torchrun --nproc-per-node 1 -m benchmarks.probe_fused_kernel_times --out probe.jsonl \\
        --device-kind nvidia-h200 [--shapes 64x1024x4096,256x8192x3584]
"""
from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import portable_overlap as po
from benchmarks.rows import ResultWriter
from portable_overlap import World
from portable_overlap.ops.gemm_alltoall import GemmAllToAll
from portable_overlap.ops.matmul import persistent_matmul

SHAPES = "64x1024x4096,128x3584x8192,256x8192x3584,2048x1024x8192"


def kernel_times(fn, calls: int) -> dict:
    """{kernel name: (launches per call, mean device µs per launch)} over ``calls`` calls."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: (e.count / calls, e.device_time_total / e.count)
            for e in prof.key_averages() if e.device_time_total > 0}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device-kind", default="unknown")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    world = World.from_env()
    if world.world_size != 1:
        raise SystemExit("probe_fused_kernel_times: run it on one GPU (--nproc-per-node 1)")
    dev = world.device
    writer = ResultWriter(args.out, args.device_kind, 1)
    g = torch.Generator(device=dev).manual_seed(0)
    for spec in args.shapes.split(","):
        M, N, K = (int(v) for v in spec.split("x"))
        a = torch.randn(M, K, generator=g, device=dev).bfloat16()
        b = torch.randn(K, N, generator=g, device=dev).bfloat16()
        out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        contexts = {"gemm_alltoall": GemmAllToAll(world, max_elems=M * N),
                    "matmul_reduce_scatter": po.MatmulReduceScatter(world, M, N,
                                                                    transport="stores"),
                    "matmul_all_reduce": po.MatmulAllReduce(world, M, N, transport="stores")}
        ops = {"persistent_matmul": lambda: persistent_matmul(a, b, out=out)}
        ops.update({name: (lambda c: lambda: c(a, b, out=out))(ctx)
                    for name, ctx in contexts.items()})
        try:
            for name, fn in ops.items():
                times = kernel_times(fn, args.calls)
                print(f"{spec:>16s} {name:22s} " + "  ".join(
                    f"{k[:40]} x{n:g} {t:.1f} us" for k, (n, t) in times.items()), flush=True)
                writer.write(op="fused_kernel_times", shape={"M": M, "N": N, "K": K},
                             dtype="bf16", impl=name, graph=False,
                             device_ms_per_call=sum(n * t for n, t in times.values()) / 1e3,
                             kernels={k: {"per_call": n, "mean_us": t}
                                      for k, (n, t) in times.items()})
        finally:
            for ctx in contexts.values():
                ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
