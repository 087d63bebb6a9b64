"""Benchmark of the whole expert-parallel MoE layer: the fused layer (dispatch, gated grouped
GEMM, GEMM + combine; no host sync) against the torch path, by the protocol in
benchmarks/harness.py. Run under torchrun:

    torchrun --nproc-per-node 2 -m benchmarks.bench_moe_layer --out results.jsonl \\
        --device-kind nvidia-h200-x2

Shapes (S tokens per rank, H, I, E experts in all, top-k); routing ``balanced`` (the layer's own
router on random tokens) or ``zipf`` (the router's scores biased so that expert popularity falls
as 1/(rank+1)^1.2). Timed, with the same weights and tokens:

- ``fused``: ``ExpertParallelMoE`` (router, ``moe_dispatch``, ``expert_swiglu``,
  ``moe_gemm_combine``); also as a CUDA-graph replay; ``fused[dedup]`` /
  ``fused[row_per_expert]``: the same with the dispatch's other choice of ``dedup`` than its
  rule's (a token sent once per rank it reaches / once per expert; rows carry ``dedup``);
- ``sequential``: the same module with ``fused=False``, the torch path: ``all_to_all_single``
  dispatch with host-read splits, per-segment matmuls, ``all_to_all_single`` back, weighted sum
  (plain launches: the host reads cannot be captured);
- ``fused_dispatch_gemm``: the same layer with ``fuse_dispatch=True`` (the dispatch and the
  gated GEMM in one launch, ``moe_dispatch_swiglu``); checked like ``fused``;
- ``fused_one_launch``: the same layer with ``one_launch=True`` (the dispatch's scatter, both
  expert GEMMs and the combine's row stores in one launch, ``moe_layer``); checked like
  ``fused``; ``stage_layer_launch``: ``moe_layer`` alone (no router), against
  ``stage_dispatch_swiglu`` + ``stage_combine`` (``_s<N>``: N senders, one per count of
  ``--senders``);
- the fused layer's stages alone: ``stage_dispatch`` (and ``stage_dispatch[...]``, the other
  ``dedup``), ``stage_experts`` (the gated grouped GEMM),
  ``stage_combine`` (down GEMM + combine; ``stage_combine_sources`` / ``_experts``: with its
  tile walk fixed source by source / expert by expert, where the layer picks by size), and
  ``stage_dispatch_swiglu`` (the fused launch that replaces the first two;
  ``stage_dispatch_swiglu_s<N>``: with N sending programs instead of ``default_senders``'
  count, one per count of ``--senders``);
- ``compute``: the expert GEMMs by cuBLAS on the same rows (per segment: gate, up, SiLU-gating,
  down); ``cublas_gemm1_dense``: the gate and up GEMMs as two dense cuBLAS GEMMs over all the
  received rows (what ``stage_experts`` is measured against); ``comm``: ``all_to_all_single``
  of the dispatched rows and of the rows back, splits known in advance (NCCL alone).

``fused`` is checked against ``sequential`` before timing; ideal = max(compute, comm).
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.cli import BenchParser, int_list
from benchmarks.runner import Case, rel_err, run_main, torch_dtype
from portable_overlap import ExpertParallelMoE, moe_layer
from portable_overlap.ops.moe_combine import MoeGemmCombine, moe_gemm_combine
from portable_overlap.ops.moe_dispatch import (MoeDispatch, moe_dispatch, moe_dispatch_reference,
                                               moe_dispatch_swiglu)
from portable_overlap.ops.moe_experts import expert_swiglu

SHAPES = [(8192, 7168, 2048, 16, 8), (8192, 4096, 14336, 8, 2), (128, 7168, 2048, 16, 8),
          (128, 4096, 14336, 8, 2)]
OP = "moe_layer"


def parser() -> BenchParser:
    ap = BenchParser(__doc__, dims=("S", "H", "I", "E", "k"),
                     split_dims=("E",), shapes=SHAPES, dtypes=("bf16",),
                     allowed_dtypes=("bf16", "fp16"), iters=50, warmup=5)
    ap.add_choices("--routings", ("balanced", "zipf"), "balanced,zipf")
    ap.add_argument("--down-tile", default="",
                    help="the down GEMM's tiles for every schedule of the layer, "
                         "BMxBNxBK/<warps>w<stages>s (default: the combine's own choice); "
                         "recorded in the rows' shape")
    ap.add_argument("--senders", default="16,64", type=int_list(1),
                    help="sender counts of the _s<N> impls of the fused launches "
                         "(default: %(default)s)")
    return ap


def down_tile(spec: str):
    """``--down-tile`` as a MatmulConfig, or None."""
    if not spec:
        return None
    from portable_overlap.ops.matmul import MatmulConfig

    blocks, rest = spec.split("/")
    warps, stages = rest.rstrip("s").split("w")
    bm, bn, bk = map(int, blocks.split("x"))
    return MatmulConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=int(warps),
                        num_stages=int(stages))


def body(bench) -> int:
    args = bench.args
    for dname in args.dtypes:
        for sh in args.shapes:
            one_shape(bench, dname, torch_dtype(dname),
                      *(sh[d] for d in ("S", "H", "I", "E", "k")))
    return 0


def one_shape(bench, dname, dt, S, H, I, E, k) -> None:
    world, args = bench.world, bench.args
    dev, W, r = world.device, world.world_size, world.rank
    El = E // W
    senders = [int(n) for n in args.senders.split(",") if n.strip()]
    tile = down_tile(args.down_tile)
    ctx = None if tile is None else MoeGemmCombine(world, max_tokens=S, top_k=k, hidden=H,
                                                   experts_per_rank=El, config=tile,
                                                   transport="stores")
    fused = ExpertParallelMoE(world, H, I, E, k, max_tokens=S, dtype=dt, ctx=ctx)
    torch_path = ExpertParallelMoE(world, H, I, E, k, max_tokens=S, dtype=dt, fused=False)
    # the down GEMM + combine with each tile walk fixed (the layer's own context picks by S)
    walks = {wk: MoeGemmCombine(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El,
                                walk=wk, transport="stores") for wk in ("sources", "experts")}
    # the staged layer's dispatch with the other choice of dedup than its rule's
    other = MoeDispatch(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El, dtype=dt,
                        transport="stores", dedup=not fused.dispatch_ctx.dedup)
    other_name = "dedup" if other.dedup else "row_per_expert"
    gen = torch.Generator(device=dev).manual_seed(100 + r)
    try:
        for kind in [x for x in args.routings.split(",") if x]:
            shape = {"S": S, "H": H, "I": I, "E": E, "k": k, "routing": kind,
                     **({"down_tile": args.down_tile} if tile else {})}
            tokens = torch.randn(S, H, generator=gen, device=dev).to(dt)
            with torch.no_grad():
                if kind == "zipf":  # bias the shared router toward the first experts
                    bias = 4 * torch.log(1.0 / torch.arange(1, E + 1, device=dev) ** 1.2)
                    scores = torch.softmax((tokens @ fused.router.T).float() + bias, -1)
                    w_top, ids = scores.topk(k, -1)
                    weights = w_top / w_top.sum(-1, keepdim=True)
                    fused.route = torch_path.route = (lambda t, w=weights, i=ids: (w, i))
                else:
                    fused.__dict__.pop("route", None)
                    torch_path.__dict__.pop("route", None)
                    weights, ids = fused.route(tokens)
                # the stages' inputs, and the baselines' host-known splits
                x, counts, slots = moe_dispatch(tokens, ids, fused.dispatch_ctx)
                h = expert_swiglu(x, fused.w_gate, fused.w_up, counts)
                xr, cr, _ = moe_dispatch_reference(tokens, ids, El, world.group)
            R = xr.shape[0]
            bounds = [0] + torch.cumsum(cr.flatten().long(), 0).tolist()
            recv_splits = cr.sum(1).tolist()
            everyone = torch.tensor(world.all_gather_object(recv_splits))  # [holder, source]
            send_splits = everyone[:, r].tolist()
            # random, not empty: "comm" moves it as it is (the protocol times no zeros)
            send_rows = torch.randn(S * k, H, generator=gen, device=dev).to(dt)
            recv_rows = torch.empty(R, H, dtype=dt, device=dev)
            gu = torch.empty(R, I, dtype=dt, device=dev)
            hh = torch.empty(R, I, dtype=dt, device=dev)
            y = torch.empty(R, H, dtype=dt, device=dev)
            out = torch.empty(S, H, dtype=dt, device=dev)

            def compute():
                for s in range(W * El):
                    lo, hi = bounds[s], bounds[s + 1]
                    if hi > lo:
                        e = s % El
                        torch.matmul(xr[lo:hi], fused.w_gate[e], out=gu[lo:hi])
                        torch.matmul(xr[lo:hi], fused.w_up[e], out=hh[lo:hi])
                        hh[lo:hi] *= F.silu(gu[lo:hi])
                        torch.matmul(hh[lo:hi], fused.w_down[e], out=y[lo:hi])

            def gemm1_dense():
                torch.matmul(xr, fused.w_gate[0], out=gu)
                torch.matmul(xr, fused.w_up[0], out=hh)

            def comm():
                dist.all_to_all_single(recv_rows, send_rows, recv_splits, send_splits,
                                       group=world.group)
                dist.all_to_all_single(send_rows, recv_rows, send_splits, recv_splits,
                                       group=world.group)

            def layer():
                return fused(tokens)

            def layer_with(dctx):
                saved, fused.dispatch_ctx = fused.dispatch_ctx, dctx
                try:
                    return fused(tokens)
                finally:
                    fused.dispatch_ctx = saved

            def layer_as(form):
                setattr(fused, form, True)  # same weights and contexts, another schedule
                try:
                    return fused(tokens)
                finally:
                    setattr(fused, form, False)

            m = S * k / E  # the layer's rows_per_segment

            def dispatch_swiglu(senders=None):
                return moe_dispatch_swiglu(tokens, ids, fused.w_gate, fused.w_up,
                                           fused.dispatch_ctx, out=h, senders=senders,
                                           rows_per_segment=m)

            def layer_launch(senders=None):
                return moe_layer(tokens, ids, weights, fused.w_gate, fused.w_up, fused.w_down,
                                 fused.dispatch_ctx, fused.ctx, out=out, senders=senders,
                                 rows_per_segment=m)

            impls = {
                "fused": lambda: out.copy_(layer()),
                f"fused[{other_name}]": lambda: out.copy_(layer_with(other)),
                "fused_dispatch_gemm": lambda: out.copy_(layer_as("fuse_dispatch")),
                "fused_one_launch": lambda: out.copy_(layer_as("one_launch")),
                "stage_layer_launch": layer_launch,
                "sequential": lambda: out.copy_(torch_path(tokens)),
                "stage_dispatch": lambda: moe_dispatch(tokens, ids, fused.dispatch_ctx),
                f"stage_dispatch[{other_name}]": lambda: moe_dispatch(tokens, ids, other),
                "stage_experts": lambda: expert_swiglu(x, fused.w_gate, fused.w_up, counts,
                                                       out=h),
                "stage_combine": lambda: moe_gemm_combine(h, fused.w_down, counts, slots,
                                                          weights, fused.ctx),
                "stage_combine_sources": lambda: moe_gemm_combine(
                    h, fused.w_down, counts, slots, weights, walks["sources"]),
                "stage_combine_experts": lambda: moe_gemm_combine(
                    h, fused.w_down, counts, slots, weights, walks["experts"]),
                "stage_dispatch_swiglu": dispatch_swiglu,
                "compute": compute, "cublas_gemm1_dense": gemm1_dense, "comm": comm,
            }
            for n in senders:
                impls[f"stage_layer_launch_s{n}"] = lambda n=n: layer_launch(n)
                impls[f"stage_dispatch_swiglu_s{n}"] = lambda n=n: dispatch_swiglu(n)
            with torch.no_grad():
                ref = torch_path(tokens).clone()

            def check(name):
                with torch.no_grad():
                    out.fill_(float("nan"))
                    impls[name]()
                    fused.synchronize()
                    other.synchronize()
                return rel_err(out, ref)

            def timed(fn):
                def run():
                    with torch.no_grad():
                        fn()
                return run

            def dedup_of(name):  # the impls that run the staged dispatch
                if other_name in name:
                    return {"dedup": other.dedup}
                staged = name in ("fused", "stage_dispatch")
                return {"dedup": fused.dispatch_ctx.dedup} if staged else {}

            label = f"{S}x{H}x{I}x{E}x{k} {kind} {dname}"
            bench.run(Case(op=OP, shape=shape, dtype=dname,
                           impls={n: timed(f) for n, f in impls.items()}, check=check,
                           checked=["fused", f"fused[{other_name}]", "fused_dispatch_gemm",
                                    "fused_one_launch", "stage_layer_launch"], tol=3e-2,
                           label=label, plain_only=("sequential",),
                           fields=lambda name: {"rows_received": R, **dedup_of(name)}))
    finally:
        fused.close()
        other.close()
        for c in (*walks.values(), *([ctx] if ctx is not None else [])):
            c.close()


if __name__ == "__main__":
    sys.exit(run_main(parser(), body))
