"""The pieces of a named GEMV + AllReduce call's host path on one GPU: cProfile of 3000 eager
calls (``stores``, 8 x 4096 x 1792 bf16, a world of one), and the per-call cost of single
steps timed alone (100000 times each, the fastest of 5 runs, µs)."""
import cProfile
import io
import pstats
import time

import torch

import portable_overlap as po

world = po.World.from_env()
dev = world.device
M, N, K = 8, 4096, 1792
x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
ctx = po.GemvAllReduce(world, N, transport="stores")
ctx(x, w)
torch.cuda.synchronize()
pr = cProfile.Profile()
pr.enable()
for i in range(3000):
    ctx(x, w)
    if i % 400 == 399:
        torch.cuda.synchronize()
pr.disable()
torch.cuda.synchronize()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
print(s.getvalue())


def per_call(fn, n=100000):
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


steps = {
    "torch.empty((M, N), dtype, device)": lambda: torch.empty((M, N), dtype=x.dtype,
                                                              device=x.device),
    "x.new_empty((M, N))": lambda: x.new_empty((M, N)),
    "x.device": lambda: x.device,
    "x.get_device()": lambda: x.get_device(),
    "x.data_ptr()": lambda: x.data_ptr(),
    "x.stride(0)": lambda: x.stride(0),
    "x.is_contiguous()": lambda: x.is_contiguous(),
    "x.shape unpack": lambda: x.shape[0],
    "current raw stream": lambda: torch._C._cuda_getCurrentRawStream(dev.index),
}
for name, fn in steps.items():
    print(f"{name:>40}: {per_call(fn):.3f} us")
ctx.close()
