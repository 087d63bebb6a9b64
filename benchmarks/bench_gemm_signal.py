"""Benchmark of GEMM with tile-group signals (GEMM + AllReduce, GEMM + ReduceScatter through
ordinary NCCL/RCCL collectives gated by stream waits) by the protocol in benchmarks/harness.py.
Run under torchrun:

    torchrun --nproc-per-node 2 -m benchmarks.bench_gemm_signal --out results.jsonl \
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
Every ``fused*`` impl is checked against the reference before it is timed; a wrong one is not
timed. The shared options (shapes, dtypes, worlds, graph modes, checks) are in benchmarks/cli.py.
"""
from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist

from benchmarks.cli import BenchParser, int_list, one_shape, parse_ints, parse_shapes
from benchmarks.harness import torch_fused_matmul_reduce_scatter
from benchmarks.runner import Case, rel_err, run_main, torch_dtype
from portable_overlap import World, collectives
from portable_overlap.testing.signal_calls import gemm_all_reduce, gemm_reduce_scatter
from portable_overlap.ops.gemm_signal import (GemmSignal, SignalConfig, gemm_all_reduce_reference,
                                              gemm_reduce_scatter_reference)
from portable_overlap.ops.matmul.api import default_config
from portable_overlap.ops.gemm_signal.copy_engine import GemmReduceScatterCE
from portable_overlap.schedule import TuningCache, default_partition

SHAPES = [(4096, 8192, 8192), (8192, 8192, 8192), (16384, 8192, 8192)]
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


def parser() -> BenchParser:
    ap = BenchParser(__doc__, dims=("M", "N", "K"),
                     split_dims=("M", "K"), shapes=SHAPES, dtypes=("bf16",),
                     allowed_dtypes=("bf16", "fp16"), iters=60, warmup=10,
                     shapes_help="the three of the issue ")
    ap.add_choices("--ops", ("all_reduce", "reduce_scatter"), "all_reduce,reduce_scatter")
    ap.add_argument("--partitions", action="store_true",
                    help="sweep wave-group partitions at --sweep-shape (named variants)")
    ap.add_argument("--reserves", default="", type=int_list(0),
                    help="comma list of reserve_sms to sweep")
    ap.add_argument("--comm-ctas", default="", type=int_list(1),
                    help="comma list: NCCL max CTAs of the collectives' group (named variants)")
    ap.add_argument("--sweep-shape", default="8192x8192x8192", type=one_shape("MNK"))
    ap.add_argument("--no-ce", action="store_true",
                    help="skip fused[ce] (ReduceScatter with the counters gating copy-engine "
                         "transfers, ops/gemm_signal/copy_engine.py)")
    ap.add_argument("--tune", action="store_true",
                    help="a fused[tuned] variant at every shape: GemmSignal.tune's config "
                         "(partition and SM reserve) on a fresh cache")
    return ap


def cta_contexts(bench, counts) -> dict:
    """{variant name: GemmSignal} whose collectives run on a group with bounded NCCL CTAs
    (created collectively, in the same order on every rank, before any timing)."""
    world, out = bench.world, {}
    for n in counts:
        for hp in (False, True):
            try:
                opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=hp)
                opts.config.max_ctas = n
                g = dist.new_group(list(range(world.world_size)), backend="nccl",
                                   pg_options=opts)
                sub = World.from_process_group(group=g, device=world.device)
                out[f"fused[ctas={n}{',hp' if hp else ''}]"] = GemmSignal(sub)
            except Exception as e:
                bench.say(f"ctas={n} hp={hp} skipped: {type(e).__name__}: {str(e)[:200]}")
    return out


def body(bench) -> int:
    world, args = bench.world, bench.args
    dev, W = world.device, world.world_size
    shapes = [(s["M"], s["N"], s["K"]) for s in args.shapes]
    sweep_shape = tuple(parse_shapes(args.sweep_shape, ("M", "N", "K"))[0].values())
    kinds = [k for k in args.ops.split(",") if k]
    ctx = GemmSignal(world)
    cta_ctxs = cta_contexts(bench, parse_ints(args.comm_ctas))
    gen = torch.Generator(device=dev).manual_seed(world.rank)
    tune_dir = tempfile.mkdtemp(prefix="po-sig-tune-") if args.tune else None
    ce_ctx = None
    if "reduce_scatter" in kinds and not args.no_ce:
        big = max(shapes + [sweep_shape], key=lambda s: s[0] * s[1])
        ce_ctx = GemmReduceScatterCE(world, GemmReduceScatterCE.elems_needed(
            big[0], big[1], W, 128, 256))
    sweeps = args.partitions or args.reserves or cta_ctxs
    for dname in args.dtypes:
        dt = torch_dtype(dname)
        for kind in kinds:
            for M, N, K in shapes + ([sweep_shape] if sweeps and sweep_shape not in shapes
                                     else []):
                one_case(bench, ctx, cta_ctxs, ce_ctx, gen, tune_dir, kind, dname, dt,
                         (M, N, K), (M, N, K) == sweep_shape, (M, N, K) == shapes[0])
    ctx.close()
    for c in cta_ctxs.values():
        c.close()
    if ce_ctx is not None:
        ce_ctx.close()
    return 0


