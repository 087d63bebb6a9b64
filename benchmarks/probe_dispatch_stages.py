"""Probe (2 or more GPUs): where the MoE dispatch's time goes, launch by launch, with and without
``dedup``. Each call's launches (routing count + counts exchange, then the scatter, which with
``dedup`` also copies the received rows to their places) are bracketed by CUDA events, every
call after a stream barrier (plain launches; the slowest rank's median of each stage). A
stage's time includes its waits for the peers (the exchange's counts, the scatter's flags), so
the scatter's is the transfer.

With ``--graph`` it times, as CUDA-graph replays (the benchmarks' protocol,
``benchmarks.harness.time_op``), the call's launches and the subsets that leave one out:
``all`` (count, exchange, scatter), ``no_count`` (exchange and scatter: the count's histograms
are the previous call's, right for the same routing, which is checked after), ``routing`` (count
and exchange) and ``exchange``; a launch's share of the call is what leaving it out saves
(``all - no_count`` the count's, ``all - routing`` the scatter's).
Prints a table; rows to --out as JSON lines (op ``moe_dispatch_stages``).

    torchrun --nproc-per-node 2 -m benchmarks.probe_dispatch_stages --out probe.jsonl \\
        --device-kind nvidia-h200-x2 [--shapes 8192x7168x16x8,128x7168x16x8] [--graph]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from benchmarks.bench_moe_combine import route
from benchmarks.harness import time_op
from benchmarks.rows import ResultWriter
from portable_overlap import World
from portable_overlap.ops.moe_dispatch import MoeDispatch, moe_dispatch_reference

STAGES = ("routing", "scatter")
#: --graph: the launches each timed subset runs (indices into count, exchange, scatter)
SUBSETS = {"all": (0, 1, 2), "no_count": (1, 2), "routing": (0, 1), "exchange": (1,)}


def stage_times(world, ctx, tokens, ids, iters: int, warmup: int) -> dict:
    """{stage: this rank's median ms} over ``iters`` calls after ``warmup``."""
    launches = ctx._launches(tokens, ids)
    groups = [launches[:2], launches[2:]]  # routing, scatter
    times = {s: [] for s in STAGES}
    for it in range(warmup + iters):
        world.stream_barrier()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(groups) + 1)]
        ev[0].record()
        for g, group in enumerate(groups):
            for launch in group:
                launch()
            ev[g + 1].record()
        torch.cuda.synchronize()
        if it >= warmup:
            for g, s in enumerate(STAGES):
                times[s].append(ev[g].elapsed_time(ev[g + 1]))
    ctx.check()
    return {s: statistics.median(v) for s, v in times.items()}


def subset_times(world, ctx, tokens, ids, ref, iters: int) -> dict:
    """{subset: the slowest rank's median ms} of each of ``SUBSETS`` replayed from a CUDA
    graph; raises if a full call after them gives other rows than ``ref``."""
    launches = ctx._launches(tokens, ids)
    out = {}
    for name, picks in SUBSETS.items():
        def run(picks=picks):
            for i in picks:
                launches[i]()
        out[name] = time_op(run, world, graph=True, iters=iters, warmup=5)["median_ms"]
    x, counts, _ = ctx(tokens, ids)
    ctx.synchronize()
    R = ref[0].shape[0]
    if not (torch.equal(counts, ref[1]) and torch.equal(x[:R], ref[0])):
        raise RuntimeError("wrong rows after the subsets' replays")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device-kind", default="unknown")
    ap.add_argument("--shapes", default="8192x7168x16x8,128x7168x16x8",
                    help="S x H x E (experts in all) x k, comma-separated")
    ap.add_argument("--routings", default="balanced,zipf")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--graph", action="store_true",
                    help="time the launch subsets as graph replays (module docstring)")
    ap.add_argument("--scatter-programs-per-sm", default="1",
                    help="comma list: the scatter's programs per SM, each timed (with dedup)")
    args = ap.parse_args()
    world = World.from_env()
    dev, W, r = world.device, world.world_size, world.rank
    writer = ResultWriter(args.out, args.device_kind, W)
    for spec in args.shapes.split(","):
        S, H, E, k = (int(v) for v in spec.split("x"))
        El = E // W
        pps = [int(v) for v in args.scatter_programs_per_sm.split(",")]
        for dedup, per_sm in [(False, 1)] + [(True, n) for n in pps]:
            front = MoeDispatch(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El,
                                transport="stores", dedup=dedup)
            ctx = front.kernel()  # the "stores" workspace, whose launches are timed one by one
            ctx._scatter_programs_per_sm = per_sm  # (before the first call plans)
            try:
                for kind in args.routings.split(","):
                    gen = torch.Generator(device=dev).manual_seed(7 + r)
                    tokens = torch.randn(S, H, generator=gen, device=dev).bfloat16()
                    ids = route(kind, S, E, k, gen, dev)
                    ref = moe_dispatch_reference(tokens, ids, El, world.group)
                    x, counts, slots = ctx(tokens, ids)
                    R = ref[0].shape[0]
                    ctx.synchronize()
                    if not (torch.equal(counts, ref[1]) and torch.equal(x[:R], ref[0])):
                        raise RuntimeError(f"{spec} {kind} dedup={dedup}: wrong rows")
                    if args.graph:
                        t = subset_times(world, ctx, tokens, ids, ref, args.iters)
                        if r == 0:
                            print(f"{spec} {kind:8s} dedup={dedup!s:5s} graph " + "  ".join(
                                f"{s} {v:.4f}" for s, v in t.items()) + "  ms", flush=True)
                            shape = {"S": S, "H": H, "E": E, "k": k, "routing": kind}
                            for s, v in t.items():
                                writer.write(op="moe_dispatch_stages", shape=shape,
                                             dtype="bf16", graph=True, median_ms=v, p10_ms=None,
                                             p90_ms=None, barrier="device",
                                             impl=f"{'dedup' if dedup else 'row_per_expert'}"
                                                  f":{s}", scatter_programs_per_sm=per_sm)
                        continue
                    mine = stage_times(world, ctx, tokens, ids, args.iters, args.warmup)
                    slowest = {s: max(m[s] for m in world.all_gather_object(mine))
                               for s in STAGES}
                    if r == 0:
                        print(f"{spec} {kind:8s} dedup={dedup!s:5s} scatter x{per_sm} " + "  ".join(
                            f"{s} {slowest[s]:.3f}" for s in STAGES) +
                            f"  sum {sum(slowest.values()):.3f} ms", flush=True)
                        shape = {"S": S, "H": H, "E": E, "k": k, "routing": kind}
                        for s in STAGES:
                            writer.write(op="moe_dispatch_stages", shape=shape, dtype="bf16",
                                         impl=f"{'dedup' if dedup else 'row_per_expert'}:{s}",
                                         scatter_programs_per_sm=per_sm,
                                         graph=False, median_ms=slowest[s], p10_ms=None,
                                         p90_ms=None, barrier="device")
            finally:
                front.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
