"""Probe (one GPU): where the time of ``expert_swiglu``'s packed experts goes, at the decode
layouts one rank of an 8-rank layer receives (128 tokens per rank, balanced routing). Times,
bf16, graph replay: the pack launch alone at a few tilings and grids (against torch's copy of
the same rows), and the gated GEMM at three tilings with per-source tiles, with every expert
packed (pack launch + GEMM), and on rows packed beforehand (the GEMM alone, the rows of an
expert contiguous): what the packing saves in the GEMM and what the copy costs. Prints a table.

    torchrun --nproc-per-node 1 -m benchmarks.probe_packed_experts
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton

from benchmarks.harness import time_op
from benchmarks.tune_moe_experts import routing_counts
from portable_overlap import World
from portable_overlap.ops.matmul import MatmulConfig
from portable_overlap.ops.moe_experts import expert_swiglu
from portable_overlap.ops.moe_experts.api import pack_capacity
from portable_overlap.ops.moe_experts.kernel import pack_rows_kernel

#: (S, H, I, E, k, W): the DeepSeek-like and Mixtral-like decode layouts of 8 ranks
LAYOUTS = ((128, 7168, 2048, 16, 8, 8), (128, 4096, 14336, 8, 2, 8))
#: the pack launch's (rows per step, columns per step, programs, warps)
PACK_TILINGS = ((16, 512, 128, 4), (8, 1024, 264, 4), (32, 256, 264, 8), (4, 1024, 528, 4))
#: the GEMM's (block_m, block_n, warps, stages)
GEMM_TILINGS = ((128, 128, 8, 3), (64, 256, 8, 3), (64, 128, 4, 4))


def main() -> int:
    # no option: the parser answers --help and refuses stray arguments before the probe starts
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    world = World.from_env()
    dev = world.device
    for S, H, I, E, k, W in LAYOUTS:
        El = E // W
        counts = routing_counts(S, E, k, W, "balanced", torch.Generator().manual_seed(S + E))
        R = int(counts.sum())
        c = counts.to(dev)
        x = torch.randn(R, H, device=dev).bfloat16()
        wg = (torch.randn(El, H, I, device=dev) * H ** -0.5).bfloat16()
        wu = torch.randn_like(wg)
        out = torch.empty(R, I, device=dev, dtype=torch.bfloat16)
        m = S * k / E
        cap = pack_capacity(R, m, W * El, 64)
        p = torch.empty(cap, H, device=dev, dtype=torch.bfloat16)
        rmap = torch.empty(cap, device=dev, dtype=torch.int32)
        # the rows expert-major (what packing every expert makes), counts as one source
        bounds = [0] + torch.cumsum(counts.flatten().long(), 0).tolist()
        order = [i for e in range(El) for q in range(W)
                 for i in range(bounds[q * El + e], bounds[q * El + e + 1])]
        xp = x[torch.tensor(order, device=dev)].contiguous()
        cp = counts.sum(0, keepdim=True).int().to(dev)
        res = {}
        for br, bh, grid, warps in PACK_TILINGS:
            def pack():
                pack_rows_kernel[(grid,)](x, c, p, rmap, H, W, El, cap, R, x.stride(0), 1,
                                          p.stride(0), BLOCK_M=64, BLOCK_SRC=W,
                                          BLOCK_E=triton.next_power_of_2(El), PACK=2,
                                          BLOCK_R=br, BLOCK_H=bh, num_warps=warps)
            pack()
            torch.cuda.synchronize()
            assert torch.equal(p[:R], xp), "the pack launch put rows elsewhere"
            res[f"pack {br}x{bh}, {grid} programs, {warps} warps"] = time_op(
                pack, world, graph=True, iters=50)["median_ms"]
        res["torch copy of the rows"] = time_op(lambda: p[:R].copy_(x), world, graph=True,
                                                iters=50)["median_ms"]
        for bm, bn, warps, stages in GEMM_TILINGS:
            cfg = MatmulConfig(block_m=bm, block_n=bn, block_k=64, num_warps=warps,
                               num_stages=stages)
            for name, args, gather in (("per-source", (x, c), False), ("packed", (x, c), True),
                                       ("rows packed beforehand", (xp, cp), False)):
                res[f"{bm}x{bn} {name}"] = time_op(
                    lambda: expert_swiglu(args[0], wg, wu, args[1], out, config=cfg,
                                          gather=gather, rows_per_segment=m),
                    world, graph=True, iters=50)["median_ms"]
        print(f"W{W} {S}x{H}x{I}x{E}x{k} R={R} cap={cap}")
        for name, t in res.items():
            print(f"  {name:40s} {t * 1e3:8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
