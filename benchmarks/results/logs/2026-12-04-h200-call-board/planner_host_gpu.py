"""Host time per eager call of GEMV + AllReduce on one GPU (a world of one: no agreement),
named transport against ``transport="auto"`` decided for the same transport: the planner's
own per-call Python. 400 calls issued back to back, then one sync; host time per call, and
the device time per call from events around the whole batch. Run under torchrun (1 process)."""
import time

import torch

import portable_overlap as po

world = po.World.from_env()
dev = world.device
M, N, K = 1, 8192, 7168
x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
ref = (x.float() @ w.float().t())
for t in ("stores", "sequential"):
    for kind in ("named", "auto"):
        kw = (dict(transport=t) if kind == "named"
              else dict(transport="auto", candidates=(t,), iters=5, warmup=1))
        ctx = po.GemvAllReduce(world, N, **kw)
        y = ctx(x, w)
        torch.cuda.synchronize()
        err = ((y.float() - ref).norm() / ref.norm()).item()
        best = []
        for rnd in range(7):
            n = 400  # fewer than the launch queue holds: the host never waits for it
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
        print(f"{t:>10} {kind:>5}: host {host:6.1f} us/call, device {device:6.1f} us/call, "
              f"rel err {err:.1e}")
        ctx.close()
