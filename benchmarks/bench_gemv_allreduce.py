"""Benchmark of fused GEMV + AllReduce against cuBLAS + NCCL and torch's symmetric-memory
one-shot all-reduce, by the protocol in benchmarks/harness.py. Run under torchrun:

    torchrun --nproc-per-node 2 -m benchmarks.bench_gemv_allreduce --out results.jsonl \
        --device-kind nvidia-h200-x2 [--tune]

Shapes are (M, N, K) with K split over the ranks (each rank holds K / world columns of W).
``--tune`` first sweeps launch configurations of the fused kernel per shape (graph replay) and
uses the fastest; every rank uses rank 0's pick. Impls: ``fused`` (the default two-shot
``"stores"`` transport), ``fused_one_shot`` (``transport="one_shot"``), ``fused_nocomm`` (the fused
kernel on a world of one rank: its GEMV streaming without any communication), ``auto``
(``transport="auto"``, called without ``out`` as torch's op is; the row's ``pick``: the
transport it chose for plain and for captured calls), ``sequential``
(torch.mm then NCCL all_reduce), ``compute``, ``comm``, ``torch_fused`` (torch.mm into symmetric
memory, then torch's one_shot_all_reduce). ``floor_ms`` = per-rank W bytes / HBM read bandwidth.
The shared options (shapes, dtypes, worlds, graph modes, checks) are in benchmarks/cli.py.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from benchmarks.cli import BenchParser
from benchmarks.harness import hbm_read_bandwidth
from benchmarks.runner import Case, auto_contexts, auto_fields, rel_err, run_main, torch_dtype
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


def tune(bench, ctx, x, w, out, log) -> GemvConfig:
    """The fastest of ``sweep_configs`` (graph replay, 30 iterations), rank 0's pick; a config
    that does not fit (shared memory) counts as infinitely slow."""
    best = None
    for cfg in sweep_configs():
        r = bench.time_impl(f"config {cfg}", lambda: ctx(x, w, out=out, config=cfg), True,
                            iters=30, warmup=5)
        t = r["median_ms"] if r else float("inf")
        log.append({"config": cfg.__dict__, "median_ms": t})
        if best is None or t < best[0]:
            best = (t, cfg)
    return bench.world.broadcast_object(best[1])


def parser() -> BenchParser:
    ap = BenchParser(__doc__, dims=("M", "N", "K"),
                     split_dims=("K",), shapes=SHAPES, dtypes=("bf16",),
                     allowed_dtypes=("bf16", "fp16"), iters=100, warmup=20)
    ap.add_argument("--tune", action="store_true",
                    help="sweep launch configurations of the fused kernel per shape first")
    return ap


def body(bench) -> int:
    world, args = bench.world, bench.args
    dev, W = world.device, world.world_size
    shapes = [(s["M"], s["N"], s["K"]) for s in args.shapes]
    bws = world.all_gather_object(hbm_read_bandwidth(dev))
    bench.write(op="hbm_read", read_bandwidth_gbs=round(min(bws), 1),
                per_rank_gbs=[round(b, 1) for b in bws], method="torch.sum over 2 GiB bf16")
    bench.say(f"HBM read bandwidth {min(bws):.0f} GB/s (slowest rank)")

    ctx = GemvAllReduce(world, max_n=max(n for _, n, _ in shapes), transport="stores")
    one_shot = GemvAllReduce(world, max_n=max(n for _, n, _ in shapes), transport="one_shot")
    autos = auto_contexts(lambda **kw: GemvAllReduce(world, max_n=max(n for _, n, _ in shapes),
                                                     **kw))
    # The fused kernel on a world of one rank: its GEMV streaming without any communication,
    # which separates the kernel's own bandwidth from what the all-reduce costs it.
    solo_groups = [dist.new_group([r]) for r in range(W)]
    solo = World.from_process_group(group=solo_groups[world.rank], device=dev)
    solo_ctx = GemvAllReduce(solo, max_n=max(n for _, n, _ in shapes), transport="stores")
    group_name = dist.group.WORLD.group_name
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        symm_mem = None
    gen = torch.Generator(device=dev).manual_seed(world.rank)
    for dname in args.dtypes:
        dt = torch_dtype(dname)
        for M, N, K in shapes:
            Kl = K // W
            shape = {"M": M, "N": N, "K": K, "K_local": Kl}
            x = torch.randn(M, Kl, generator=gen, device=dev, dtype=torch.float32).to(dt)
            w = torch.randn(N, Kl, generator=gen, device=dev, dtype=torch.float32).to(dt)
            out = torch.empty(M, N, device=dev, dtype=dt)
            y = torch.empty(M, N, device=dev, dtype=dt)
            floor_ms = N * Kl * w.element_size() / (min(bws) * 1e9) * 1e3

            cfg = None
            if args.tune:
                log = []
                cfg = tune(bench, ctx, x, w, out, log)
                bench.write(op=OP + "_tuning", shape=shape, dtype=dname, best=cfg.__dict__,
                            sweep=log)
            facts = world.facts
            plan_cfg = cfg or pick_config(M, N, Kl, dt, facts.arch, facts.sm_count, W,
                                          facts.shared_per_program)
            impls = {
                "fused": lambda: ctx(x, w, out=out, config=cfg),
                "fused_one_shot": lambda: one_shot(x, w, out=out, config=cfg),
                "fused_nocomm": lambda: solo_ctx(x, w, out=y, config=plan_cfg),
                # (without out, as torch's op is called)
                **{n: (lambda c=c: c(x, w)) for n, c in autos.items()},
                "sequential": lambda: dist.all_reduce(torch.mm(x, w.t(), out=y)),
                "compute": lambda: torch.mm(x, w.t(), out=y),
                "comm": lambda: dist.all_reduce(y),
            }
            if symm_mem is not None:
                try:
                    ys = symm_mem.empty((M, N), dtype=dt, device=dev)
                    symm_mem.rendezvous(ys, group_name)

                    def torch_fused():
                        torch.mm(x, w.t(), out=ys)
                        return torch.ops.symm_mem.one_shot_all_reduce(ys, "sum", group_name)

                    impls["torch_fused"] = torch_fused
                except Exception as e:
                    bench.say(f"torch symmetric memory unavailable: {e}")

            def check(name):
                out.fill_(float("nan"))
                if name in ("sequential", "torch_fused"):  # the baselines: speedups divide by them
                    y.fill_(float("nan"))
                    got = impls[name]()
                    return rel_err(y if name == "sequential" else got,
                                   gemv_all_reduce_reference(x, w, world.group))
                if name in autos:
                    c = autos[name]
                    got = c(x, w)
                else:
                    c = one_shot if name == "fused_one_shot" else ctx
                    got = c(x, w, out=out, config=cfg)
                c.synchronize()
                return rel_err(got, gemv_all_reduce_reference(x, w, world.group))

            bench.run(Case(
                op=OP, shape=shape, dtype=dname, impls=impls, check=check,
                checked=["fused", "fused_one_shot", *autos, "sequential",
                         *(["torch_fused"] if "torch_fused" in impls else [])],
                label=f"{M}x{N}x{K} {dname}",
                fields=lambda name: {"floor_ms": round(floor_ms, 5),
                                     **({"config": cfg.__dict__}
                                        if name == "fused" and cfg else {}),
                                     **(auto_fields(autos[name], x, w)
                                        if name in autos else {})},
                notes={"floor_ms": floor_ms},
                derive=lambda t: {"fused_over_floor": t["fused"] / floor_ms
                                  if "fused" in t else None}))
    ctx.close()
    one_shot.close()
    for c in autos.values():
        c.close()
    solo_ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(run_main(parser(), body))
