"""Benchmark of GEMM with tile-group signals (GEMM + AllReduce, GEMM + ReduceScatter through
ordinary NCCL/RCCL collectives gated by stream waits) by the protocol in benchmarks/harness.py.
Run under torchrun:

    torchrun --nproc-per-node 2 benchmarks/bench_gemm_signal.py --out results.jsonl \
        --device-kind nvidia-h200-x2 [--partitions] [--reserves 0,8,16,24,32] \
        [--comm-ctas 8,16,32]

Shapes are (M, N, K) with K split over the ranks (each rank holds a [M, K/W], b [K/W, N]).
Impls: ``fused`` (this op), ``sequential`` (torch.mm, then the NCCL collective), ``compute``
(torch.mm alone), ``comm`` (the collective alone), ``torch_fused`` (torch's
``symm_mem.fused_matmul_reduce_scatter``, ReduceScatter only, skipped with a printed reason where
it does not work), and with ``--partitions`` / ``--reserves`` named variants of ``fused`` at one
shape (``--sweep-shape``): ``fused[<partition name>]``, ``fused[event_gate]`` (same kernels, the
collectives after the whole GEMM: no overlap), ``fused[reserve=<n>]``, and with
``--comm-ctas`` ``fused[ctas=<n>]`` / ``fused[ctas=<n>,hp]``: the collectives on a process group
whose NCCL communicator may use at most n CTAs (``ProcessGroupNCCL.Options().config.max_ctas``;
``hp``: a high-priority NCCL stream as well). The persistent GEMM leaves only ``reserve_sms`` SMs
free, so a collective with more CTAs than that waits for the GEMM's end in its extra CTAs.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from benchmarks.harness import ResultWriter, time_op, torch_fused_matmul_reduce_scatter
from portable_overlap import World
from portable_overlap.ops.gemm_signal import (GemmSignal, SignalConfig, gemm_all_reduce_reference,
                                              gemm_reduce_scatter_reference)
from portable_overlap.ops.matmul.api import default_config
from portable_overlap.ops.gemm_signal.copy_engine import GemmReduceScatterCE
from portable_overlap.schedule import TuningCache, default_partition

SHAPES = [(4096, 8192, 8192), (8192, 8192, 8192), (16384, 8192, 8192)]


def gemm_all_reduce(a, b, ctx, out=None, **kw):
    """The signal transport's AllReduce on its own workspace (``GemmSignal``)."""
    return ctx.all_reduce(a, b, out, **kw)


def gemm_reduce_scatter(a, b, ctx, out=None, **kw):
    """The signal transport's ReduceScatter on its own workspace (``GemmSignal``)."""
    return ctx.reduce_scatter(a, b, out, **kw)

OPS = {"all_reduce": ("gemm_allreduce_signal", gemm_all_reduce, gemm_all_reduce_reference),
       "reduce_scatter": ("gemm_reducescatter_signal", gemm_reduce_scatter,
                          gemm_reduce_scatter_reference)}


