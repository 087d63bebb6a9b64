"""Probe: what the register cap of the fused embedding op (``ops.launch.fewer_registers``) does
to the fused op itself, on the benchmark's shapes. Run under torchrun on 2 or more GPUs:

    torchrun --nproc-per-node 2 -m benchmarks.probe_embedding_residency --out probe.jsonl

Per (shape, dtype, index distribution), graph replay of the fused op, three variants in
alternating rounds, each with its own context:

- ``cap``: the op as it is (capped where that fits one more program per SM without a spill);
- ``nocap``: the compiler's register count (the cap policy switched off for this context);
- ``cap_grid``: capped, but the grid limited to the uncapped variant's program count, which
  separates "more registers per program" from "more programs".

Each row carries the variant's registers per thread, cap and programs.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

from benchmarks.bench_embedding_alltoall import DTYPES, SHAPES, make_indices
from benchmarks.cli import BenchParser
from benchmarks.harness import time_op
from benchmarks.runner import run_main
from portable_overlap import EmbeddingAllToAll
from portable_overlap.ops import context as context_module


@contextmanager
def no_register_cap():
    """Plans compiled inside keep the compiler's register count."""
    saved = context_module.fewer_registers
    context_module.fewer_registers = lambda compile_capped, compiled, *a, **k: (compiled, None)
    try:
        yield
    finally:
        context_module.fewer_registers = saved


def parser() -> BenchParser:
    ap = BenchParser(__doc__, dims=("batch", "tables", "dim", "pooling_factor", "rows"),
                     shapes=SHAPES, dtypes=("fp32", "fp16"), iters=100, warmup=20,
                     shapes_help="(B x T x D x PF x ROWS) ")
    ap.add_argument("--dists", default="uniform,zipf")
    # BenchParser's --rounds: here the variants' rounds, the order reversed every other round,
    # a variant's time the mean of its rounds' medians
    ap.set_defaults(rounds=2)
    return ap


def body(bench) -> int:
    world, args = bench.world, bench.args
    dev, W, r = world.device, world.world_size, world.rank
    gen = torch.Generator(device=dev).manual_seed(91 + r)
    table = []
    for sh in args.shapes:
        B, T, D, pf, rows = (sh[k] for k in ("batch", "tables", "dim", "pooling_factor", "rows"))
        splits = [B // W] * W
        for dname in args.dtypes:
            dt = DTYPES[dname]
            for dist_name in [d for d in args.dists.split(",") if d]:
                ctxs = {}
                ctxs["cap"] = EmbeddingAllToAll(world, [rows] * T, D, B // W)
                n_loc = ctxs["cap"].n_loc
                weight = (torch.randn(ctxs["cap"].weight_rows, D, generator=gen, device=dev)
                          * 0.1).to(dt)
                lengths = torch.full((n_loc * B,), pf, dtype=torch.int64, device=dev)
                indices = make_indices(n_loc, rows, B * pf, dist_name, gen, dev)
                out = torch.empty(ctxs["cap"].output_shape(splits), dtype=dt, device=dev)

                def call(ctx):
                    ctx(weight, lengths, indices, batch_splits=splits, out=out, validate=False)

                call(ctxs["cap"])  # plans (compiles) each context on its first call
                ctxs["nocap"] = EmbeddingAllToAll(world, [rows] * T, D, B // W)
                with no_register_cap():
                    call(ctxs["nocap"])
                nocap_programs = next(iter(ctxs["nocap"]._plans.values())).programs
                ctxs["cap_grid"] = EmbeddingAllToAll(world, [rows] * T, D, B // W,
                                                     max_programs=nocap_programs)
                call(ctxs["cap_grid"])
                for c in ctxs.values():
                    c.synchronize()
                times = {name: [] for name in ctxs}
                for rnd in range(args.rounds):
                    names = list(ctxs) if rnd % 2 == 0 else list(reversed(ctxs))
                    for name in names:
                        times[name].append(time_op(lambda: call(ctxs[name]), world, graph=True,
                                                   iters=args.iters,
                                                   warmup=args.warmup)["median_ms"])
                shape = {"batch": B, "tables": T, "dim": D, "pooling_factor": pf, "rows": rows,
                         "indices": dist_name}
                line = [f"{B}x{T}x{D} {dname} {dist_name}"]
                for name, c in ctxs.items():
                    plan = next(iter(c._plans.values()))
                    regs = plan.compiled.n_regs if plan.compiled is not None else None
                    t = sum(times[name]) / len(times[name])
                    bench.write(op="embedding_alltoall_residency", shape=shape, dtype=dname,
                                impl=f"fused_{name}", graph=True, median_ms=round(t, 5),
                                rounds=[round(x, 5) for x in times[name]], programs=plan.programs,
                                regs=regs, cap=plan.consts.get("maxnreg"))
                    line.append(f"{name} {t:.4f} ms ({plan.programs} programs, {regs} regs)")
                table.append(" | ".join(line))
                for c in ctxs.values():
                    c.close()
                del weight, lengths, indices, out
                torch.cuda.empty_cache()
    if r == 0:
        print("\n".join(table), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(parser(), body))
