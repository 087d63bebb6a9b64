"""Where the host time of an eager call of ``transport="auto"`` (decided ``"sequential"``)
goes: the planner's methods wrapped with timers, on 2 and 8 emulated ranks, 300 calls each
after a barrier; per-rank medians, ms."""
import statistics
import time

import torch

import portable_overlap as po
from portable_overlap.ops import planner as P
from portable_overlap.testing.emulated import EmulatedWorld

NAMES = ("__call__", "_settle_decided", "_refusal", "_agree", "_post", "_collect")


def _timed(acc, name, orig):
    def wrap(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return orig(self, *a, **k)
        finally:
            acc[name].append(time.perf_counter() - t0)
    return wrap


def body(world, n_calls):
    acc = {n: [] for n in NAMES}
    for name in NAMES:
        setattr(P.TransportPlanner, name, _timed(acc, name, getattr(P.TransportPlanner, name)))
    x, w = torch.randn(1, 128), torch.randn(64, 128)
    ctx = po.GemvAllReduce(world, max_n=64, transport="auto", candidates=("sequential",),
                           iters=1, warmup=0)
    ctx(x, w)
    for v in acc.values():
        v.clear()
    ts = []
    for _ in range(n_calls):
        world.barrier()
        t0 = time.perf_counter()
        ctx(x, w)
        ts.append(time.perf_counter() - t0)
    ctx.close()
    return {"call": statistics.median(ts) * 1e3,
            **{k: statistics.median(v) * 1e3 for k, v in acc.items() if v}}


if __name__ == "__main__":
    for W in (2, 8):
        with EmulatedWorld(W) as ew:
            res = ew.run(body, 300)
        for r, o in enumerate(res):
            print(f"W{W} rank {r}: " + ", ".join(f"{k} {v:.3f}" for k, v in o.items()))