def sweep_partitions(n_tiles: int, programs: int, dests: int) -> dict:
    """Named partitions for the sweep: the default, one group (no overlap: the GEMM, then one
    collective), one wave per group, and k near-equal groups of whole waves."""
    wave = max(dests, programs - programs % dests)
    out = {"default": default_partition(n_tiles, programs, dests).sizes, "one_group": (n_tiles,)}
    waves = [wave] * (n_tiles // wave) + ([n_tiles % wave] if n_tiles % wave else [])
    if len(waves) <= 64:
        out["wave_each"] = tuple(waves)
    for k in (2, 4, 8):
        if len(waves) >= k:  # k groups of consecutive waves, the last one takes the rest
            per = len(waves) // k
            sizes = [sum(waves[i * per:(i + 1) * per]) for i in range(k - 1)]
            sizes.append(n_tiles - sum(sizes))
            out[f"equal{k}"] = tuple(sizes)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device-kind", default="unknown")
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--shapes", default="", help="MxNxK,... (default: the three of the issue)")
    ap.add_argument("--ops", default="all_reduce,reduce_scatter")
    ap.add_argument("--partitions", action="store_true",
                    help="sweep wave-group partitions at --sweep-shape (named variants)")
    ap.add_argument("--reserves", default="", help="comma list of reserve_sms to sweep")
    ap.add_argument("--comm-ctas", default="",
                    help="comma list: NCCL max CTAs of the collectives' group (named variants)")
    ap.add_argument("--sweep-shape", default="8192x8192x8192")
    ap.add_argument("--no-ce", action="store_true",
                    help="skip fused[ce] (ReduceScatter with the counters gating copy-engine "
                         "transfers, ops/gemm_signal/copy_engine.py)")
    ap.add_argument("--tune", action="store_true",
                    help="a fused[tuned] variant at every shape: GemmSignal.tune's config "
                         "(partition and SM reserve) on a fresh cache")
    ap.add_argument("--no-graph", action="store_true")
    args = ap.parse_args()
    world = World.from_env()
    dev, W = world.device, world.world_size
    writer = ResultWriter(args.out, args.device_kind, W)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",") if s] or SHAPES
    sweep_shape = tuple(map(int, args.sweep_shape.split("x")))
    kinds = [k for k in args.ops.split(",") if k]
    graphs = (False,) if args.no_graph else (False, True)
    ctx = GemmSignal(world)
    # contexts whose collectives run on a group with bounded NCCL CTAs (created collectively,
    # in the same order on every rank, before any timing)
    cta_ctxs = {}
    for n in [int(x) for x in args.comm_ctas.split(",") if x]:
        for hp in (False, True):
            try:
                opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=hp)
                opts.config.max_ctas = n
                g = dist.new_group(list(range(W)), backend="nccl", pg_options=opts)
                sub = World.from_process_group(group=g, device=dev)
                cta_ctxs[f"fused[ctas={n}{',hp' if hp else ''}]"] = GemmSignal(sub)
            except Exception as e:
                if world.rank == 0:
                    print(f"ctas={n} hp={hp} skipped: {type(e).__name__}: {str(e)[:200]}",
                          flush=True)
    gen = torch.Generator(device=dev).manual_seed(world.rank)
    tune_dir = tempfile.mkdtemp(prefix="po-sig-tune-") if args.tune else None
    ce_ctx = None
    if "reduce_scatter" in kinds and not args.no_ce:
        big = max(shapes + [sweep_shape], key=lambda s: s[0] * s[1])
        ce_ctx = GemmReduceScatterCE(world, GemmReduceScatterCE.elems_needed(
            big[0], big[1], W, 128, 256))
    table = []
    for kind in kinds:
        op_name, fused_fn, ref_fn = OPS[kind]
        for M, N, K in shapes + ([sweep_shape] if (args.partitions or args.reserves or cta_ctxs)
                                  and sweep_shape not in shapes else []):
            Kl = K // W
            shape = {"M": M, "N": N, "K": K, "K_local": Kl}
            a = torch.randn(M, Kl, generator=gen, device=dev, dtype=torch.float32).bfloat16()
            b = torch.randn(Kl, N, generator=gen, device=dev, dtype=torch.float32).bfloat16()
            rows = M // W if kind == "reduce_scatter" else M
            out = torch.empty(rows, N, device=dev, dtype=torch.bfloat16)
            y = torch.randn(M, N, generator=gen, device=dev, dtype=torch.float32).bfloat16()
            ys = torch.empty(rows, N, device=dev, dtype=torch.bfloat16)
            # correctness in the same run, before timing (fresh random inputs, poisoned output)
            out.fill_(float("nan"))
            try:
                fused_fn(a, b, ctx, out)
                ctx.synchronize()
                ref = ref_fn(a, b, world.group).double()
                err = ((out.double() - ref).norm() / ref.norm()).item()
            except Exception as e:
                print(f"rank {world.rank}: fused {kind} failed at {M}x{N}x{K}: "
                      f"{type(e).__name__}: {str(e)[-300:]}", flush=True)
                err = float("inf")
            err = max(world.all_gather_object(err))  # every rank decides alike what to time
            correct = bool(err < 1e-2)
            if kind == "all_reduce":
                comm = lambda: dist.all_reduce(y)  # noqa: E731
                seq = lambda: dist.all_reduce(torch.mm(a, b, out=y))  # noqa: E731
            else:
                comm = lambda: dist.reduce_scatter_tensor(ys, y)  # noqa: E731
                seq = lambda: dist.reduce_scatter_tensor(ys, torch.mm(a, b, out=y))  # noqa: E731
            impls = {"fused": lambda: fused_fn(a, b, ctx, out), "sequential": seq,
                     "compute": lambda: torch.mm(a, b, out=y), "comm": comm}
            if kind == "reduce_scatter":  # the reason is printed where torch's op fails
                try:
                    impls["torch_fused"] = torch_fused_matmul_reduce_scatter(world, a, b, ref_fn,
                                                                             tol=1e-2)
                except Exception as e:
                    if world.rank == 0:
                        print(f"torch_fused skipped: {type(e).__name__}: {str(e)[:200]}",
                              flush=True)
            elif kind == "all_reduce" and world.rank == 0 and (M, N, K) == shapes[0]:
                print("torch_fused skipped for all_reduce: torch has no fused matmul + "
                      "all-reduce op", flush=True)
            variants = {}
            if (M, N, K) == sweep_shape:
                mm = default_config(torch.bfloat16, dev)
                dests = 1 if kind == "all_reduce" else W
                n_tiles = dests * -(-(M // dests) // mm.block_m) * -(-N // mm.block_n)
                if args.partitions:
                    programs = ctx._programs(ctx.config)
                    for pname, part in sweep_partitions(n_tiles, programs, dests).items():
                        variants[f"fused[{pname}]"] = (SignalConfig(partition=part), part)
                    # the same kernels, the collectives after the whole GEMM: what the overlap
                    # itself gains, apart from the reserve and the reorder
                    variants["fused[event_gate]"] = (SignalConfig(gate="event"), None)
                for r in [int(x) for x in args.reserves.split(",") if x]:
                    variants[f"fused[reserve={r}]"] = (SignalConfig(reserve_sms=r), None)
                for vname in cta_ctxs:
                    variants[vname] = (None, None)
            if args.tune:
                try:
                    tcfg = ctx.tune(kind, a, b, cache=TuningCache(
                        os.path.join(tune_dir, f"{kind}-{M}x{N}x{K}-rank{world.rank}.json")))
                    variants["fused[tuned]"] = (tcfg, tcfg.partition)
                    if world.rank == 0:
                        print(f"{kind} {M}x{N}x{K} tuned: partition {list(tcfg.partition)}, "
                              f"reserve {tcfg.reserve_sms}", flush=True)
                except Exception as e:
                    print(f"rank {world.rank}: tuning {kind} {M}x{N}x{K} failed: "
                          f"{type(e).__name__}: {str(e)[:200]}", flush=True)
                    torch.cuda.synchronize()
                # every rank times the same variants, or none
                if not all(world.all_gather_object("fused[tuned]" in variants)):
                    variants.pop("fused[tuned]", None)
            def admit(vname, run, vctx):
                """Time ``run`` as ``vname`` only if one call of it, checked against the
                reference on every rank, is right (it also plans and loads outside the timing)."""
                try:
                    out.fill_(float("nan"))
                    run()
                    vctx.synchronize()
                    ref = ref_fn(a, b, world.group).double()
                    verr = ((out.double() - ref).norm() / ref.norm()).item()
                except Exception as e:
                    print(f"rank {world.rank}: {vname} failed: {type(e).__name__}: "
                          f"{str(e)[:200]}", flush=True)
                    verr = float("inf")
                verr = max(world.all_gather_object(verr))
                if verr < 1e-2:
                    impls[vname] = run
                elif world.rank == 0:
                    print(f"{vname} wrong (rel_err {verr:.2e}): not timed", flush=True)

            for vname, (cfg, part) in variants.items():
                vctx = cta_ctxs.get(vname, ctx)
                admit(vname, (lambda c, x: (lambda: fused_fn(a, b, x, out, config=c)))(cfg, vctx),
                      vctx)
            if kind == "reduce_scatter" and ce_ctx is not None:
                admit("fused[ce]", lambda: ce_ctx.reduce_scatter(a, b, out), ce_ctx)
            row = {"op": kind, "shape": f"{M}x{N}x{K}", "err": err}
            for graph in graphs:
                for name, fn in impls.items():
                    if name.startswith("fused") and not correct:
                        continue  # never time a wrong result
                    try:
                        r = time_op(fn, world, graph=graph, iters=args.iters, warmup=10)
                    except Exception as e:
                        if world.rank == 0:
                            print(f"{kind} {name} graph={graph} failed: {type(e).__name__}: "
                                  f"{str(e)[:200]}", flush=True)
                        torch.cuda.synchronize()
                        continue
                    row[(name, graph)] = r["median_ms"]
                    if world.rank == 0:
                        extra = {}
                        if name.startswith("fused["):
                            v = variants.get(name, (None, None))
                            extra = {"partition": list(v[1]) if v[1] else None,
                                     "reserve_sms": v[0].reserve_sms if v[0] else None}
                        writer.write(op=op_name, shape=shape, dtype="bf16", impl=name,
                                     graph=graph, correct=correct if name == "fused" else None,
                                     rel_err=err if name == "fused" else None,
                                     **{k: round(v, 5) for k, v in r.items()}, **extra)
            table.append(row)
            if world.rank == 0:
                for graph in graphs:
                    t = {n: row.get((n, graph)) for n in ("fused", "sequential", "compute",
                                                         "comm")}
                    if None in t.values():
                        continue
                    ideal = max(t["compute"], t["comm"])
                    writer.write(op=op_name + "_summary", shape=shape, dtype="bf16", graph=graph,
                                 ideal_ms=round(ideal, 5), fused_ms=round(t["fused"], 5),
                                 sequential_ms=round(t["sequential"], 5),
                                 speedup=round(t["sequential"] / t["fused"], 3),
                                 fraction_of_ideal=round((t["sequential"] - t["fused"])
                                                         / (t["sequential"] - ideal), 3)
                                 if t["sequential"] > ideal else None)
    ctx.close()
    for c in cta_ctxs.values():
        c.close()
    if world.rank == 0:
        print("\nmilliseconds, slowest rank's median; P = plain launches, G = CUDA-graph replay; "
              "frac = (seq - fused) / (seq - max(compute, comm))")
        print(f"{'op':>14} {'M x N x K':>17} {'g':>1} {'fused':>7} {'seq':>7} {'compute':>7} "
              f"{'comm':>7} {'torch':>7} {'speedup':>7} {'frac':>6} {'ok':>3}")
        for r in table:
            for graph in graphs:
                g = lambda n: r.get((n, graph), float("nan"))  # noqa: E731
                ideal = max(g("compute"), g("comm"))
                frac = (g("sequential") - g("fused")) / (g("sequential") - ideal) \
                    if g("sequential") > ideal else float("nan")
                print(f"{r['op']:>14} {r['shape']:>17} {'G' if graph else 'P'} "
                      f"{g('fused'):7.3f} {g('sequential'):7.3f} {g('compute'):7.3f} "
                      f"{g('comm'):7.3f} {g('torch_fused'):7.3f} "
                      f"{g('sequential') / g('fused'):7.2f} {frac:6.2f} "
                      f"{'yes' if r['err'] < 1e-2 else 'NO':>3}")
            for name in sorted(k for k in r if isinstance(k, tuple) and k[0].startswith("fused[")):
                print(f"{'':>14} {r['shape']:>17} {'G' if name[1] else 'P'} {name[0]:>24} "
                      f"{r[name]:7.3f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
