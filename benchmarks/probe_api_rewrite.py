"""Probe: do the ``"stores"`` kernels written on the public device API (``portable_overlap.
language``) run as fast as the kernels they replaced, on several ranks?

The script uses only what both versions of the package have (``World.from_env``,
``AllGatherMatmul`` / ``MatmulReduceScatter`` with ``transport="stores"``, ``GemvAllReduce``),
so it runs unchanged against a tree from before the rewrite: put that tree first on
``PYTHONPATH`` and give it a ``--label``. Run the trees alternately (before, after, before,
after) so that the GPUs' clock drift falls on both::

    git archive <commit> portable_overlap | tar -x -C /tmp/before
    PYTHONPATH=/tmp/before torchrun --nproc-per-node 2 benchmarks/probe_api_rewrite.py \\
        --label before --out DIR
    PYTHONPATH=$PWD torchrun --nproc-per-node 2 benchmarks/probe_api_rewrite.py \\
        --label after --out DIR
    python benchmarks/probe_api_rewrite.py --table DIR     # medians per label, side by side

Each call is checked against torch (all_gather / reduce_scatter / all_reduce of the torch
product), into an output filled with NaN, before it is timed. Timing: one CUDA graph of one
call, ``--iters`` replays (four times as many for the GEMV), each between two events after an
all-reduce of one word on the stream (the ranks' streams leave it together, so a rank's time
holds no wait for a peer that started late), the stream held while the host queues ten of them
(as ``portable_overlap.schedule.tuning.queue_ahead`` does, which a tree from before may lack);
the slowest rank's median.
Shapes are the ops' benchmark shapes (M, N, K of the whole product, split as the op splits
them); GEMV + AllReduce at M = 1, 8, 32, N = 8192, K = 28672 split over the ranks.
Appends one JSON line per (op, shape) to DIR/probe_api_rewrite.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

# the package's own comparison (in trees from before the rewrite too): relative Frobenius
# error, inf where the output holds a NaN (a tile not written)
from portable_overlap import collectives
from portable_overlap.testing.compare import rel_err

GEMM_SHAPES = ((8192, 8192, 8192), (16384, 8192, 8192), (8192, 28672, 8192))
GEMV_SHAPES = ((1, 8192, 28672), (8, 8192, 28672), (32, 8192, 28672))
#: timed runs queued behind one hold of the stream, and the hold (about 2 ms of spinning)
AHEAD, HOLD_CYCLES = 10, 4_000_000


def slowest_median(world, fn, iters: int, warmup: int = 5) -> float:
    """The slowest rank's median time (ms) of one graph replay of ``fn``."""
    dist = torch.distributed
    word = torch.zeros(1, device=world.device)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(warmup):
        g.replay()
    times = []
    for block in range(0, iters, AHEAD):
        # the stream held (a spinning kernel) while the host queues the block: each run starts
        # when the barrier ends on its GPU, not when its host gets there (a GEMV + AllReduce
        # timed 0.07 or 0.10 ms from one process to the next with a host sync per run)
        torch.cuda._sleep(HOLD_CYCLES)
        events = []
        for _ in range(min(AHEAD, iters - block)):
            dist.all_reduce(word)  # the stream barrier
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            events.append((a, b))
        torch.cuda.synchronize()
        times += [a.elapsed_time(b) for a, b in events]
    med = torch.tensor([statistics.median(times)], device=world.device)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return med.item()


