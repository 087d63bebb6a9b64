"""The shared tile-GEMM core (``persistent_matmul``) against cuBLAS across shapes, on one GPU (a
world of one rank): the per-rank GEMMs of tensor-parallel layers at 2-8 ranks, from decode-sized
M to prefill, and odd sizes. For each shape, the library's pick (``matmul.api.shape_config``),
the fused ops' pick where it differs (``default_config``: warps that run with or without
descriptors), fixed alternatives (``TILES``) and cuBLAS, graph replay; prints one line per shape,
each tiling's speed as a fraction of cuBLAS's (above 1: faster), and writes rows to ``--out``.
With ``--fused``, also the fused ops whose GEMM takes these tiles (GEMM + All-to-All, GEMM +
ReduceScatter, AllGather + GEMM over ``"stores"``) on this world of one, at their default
tiling and at one alternative each (``_fused``).

    python -m benchmarks.tune_gemm_shapes --out rows.jsonl --device-kind nvidia-h200 \\
        [--shapes 256x8192x3584,...] [--dtype bf16] [--fused]
"""
from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.harness import time_op
from benchmarks.rows import ResultWriter
import portable_overlap as po
from portable_overlap import World
from portable_overlap.backends import device_facts
from portable_overlap.ops.gemm_alltoall import GemmAllToAll
from portable_overlap.ops.matmul import MatmulConfig, persistent_matmul
from portable_overlap.ops.matmul.api import default_config, shape_config, tile_config

#: (M, N, K): Llama-3-70B's MLP and attention projections per rank at 8 and 4 ranks with 128 to
#: 16384 rows, and odd sizes
SHAPES = ["128x3584x8192", "256x8192x3584", "384x8192x3584", "512x8192x3584",
          "1024x7168x1024", "2048x1024x8192", "4096x3584x8192", "8192x1024x8192",
          "8192x8192x1024", "16384x1024x8192", "8192x3584x8192", "1000x777x4099",
          "3000x5000x700", "128x3584x8191", "256x8192x3583", "2048x1024x8191", "64x1024x4096",
          "200x28672x1024"]
#: the tilings timed beside the library's pick: (block_m, block_n, block_k, warps, stages)
TILES = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4),
         (64, 128, 64, 4, 3), (64, 128, 64, 8, 3), (64, 256, 64, 8, 3)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device-kind", default="unknown")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--fused", action="store_true",
                    help="also time the fused ops whose GEMM takes these tiles (world of one)")
    args = ap.parse_args()
    world = World.from_env()
    dev, dt = world.device, DTYPES[args.dtype]
    writer = ResultWriter(args.out, args.device_kind, 1)
    g = torch.Generator(device=dev).manual_seed(0)
    for spec in args.shapes.split(","):
        M, N, K = (int(v) for v in spec.split("x"))
        a = torch.randn(M, K, generator=g, device=dev).to(dt)
        b = torch.randn(K, N, generator=g, device=dev).to(dt)
        c = torch.empty(M, N, device=dev, dtype=dt)
        ref = torch.matmul(a.float(), b.float())
        t_cublas = time_op(lambda: torch.matmul(a, b, out=c), world, graph=True,
                           iters=args.iters)["median_ms"]
        pick = shape_config(a, b, device_facts(dev))
        fused = default_config(dt, dev, M, N)  # the fused ops' pick: warps for either loads
        tiles = [("pick", pick)] + [("fused_pick", fused)] * (fused != pick) + [
            (f"{bm}x{bn}x{bk}/{w}w{s}s",
             MatmulConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s))
            for bm, bn, bk, w, s in TILES]
        parts = [f"{spec:>16s} cuBLAS {t_cublas * 1e3:7.1f} us"]
        for name, cfg in tiles:
            c.fill_(float("nan"))
            persistent_matmul(a, b, config=cfg, out=c)
            err = float((c.float() - ref).norm() / ref.norm())
            t = time_op(lambda: persistent_matmul(a, b, config=cfg, out=c), world, graph=True,
                        iters=args.iters)["median_ms"]
            label = (f"{name} {cfg.block_m}x{cfg.block_n}/{cfg.num_warps}w{cfg.num_stages}s"
                     if "pick" in name else name)
            parts.append(f"{label} {t_cublas / t:.2f}" + ("" if err < 1e-2 else f" ERR {err:.1e}"))
            writer.write(op="gemm_core_shapes", shape={"M": M, "N": N, "K": K},
                         dtype=args.dtype, impl=name, graph=True, median_ms=t,
                         cublas_ms=t_cublas, config=cfg.__dict__, rel_err=err)
        if args.fused:
            parts += _fused(world, a, b, ref, t_cublas, writer, args)
        print("  ".join(parts), flush=True)
    return 0


def _fused(world, a, b, ref, t_cublas, writer, args) -> list:
    """The fused ops over ``"stores"`` at their default tiling and at one alternative each:
    GEMM + All-to-All and GEMM + ReduceScatter at the pointer loads' warps of the same tiles,
    AllGather + GEMM at the full tile. Each one's speed as a fraction of cuBLAS's."""
    M, K = a.shape
    N = b.shape[1]
    pointers = tile_config(a.dtype, device_facts(a.device), M, N, descriptors=False)
    makers = {
        "gemm_alltoall": lambda cfg: GemmAllToAll(world, max_elems=M * N, config=cfg),
        "matmul_reduce_scatter": lambda cfg: po.MatmulReduceScatter(
            world, M, N, transport="stores", config=cfg),
        "all_gather_matmul": lambda cfg: po.AllGatherMatmul(
            world, max_shard_elems=M * K, transport="stores", config=cfg),
    }
    parts = []
    for op, make in makers.items():
        other = ("full", MatmulConfig()) if op == "all_gather_matmul" else ("pointers", pointers)
        for variant, cfg in (("default", None), other):
            ctx = make(cfg)
            out = torch.full((M, N), float("nan"), device=a.device, dtype=a.dtype)
            try:
                ctx(a, b, out=out)
                torch.cuda.synchronize()
                err = float((out.float() - ref).norm() / ref.norm())
                t = time_op(lambda: ctx(a, b, out=out), world, graph=True,
                            iters=args.iters)["median_ms"]
            finally:
                ctx.close()
            parts.append(f"{op}/{variant} {t_cublas / t:.2f}"
                         + ("" if err < 1e-2 else f" ERR {err:.1e}"))
            writer.write(op="gemm_core_shapes", shape={"M": M, "N": N, "K": K},
                         dtype=args.dtype, impl=f"{op}_{variant}", graph=True, median_ms=t,
                         cublas_ms=t_cublas, config=cfg and cfg.__dict__, rel_err=err)
    return parts


if __name__ == "__main__":
    sys.exit(main())
