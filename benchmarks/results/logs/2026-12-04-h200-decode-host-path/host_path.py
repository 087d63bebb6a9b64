"""Host time per eager call of GEMV + AllReduce on one GPU (a world of one), by transport:
named ``stores`` / ``one_shot`` / ``sequential``, and ``"auto"`` decided for ``stores``. 400
calls issued back to back (fewer than the launch queue holds, so the host never waits for the
device), then one sync; host time per call and the device time per call from events around
the batch, the fastest of 7 batches. Prints one line per (shape, transport); run under
torchrun (1 process) with the tree to time on PYTHONPATH; ``argv[1]`` labels the lines."""
import sys
import time

import torch

import portable_overlap as po

label = sys.argv[1] if len(sys.argv) > 1 else "tree"
world = po.World.from_env()
dev = world.device
for M, N, K in ((1, 8192, 7168), (1, 8192, 1024), (8, 4096, 1792)):
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    ref = x.float() @ w.float().t()
    for t, kind in (("stores", "named"), ("one_shot", "named"), ("sequential", "named"),
                    ("stores", "auto")):
        kw = (dict(transport=t) if kind == "named"
              else dict(transport="auto", candidates=(t,), iters=5, warmup=1))
        ctx = po.GemvAllReduce(world, N, **kw)
        y = ctx(x, w)
        torch.cuda.synchronize()
        err = ((y.float() - ref).norm() / ref.norm()).item()
        best = []
        for rnd in range(7):
            n = 400
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            e0.record()
            t0 = time.perf_counter()
            for _ in range(n):
                ctx(x, w)
            t1 = time.perf_counter()
            e1.record()
            torch.cuda.synchronize()
            best.append(((t1 - t0) / n * 1e6, e0.elapsed_time(e1) / n * 1e3))
        host, device = min(best)
        print(f"{label:>4} {M}x{N}x{K:<5} {t:>10} {kind:>5}: host {host:6.1f} us/call, "
              f"device {device:6.1f} us/call, rel err {err:.1e}", flush=True)
        ctx.close()