def gemm_cases(world):
    """(op, shape, call, reference) of AllGather + GEMM and GEMM + ReduceScatter."""
    from portable_overlap import AllGatherMatmul, MatmulReduceScatter

    dev, W, r = world.device, world.world_size, world.rank
    bf = torch.bfloat16
    for M, N, K in GEMM_SHAPES:
        g = torch.Generator(dev).manual_seed(1 + r)
        a = torch.randn(M // W, K, device=dev, generator=g).to(bf)  # rows of this rank
        b = (torch.randn(K, N // W, device=dev, generator=g) / K ** 0.5).to(bf)  # its columns
        full = torch.empty(M, K, device=dev, dtype=bf)
        collectives.all_gather(full, a)
        ctx = AllGatherMatmul(world, (M // W) * K, transport="stores")
        yield ("all_gather_matmul", (M, N, K), ctx,
               lambda out=None, c=ctx, a=a, b=b: c(a, b, out=out), full @ b)
        ctx.close()
    for M, N, K in GEMM_SHAPES:
        g = torch.Generator(dev).manual_seed(11 + r)
        a = torch.randn(M, K // W, device=dev, generator=g).to(bf)  # this rank's K slice
        b = (torch.randn(K // W, N, device=dev, generator=g) / K ** 0.5).to(bf)
        part = (a.float() @ b.float()).to(bf)
        ref = torch.empty(M // W, N, device=dev, dtype=bf)
        collectives.reduce_scatter(ref, part)
        ctx = MatmulReduceScatter(world, M, N, transport="stores")
        yield ("matmul_reduce_scatter", (M, N, K), ctx,
               lambda out=None, c=ctx, a=a, b=b: c(a, b, out=out), ref)
        ctx.close()


def gemv_cases(world):
    from portable_overlap import GemvAllReduce

    dev, W, r = world.device, world.world_size, world.rank
    bf = torch.bfloat16
    for M, N, K in GEMV_SHAPES:
        g = torch.Generator(dev).manual_seed(21 + r)
        x = torch.randn(M, K // W, device=dev, generator=g).to(bf)
        w = (torch.randn(N, K // W, device=dev, generator=g) / K ** 0.5).to(bf)
        ref = x.float() @ w.float().T
        torch.distributed.all_reduce(ref)
        ctx = GemvAllReduce(world, N, transport="stores")
        yield ("gemv_all_reduce", (M, N, K), ctx,
               lambda out=None, c=ctx, x=x, w=w: c(x, w, out=out), ref)
        ctx.close()


def run(args) -> int:
    from portable_overlap import World

    world = World.from_env()
    rows = []
    try:
        for cases in (gemm_cases, gemv_cases):
            for op, (M, N, K), ctx, call, ref in cases(world):
                poisoned = torch.full(ref.shape, float("nan"), device=world.device,
                                      dtype=torch.bfloat16)
                err = rel_err(call(poisoned), ref)  # NaN where a tile was not written
                ctx.synchronize()
                ok = torch.tensor([1.0 if err < 2e-2 else 0.0], device=world.device)
                torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
                iters = args.iters * (4 if op == "gemv_all_reduce" else 1)
                ms = slowest_median(world, call, iters) if ok.item() else None
                rows.append({"op": op, "shape": {"M": M, "N": N, "K": K}, "label": args.label,
                             "world": world.world_size, "median_ms": ms, "rel_err": err,
                             "correct": bool(ok.item())})
                if world.rank == 0:
                    print(f"{args.label:>8} {op:>22} {M}x{N}x{K}: "
                          + (f"{ms:.4f} ms" if ms else "WRONG") + f" (rel err {err:.1e})",
                          flush=True)
        if world.rank == 0:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "probe_api_rewrite.jsonl"), "a") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0 if all(r["correct"] for r in rows) else 1


def table(folder: str) -> str:
    """Per (op, shape): each label's runs (ms), labels in the order they first ran, and the
    first label's median over the last's (above 1: the last is faster)."""
    runs = {}
    for line in open(os.path.join(folder, "probe_api_rewrite.jsonl")):
        r = json.loads(line)
        key = (r["op"], "x".join(str(v) for v in r["shape"].values()))
        runs.setdefault(key, {}).setdefault(r["label"], []).append(r["median_ms"])
    labels = list(dict.fromkeys(lab for per in runs.values() for lab in per))
    out = [" | ".join(["op", "M x N x K", *labels, f"{labels[0]} / {labels[-1]}"])]
    for (op, shape), per in runs.items():
        meds = [statistics.median(per[lab]) if lab in per and None not in per[lab] else None
                for lab in labels]
        cells = [", ".join(f"{t:.4f}" for t in per.get(lab, []) if t) for lab in labels]
        ratio = f"{meds[0] / meds[-1]:.3f}" if None not in meds else "-"
        out.append(" | ".join([op, shape, *cells, ratio]))
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for probe_api_rewrite.jsonl")
    p.add_argument("--label", default="after", help="the tree's name in the rows")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--table", metavar="DIR", help="print the table of DIR's rows and stop")
    args = p.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    if not args.out:
        p.error("--out is required")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
