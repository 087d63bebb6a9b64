"""Probe (one GPU): what sets the time of ``expert_swiglu`` at decode sizes, against cuBLAS on
the equivalent dense problem. For the DeepSeek-like layouts one rank of a 2- and an 8-rank
layer receives (128 tokens per rank, top-8 of 16 experts, H 7168, I 2048, balanced routing) it
times (CUDA-graph replay, median) and then launches once each, between
``torch.cuda.profiler.start()`` / ``stop()`` so that Nsight Compute sees only those launches:

- the gated GEMM as the op runs it by default, and with fixed tiles per source;
- every expert packed (the pack launch, then the GEMM on full row tiles);
- the same kernel on the dense problem (all rows one segment of one expert: the grouping and
  the ragged segments taken away, the tiles kept);
- each of the three with the last round's tiles split (the default) and with whole K loops;
- cuBLAS's two GEMMs (gate, up) over all the rows, one weight.

Run plainly for the times, under ``ncu --profile-from-start off`` for the counters; the cases
print in launch order (the kernels ncu reports follow it)::

    python -m benchmarks.profile_decode_experts
    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \\
        python -m benchmarks.profile_decode_experts --once
"""
from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench_cudagraph

from benchmarks.tune_moe_experts import routing_counts
from portable_overlap.ops.matmul import MatmulConfig
from portable_overlap.ops.moe_experts import expert_swiglu

#: (S, H, I, E, k, W)
LAYOUTS = ((128, 7168, 2048, 16, 8, 8), (128, 7168, 2048, 16, 8, 2))
#: (block_m, block_n, warps, stages)
TILES = ((64, 128, 4, 4), (128, 128, 8, 3))


def cases(S, H, I, E, k, W, dev):  # noqa: E741
    """``[(name, fn)]`` for one layout, inputs made and outputs checked against torch."""
    El = E // W
    counts = routing_counts(S, E, k, W, "balanced", torch.Generator().manual_seed(S + E))
    R = int(counts.sum())
    g = torch.Generator(device=dev).manual_seed(R)
    x = torch.randn(R, H, generator=g, device=dev).bfloat16()
    wg = (torch.randn(El, H, I, generator=g, device=dev) * H ** -0.5).bfloat16()
    wu = (torch.randn(El, H, I, generator=g, device=dev) * H ** -0.5).bfloat16()
    c = counts.to(dev)
    out = torch.empty(R, I, device=dev, dtype=torch.bfloat16)
    bounds = [0] + torch.cumsum(counts.flatten().long(), 0).tolist()
    ref = torch.empty_like(out)
    for s in range(counts.numel()):
        e = s % El
        xs = x[bounds[s]:bounds[s + 1]].float()
        ref[bounds[s]:bounds[s + 1]] = (torch.nn.functional.silu(xs @ wg[e].float())
                                        * (xs @ wu[e].float())).bfloat16()
    one = torch.tensor([[R]], dtype=torch.int32, device=dev)
    gu, hh = torch.empty_like(out), torch.empty_like(out)
    res = [(f"W{W} default", lambda: expert_swiglu(x, wg, wu, c, out, rows_per_segment=S * k / E),
            True)]
    for bm, bn, warps, stages in TILES:
        cfg = MatmulConfig(block_m=bm, block_n=bn, block_k=64, num_warps=warps,
                           num_stages=stages)
        tag = f"{bm}x{bn}/{warps}w{stages}s"
        for split in (True, False):
            whole = "" if split else ", whole K"
            res += [(f"W{W} {tag} per source{whole}",
                     lambda cfg=cfg, split=split: expert_swiglu(x, wg, wu, c, out, config=cfg,
                                                                gather=False, split=split), True),
                    (f"W{W} {tag} packed{whole}",
                     lambda cfg=cfg, split=split: expert_swiglu(x, wg, wu, c, out, config=cfg,
                                                                gather=True, split=split), True),
                    (f"W{W} {tag} dense (one segment){whole}",
                     lambda cfg=cfg, split=split: expert_swiglu(x, wg[:1], wu[:1], one, out,
                                                                config=cfg, gather=False,
                                                                split=split), False)]

    def dense():
        torch.matmul(x, wg[0], out=gu)
        torch.matmul(x, wu[0], out=hh)
    res.append((f"W{W} cuBLAS dense gate+up", dense, False))
    checked = []
    for name, fn, check in res:
        out.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        if check:
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            assert err < 1e-2, f"{name}: relative error {err:.1e}"
        checked.append((name, fn, R))
    return checked


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--once", action="store_true",
                    help="launch each case once inside the profiler's range, no timing")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    todo = [cs for lay in LAYOUTS for cs in cases(*lay, dev)]
    if args.once:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for i, (name, fn, _) in enumerate(todo):
            print(f"case {i}: {name}", flush=True)
            fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return 0
    for name, fn, R in todo:
        ms = do_bench_cudagraph(fn, rep=200, return_mode="median")
        print(f"{name:40s} R={R:5d} {ms * 1e3:8.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
