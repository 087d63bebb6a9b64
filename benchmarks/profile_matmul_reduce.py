"""Timeline of GEMM + AllReduce / ReduceScatter over copy engines under torch.profiler (one
shape, a few calls): writes a Chrome trace per rank and prints each copy's size, time and
bandwidth, so the exposed part of a transfer can be told from the GEMM's own time.

    torchrun --nproc-per-node 2 -m benchmarks.profile_matmul_reduce --out DIR [--mode all_reduce]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from portable_overlap import World
from portable_overlap.ops.matmul_reduce import MatmulReduce


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", default="all_reduce")
    ap.add_argument("--shape", default="8192x8192x8192")
    ap.add_argument("--pieces", type=int, default=4)
    ap.add_argument("--put-lanes", type=int, default=0, help="0: one per peer (the default)")
    ap.add_argument("--graph", action="store_true", help="profile CUDA-graph replays (what the "
                    "benchmark times) instead of plain launches (host-bound here)")
    args = ap.parse_args()
    world = World.from_env()
    M, N, K = map(int, args.shape.split("x"))
    dev, W = world.device, world.world_size
    ctx = MatmulReduce(world, MatmulReduce.elems_needed(M, N, world.world_size),
                       pieces=args.pieces, put_lanes=args.put_lanes or None)
    a = torch.randn(M, K // W, device=dev).bfloat16()
    b = torch.randn(N, K // W, device=dev).bfloat16().t()
    fn = getattr(ctx, args.mode)
    out = fn(a, b)
    for _ in range(5):
        fn(a, b, out)
    ctx.synchronize()
    call = lambda: fn(a, b, out)  # noqa: E731
    if args.graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(a, b, out)
        call = g.replay
    world.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            world.barrier()
            call()
        torch.cuda.synchronize()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"trace_{args.mode}_rank{world.rank}.json")
    prof.export_chrome_trace(path)
    ctx.close()
    if world.rank == 0:
        ev = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"
              and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        ev.sort(key=lambda e: e["ts"])
        # the last call only: from its epoch kernel on
        starts = [e["ts"] for e in ev if "epoch_kernel" in e["name"]]
        t0 = starts[-1] if starts else ev[0]["ts"]
        print(f"{'start us':>9} {'dur us':>8} {'stream':>7}  what")
        for e in ev:
            if e["ts"] < t0:
                continue
            nb = e.get("args", {}).get("bytes")
            bw = f"  {nb / e['dur'] / 1e3:.0f} GB/s {nb / 2**20:.0f} MiB" if nb else ""
            print(f"{e['ts'] - t0:9.1f} {e['dur']:8.1f} {e.get('args', {}).get('stream', '?'):>7}"
                  f"  {e['name'][:60]}{bw}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
