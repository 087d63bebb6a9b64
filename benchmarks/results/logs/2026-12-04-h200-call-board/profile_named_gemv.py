"""cProfile of 3000 eager calls of GEMV + AllReduce over ``"stores"`` on one GPU (a world of
one), the 25 functions with the most own time: where the host's time per call goes. Run under
torchrun (1 process)."""
import cProfile
import pstats

import torch

import portable_overlap as po

world = po.World.from_env()
x = torch.randn(1, 7168, device=world.device, dtype=torch.bfloat16)
w = torch.randn(8192, 7168, device=world.device, dtype=torch.bfloat16)
for kw in (dict(transport="stores"), dict(transport="auto", candidates=("stores",), iters=5,
                                          warmup=1)):
    ctx = po.GemvAllReduce(world, 8192, **kw)
    for _ in range(100):
        ctx(x, w)
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(3000):
        ctx(x, w)
    pr.disable()
    torch.cuda.synchronize()
    print(f"=== {kw['transport']}")
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    ctx.close()
