import sys, time, statistics
import torch
import portable_overlap as po
from portable_overlap.ops import planner as P
from portable_overlap.testing.emulated import EmulatedWorld

NAMES = ("__call__", "_settle_decided", "_refusal", "_agree", "_post", "_collect")

def body(world, n_calls):
    acc = {n: [] for n in NAMES}
    for name in NAMES:
        orig = getattr(P.TransportPlanner, name)
        def wrap(self, *a, __o=orig, __n=name, **k):
            t0 = time.perf_counter()
            try:
                return __o(self, *a, **k)
            finally:
                acc[__n].append(time.perf_counter() - t0)
        setattr(P.TransportPlanner, name, wrap)
    x = torch.randn(1, 128); w = torch.randn(64, 128)
    ctx = po.GemvAllReduce(world, max_n=64, transport="auto", candidates=("sequential",), iters=1, warmup=0)
    ctx(x, w)
    for v in acc.values(): v.clear()
    ts = []
    for _ in range(n_calls):
        world.barrier()
        t0 = time.perf_counter(); ctx(x, w); ts.append(time.perf_counter() - t0)
    ctx.close()
    return {"call": statistics.median(ts) * 1e3, **{k: statistics.median(v) * 1e3 for k, v in acc.items() if v}}

if __name__ == "__main__":
    for W in (2, 8):
        with EmulatedWorld(W) as ew:
            res = ew.run(body, 300)
        for r, o in enumerate(res):
            print(f"W{W} rank {r}: " + ", ".join(f"{k} {v:.3f}" for k, v in o.items()))
