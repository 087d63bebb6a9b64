"""Benchmark of the fused MoE expert GEMM + combine against the sequential expert-parallel path,
by the protocol in benchmarks/harness.py. Run under torchrun:

    torchrun --nproc-per-node 2 -m benchmarks.bench_moe_combine --out results.jsonl \\
        --device-kind nvidia-h200-x2

Shapes (S tokens per rank, H, I, E experts in all, top-k). Routing ``balanced`` (uniform random
top-k) or ``zipf`` (expert popularity ~ 1/(rank+1)^1.2, top-k drawn without replacement). The
dispatch (untimed) gives every rank its rows; then, timed:

- ``fused``: the fused kernel pair (grouped GEMM storing rows into the sources' combine buffers,
  weighted sum), ``transport="stores"``; ``fused_shmem``: the same over the SHMEM library;
- ``auto``: ``transport="auto"`` (its pick, timed at its first call, runs the timed calls);
- ``sequential_transport``: ``transport="sequential"``, the torch path as the library runs it
  (the splits read on the host at every call; plain launches only, it cannot be captured);
- ``sequential``: per (source, expert) segment torch.matmul, all_to_all_single with splits,
  un-permute, weighted sum;
- ``sequential_padded``: every (source, expert) segment padded to the largest one (capacity),
  one bmm per expert, equal-split all_to_all_single, weighted sum (what capacity-padded MoE does);
- ``compute``: the sequential path's matmuls alone; ``compute_fused``: the fused kernels on a
  world of one rank (no communication, same rows); ``comm``: the unpadded all_to_all_single alone.

``fused``, ``fused_shmem``, ``auto``, ``sequential_transport`` and ``sequential_padded`` are
checked against ``sequential``'s result.
The shared options (shapes, dtypes, worlds, graph modes, checks) are in benchmarks/cli.py.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from benchmarks.cli import BenchParser
from benchmarks.runner import Case, rel_err, run_main, torch_dtype
from portable_overlap import World
from portable_overlap.ops.moe_combine import MoeGemmCombine
from portable_overlap.ops.moe_dispatch import moe_dispatch_reference

SHAPES = [(8192, 2048, 1536, 8, 2), (8192, 2048, 1536, 32, 5), (8192, 4096, 2048, 8, 2),
          (8192, 4096, 2048, 32, 5)]
OP = "moe_gemm_combine"


def route(kind, S, E, k, gen, dev):
    if kind == "zipf":
        p = 1.0 / torch.arange(1, E + 1, device=dev, dtype=torch.float32) ** 1.2
        return torch.multinomial(p.expand(S, E), k, replacement=False, generator=gen)
    return torch.rand(S, E, generator=gen, device=dev).topk(k, dim=1).indices


def parser() -> BenchParser:
    ap = BenchParser(__doc__, dims=("S", "H", "I", "E", "k"),
                     split_dims=("E",), shapes=SHAPES, dtypes=("bf16",),
                     allowed_dtypes=("bf16", "fp16"), iters=50, warmup=10)
    ap.add_choices("--routings", ("balanced", "zipf"), "balanced,zipf")
    return ap


def body(bench) -> int:
    world, args = bench.world, bench.args
    dev, W, r = world.device, world.world_size, world.rank
    solo = World.from_process_group(group=[dist.new_group([q]) for q in range(W)][r], device=dev)
    gen = torch.Generator(device=dev).manual_seed(r)
    for dname in args.dtypes:
        dt = torch_dtype(dname)
        for sh in args.shapes:
            one_shape(bench, solo, gen, dname, dt, *(sh[d] for d in ("S", "H", "I", "E", "k")))
    return 0


def one_shape(bench, solo, gen, dname, dt, S, H, I, E, k) -> None:
    """Every routing of one shape: dispatch (untimed), the impls, ``bench.run``."""
    world, args = bench.world, bench.args
    dev, W, r = world.device, world.world_size, world.rank
    El = E // W
    ctx = MoeGemmCombine(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El,
                         transport="stores")
    # the library's default: the faster of "stores" and "sequential" at the first call
    ctx_auto = MoeGemmCombine(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El,
                              transport="auto")
    ctx_seq = MoeGemmCombine(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El,
                             transport="sequential")
    try:  # device-initiated puts (NVSHMEM / ROC_SHMEM)
        ctx_shmem = MoeGemmCombine(world, max_tokens=S, top_k=k, hidden=H,
                                   experts_per_rank=El, transport="shmem")
    except Exception as e:
        ctx_shmem = None
        bench.say(f"shmem transport unavailable: {type(e).__name__}: {e}")
    w = (torch.randn(El, I, H, generator=gen, device=dev) / I ** 0.5).to(dt)
    for kind in [x for x in args.routings.split(",") if x]:
        shape = {"S": S, "H": H, "I": I, "E": E, "k": k, "routing": kind}
        tokens = torch.randn(S, I, generator=gen, device=dev).to(dt)
        ids = route(kind, S, E, k, gen, dev)
        tw = torch.softmax(torch.randn(S, k, generator=gen, device=dev), 1)
        x, counts, slots = moe_dispatch_reference(tokens, ids, El, world.group)
        R = x.shape[0]
        out = torch.empty(S, H, device=dev, dtype=dt)
        # --- the sequential path's fixed metadata (known on the host after dispatch)
        bounds = [0] + torch.cumsum(counts.flatten().long(), 0).tolist()
        send_splits = counts.sum(1).tolist()
        recv_splits = world.all_gather_object(send_splits)
        recv_splits = [recv_splits[q][r] for q in range(W)]
        order = torch.argsort(ids.reshape(-1), stable=True)  # as dispatch sent them
        y = torch.empty(R, H, device=dev, dtype=dt)
        back = torch.empty(S * k, H, device=dev, dtype=dt)
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
        x_pad = torch.zeros(El, W * C, I, device=dev, dtype=dt)
        for s in range(W * El):
            q, e = divmod(s, El)
            n = bounds[s + 1] - bounds[s]
            x_pad[e, q * C:q * C + n] = x[bounds[s]:bounds[s + 1]]
        y_pad = torch.empty(El, W * C, H, device=dev, dtype=dt)
        send_pad = torch.empty(W, El, C, H, device=dev, dtype=dt)
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
                                  experts_per_rank=W * El, transport="stores")
        w_rep = w.repeat(W, 1, 1)
        c_solo = counts.reshape(1, W * El).contiguous()
        s_solo = torch.arange(R, dtype=torch.int32, device=dev)
        t_solo = torch.ones(R, 1, device=dev)
        o_solo = torch.empty(R, H, device=dev, dtype=dt)
        impls = {
            "fused": lambda: ctx(x, w, counts, slots, tw, out=out),
            "fused_shmem": lambda: ctx_shmem(x, w, counts, slots, tw, out=out),
            "auto": lambda: ctx_auto(x, w, counts, slots, tw, out=out),
            "sequential_transport": lambda: ctx_seq(x, w, counts, slots, tw, out=out),
            "sequential": sequential,
            "sequential_padded": sequential_padded,
            "compute": compute,
            "compute_fused": lambda: solo_ctx(x, w_rep, c_solo, s_solo, t_solo, out=o_solo),
            "comm": comm,
        }
        if ctx_shmem is None:
            del impls["fused_shmem"]
        real_rows = R - int(counts[r].sum())  # rows this rank sends to other ranks
        row_bytes = H * out.element_size()
        bytes_sent = {"fused": real_rows * row_bytes, "fused_shmem": real_rows * row_bytes,
                      "auto": real_rows * row_bytes, "sequential_transport": real_rows * row_bytes,
                      "sequential": real_rows * row_bytes, "comm": real_rows * row_bytes,
                      "sequential_padded": (W - 1) * El * C * row_bytes}
        sequential()
        ref = out.clone()  # the fused impls and the padded baseline are checked against it

        def check(name):
            out.fill_(float("nan"))
            impls[name]()
            torch.cuda.synchronize()
            owner = {"fused": ctx, "fused_shmem": ctx_shmem, "auto": ctx_auto,
                     "sequential_transport": ctx_seq}.get(name)
            if owner is not None:
                owner.synchronize()
            return rel_err(out, ref)

        def derive(t):
            return {"sequential_padded_ms": t.get("sequential_padded"),
                    "compute_fused_over_compute": t["compute"] / t["compute_fused"]
                    if "compute" in t and t.get("compute_fused") else None}

        bench.run(Case(
            op=OP, shape=shape, dtype=dname, impls=impls, check=check,
            checked=["fused", "fused_shmem", "auto", "sequential_transport", "sequential_padded"],
            tol=2e-2, plain_only=("sequential_transport",),
            label=f"{S}x{H}x{I}x{E}x{k} {kind} {dname}", derive=derive,
            fields=lambda name: {"bytes_sent_per_rank": bytes_sent.get(name, 0),
                                 "rows_received": R, "capacity": C}))
        solo_ctx.close()
    for c in (ctx, ctx_auto, ctx_seq):
        c.close()
    if ctx_shmem is not None:
        ctx_shmem.close()


if __name__ == "__main__":
    sys.exit(run_main(parser(), body))
