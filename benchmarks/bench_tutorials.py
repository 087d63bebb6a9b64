"""Benchmark of the tutorials' kernels (docs/tutorials 3-5, written on portable_overlap.language)
beside the library's own ops, by the protocol in benchmarks/harness.py:

    torchrun --nproc-per-node 2 -m benchmarks.bench_tutorials --out r.jsonl \\
        --device-kind nvidia-h200-x2

Shapes (M, N, K) follow the op's own benchmark, so the rows sit beside its rows:
``allgather_gemm`` and ``allgather_rmsnorm_gemm`` as bench_allgather_gemm.py (each rank holds
M / W rows and N / W columns of the weight), ``gemm_reduce_scatter`` as bench_matmul_reduce.py
(each rank holds K / W of the reduction axis). Impls: ``tutorial`` (the tutorial's kernel),
``fused[stores]`` (the library's op of the same design: AllGatherMatmul / MatmulReduceScatter
with ``transport="stores"``), ``sequential`` (the tutorial's torch path); the RMSNorm tutorial has
no library op. CUDA-graph replay only (the tutorials capture their calls).

Each tutorial's ``main()`` runs as written: it checks its result against torch on every rank (a
wrong tutorial is reported and its time not written) and times its paths through ``time_paths``,
which this script replaces by the protocol's timer, naming each path by its role: ``ROUNDS``
rounds of ``--iters`` each, the paths' order rotated each round, and per path the round with
the median median.
"""
from __future__ import annotations

import importlib.util
import os
import sys

from benchmarks.cli import BenchParser
from benchmarks.metrics import rounded
from benchmarks.runner import run_main, torch_dtype
from portable_overlap.schedule.tuning import rotated_rounds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [(8192, 8192, 8192), (16384, 8192, 8192), (8192, 28672, 8192)]
#: op -> (tutorial file, main()'s (rows, columns, reduction) from the op's (M, N, K) on W ranks)
TUTORIALS = {
    "allgather_gemm": ("03_allgather_gemm.py", lambda M, N, K, W: (M // W, N // W, K)),
    "gemm_reduce_scatter": ("04_gemm_reduce_scatter.py", lambda M, N, K, W: (M, N, K // W)),
    "allgather_rmsnorm_gemm": ("05_allgather_rmsnorm_gemm.py",
                               lambda M, N, K, W: (M // W, N // W, K)),
}
#: rounds of each tutorial's paths, the order rotated each round (``time_paths``): timed in
#: main()'s fixed order, the library op (timed last) ran 9-13% slower than the same kernel
#: timed first, on one H100 (benchmarks/probe_allgather_tutorial_gap.py)
ROUNDS = 3
#: the tutorials' callables by name -> the impl their rows carry
ROLES = {"ours": "tutorial", "torch_path": "sequential", "<lambda>": "fused[stores]"}


def parser() -> BenchParser:
    p = BenchParser(__doc__, dims=("M", "N", "K"), shapes=SHAPES, dtypes=("bf16",),
                    allowed_dtypes=("bf16", "fp16", "fp32"), iters=50, warmup=5,
                    graphs=(True,))
    p.add_argument("--ops", default=",".join(TUTORIALS),
                   help="comma list of the tutorials' ops (default: %(default)s)")
    return p


def load_tutorial(filename: str):
    """The tutorial's module (a fresh one per call: ``time_paths`` is replaced in it)."""
    path = os.path.join(ROOT, "docs", "tutorials", filename)
    spec = importlib.util.spec_from_file_location("tutorial_" + filename[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def body(bench) -> int:
    world, args = bench.world, bench.args
    W = world.world_size
    ops = [o for o in args.ops.split(",") if o]
    unknown = [o for o in ops if o not in TUTORIALS]
    if unknown:
        raise SystemExit(f"unknown --ops {unknown}; choose from {list(TUTORIALS)}")
    if args.graphs != (True,):
        bench.say("the tutorials time CUDA-graph replay only; --graph plain is ignored")
    status = 0
    for op in ops:
        filename, sizes = TUTORIALS[op]
        mod = load_tutorial(filename)
        for shape in args.shapes:
            M, N, K = shape["M"], shape["N"], shape["K"]
            if M % W or N % W or K % W:
                bench.say(f"{op} {M}x{N}x{K}: skipped (every size must split {W} ways)")
                continue
            for dname in args.dtypes:
                timed = []

                def timer(paths, world_, **_):  # the tutorial's time_paths, by the protocol
                    rounds = {name: [] for name in paths}
                    for order in rotated_rounds(paths, ROUNDS):
                        for name in order:
                            fn = paths[name]
                            r = bench.time_impl(ROLES.get(fn.__name__, fn.__name__), fn,
                                                graph=True)
                            if r is not None:
                                rounds[name].append(r)
                    ms = {}
                    for name, rs in rounds.items():
                        # the round whose median is the median of the rounds' (with its p10 / p90)
                        r = sorted(rs, key=lambda x: x["median_ms"])[len(rs) // 2] if rs else None
                        timed.append((ROLES.get(paths[name].__name__, name), r))
                        ms[name] = r["median_ms"] if r else float("nan")
                    return ms

                mod.time_paths = timer
                rc = mod.main(world, *sizes(M, N, K, W), torch_dtype(dname))
                status |= rc  # the same on every rank: main gathers every rank's check
                ms = {role: r["median_ms"] for role, r in timed if r is not None}
                for role, r in timed:
                    if r is None or (role == "tutorial" and rc):
                        continue  # never write a wrong result's time
                    bench.write(op=op, shape=shape, dtype=dname, impl=role, graph=True,
                                correct=(rc == 0) if role == "tutorial" else None,
                                rel_err=None, **rounded(r))
                line = ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
                if "tutorial" in ms and "fused[stores]" in ms:
                    line += (f"; library op / tutorial = "
                             f"{ms['fused[stores]'] / ms['tutorial']:.3f}")
                bench.say(f"{op} {M}x{N}x{K} {dname} W={W}: "
                          f"{'right' if rc == 0 else 'WRONG'}; {line}")
    return status


if __name__ == "__main__":
    sys.exit(run_main(parser(), body))
