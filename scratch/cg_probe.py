import os, sys, traceback
import torch
import torch.distributed as dist
import torch._inductor.config as icfg
icfg.triton.cudagraph_trees_history_recording = True
import portable_overlap as po
from portable_overlap import World

world = World.from_env()
dev, dt = world.device, torch.bfloat16
W = world.world_size
in_f, out_f = 1024 * W, 2048
rows = int(sys.argv[1]) if len(sys.argv) > 1 else 512
mod = po.RowParallelLinear(in_f, out_f, world, dtype=dt, device=dev, max_rows=512)
print("reduce ctx", type(mod.reduce_ctx).__name__, getattr(mod.reduce_ctx, "transport", None), flush=True)
cm = torch.compile(mod, mode="reduce-overhead")
for i in range(5):
    x = torch.randn(rows, 1024, device=dev, dtype=dt)
    try:
        with torch.no_grad():
            y = cm(x).clone()
        print("call", i, "ok", flush=True)
    except Exception as e:
        print("call", i, type(e).__name__, str(e)[:6000], flush=True)
        break
rc = mod.reduce_ctx
for name in ("_decided", "decisions", "_plans", "_contexts", "_candidates"):
    if hasattr(rc, name):
        print(name, getattr(rc, name), flush=True)
print("transport now", getattr(rc, "transport", None), getattr(rc, "_last_transport", None))