def one_case(bench, ctx, cta_ctxs, ce_ctx, gen, tune_dir, kind, dname, dt, mnk, at_sweep,
             first) -> None:
    """One op and shape: the impls, the named variants (at the sweep shape, or tuned),
    ``bench.run``."""
    world, args = bench.world, bench.args
    dev, W = world.device, world.world_size
    op_name, fused_fn, ref_fn = OPS[kind]
    M, N, K = mnk
    Kl = K // W
    a = torch.randn(M, Kl, generator=gen, device=dev, dtype=torch.float32).to(dt)
    b = torch.randn(Kl, N, generator=gen, device=dev, dtype=torch.float32).to(dt)
    rows = M // W if kind == "reduce_scatter" else M
    out = torch.empty(rows, N, device=dev, dtype=dt)
    y = torch.randn(M, N, generator=gen, device=dev, dtype=torch.float32).to(dt)
    ys = torch.empty(rows, N, device=dev, dtype=dt)
    if kind == "all_reduce":
        comm = lambda: dist.all_reduce(y)  # noqa: E731
        seq = lambda: dist.all_reduce(torch.mm(a, b, out=y))  # noqa: E731
    else:
        comm = lambda: collectives.reduce_scatter(ys, y)  # noqa: E731
        seq = lambda: collectives.reduce_scatter(ys, torch.mm(a, b, out=y))  # noqa: E731
    impls = {"fused": lambda: fused_fn(a, b, ctx, out), "sequential": seq,
             "compute": lambda: torch.mm(a, b, out=y), "comm": comm}
    if kind == "reduce_scatter":  # the reason is printed where torch's op fails
        try:
            impls["torch_fused"] = torch_fused_matmul_reduce_scatter(world, a, b, ref_fn,
                                                                     tol=1e-2)
        except Exception as e:
            bench.say(f"torch_fused skipped: {type(e).__name__}: {str(e)[:200]}")
    elif first:
        bench.say("torch_fused skipped for all_reduce: torch has no fused matmul + all-reduce op")
    variants = {}  # name: (SignalConfig or None, partition or None)
    if at_sweep:
        mm = default_config(dt, dev)
        dests = 1 if kind == "all_reduce" else W
        n_tiles = dests * -(-(M // dests) // mm.block_m) * -(-N // mm.block_n)
        if args.partitions:
            programs = ctx.grid_programs(ctx.config)
            for pname, part in sweep_partitions(n_tiles, programs, dests).items():
                variants[f"fused[{pname}]"] = (SignalConfig(partition=part), part)
            # the same kernels, the collectives after the whole GEMM: what the overlap
            # itself gains, apart from the reserve and the reorder
            variants["fused[event_gate]"] = (SignalConfig(gate="event"), None)
        for r in parse_ints(args.reserves):
            variants[f"fused[reserve={r}]"] = (SignalConfig(reserve_sms=r), None)
        for vname in cta_ctxs:
            variants[vname] = (None, None)
    if args.tune:
        try:
            tcfg = ctx.tune(kind, a, b, cache=TuningCache(
                os.path.join(tune_dir, f"{kind}-{M}x{N}x{K}-rank{world.rank}.json")))
            variants["fused[tuned]"] = (tcfg, tcfg.partition)
            bench.say(f"{kind} {M}x{N}x{K} tuned: partition {list(tcfg.partition)}, "
                      f"reserve {tcfg.reserve_sms}")
        except Exception as e:
            print(f"rank {world.rank}: tuning {kind} {M}x{N}x{K} failed: "
                  f"{type(e).__name__}: {str(e)[:200]}", flush=True)
            torch.cuda.synchronize()
        # every rank times the same variants, or none
        if not all(world.all_gather_object("fused[tuned]" in variants)):
            variants.pop("fused[tuned]", None)
    owners = {"fused": ctx}
    for vname, (cfg, _) in variants.items():
        vctx = cta_ctxs.get(vname, ctx)
        impls[vname] = (lambda c, x: (lambda: fused_fn(a, b, x, out, config=c)))(cfg, vctx)
        owners[vname] = vctx
    if kind == "reduce_scatter" and ce_ctx is not None:
        impls["fused[ce]"] = lambda: ce_ctx.reduce_scatter(a, b, out)
        owners["fused[ce]"] = ce_ctx
    ref = ref_fn(a, b, world.group).double()

    def check(name):
        out.fill_(float("nan"))
        impls[name]()  # also plans and loads the kernels outside the timing
        owners[name].synchronize()
        return rel_err(out, ref)

    def fields(name):
        if not name.startswith("fused["):
            return {}
        cfg, part = variants.get(name, (None, None))
        return {"partition": list(part) if part else None,
                "reserve_sms": cfg.reserve_sms if cfg else None}

    bench.run(Case(op=op_name, shape={"M": M, "N": N, "K": K, "K_local": Kl}, dtype=dname,
                   impls=impls, check=check, tol=1e-2, fields=fields,
                   label=f"{kind} {M}x{N}x{K} {dname}"))


if __name__ == "__main__":
    sys.exit(run_main(parser(), body))
