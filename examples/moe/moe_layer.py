"""An expert-parallel MoE layer (router, top-k, dispatch, expert MLPs, combine) run by the fused
ops on the GPU end to end, checked against the same layer's torch path.

    torchrun --nproc-per-node 2 examples/moe/moe_layer.py       # GPUs: a small layer
    torchrun --nproc-per-node 2 examples/moe/moe_layer.py --shape deepseek --schedule one_launch
    python examples/moe/moe_layer.py                            # no GPUs: emulated ranks, tiny

``--shape``: ``small`` (8192 tokens per rank, hidden 4096, expert width 2048, 8 experts,
top-2), ``deepseek`` (hidden 7168, width 2048, 16 experts, top-8) or ``mixtral`` (hidden 4096,
width 14336, 8 experts, top-2), 8192 tokens per rank. ``--schedule``: the fused layer's
launches, ``staged`` (dispatch, gated GEMM, down GEMM + combine), ``dispatch_gemm`` (the
dispatch fused into the gated GEMM) or ``one_launch`` (the dispatch and both GEMMs in one
launch).

Both layers share their weights; the script prints how far the outputs and the gradients of
one training step (forward + backward; the backward is the staged torch path under either
forward) are apart, and on GPUs each layer's forward and training-step times (CUDA events,
median of 20, plain launches).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from portable_overlap import World
from portable_overlap.cli import int_at_least
from portable_overlap.modules.moe import ExpertParallelMoE
from portable_overlap.testing.compare import worst

SHAPES = {"small": dict(tokens=8192, hidden=4096, inter=2048, experts=8, top_k=2),
          "deepseek": dict(tokens=8192, hidden=7168, inter=2048, experts=16, top_k=8),
          "mixtral": dict(tokens=8192, hidden=4096, inter=14336, experts=8, top_k=2)}
TINY = dict(tokens=12, hidden=32, inter=24, experts=4, top_k=2)
SCHEDULES = {"staged": {}, "dispatch_gemm": {"fuse_dispatch": True},
             "one_launch": {"one_launch": True}}


def run(world, dims, iters, schedule="staged"):
    dev = world.device
    dtype = torch.bfloat16 if dev.type != "cpu" else torch.float32
    fused = ExpertParallelMoE(world, dims["hidden"], dims["inter"], dims["experts"],
                              dims["top_k"], max_tokens=dims["tokens"], dtype=dtype,
                              **SCHEDULES[schedule])
    ref = ExpertParallelMoE(world, dims["hidden"], dims["inter"], dims["experts"],
                            dims["top_k"], max_tokens=dims["tokens"], dtype=dtype, fused=False)
    g = torch.Generator(device=dev).manual_seed(100 + world.rank)
    # ranks hold different numbers of tokens
    S = dims["tokens"] - 3 * world.rank
    tokens = torch.randn(S, dims["hidden"], generator=g, device=dev).to(dtype)
    times = {}
    dout = torch.randn(S, dims["hidden"], generator=g, device=dev).to(dtype)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    def train_step(layer):
        layer.zero_grad(set_to_none=True)
        t = tokens.clone().requires_grad_()
        layer(t).backward(dout)
        return t.grad, layer.w_down.grad, layer.router.grad

    with torch.no_grad():
        y = fused(tokens)
        y_ref = ref(tokens)
        fused.synchronize()
    err = rel(y, y_ref)
    grad_err = worst(rel(a, b) for a, b in zip(train_step(fused), train_step(ref)))
    if dev.type != "cpu":
        for name, layer in (("fused ops", fused), ("torch path", ref)):
            for what, step in (("forward", lambda: layer(tokens)),
                               ("training step", lambda: train_step(layer))):
                ms = []
                for _ in range(iters):
                    a = torch.cuda.Event(enable_timing=True)
                    b = torch.cuda.Event(enable_timing=True)
                    world.barrier()
                    a.record()
                    with torch.set_grad_enabled(what != "forward"):
                        step()
                    b.record()
                    torch.cuda.synchronize()
                    ms.append(a.elapsed_time(b))
                times[f"{name}, {what}"] = statistics.median(ms)
    fused.close()
    errs = world.all_gather_object(worst((err, grad_err)))
    all_times = world.all_gather_object(times)
    return worst(errs), {k: max(t[k] for t in all_times) for k in times}


def report(W, dims, err, times, device, schedule) -> int:
    print(f"MoE layer on {W} ranks ({device}): {dims}, fused schedule {schedule}")
    ok = err < (2e-2 if device != "cpu" else 1e-4)
    print(f"fused layer vs torch path, outputs and gradients: worst relative difference "
          f"{err:.2e} -> {'they agree' if ok else 'THEY DIFFER'}")
    for k, v in times.items():
        print(f"  layer with the {k}: {v:.3f} ms (slowest rank's median)")
    return 0 if ok else 1


def _emulated(world, dims, iters, schedule):
    return run(world, dims, iters, schedule)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int_at_least(1), default=20,
                    help="timed forwards and training steps of each path (GPUs; CPU ranks "
                         "check the paths and time nothing)")
    ap.add_argument("--tiny", action="store_true", help="toy dimensions on GPUs too")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small",
                    help="the layer's dimensions on GPUs (module docstring)")
    ap.add_argument("--schedule", choices=list(SCHEDULES), default="staged",
                    help="the fused layer's launches (module docstring)")
    args = ap.parse_args()
    if "RANK" in os.environ:  # torchrun
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        world = World.from_env()
        dims = TINY if args.tiny or world.device.type == "cpu" else SHAPES[args.shape]
        err, times = run(world, dims, args.iters, args.schedule)
        code = report(world.world_size, dims, err, times, world.device.type, args.schedule) \
            if world.rank == 0 else 0
        torch.distributed.destroy_process_group()
        return code
    from portable_overlap.testing import EmulatedWorld

    with EmulatedWorld(2) as ew:
        err, times = ew.run(_emulated, TINY, args.iters, args.schedule, timeout=600)[0]
    return report(2, TINY, err, times, "cpu", args.schedule)


if __name__ == "__main__":
    sys.exit(main())
