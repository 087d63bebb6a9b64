"""Benchmark of the fused MoE expert GEMM + combine against the sequential expert-parallel path,
by the protocol in benchmarks/harness.py. Run under torchrun:

    torchrun --nproc-per-node 2 benchmarks/bench_moe_combine.py --out results.jsonl \\
        --device-kind nvidia-h200-x2

Shapes (S tokens per rank, H, I, E experts in all, top-k). Routing ``balanced`` (uniform random
top-k) or ``zipf`` (expert popularity ~ 1/(rank+1)^1.2, top-k drawn without replacement). The
dispatch (untimed) gives every rank its rows; then, timed:

- ``fused``: the fused kernel pair (grouped GEMM storing rows into the sources' combine buffers,
  weighted sum);
- ``sequential``: per (source, expert) segment torch.matmul, all_to_all_single with splits,
  un-permute, weighted sum;
- ``sequential_padded``: every (source, expert) segment padded to the largest one (capacity),
  one bmm per expert, equal-split all_to_all_single, weighted sum (what capacity-padded MoE does);
- ``compute``: the sequential path's matmuls alone; ``compute_fused``: the fused kernels on a
  world of one rank (no communication, same rows); ``comm``: the unpadded all_to_all_single alone.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from benchmarks.harness import ResultWriter, time_op
from portable_overlap import World
from portable_overlap.ops.moe_combine import MoeGemmCombine, dispatch

SHAPES = [(8192, 2048, 1536, 8, 2), (8192, 2048, 1536, 32, 5), (8192, 4096, 2048, 8, 2),
          (8192, 4096, 2048, 32, 5)]
OP = "moe_gemm_combine"


def route(kind, S, E, k, gen, dev):
    if kind == "zipf":
        p = 1.0 / torch.arange(1, E + 1, device=dev, dtype=torch.float32) ** 1.2
        return torch.multinomial(p.expand(S, E), k, replacement=False, generator=gen)
    return torch.rand(S, E, generator=gen, device=dev).topk(k, dim=1).indices


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device-kind", default="unknown")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--shapes", default="", help="SxHxIxExk,...")
    ap.add_argument("--routings", default="balanced,zipf")
    ap.add_argument("--graph", default="0,1")
    args = ap.parse_args()
    world = World.from_env()
    dev, W, r = world.device, world.world_size, world.rank
    writer = ResultWriter(args.out, args.device_kind, W)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",") if s] or SHAPES
    graphs = [bool(int(g)) for g in args.graph.split(",")]
    solo = World.from_process_group(group=[dist.new_group([q]) for q in range(W)][r], device=dev)
    gen = torch.Generator(device=dev).manual_seed(r)
    table = []
    for S, H, I, E, k in shapes:
        El = E // W
        ctx = MoeGemmCombine(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El)
        try:  # device-initiated puts (NVSHMEM / ROC_SHMEM)
            ctx_shmem = MoeGemmCombine(world, max_tokens=S, top_k=k, hidden=H,
                                       experts_per_rank=El, transport="shmem")
        except Exception as e:
            ctx_shmem = None
            if r == 0:
                print(f"shmem transport unavailable: {type(e).__name__}: {e}", flush=True)
        w = (torch.randn(El, I, H, generator=gen, device=dev) / I ** 0.5).bfloat16()
        for kind in args.routings.split(","):
            shape = {"S": S, "H": H, "I": I, "E": E, "k": k, "routing": kind}
            tokens = torch.randn(S, I, generator=gen, device=dev).bfloat16()
            ids = route(kind, S, E, k, gen, dev)
            tw = torch.softmax(torch.randn(S, k, generator=gen, device=dev), 1)
            x, counts, slots = dispatch(tokens, ids, El, world.group)
            R = x.shape[0]
            out = torch.empty(S, H, device=dev, dtype=torch.bfloat16)
            # --- the sequential path's fixed metadata (known on the host after dispatch)
            bounds = [0] + torch.cumsum(counts.flatten().long(), 0).tolist()
            send_splits = counts.sum(1).tolist()
            recv_splits = world.all_gather_object(send_splits)
            recv_splits = [recv_splits[q][r] for q in range(W)]
            order = torch.argsort(ids.reshape(-1), stable=True)  # as dispatch sent them
            y = torch.empty(R, H, device=dev, dtype=torch.bfloat16)
            back = torch.empty(S * k, H, device=dev, dtype=torch.bfloat16)
            placed = torch.empty_like(back)

            def compute():
                for s in range(W * El):
                    if bounds[s + 1] > bounds[s]:
                        torch.matmul(x[bounds[s]:bounds[s + 1]], w[s % El],
                                     out=y[bounds[s]:bounds[s + 1]])

            def comm():
                dist.all_to_all_single(back, y, recv_splits, send_splits)

            def sequential():
                compute()
                comm()
                placed[order] = back
                torch.sum(placed.view(S, k, H) * tw.unsqueeze(-1).to(placed.dtype), 1, out=out)

            # capacity padding: every (source, expert) segment padded to the largest anywhere
            cap = counts.max().to(torch.int64).reshape(1)
            dist.all_reduce(cap, op=dist.ReduceOp.MAX)
            C = max(1, int(cap))
            x_pad = torch.zeros(El, W * C, I, device=dev, dtype=torch.bfloat16)
            for s in range(W * El):
                q, e = divmod(s, El)
                n = bounds[s + 1] - bounds[s]
                x_pad[e, q * C:q * C + n] = x[bounds[s]:bounds[s + 1]]
            y_pad = torch.empty(El, W * C, H, device=dev, dtype=torch.bfloat16)
            send_pad = torch.empty(W, El, C, H, device=dev, dtype=torch.bfloat16)
            recv_pad = torch.empty_like(send_pad)
            # where each of this rank's S*k slots sits in what comes back padded
            cnt_all = torch.stack(world.all_gather_object(counts.cpu()))  # [holder, src, e]
            pad_index = torch.empty(S * k, dtype=torch.long, device=dev)
            pos = 0
            for d in range(W):
                for e in range(El):
                    n = int(cnt_all[d, r, e])
                    pad_index[pos:pos + n] = (d * El + e) * C + torch.arange(n, device=dev)
                    pos += n

            def sequential_padded():
                torch.bmm(x_pad, w, out=y_pad)
                send_pad.copy_(y_pad.view(El, W, C, H).transpose(0, 1))
                dist.all_to_all_single(recv_pad, send_pad)
                placed[order] = recv_pad.view(-1, H)[pad_index]
                torch.sum(placed.view(S, k, H) * tw.unsqueeze(-1).to(placed.dtype), 1, out=out)

            # the fused kernels with no peers: same rows, segments as experts, one slot each
            solo_ctx = MoeGemmCombine(solo, max_tokens=max(R, 1), top_k=1, hidden=H,
                                      experts_per_rank=W * El)
            w_rep = w.repeat(W, 1, 1)
            c_solo = counts.reshape(1, W * El).contiguous()
            s_solo = torch.arange(R, dtype=torch.int32, device=dev)
            t_solo = torch.ones(R, 1, device=dev)
            o_solo = torch.empty(R, H, device=dev, dtype=torch.bfloat16)
            impls = {
                "fused": lambda: ctx(x, w, counts, slots, tw, out=out),
                "fused_shmem": lambda: ctx_shmem(x, w, counts, slots, tw, out=out),
                "sequential": sequential,
                "sequential_padded": sequential_padded,
                "compute": compute,
                "compute_fused": lambda: solo_ctx(x, w_rep, c_solo, s_solo, t_solo, out=o_solo),
                "comm": comm,
            }
            if ctx_shmem is None:
                del impls["fused_shmem"]
            real_rows = R - int(counts[r].sum())  # rows this rank sends to other ranks
            bytes_sent = {"fused": real_rows * H * 2, "fused_shmem": real_rows * H * 2,
                          "sequential": real_rows * H * 2,
                          "comm": real_rows * H * 2,
                          "sequential_padded": (W - 1) * El * C * H * 2}
            # correctness of fused and both baselines against each other, before timing
            errs = {}
            sequential()
            ref = out.clone()
            for name in [n for n in ("fused", "fused_shmem", "sequential_padded") if n in impls]:
                out.fill_(float("nan"))
                impls[name]()
                torch.cuda.synchronize()
                if name == "fused":
                    ctx.check()
                if name == "fused_shmem":
                    ctx_shmem.check()
                errs[name] = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
            row = {"shape": f"{S}x{H}x{I}x{E}x{k} {kind}", "errs": errs, "R": R, "C": C}
            for graph in graphs:
                for name, fn in impls.items():
                    try:
                        res = time_op(fn, world, graph=graph, iters=args.iters, warmup=10)
                    except Exception as e:
                        if r == 0:
                            print(f"{name} graph={graph} failed: {type(e).__name__}: {e}",
                                  flush=True)
                        continue
                    row[(name, graph)] = res["median_ms"]
                    if r == 0:
                        err = errs.get(name)
                        writer.write(op=OP, shape=shape, dtype="bf16", impl=name, graph=graph,
                                     bytes_sent_per_rank=bytes_sent.get(name, 0),
                                     rows_received=R, capacity=C, rel_err=err,
                                     correct=None if err is None else bool(err < 2e-2),
                                     **{kk: round(v, 5) for kk, v in res.items()})
            for graph in graphs:
                t = {n: row.get((n, graph)) for n in impls}
                if r == 0 and None not in (t["fused"], t["sequential"], t["compute"], t["comm"]):
                    ideal = max(t["compute"], t["comm"])
                    writer.write(op=OP + "_summary", shape=shape, dtype="bf16", graph=graph,
                                 impl="fused", ideal_ms=round(ideal, 5),
                                 fused_ms=round(t["fused"], 5),
                                 sequential_ms=round(t["sequential"], 5),
                                 sequential_padded_ms=t["sequential_padded"],
                                 speedup=round(t["sequential"] / t["fused"], 3),
                                 fraction_of_ideal=round((t["sequential"] - t["fused"])
                                                         / (t["sequential"] - ideal), 3)
                                 if t["sequential"] > ideal else None,
                                 compute_fused_over_compute=round(t["compute"]
                                                                  / t["compute_fused"], 3)
                                 if t["compute_fused"] else None)
            table.append(row)
            solo_ctx.close()
        ctx.close()
        if ctx_shmem is not None:
            ctx_shmem.close()
    if r == 0:
        names = ["fused", "fused_shmem", "sequential", "sequential_padded", "compute",
                 "compute_fused", "comm"]
        print("\nms, slowest rank's median; frac = (seq - fused) / (seq - max(compute, comm))")
        for graph in graphs:
            print(f"-- {'graph replay' if graph else 'plain launches'}")
            print(f"{'S x H x I x E x k routing':>28} " + " ".join(f"{n[:12]:>12}" for n in names)
                  + "   frac  cmp_eff")
            for row in table:
                t = {n: row.get((n, graph), float("nan")) for n in names}
                ideal = max(t["compute"], t["comm"])
                frac = (t["sequential"] - t["fused"]) / (t["sequential"] - ideal)
                print(f"{row['shape']:>28} " + " ".join(f"{t[n]:12.3f}" for n in names)
                      + f" {frac:6.2f} {t['compute'] / t['compute_fused']:7.2f}")
        print("rel errors vs sequential:", {row["shape"]: {kk: f"{v:.1e}" for kk, v in
                                                           row["errs"].items()} for row in table})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
