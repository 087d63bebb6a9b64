"""Benchmark of the fused embedding pooling + All-to-All against a torch EmbeddingBag loop +
NCCL all_to_all_single, by the protocol in benchmarks/harness.py. Run under torchrun:

    torchrun --nproc-per-node 2 -m benchmarks.bench_embedding_alltoall --out results.jsonl \
        --device-kind nvidia-h200-x2

Shapes are (global batch, total tables, D, pooling factor, rows per table); the tables are
sharded table-wise over the ranks (``ShardingPlan.make``: equal rows, so T / world each), every
bag holds exactly ``pooling factor`` indices, uniform or Zipf(1.05) over a table's rows. Impls:

- ``fused``: the fused kernel (remote slices first, stores into the peers' heaps; the
  ``"stores"`` transport);
- ``sequential``: ``F.embedding_bag`` per local table, ``all_to_all_single``, columns into
  global table order (what a model does without the fused op);
- ``plain``: the op's ``"sequential"`` transport (the pooled lookup of the rank's packed
  tables in one Triton launch, the fused kernel's gather without its flag rounds, written in
  the exchange's send order; ``all_to_all_single``; one gather into global table order);
- ``auto``: the op with ``transport="auto"`` (decided at an eager call before the timing);
- ``compute``: the fused kernel on a world of one rank (its own tables for the whole global
  batch, every store local): the lookup alone;
- ``comm``: ``all_to_all_single`` of the same bytes alone;
- ``sequential_compute``: the EmbeddingBag loop alone (for reading the table).

``ideal = max(compute, comm)``; summary rows give the speedup ``sequential / fused`` and the
fraction of ideal ``(sequential - fused) / (sequential - ideal)``. Correctness of the fused op is
checked against the float32 reference in the same run before timing; ``fused_shmem`` (``--shmem``)
must give the same bits as ``fused``. The shared options (shapes, dtypes, worlds, graph modes,
checks) are in benchmarks/cli.py.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.cli import BenchParser
from benchmarks.harness import time_op
from benchmarks.runner import Case, rel_err, run_main
from portable_overlap import EmbeddingAllToAll, World, embedding_all_to_all_reference

OP = "embedding_alltoall"
SHAPES = [(16384, 32, 128, 32, 200000), (65536, 16, 64, 20, 200000), (4096, 64, 256, 8, 100000)]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def zipf_cdf(n: int, s: float, device) -> torch.Tensor:
    p = torch.arange(1, n + 1, dtype=torch.float64, device=device) ** -s
    return (p.cumsum(0) / p.sum()).float()


def make_indices(n_tables, rows, count, dist_name, gen, device):
    """``count`` indices per table, table after table (int64)."""
    if dist_name == "uniform":
        return torch.randint(0, rows, (n_tables * count,), generator=gen, device=device)
    cdf = zipf_cdf(rows, 1.05, device)
    out = []
    for _ in range(n_tables):  # hot rows scattered over the table by a per-table permutation
        perm = torch.randperm(rows, generator=gen, device=device)
        u = torch.rand(count, generator=gen, device=device)
        out.append(perm[torch.searchsorted(cdf, u).clamp_max(rows - 1)])
    return torch.cat(out)


class Sequential:
    """The unfused baseline, with everything that does not depend on the data prepared once:
    per-table index and offset views, the exchange buffers, the column order."""

    def __init__(self, ctx, weight, indices, B, pf, splits, group):
        plan, r = ctx.plan, ctx.rank
        W = ctx.world.world_size
        self.group = group
        self.n_loc, self.D = ctx.n_loc, plan.dim
        dev = weight.device
        per = B * pf
        offs = torch.arange(0, per, pf, device=dev)
        self.tables = [(weight[o:o + plan.table_rows[t]], indices[j * per:(j + 1) * per], offs)
                       for j, (o, t) in enumerate(zip(plan.row_offsets(r), ctx.local_tables))]
        self.B_r = splits[r]
        self.n_of = [len(plan.tables_of(q)) for q in range(W)]
        self.in_splits = [splits[d] * self.n_loc * self.D for d in range(W)]
        self.out_splits = [self.B_r * n * self.D for n in self.n_of]
        self.recv = torch.empty(sum(self.out_splits), dtype=weight.dtype, device=dev)
        self.order = torch.tensor([t for q in range(W) for t in plan.tables_of(q)], device=dev)
        self.out = torch.empty(self.B_r, plan.num_tables, self.D, dtype=weight.dtype, device=dev)

    def compute(self):
        return torch.stack([F.embedding_bag(ix, tab, off, mode="sum")
                            for tab, ix, off in self.tables], 1)  # [B, n_loc, D]

    def __call__(self):
        send = self.compute().reshape(-1)
        dist.all_to_all_single(self.recv, send, self.out_splits, self.in_splits, group=self.group)
        parts = self.recv.split(self.out_splits)
        cols = torch.cat([p.view(self.B_r, n, self.D) for p, n in zip(parts, self.n_of)], 1)
        self.out.index_copy_(1, self.order, cols)
        return self.out


def sweep(bench, shape, dname, weight, lengths, indices, splits) -> None:
    """Time the fused op per (bags per tile, warps, grid cap): a context per variant, graph
    replay. ``programs`` 0 is the op's default cap."""
    world, args = bench.world, bench.args
    D = shape["dim"]
    base = max(1, min(64, 4096 // (1 << (D - 1).bit_length())))
    found = []
    variants = [(bb, nw, 0) for bb in sorted({max(1, base // 2), base, base * 2}) for nw in (4, 8)]
    variants += [(0, 0, cap) for cap in (264, 396, 792)]  # grid caps at the default tile
    for bb, nw, cap in variants:
        ctx = EmbeddingAllToAll(world, [shape["rows"]] * shape["tables"], D, max(splits),
                                transport="stores", block_b=bb or None, num_warps=nw or None,
                                max_programs=cap or None)
        try:
            out = torch.empty(ctx.output_shape(splits), dtype=weight.dtype,
                              device=weight.device)
            ctx(weight, lengths, indices, batch_splits=splits, out=out)
            ctx.synchronize()
            timing = time_op(lambda: ctx(weight, lengths, indices, batch_splits=splits,
                                         out=out, validate=False), world, graph=True,
                             iters=args.iters, warmup=args.warmup)
            t = timing["median_ms"]
            programs = next(iter(ctx.impl._plans.values())).programs
        except Exception as e:  # a tile that does not fit is skipped
            t, programs, timing = float("inf"), None, None
            if world.rank == 0:
                print(f"  block_b={bb} num_warps={nw} cap={cap} failed: {type(e).__name__}: "
                      f"{str(e)[:200]}", flush=True)
        finally:
            bb, nw = ctx.impl.tile_for(weight.dtype)
            ctx.close()
        found.append((t, bb, nw, programs))
        if world.rank == 0:
            bench.write(op=OP + "_tuning", shape=shape, dtype=dname, impl="fused",
                        graph=True, block_b=bb, num_warps=nw, programs=programs,
                        # the protocol's p10 / p90 with the median; a variant that failed has
                        # no time (its median was written as Infinity, which is no JSON)
                        **({k: round(v, 5) for k, v in timing.items()} if timing
                           else {"failed": True}))
    if world.rank == 0:
        best = min(found, key=lambda f: f[0])
        print(f"  sweep {shape['batch']}x{shape['tables']}x{D}: best block_b={best[1]} "
              f"num_warps={best[2]} programs={best[3]} {best[0]:.3f} ms; all: "
              + ", ".join(f"{bb}/{nw}/{g}:{t:.3f}" for t, bb, nw, g in found), flush=True)


def parser() -> BenchParser:
    ap = BenchParser(__doc__, dims=("batch", "tables", "dim", "pooling_factor", "rows"),
                     split_dims=("batch",),
                     shapes=SHAPES, dtypes=("fp32", "fp16"), iters=50, warmup=10,
                     shapes_help="(B x T x D x PF x ROWS) ")
    ap.add_choices("--dists", ("uniform", "zipf"), "uniform,zipf")
    ap.add_argument("--shmem", action="store_true",
                    help="also time the device-initiated (NVSHMEM) transport as fused_shmem")
    ap.add_argument("--sweep", action="store_true",
                    help="first time the fused op per tile (bags per tile x warps) on each "
                         "shape's first dtype and index distribution (graph replay)")
    return ap


def body(bench) -> int:
    world, args = bench.world, bench.args
    dev, W, r = world.device, world.world_size, world.rank
    solo_groups = [dist.new_group([q]) for q in range(W)]
    solo = World.from_process_group(group=solo_groups[r], device=dev)
    gen = torch.Generator(device=dev).manual_seed(77 + r)
    dists = [d for d in args.dists.split(",") if d]
    for sh in args.shapes:
        B, T, D, pf, rows = (sh[k] for k in ("batch", "tables", "dim", "pooling_factor", "rows"))
        if B % W or T % W:
            bench.say(f"skipping {B}x{T}: batch and tables must split over {W} ranks")
            continue
        splits = [B // W] * W
        ctx = EmbeddingAllToAll(world, [rows] * T, D, B // W, transport="stores")
        plain_ctx = EmbeddingAllToAll(world, [rows] * T, D, B // W, transport="sequential")
        auto_ctx = EmbeddingAllToAll(world, [rows] * T, D, B // W, transport="auto")
        shmem_ctx = None
        if args.shmem:  # device-initiated puts (NVSHMEM / ROC_SHMEM)
            try:
                shmem_ctx = EmbeddingAllToAll(world, [rows] * T, D, B // W, transport="shmem")
            except Exception as e:
                bench.say(f"shmem transport unavailable: {type(e).__name__}: {e}")
        n_loc = ctx.n_loc
        # the compute-alone baseline: the same kernel, this rank's tables, the whole batch, alone
        solo_ctx = EmbeddingAllToAll(solo, [rows] * n_loc, D, B, transport="stores")
        lengths = torch.full((n_loc * B,), pf, dtype=torch.int64, device=dev)
        for dname in args.dtypes:
            dt = DTYPES[dname]
            weight = (torch.randn(ctx.weight_rows, D, generator=gen, device=dev) * 0.1).to(dt)
            for dist_name in dists:
                shape = {"batch": B, "tables": T, "dim": D, "pooling_factor": pf, "rows": rows,
                         "indices": dist_name, "tables_per_rank": n_loc}
                indices = make_indices(n_loc, rows, B * pf, dist_name, gen, dev)
                out = torch.empty(ctx.output_shape(splits), dtype=dt, device=dev)
                solo_out = torch.empty(solo_ctx.output_shape([B]), dtype=dt, device=dev)
                seq = Sequential(ctx, weight, indices, B, pf, splits, world.group)
                if args.sweep and dname == args.dtypes[0] and dist_name == dists[0]:
                    sweep(bench, shape, dname, weight, lengths, indices, splits)
                # random, not empty: "comm" moves it as it is (the protocol times no zeros)
                send = torch.randn(B * n_loc * D, generator=gen, device=dev).to(dt)
                recv = torch.empty_like(send)
                out2 = torch.full_like(out, float("nan")) if shmem_ctx is not None else None
                out3, out4 = torch.empty_like(out), torch.empty_like(out)
                # the decision, at an eager call with the timed call's options (the timing
                # captures it in a graph)
                auto_ctx(weight, lengths, indices, batch_splits=splits, out=out4, validate=False)
                auto_ctx.synchronize()
                impls = {
                    "fused": lambda: ctx(weight, lengths, indices, batch_splits=splits, out=out,
                                         validate=False),
                    "sequential": seq,
                    "plain": lambda: plain_ctx(weight, lengths, indices, batch_splits=splits,
                                               out=out3, validate=False),
                    "auto": lambda: auto_ctx(weight, lengths, indices, batch_splits=splits,
                                             out=out4, validate=False),
                    "compute": lambda: solo_ctx(weight, lengths, indices, batch_splits=[B],
                                                out=solo_out, validate=False),
                    "comm": lambda: dist.all_to_all_single(recv, send, group=world.group),
                    "sequential_compute": seq.compute,
                }
                if shmem_ctx is not None:
                    impls["fused_shmem"] = lambda: shmem_ctx(
                        weight, lengths, indices, batch_splits=splits, out=out2, validate=False)
                # the reference paths' errors, for their rows
                found = {"sequential": float("nan"), "plain": float("nan"), "auto": float("nan")}

                def check(name):
                    if name in ("plain", "auto"):  # (found by the check of "fused", run first)
                        return found[name]
                    if name == "fused_shmem":  # same kernel body, same sums: same bits
                        shmem_ctx(weight, lengths, indices, batch_splits=splits, out=out2)
                        shmem_ctx.synchronize()
                        return 0.0 if torch.equal(out2, out) else float("inf")
                    # validate=True (the default) checks the indices
                    out.fill_(float("nan"))
                    ctx(weight, lengths, indices, batch_splits=splits, out=out)
                    ctx.synchronize()
                    ref = embedding_all_to_all_reference(weight, lengths, indices, None,
                                                         ctx.plan, r, splits, "sum",
                                                         world.group)
                    found["sequential"] = rel_err(seq().reshape(ref.shape), ref)
                    for name, c, o in (("plain", plain_ctx, out3), ("auto", auto_ctx, out4)):
                        o.fill_(float("nan"))
                        c(weight, lengths, indices, batch_splits=splits, out=o)
                        c.synchronize()
                        found[name] = rel_err(o, ref)
                    return rel_err(out, ref)

                bench.run(Case(
                    op=OP, shape=shape, dtype=dname, impls=impls, check=check,
                    checked=["fused", "fused_shmem", "plain", "auto"],
                    tol=1e-5 if dt == torch.float32 else 2e-3,
                    label=f"{B}x{T}x{D}x{pf}x{rows} {dname} {dist_name}",
                    fields=lambda name: {"rel_err": found["sequential"]}
                    if name == "sequential" else {}))
                picks = auto_ctx.choices(weight, lengths, indices, batch_splits=splits,
                                         validate=False)
                bench.say(f"  auto picked {picks}")
                del seq, indices, out, solo_out, send, recv, out2, out3, out4
            del weight
            torch.cuda.empty_cache()
        ctx.close()
        plain_ctx.close()
        auto_ctx.close()
        solo_ctx.close()
        if shmem_ctx is not None:
            shmem_ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(run_main(parser(), body))
