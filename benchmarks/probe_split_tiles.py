"""Probe: GEMM + ReduceScatter (or AllReduce, ``--mode``) over ``"stores"`` with split tiles
(K ranges run side by side, ``ops/matmul_reduce/stores.py:tile_parts``) against the same op
with whole tiles, at products whose tiles leave most of the grid idle (decode-sized M, small
N, long K). Per shape (bf16,
graph replay, each impl checked against a float32 reference before it is timed, ``--rounds``
rounds in rotated order, each impl's median round): cuBLAS's GEMM alone, the op with whole
tiles (the rule forced to one part), the op as it plans (``split``), with ``--parts`` the op
with each of those part counts forced (``parts<n>``, where the grid has room for them), and
on several ranks the ``"sequential"`` transport (cuBLAS then NCCL's collective). Rows to
--out (op ``matmul_<mode>_split``, the parts in each row); one line per shape.

    torchrun --nproc-per-node 1 -m benchmarks.probe_split_tiles --out rows.jsonl \\
        --device-kind nvidia-h200 [--shapes 64x1024x4096,128x3584x8192] [--rounds 2] \\
        [--parts 2,4,8] [--mode all_reduce]
"""
from __future__ import annotations

import argparse
import sys

import torch

import portable_overlap as po
from benchmarks.harness import check_and_time
from benchmarks.rows import ResultWriter
from portable_overlap import World
from portable_overlap.ops.matmul_reduce import stores

#: M x N x K per rank: decode-sized products of row-parallel layers (Llama-3-8B / 70B
#: projections at 1-2 ranks) and the probes' small shapes
SHAPES = ("64x1024x4096,128x3584x8192,128x4096x7168,96x2048x8192,256x1024x8192,"
          "128x4096x14336,256x8192x3584")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device-kind", default="unknown")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--parts", default="", help="part counts to force, beside the rule's")
    ap.add_argument("--mode", default="reduce_scatter", choices=("reduce_scatter", "all_reduce"))
    args = ap.parse_args()
    world = World.from_env()
    W, r, dev = world.world_size, world.rank, world.device
    writer = ResultWriter(args.out, args.device_kind, W)
    rule = stores.tile_parts
    for spec in args.shapes.split(","):
        M, N, K = (int(v) for v in spec.split("x"))
        g = torch.Generator(device=dev).manual_seed(r)
        a = torch.randn(M, K, generator=g, device=dev).to(torch.bfloat16)
        b = torch.randn(K, N, generator=g, device=dev).to(torch.bfloat16)
        full = a.float() @ b.float()
        if W > 1:
            torch.distributed.all_reduce(full, group=world.group)
        rs = args.mode == "reduce_scatter"
        ref = full[M // W * r: M // W * (r + 1)] if rs else full
        out = torch.empty(M // W if rs else M, N, device=dev, dtype=torch.bfloat16)
        make = po.MatmulReduceScatter if rs else po.MatmulAllReduce
        c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        ctxs = {}
        sms = world.facts.sm_count
        tiles = W * -(-(M // W) // 64) * -(-N // 128)  # the split tiles' grid (64 x 128)
        forced = [("whole", 1)] + [(f"parts{n}", int(n)) for n in filter(None, args.parts.split(
            ",")) if tiles * int(n) <= sms]
        for name, n in forced:  # each planned (at its first call) with the rule forced
            stores.tile_parts = lambda *_, n=n: n
            ctxs[name] = make(world, M, N, transport="stores")
            ctxs[name](a, b, out=out)
        stores.tile_parts = rule
        ctxs["split"] = make(world, M, N, transport="stores")
        if W > 1:
            ctxs["sequential"] = make(world, M, N, transport="sequential")
        runs = {name: (lambda ctx=ctx: ctx(a, b, out=out)) for name, ctx in ctxs.items()}
        impls = ["cublas"] + list(runs)
        times = {name: [] for name in impls}
        errs = {}
        for rnd in range(args.rounds):
            for name in impls[rnd % len(impls):] + impls[:rnd % len(impls)]:
                if name == "cublas":
                    fn, o, want = (lambda: torch.matmul(a, b, out=c)), c, a.float() @ b.float()
                else:
                    fn, o, want = runs[name], out, ref
                errs[name], t = check_and_time(fn, o, want, world, tol=2e-2, iters=args.iters,
                                               warmup=10)
                times[name].append(t)
        parts = {name: next(iter(ctx.workspace("stores")._plans.values())).parts
                 for name, ctx in ctxs.items() if name != "sequential"}
        line = [f"{spec:>16s}"]
        for name in impls:
            t = sorted(times[name], key=lambda x: x["median_ms"])[len(times[name]) // 2]
            writer.write(op=f"matmul_{args.mode}_split", shape={"M": M, "N": N, "K": K},
                         dtype="bf16", impl=name, graph=True, parts=parts.get(name),
                         rel_err=errs[name], rounds=[x["median_ms"] for x in times[name]],
                         **{k: t[k] for k in ("median_ms", "p10_ms", "p90_ms")})
            line.append(f"{name}{'/' + str(parts[name]) if name in parts else ''} "
                        f"{t['median_ms'] * 1e3:7.1f} us")
        if r == 0:
            print("  ".join(line), flush=True)
        for ctx in ctxs.values():
            ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
