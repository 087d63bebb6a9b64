"""Benchmark of AllGather + GEMM (copy engines with the FiCCO schedules; SM stores into every
peer) against all_gather + cuBLAS and torch's fused_all_gather_matmul, by the protocol in
benchmarks/harness.py:

    torchrun --nproc-per-node 2 -m benchmarks.bench_allgather_gemm --out r.jsonl \\
        --device-kind nvidia-h200-x2

Shapes (M, N, K) of the whole layer: the gathered A is [M, K] (each rank holds M / W rows) and
each rank holds its N / W columns of the column-parallel B ([K, N / W]).
Impls: ``fused`` (the copy-engine transport, the heuristic's schedule), one ``fused[<schedule>]``
per schedule of ``--schedules``, ``fused[pull]`` (the copy-engine transport pulling whole
shards, ``direction="pull"``; ``--no-pull`` skips it), one ``fused[stores,senders=<S>]`` per
count of ``--senders`` (the ``"stores"`` transport; ``default`` is its own rule, ``none`` skips
it), one ``fused[stores,<k>=<v>,...]`` per option set of ``--stores``, ``auto``
(``transport="auto"``, called without ``out`` as torch's op is; the row's ``pick``: the
transport it chose for plain and for captured calls), ``sequential`` (all_gather_into_tensor then
torch.matmul), ``compute``, ``comm``, ``torch_fused``.
The shared options (shapes, dtypes, worlds, graph modes, checks) are in benchmarks/cli.py.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from benchmarks.cli import BenchParser
from benchmarks.runner import Case, auto_contexts, auto_fields, rel_err, run_main, torch_dtype
from portable_overlap import collectives
from portable_overlap.ops.allgather_gemm import (SCHEDULES, AllGatherMatmul,
                                                 all_gather_matmul_reference, pick_schedule)

# the last has M < K, where the paper's heuristic would pick its 2-D schedule (pieces along K)
SHAPES = [(8192, 8192, 8192), (16384, 8192, 8192), (8192, 11008, 4096), (8192, 28672, 8192),
          (4096, 8192, 16384)]
OP = "allgather_gemm"


def parser() -> BenchParser:
    p = BenchParser(__doc__, dims=("M", "N", "K"),
                    split_dims=("M", "N"), shapes=SHAPES, dtypes=("bf16",),
                    allowed_dtypes=("bf16", "fp16"), iters=50, warmup=5)
    p.add_argument("--schedules", default=",".join(SCHEDULES),
                   help="comma list of copy-engine schedules to time besides the pick "
                        "(default: all; 'none' for none)")
    p.add_argument("--senders", default="default",
                   help="comma list of sender counts of the 'stores' transport, 'default' for "
                        "its rule, 'none' to skip it (default: %(default)s)")
    p.add_argument("--no-pull", action="store_true",
                   help="skip the copy-engine transport's whole-shard pulls (fused[pull])")
    p.add_argument("--stores", default="none",
                   help="comma list of option sets of the 'stores' transport, each "
                        "'key=value' joined by '+' (senders, copy_block, join, pull_share, "
                        "pull_pieces, bulk_copies), e.g. "
                        "'senders=8+copy_block=32768,join=0' (default: none)")
    return p


STORES_OPTIONS = {"senders": int, "copy_block": int, "join": lambda v: bool(int(v)),
                  "pull_share": float, "pull_pieces": int,
                  "bulk_copies": lambda v: bool(int(v))}


def _options(text: str) -> dict:
    """One ``--stores`` option set: 'senders=8+join=0' -> {'senders': 8, 'join': False}."""
    opts = {}
    for kv in text.split("+"):
        k, _, v = kv.partition("=")
        if k not in STORES_OPTIONS or not v:
            raise SystemExit(f"--stores: bad option {kv!r}; choose from {list(STORES_OPTIONS)}")
        opts[k] = STORES_OPTIONS[k](v)
    return opts


def _list(text: str, allowed=None) -> list:
    items = [] if text.strip() in ("", "none") else [x.strip() for x in text.split(",")]
    bad = [x for x in items if allowed is not None and x not in allowed]
    if bad:
        raise SystemExit(f"unknown {bad}; choose from {allowed}")
    return items


def body(bench) -> int:
    world, args = bench.world, bench.args
    dev, W = world.device, world.world_size
    shapes = [(s["M"], s["N"], s["K"]) for s in args.shapes]
    elems = max(M // W * K for M, _, K in shapes)
    ctx = AllGatherMatmul(world, max_shard_elems=elems, transport="copy_engine")
    schedules = _list(args.schedules, SCHEDULES)
    stores = {n: AllGatherMatmul(world, max_shard_elems=elems, transport="stores",
                                 senders=None if n == "default" else int(n))
              for n in _list(args.senders)}
    pull = (None if args.no_pull
            else AllGatherMatmul(world, max_shard_elems=elems, transport="copy_engine",
                                 direction="pull"))
    variants = {v: AllGatherMatmul(world, max_shard_elems=elems, transport="stores",
                                   **_options(v))
                for v in _list(args.stores)}
    autos = auto_contexts(lambda **kw: AllGatherMatmul(world, max_shard_elems=elems, **kw))
    contexts = (ctx, *stores.values(), *variants.values(), *([pull] if pull else []),
                *autos.values())
    group_name = dist.group.WORLD.group_name
    gen = torch.Generator(device=dev).manual_seed(world.rank)
    for dname in args.dtypes:
        dt = torch_dtype(dname)
        for M, N, K in shapes:
            m = M // W
            a = torch.randn(m, K, generator=gen, device=dev).to(dt)
            b = torch.randn(K, N // W, generator=gen, device=dev).to(dt)
            # random, not empty: "compute" alone multiplies it without a gather first
            full = torch.randn(M, K, generator=gen, device=dev).to(dt)
            out = torch.empty(M, N // W, device=dev, dtype=dt)
            pick = pick_schedule(M, N // W, K, 2, world.facts.arch)
            impls = {"fused": lambda: ctx(a, b, out)}
            for s in schedules:
                impls[f"fused[{s}]"] = lambda s=s: ctx(a, b, out, schedule=s)
            for n, sctx in stores.items():
                impls[f"fused[stores,senders={n}]"] = lambda c=sctx: c(a, b, out)
            for v, vctx in variants.items():
                impls[f"fused[stores,{v.replace('+', ',')}]"] = lambda c=vctx: c(a, b, out)
            if pull is not None:
                impls["fused[pull]"] = lambda: pull(a, b, out)
            for n, actx in autos.items():  # without out, as torch's op is called
                impls[n] = lambda c=actx: c(a, b)
            impls.update({
                "sequential": lambda: (collectives.all_gather(full, a),
                                       torch.matmul(full, b, out=out)),
                "compute": lambda: torch.matmul(full, b, out=out),
                "comm": lambda: collectives.all_gather(full, a),
            })
            try:
                import torch.distributed._symmetric_memory as symm_mem

                a_sym = symm_mem.empty(m, K, dtype=dt, device=dev)
                symm_mem.rendezvous(a_sym, group_name)
                a_sym.copy_(a)
                impls["torch_fused"] = lambda: torch.ops.symm_mem.fused_all_gather_matmul(
                    a_sym, [b], gather_dim=0, group_name=group_name)
            except Exception as e:
                bench.say(f"torch_fused unavailable: {type(e).__name__}: {e}")
            ref = all_gather_matmul_reference(a, b, world.group)

            def check(name):
                out.fill_(float("nan"))
                y = impls[name]()
                for c in contexts:
                    c.synchronize()
                if name == "torch_fused":  # (the gathered a, [a_full @ b])
                    return rel_err(y[1][0], ref)
                return rel_err(y if name in autos else out, ref)

            bench.run(Case(
                op=OP, shape={"M": M, "N": N, "K": K}, dtype=dname, impls=impls, check=check,
                # the baselines too: every speedup divides by them
                checked=[n for n in impls if n.startswith(("fused", "auto"))
                         or n in ("sequential", "torch_fused")],
                fields=lambda name: {"schedule": pick if name == "fused" else None,
                                     **(auto_fields(autos[name], a, b)
                                        if name in autos else {})},
                notes={"pick": pick}, label=f"{M}x{N}x{K} {dname}"))
    for c in contexts:
        c.close()
    return 0


if __name__ == "__main__":
    sys.exit(run_main(parser(), body))
