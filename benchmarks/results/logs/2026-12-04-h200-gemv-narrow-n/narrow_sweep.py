"""GEMV + AllReduce's kernel on a world of one at narrow N (few 16-column blocks: fewer
programs than SMs), against cuBLAS: does a deeper pipeline per program (more bytes of W in
flight per SM) close the gap where the rule's pick (16 x 512, 3 stages) ran at 0.59-0.63 of
cuBLAS? Graph replay of 20 calls, the median of 30 replays per config, µs per call."""
import statistics

import torch

import portable_overlap as po
from portable_overlap import GemvConfig
from portable_overlap.ops.gemv_allreduce.config import pick_config

world = po.World.from_env()
dev = world.device
facts = world.facts


def timed(fn, reps=20, rounds=30):
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    ts = []
    for _ in range(rounds):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / reps * 1e3)
    return statistics.median(ts)


CONFIGS = [(16, 512, 4, 3, 2), (16, 512, 4, 6, 1), (16, 512, 8, 6, 1), (16, 512, 4, 8, 1),
           (16, 256, 4, 8, 1), (16, 256, 8, 8, 1), (16, 512, 8, 4, 2), (32, 512, 4, 4, 1),
           (32, 256, 8, 6, 1), (16, 128, 4, 8, 2)]
ctx = po.GemvAllReduce(world, 4096, transport="stores")
for M, N, K in ((1, 1024, 8192), (32, 1024, 8192), (1, 2048, 4096), (8, 1024, 4096),
                (1, 1536, 7168)):
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    ref = x.float() @ w.float().t()
    out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(out)
    cub = timed(lambda: torch.mm(x, w.t(), out=y))
    pick = pick_config(M, N, K, torch.bfloat16, facts.arch, facts.sm_count, 1,
                       facts.shared_per_program)
    line = [f"{M}x{N}x{K}: cuBLAS {cub:.1f} us; rule {tuple(pick.__dict__.values())}"]
    for c in CONFIGS:
        cfg = GemvConfig(*c)
        try:
            out.fill_(float("nan"))
            ctx(x, w, out=out, config=cfg)
            torch.cuda.synchronize()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                line.append(f"  {c}: WRONG rel err {err:.2e}")
                continue
            t = timed(lambda: ctx(x, w, out=out, config=cfg))
            line.append(f"  {c}: {t:.1f} us ({cub / t:.2f} of cuBLAS)")
        except Exception as e:
            line.append(f"  {c}: {type(e).__name__}: {str(e)[:80]}")
    print("\n".join(line), flush=True)
ctx.close()
