"""Benchmark of the device-initiated MoE dispatch against the torch dispatch, by the protocol in
benchmarks/harness.py. Run under torchrun:

    torchrun --nproc-per-node 2 -m benchmarks.bench_moe_dispatch --out results.jsonl \\
        --device-kind nvidia-h200-x2

Shapes (S tokens per rank, H, E experts in all, top-k); routing ``balanced`` (uniform top-k) or
``zipf`` (expert popularity ~ 1/(rank+1)^1.2). Timed:

- ``fused``: ``MoeDispatch(transport="stores")`` (count, exchange, and rows stored straight into
  the destinations' heaps; no host sync, so it is also timed as a CUDA-graph replay), with
  ``dedup`` by its rule; ``fused[dedup]`` / ``fused[row_per_expert]``: with the other choice (a
  token sent once per rank it reaches, then copied to its places there / a row per expert);
  rows carry ``dedup``;
- ``auto``: ``MoeDispatch`` with the library's default, ``transport="auto"`` on a GPU world
  (it times ``"stores"`` and ``"sequential"`` at its first call; graph replays run the
  capturable pick); ``sequential_transport``: ``MoeDispatch(transport="sequential")``, the
  torch path copied into the context's buffers (plain launches only);
- ``sequential``: ``moe_dispatch_reference``, the torch path: argsort, bincount, an
  ``all_to_all_single`` of the counts, a host read of the splits, ``all_to_all_single`` of the
  rows and of the slots (plain launches only: the host read cannot be captured);
- ``comm``: ``all_to_all_single`` of the same rows with the splits known in advance (the
  bytes by NCCL alone, the dispatch's ideal).

``fused`` is checked against ``sequential`` (rows, counts and slots equal) before timing.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from benchmarks.bench_moe_combine import route
from benchmarks.cli import BenchParser
from benchmarks.runner import Case, run_main, torch_dtype
from portable_overlap.ops.moe_dispatch import MoeDispatch, moe_dispatch_reference

# (S, H, E, k): DeepSeek-like and Mixtral-like expert layouts, prefill and decode token counts
SHAPES = [(8192, 7168, 16, 8), (8192, 4096, 8, 2), (128, 7168, 16, 8), (128, 4096, 8, 2)]
OP = "moe_dispatch"


def parser() -> BenchParser:
    ap = BenchParser(__doc__, dims=("S", "H", "E", "k"),
                     split_dims=("E",), shapes=SHAPES, dtypes=("bf16",),
                     allowed_dtypes=("bf16", "fp16", "fp32"), iters=50, warmup=10)
    ap.add_choices("--routings", ("balanced", "zipf"), "balanced,zipf")
    return ap


def body(bench) -> int:
    world, args = bench.world, bench.args
    dev, r = world.device, world.rank
    gen = torch.Generator(device=dev).manual_seed(r)
    for dname in args.dtypes:
        for sh in args.shapes:
            one_shape(bench, gen, dname, torch_dtype(dname),
                      *(sh[d] for d in ("S", "H", "E", "k")))
    return 0


def one_shape(bench, gen, dname, dt, S, H, E, k) -> None:
    world, args = bench.world, bench.args
    dev, W, r = world.device, world.world_size, world.rank
    El = E // W
    sizes = dict(max_tokens=S, top_k=k, hidden=H, experts_per_rank=El, dtype=dt)
    ctx = MoeDispatch(world, **sizes, transport="stores")
    other = MoeDispatch(world, **sizes, transport="stores", dedup=not ctx.dedup)
    other_name = f"fused[{'dedup' if other.dedup else 'row_per_expert'}]"
    contexts = {"fused": ctx, other_name: other, "auto": MoeDispatch(world, **sizes),
                "sequential_transport": MoeDispatch(world, **sizes, transport="sequential")}
    try:
        for kind in [x for x in args.routings.split(",") if x]:
            shape = {"S": S, "H": H, "E": E, "k": k, "routing": kind}
            tokens = torch.randn(S, H, generator=gen, device=dev).to(dt)
            ids = route(kind, S, E, k, gen, dev)
            ref = moe_dispatch_reference(tokens, ids, El, world.group)
            R = ref[0].shape[0]
            # the same rows by NCCL alone, splits known on the host beforehand
            order = torch.argsort(ids.reshape(-1), stable=True)
            send_rows = tokens[order // k].contiguous()
            send_splits = torch.bincount(ids.reshape(-1), minlength=E).view(W, El).sum(1)
            send_splits = send_splits.tolist()
            recv_splits = ref[1].sum(1).tolist()
            recv_rows = torch.empty(R, H, dtype=dt, device=dev)

            def comm():
                dist.all_to_all_single(recv_rows, send_rows, recv_splits, send_splits,
                                       group=world.group)

            impls = {name: (lambda c=c: c(tokens, ids)) for name, c in contexts.items()}
            impls = {**impls,
                     "sequential": lambda: moe_dispatch_reference(tokens, ids, El,
                                                                  world.group),
                     "comm": comm}

            def check(name):
                c = contexts[name]
                c.recv.fill_(float("nan"))
                x, counts, slots = impls[name]()
                c.synchronize()
                same = (torch.equal(counts, ref[1]) and torch.equal(slots[:R], ref[2])
                        and torch.equal(x[:R], ref[0]))
                return 0.0 if same else float("inf")

            row_bytes = H * tokens.element_size()
            sent = (S * k - send_splits[r]) * row_bytes  # the rows that leave this rank
            # with dedup, one row per (token, peer rank it reaches)
            reached = torch.zeros(S, W, dtype=torch.int32, device=dev).scatter_(1, ids // El, 1)
            sent_once = int(reached.sum() - reached[:, r].sum()) * row_bytes
            label = f"{S}x{H}x{E}x{k} {kind} {dname}"
            bench.run(Case(op=OP, shape=shape, dtype=dname, impls=impls, check=check,
                           checked=list(contexts), tol=1e-9, label=label,
                           plain_only=("sequential", "sequential_transport"),
                           fields=lambda name: {"bytes_sent_per_rank": (
                                                    sent_once if name in contexts
                                                    and contexts[name].dedup else sent),
                                                "rows_received": R,
                                                **({"dedup": contexts[name].dedup}
                                                   if name in contexts else {})}))
    finally:
        for c in contexts.values():
            c.close()


if __name__ == "__main__":
    sys.exit(run_main(parser(), body))
