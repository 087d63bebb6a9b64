"""Benchmark of the fused embedding pooling + All-to-All against a torch EmbeddingBag loop +
NCCL all_to_all_single, by the protocol in benchmarks/harness.py. Run under torchrun:

    torchrun --nproc-per-node 2 benchmarks/bench_embedding_alltoall.py --out results.jsonl \
        --device-kind nvidia-h200-x2

Shapes are (global batch, total tables, D, pooling factor, rows per table); the tables are
sharded table-wise over the ranks (``ShardingPlan.make``: equal rows, so T / world each), every
bag holds exactly ``pooling factor`` indices, uniform or Zipf(1.05) over a table's rows. Impls:

- ``fused``: the fused kernel (remote slices first, stores into the peers' heaps);
- ``sequential``: ``F.embedding_bag`` per local table, ``all_to_all_single``, columns into
  global table order (what a model does without the fused op);
- ``compute``: the fused kernel on a world of one rank (its own tables for the whole global
  batch, every store local): the lookup alone;
- ``comm``: ``all_to_all_single`` of the same bytes alone;
- ``sequential_compute``: the EmbeddingBag loop alone (for reading the table).

``ideal = max(compute, comm)``; summary rows give the speedup ``sequential / fused`` and the
fraction of ideal ``(sequential - fused) / (sequential - ideal)``. Correctness of the fused op is
checked against the float32 reference in the same run before timing.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.harness import ResultWriter, time_op
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


def sweep(world, shape, dname, weight, lengths, indices, splits, args, writer) -> None:
    """Time the fused op per (bags per tile, warps, grid cap): a context per variant, graph
    replay. ``programs`` 0 is the op's default cap."""
    D = shape["dim"]
    base = max(1, min(64, 4096 // (1 << (D - 1).bit_length())))
    found = []
    variants = [(bb, nw, 0) for bb in sorted({max(1, base // 2), base, base * 2}) for nw in (4, 8)]
    variants += [(0, 0, cap) for cap in (264, 396, 792)]  # grid caps at the default tile
    for bb, nw, cap in variants:
        ctx = EmbeddingAllToAll(world, [shape["rows"]] * shape["tables"], D, max(splits),
                                block_b=bb or None, num_warps=nw or None,
                                max_programs=cap or None)
        try:
            out = torch.empty(ctx.output_shape(splits), dtype=weight.dtype,
                              device=weight.device)
            ctx(weight, lengths, indices, batch_splits=splits, out=out)
            ctx.synchronize()
            t = time_op(lambda: ctx(weight, lengths, indices, batch_splits=splits, out=out,
                                    validate=False), world, graph=True, iters=args.iters,
                        warmup=args.warmup)["median_ms"]
            programs = next(iter(ctx._plans.values())).programs
        except Exception as e:  # a tile that does not fit is skipped
            t, programs = float("inf"), None
            if world.rank == 0:
                print(f"  block_b={bb} num_warps={nw} cap={cap} failed: {type(e).__name__}: "
                      f"{str(e)[:200]}", flush=True)
        finally:
            bb, nw = ctx.block_b, ctx.num_warps
            ctx.close()
        found.append((t, bb, nw, programs))
        if world.rank == 0:
            writer.write(op=OP + "_tuning", shape=shape, dtype=dname, impl="fused",
                         graph=True, block_b=bb, num_warps=nw, programs=programs,
                         median_ms=round(t, 5))
    if world.rank == 0:
        best = min(found, key=lambda f: f[0])
        print(f"  sweep {shape['batch']}x{shape['tables']}x{D}: best block_b={best[1]} "
              f"num_warps={best[2]} programs={best[3]} {best[0]:.3f} ms; all: "
              + ", ".join(f"{bb}/{nw}/{g}:{t:.3f}" for t, bb, nw, g in found), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device-kind", default="unknown")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--shapes", default="", help="BxTxDxPFxROWS,... (default: the 3 standard)")
    ap.add_argument("--dtypes", default="fp32,fp16")
    ap.add_argument("--dists", default="uniform,zipf")
    ap.add_argument("--shmem", action="store_true",
                    help="also time the device-initiated (NVSHMEM) transport as fused_shmem")
    ap.add_argument("--sweep", action="store_true",
                    help="first time the fused op per tile (bags per tile x warps) on each "
                         "shape's first dtype and index distribution (graph replay)")
    args = ap.parse_args()
    world = World.from_env()
    dev = world.device
    W, r = world.world_size, world.rank
    writer = ResultWriter(args.out, args.device_kind, W)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",") if s] or SHAPES
    solo_groups = [dist.new_group([q]) for q in range(W)]
    solo = World.from_process_group(group=solo_groups[r], device=dev)
    gen = torch.Generator(device=dev).manual_seed(77 + r)
    table = []
    for B, T, D, pf, rows in shapes:
        if B % W or T % W:
            if r == 0:
                print(f"skipping {B}x{T}: batch and tables must split over {W} ranks", flush=True)
            continue
        splits = [B // W] * W
        ctx = EmbeddingAllToAll(world, [rows] * T, D, B // W)
        shmem_ctx = None
        if args.shmem:  # device-initiated puts (NVSHMEM / ROC_SHMEM)
            try:
                shmem_ctx = EmbeddingAllToAll(world, [rows] * T, D, B // W, transport="shmem")
            except Exception as e:
                if r == 0:
                    print(f"shmem transport unavailable: {type(e).__name__}: {e}", flush=True)
        n_loc = ctx.n_loc
        # the compute-alone baseline: the same kernel, this rank's tables, the whole batch, alone
        solo_ctx = EmbeddingAllToAll(solo, [rows] * n_loc, D, B)
        lengths = torch.full((n_loc * B,), pf, dtype=torch.int64, device=dev)
        for dname in args.dtypes.split(","):
            dt = DTYPES[dname]
            weight = (torch.randn(ctx.weight_rows, D, generator=gen, device=dev) * 0.1).to(dt)
            for dist_name in args.dists.split(","):
                shape = {"batch": B, "tables": T, "dim": D, "pooling_factor": pf, "rows": rows,
                         "indices": dist_name, "tables_per_rank": n_loc}
                indices = make_indices(n_loc, rows, B * pf, dist_name, gen, dev)
                out = torch.empty(ctx.output_shape(splits), dtype=dt, device=dev)
                solo_out = torch.empty(solo_ctx.output_shape([B]), dtype=dt, device=dev)
                seq = Sequential(ctx, weight, indices, B, pf, splits, world.group)
                # correctness in the same run, before timing (validate=True checks the indices)
                err = float("inf")
                try:
                    out.fill_(float("nan"))
                    ctx(weight, lengths, indices, batch_splits=splits, out=out)
                    ctx.synchronize()
                    ref = embedding_all_to_all_reference(weight, lengths, indices, None, ctx.plan,
                                                         r, splits, "sum", world.group)
                    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
                    seq_err = ((seq().reshape(ref.shape).double() - ref.double()).norm()
                               / ref.double().norm()).item()
                    del ref
                except Exception as e:
                    print(f"rank {r}: fused failed at {shape}: {type(e).__name__}: "
                          f"{str(e)[-300:]}", flush=True)
                    seq_err = float("nan")
                correct = bool(err < (1e-5 if dt == torch.float32 else 2e-3))
                if args.sweep and dname == args.dtypes.split(",")[0] \
                        and dist_name == args.dists.split(",")[0]:
                    sweep(world, shape, dname, weight, lengths, indices, splits, args, writer)
                if r == 0:
                    print(f"{B}x{T}x{D}x{pf}x{rows} {dname} {dist_name}: rel_err fused "
                          f"{err:.1e}, sequential {seq_err:.1e}", flush=True)
                send = torch.empty(B * n_loc * D, dtype=dt, device=dev)
                recv = torch.empty_like(send)
                impls = {
                    "fused": lambda: ctx(weight, lengths, indices, batch_splits=splits, out=out,
                                         validate=False),
                    "sequential": seq,
                    "compute": lambda: solo_ctx(weight, lengths, indices, batch_splits=[B],
                                                out=solo_out, validate=False),
                    "comm": lambda: dist.all_to_all_single(recv, send, group=world.group),
                    "sequential_compute": seq.compute,
                }
                if shmem_ctx is not None:
                    out2 = torch.full_like(out, float("nan"))
                    shmem_ctx(weight, lengths, indices, batch_splits=splits, out=out2)
                    shmem_ctx.synchronize()
                    if torch.equal(out2, out):  # same kernel body, same sums: same bits
                        impls["fused_shmem"] = lambda: shmem_ctx(
                            weight, lengths, indices, batch_splits=splits, out=out2,
                            validate=False)
                    elif r == 0:
                        print(f"fused_shmem differs from fused at {shape}: not timed", flush=True)
                row = {"shape": f"{B}x{T}x{D}x{pf}x{rows}", "dtype": dname, "dist": dist_name,
                       "err": err}
                for graph in (False, True):
                    for name, fn in impls.items():
                        if name == "fused" and not correct:
                            continue
                        try:
                            t = time_op(fn, world, graph=graph, iters=args.iters,
                                        warmup=args.warmup)
                        except Exception as e:
                            if r == 0:
                                print(f"{name} graph={graph} failed: {type(e).__name__}: "
                                      f"{str(e)[:300]}", flush=True)
                            continue
                        row[(name, graph)] = t["median_ms"]
                        if r == 0:
                            writer.write(op=OP, shape=shape, dtype=dname, impl=name, graph=graph,
                                         correct=correct if name == "fused" else None,
                                         rel_err=err if name == "fused" else (
                                             seq_err if name == "sequential" else None),
                                         **{k: round(v, 5) for k, v in t.items()})
                table.append(row)
                if r == 0:
                    for graph in (False, True):
                        t = {n: row.get((n, graph)) for n in impls}
                        if None in (t["fused"], t["sequential"], t["compute"], t["comm"]):
                            continue
                        ideal = max(t["compute"], t["comm"])
                        writer.write(
                            op=OP + "_summary", shape=shape, dtype=dname, graph=graph,
                            ideal_ms=round(ideal, 5), fused_ms=round(t["fused"], 5),
                            sequential_ms=round(t["sequential"], 5),
                            compute_ms=round(t["compute"], 5), comm_ms=round(t["comm"], 5),
                            speedup=round(t["sequential"] / t["fused"], 3),
                            # undefined when the sequential run was not slower than the ideal
                            fraction_of_ideal=round((t["sequential"] - t["fused"])
                                                    / (t["sequential"] - ideal), 3)
                            if t["sequential"] > ideal else None)
                del seq, indices, out, solo_out, send, recv
            del weight
            torch.cuda.empty_cache()
        ctx.close()
        solo_ctx.close()
        if shmem_ctx is not None:
            shmem_ctx.close()
    if r == 0:
        print("\nEmbedding pooling + All-to-All, ms (slowest rank's median), graph replay | plain")
        print(f"{'B x T x D x pf x rows':>26} {'dt':>4} {'idx':>7} {'fused':>7} {'seq':>7} "
              f"{'comp':>7} {'comm':>7} {'seqC':>7} {'spd':>5} {'f.ideal':>7} | {'fusedP':>7} "
              f"{'seqP':>7} {'spdP':>5} {'ok':>3}")
        for row in table:
            g = lambda n, gr: row.get((n, gr), float("nan"))  # noqa: E731
            ideal = max(g("compute", True), g("comm", True))
            frac = (g("sequential", True) - g("fused", True)) / (g("sequential", True) - ideal) \
                if g("sequential", True) > ideal else float("nan")
            print(f"{row['shape']:>26} {row['dtype']:>4} {row['dist']:>7} {g('fused', True):7.3f} "
                  f"{g('sequential', True):7.3f} {g('compute', True):7.3f} {g('comm', True):7.3f} "
                  f"{g('sequential_compute', True):7.3f} "
                  f"{g('sequential', True) / g('fused', True):5.2f} {frac:7.2f} | "
                  f"{g('fused', False):7.3f} {g('sequential', False):7.3f} "
                  f"{g('sequential', False) / g('fused', False):5.2f} "
                  f"{'yes' if row['err'] < 2e-3 else 'NO':>3}"
                  + (f" | shmem {g('fused_shmem', True):.3f}" if ("fused_shmem", True) in row
                     else ""), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
