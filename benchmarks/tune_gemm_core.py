"""Sweep tile configurations of the shared tile-GEMM core on one GPU (a world of one rank):
the persistent matmul at a dense shape and the MoE grouped GEMM + combine at an MoE shape,
against cuBLAS. Prints one line per config; results go to --out as JSON lines.

    python -m benchmarks.tune_gemm_core --out tune.jsonl --device-kind nvidia-h200-x2
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from benchmarks.harness import time_op
from benchmarks.rows import ResultWriter
from portable_overlap import World
from portable_overlap.ops.matmul import MatmulConfig, persistent_matmul
from portable_overlap.ops.moe_combine import CombineConfig, MoeGemmCombine

CONFIGS = [(128, 256, 64, 8, 4, 8)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device-kind", default="unknown")
    args = ap.parse_args()
    world = World.from_env()
    dev = world.device
    writer = ResultWriter(args.out, args.device_kind, 1)
    g = torch.Generator(device=dev).manual_seed(0)
    M, N, K = 16384, 7168, 2048
    a = torch.randn(M, K, generator=g, device=dev).bfloat16()
    b = torch.randn(K, N, generator=g, device=dev).bfloat16()
    c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    t_cublas = time_op(lambda: torch.matmul(a, b, out=c), world, graph=True, iters=30)["median_ms"]
    print(f"dense {M}x{N}x{K}: cuBLAS {t_cublas:.3f} ms", flush=True)
    # MoE: 16384 rows in 8 segments of uneven length, I=1536, H=2048, combine with k=1
    R, I, H, segs = 16384, 1536, 2048, 8
    cuts = sorted(torch.randint(1, R, (segs - 1,), generator=torch.Generator().manual_seed(1))
                  .tolist())
    counts = torch.tensor([b_ - a_ for a_, b_ in zip([0] + cuts, cuts + [R])],
                          dtype=torch.int32, device=dev).view(1, segs)
    x = torch.randn(R, I, generator=g, device=dev).bfloat16()
    w = (torch.randn(segs, I, H, generator=g, device=dev) / I ** 0.5).bfloat16()
    y = torch.empty(R, H, device=dev, dtype=torch.bfloat16)
    bounds = [0] + torch.cumsum(counts.flatten().long(), 0).tolist()

    def moe_cublas():
        for s in range(segs):
            torch.matmul(x[bounds[s]:bounds[s + 1]], w[s], out=y[bounds[s]:bounds[s + 1]])

    t_moe_cublas = time_op(moe_cublas, world, graph=True, iters=30)["median_ms"]
    print(f"moe rows {R} I {I} H {H}: cuBLAS per segment {t_moe_cublas:.3f} ms", flush=True)
    slots = torch.arange(R, dtype=torch.int32, device=dev)
    tw = torch.ones(R, 1, device=dev)
    # the plain persistent matmul at the MoE GEMM's dense equivalent (all rows, one weight)
    for cfg in (MatmulConfig(num_stages=4), MatmulConfig(num_stages=3)):
        t_p = time_op(lambda: persistent_matmul(x, w[0], out=y, config=cfg), world, graph=True,
                      iters=30)["median_ms"]
        t_c = time_op(lambda: torch.matmul(x, w[0], out=y), world, graph=True,
                      iters=30)["median_ms"]
        print(f"dense {R}x{H}x{I}: persistent matmul {cfg.num_stages} stages {t_p:.3f} ms, "
              f"cuBLAS {t_c:.3f} ms", flush=True)
    # the two kernels of the MoE op separately (a world of one: no waits), combine tilings
    for cc in (CombineConfig(), CombineConfig(block_s=4, block_h=1024, num_warps=4),
               CombineConfig(block_s=16, block_h=512, num_warps=8),
               CombineConfig(block_s=1, block_h=2048, num_warps=4)):
        ctx = MoeGemmCombine(world, max_tokens=R, top_k=1, hidden=H, experts_per_rank=segs,
                             combine_config=cc, transport="stores")
        phases = ctx.phases(x, w, counts, slots, tw, y)
        t_g = time_op(phases["gemm"], world, graph=True, iters=30)["median_ms"]
        k = phases["gemm_kernel"]
        ptx = k.asm["ptx"]
        import re
        print(f"  grouped GEMM kernel: {k.n_regs} regs, {k.n_spills} spills, shared "
              f"{k.metadata.shared} B; ptx: wgmma {ptx.count('wgmma.mma_async')}, cp.async "
              f"{ptx.count('cp.async')}, ld.global.v4 {len(re.findall(r'ld.global[.a-z0-9]*.v4', ptx))}"
              f", st.global.v4 {len(re.findall(r'st.global[.a-z0-9]*.v4', ptx))}, "
              f"st.global.b16 {len(re.findall(r'st.global.b16', ptx))}", flush=True)
        if cc == CombineConfig():
            open(os.path.join(os.environ.get("OUT", "."), "moe_gemm.ptx"), "w").write(ptx)
        t_c = time_op(phases["combine"], world, graph=True, iters=30)["median_ms"]
        print(f"moe kernels alone: grouped GEMM {t_g:.3f} ms, combine {cc} {t_c:.3f} ms "
              f"({2 * R * H * 2 / t_c / 1e6:.0f} GB/s)", flush=True)
        ctx.close()
    for bm, bn, bk, nw, st, gm in CONFIGS:
        cfg = MatmulConfig(block_m=bm, block_n=bn, block_k=bk, group_m=gm, num_warps=nw,
                           num_stages=st)
        try:
            t_dense = time_op(lambda: persistent_matmul(a, b, out=c, config=cfg), world,
                              graph=True, iters=30)["median_ms"]
        except Exception as e:
            t_dense = float("nan")
            print(f"  dense {cfg} failed: {type(e).__name__}: {str(e)[:120]}")
        ctx = MoeGemmCombine(world, max_tokens=R, top_k=1, hidden=H, experts_per_rank=segs,
                             config=cfg, transport="stores")
        try:
            t_moe = time_op(lambda: ctx(x, w, counts, slots, tw, out=y), world, graph=True,
                            iters=30)["median_ms"]
        except Exception as e:
            t_moe = float("nan")
            print(f"  moe {cfg} failed: {type(e).__name__}: {str(e)[:120]}")
        ctx.close()
        print(f"{bm:4d} {bn:4d} {bk:4d} w{nw} s{st} g{gm}: dense {t_dense:.3f} ms "
              f"({t_cublas / t_dense:.2f} of cuBLAS)  moe {t_moe:.3f} ms "
              f"({t_moe_cublas / t_moe:.2f} of cuBLAS)", flush=True)
        writer.write(op="gemm_core_tuning", shape={"dense": [M, N, K], "moe": [R, I, H, segs]},
                     dtype="bf16", impl="config", graph=True, config=cfg.__dict__,
                     dense_ms=t_dense, dense_cublas_ms=t_cublas, moe_ms=t_moe,
                     moe_cublas_ms=t_moe_cublas)
    return 0


if __name__ == "__main__":
    sys.exit(main())
