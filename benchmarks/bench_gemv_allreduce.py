"""Benchmark of fused GEMV + AllReduce against cuBLAS + NCCL and torch's symmetric-memory
one-shot all-reduce, by the protocol in benchmarks/harness.py. Run under torchrun:

    torchrun --nproc-per-node 2 benchmarks/bench_gemv_allreduce.py --out results.jsonl \
        --device-kind nvidia-h200-x2 [--tune]

Shapes are (M, N, K) with K split over the ranks (each rank holds K / world columns of W).
``--tune`` first sweeps launch configurations of the fused kernel per shape (graph replay) and
uses the fastest; every rank uses rank 0's pick.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from benchmarks.harness import ResultWriter, hbm_read_bandwidth, time_op
from portable_overlap import GemvAllReduce, GemvConfig, World, gemv_all_reduce_reference
from portable_overlap.ops.gemv_allreduce.config import pick_config

SHAPES = [(1, 8192, 28672), (8, 8192, 28672), (32, 8192, 28672), (1, 16384, 53248),
          (8, 4096, 14336)]
OP = "gemv_allreduce"


#: (block_n, block_k, num_stages, programs_per_sm): a spread of W-tile sizes and loads in flight
#: per SM (16 to 128 KB), each with as many programs per SM as its shared memory allows
SWEEP = [(16, 256, 4, 2), (16, 512, 3, 2), (32, 128, 6, 2), (32, 256, 4, 2), (32, 256, 6, 1),
         (64, 128, 4, 2), (64, 128, 6, 1), (64, 256, 4, 1), (128, 64, 6, 1), (128, 128, 4, 1)]


def sweep_configs():
    for bn, bk, st, ppsm in SWEEP:
        yield GemvConfig(block_n=bn, block_k=bk, num_warps=4, num_stages=st, programs_per_sm=ppsm)


def tune(world, ctx, x, w, out, log) -> GemvConfig:
    best = None
    for cfg in sweep_configs():
        try:
            t = time_op(lambda: ctx(x, w, out=out, config=cfg), world, graph=True, iters=30,
                        warmup=5)["median_ms"]
        except Exception as e:  # a config that does not fit (shared memory) is skipped
            t = float("inf")
            if world.rank == 0:
                print(f"  config {cfg} failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
        log.append({"config": cfg.__dict__, "median_ms": t})
        if best is None or t < best[0]:
            best = (t, cfg)
    return world.broadcast_object(best[1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device-kind", default="unknown")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--shapes", default="")
    args = ap.parse_args()
    world = World.from_env()
    dev = world.device
    W = world.world_size
    writer = ResultWriter(args.out, args.device_kind, W)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",") if s] or SHAPES

    bw = hbm_read_bandwidth(dev)
    bws = world.all_gather_object(bw)
    if world.rank == 0:
        writer.write(op="hbm_read", read_bandwidth_gbs=round(min(bws), 1),
                     per_rank_gbs=[round(b, 1) for b in bws], method="torch.sum over 2 GiB bf16")

    ctx = GemvAllReduce(world, max_n=max(n for _, n, _ in shapes))
    # The fused kernel on a world of one rank: its GEMV streaming without any communication,
    # which separates the kernel's own bandwidth from what the all-reduce costs it.
    solo_groups = [dist.new_group([r]) for r in range(W)]
    solo = World.from_process_group(group=solo_groups[world.rank], device=dev)
    solo_ctx = GemvAllReduce(solo, max_n=max(n for _, n, _ in shapes))
    group_name = dist.group.WORLD.group_name
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        symm_mem = None
    table = []
    gen = torch.Generator(device=dev).manual_seed(world.rank)
    for M, N, K in shapes:
        Kl = K // W
        shape = {"M": M, "N": N, "K": K, "K_local": Kl}
        x = torch.randn(M, Kl, generator=gen, device=dev, dtype=torch.float32).bfloat16()
        w = torch.randn(N, Kl, generator=gen, device=dev, dtype=torch.float32).bfloat16()
        out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        floor_ms = N * Kl * 2 / (min(bws) * 1e9) * 1e3

        cfg = None
        if args.tune:
            log = []
            cfg = tune(world, ctx, x, w, out, log)
            if world.rank == 0:
                writer.write(op=OP + "_tuning", shape=shape, dtype="bf16", best=cfg.__dict__,
                             sweep=log)
        # correctness in the same run, before timing
        out.fill_(float("nan"))
        try:
            ctx(x, w, out=out, config=cfg)
            ctx.synchronize()
            ref = gemv_all_reduce_reference(x, w, world.group)
            err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        except Exception as e:
            print(f"rank {world.rank}: fused failed at {M}x{N}x{K}: {type(e).__name__}: "
                  f"{str(e)[-300:]}", flush=True)
            err = float("inf")
        correct = bool(err < 1e-2)

        facts = world.facts
        plan_cfg = cfg or pick_config(M, N, Kl, torch.bfloat16, facts.arch, facts.sm_count, W)
        impls = {
            "fused": lambda: ctx(x, w, out=out, config=cfg),
            "fused_nocomm": lambda: solo_ctx(x, w, out=y, config=plan_cfg),
            "sequential": lambda: dist.all_reduce(torch.mm(x, w.t(), out=y)),
            "compute": lambda: torch.mm(x, w.t(), out=y),
            "comm": lambda: dist.all_reduce(y),
        }
        if symm_mem is not None:
            try:
                ys = symm_mem.empty((M, N), dtype=torch.bfloat16, device=dev)
                symm_mem.rendezvous(ys, group_name)

                def torch_fused():
                    torch.mm(x, w.t(), out=ys)
                    return torch.ops.symm_mem.one_shot_all_reduce(ys, "sum", group_name)

                impls["torch_fused"] = torch_fused
            except Exception as e:
                if world.rank == 0:
                    print(f"torch symmetric memory unavailable: {e}", flush=True)
        row = {"shape": f"{M}x{N}x{K}", "floor": floor_ms, "err": err}
        for graph in (False, True):
            for name, fn in impls.items():
                try:
                    r = time_op(fn, world, graph=graph, iters=args.iters)
                except Exception as e:
                    if world.rank == 0:
                        print(f"{name} graph={graph} failed: {type(e).__name__}: {e}", flush=True)
                    continue
                row[(name, graph)] = r["median_ms"]
                if world.rank == 0:
                    writer.write(op=OP, shape=shape, dtype="bf16", impl=name, graph=graph,
                                 floor_ms=round(floor_ms, 5), correct=correct if name == "fused"
                                 else None, rel_err=err if name == "fused" else None,
                                 **{k: round(v, 5) for k, v in r.items()},
                                 **({"config": cfg.__dict__} if (name == "fused" and cfg) else {}))
        table.append(row)
        if world.rank == 0:
            for graph in (False, True):
                t = {n: row.get((n, graph)) for n in impls}
                if None in (t["fused"], t["sequential"], t["compute"], t["comm"]):
                    continue
                ideal = max(t["compute"], t["comm"])
                writer.write(op=OP + "_summary", shape=shape, dtype="bf16", graph=graph,
                             floor_ms=round(floor_ms, 5), ideal_ms=round(ideal, 5),
                             fused_ms=round(t["fused"], 5), sequential_ms=round(t["sequential"], 5),
                             speedup=round(t["sequential"] / t["fused"], 3),
                             # undefined when the sequential run was not slower than the ideal
                             fraction_of_ideal=round((t["sequential"] - t["fused"])
                                                     / (t["sequential"] - ideal), 3)
                             if t["sequential"] > ideal else None,
                             fused_over_floor=round(t["fused"] / floor_ms, 3))
    ctx.close()
    solo_ctx.close()
    if world.rank == 0:
        print(f"\nHBM read bandwidth {min(bws):.0f} GB/s; times in microseconds, slowest rank's "
              f"median; floor = per-rank W bytes / HBM read bandwidth")
        hdr = (f"{'M x N x K':>16} {'floor':>7} {'fused':>7} {'nocomm':>7} {'seq':>7} {'torch':>7} "
               f"{'fused/fl':>8} {'speedup':>7} | {'fusedP':>7} {'seqP':>7} {'spdP':>5} {'ok':>3}")
        print(hdr)
        for r in table:
            g = lambda n, gr: r.get((n, gr), float("nan")) * 1e3
            print(f"{r['shape']:>16} {r['floor'] * 1e3:7.1f} {g('fused', True):7.1f} "
                  f"{g('fused_nocomm', True):7.1f} "
                  f"{g('sequential', True):7.1f} {g('torch_fused', True):7.1f} "
                  f"{g('fused', True) / (r['floor'] * 1e3):8.2f} "
                  f"{g('sequential', True) / g('fused', True):7.2f} | {g('fused', False):7.1f} "
                  f"{g('sequential', False):7.1f} {g('sequential', False) / g('fused', False):5.2f} "
                  f"{'yes' if r['err'] < 1e-2 else 'NO':>3}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
