"""Sweep tile configurations of ``expert_swiglu`` (the experts' gated gate/up grouped GEMM) on
one GPU, over the dispatch layout one rank of a W-rank layer receives, against cuBLAS on the
same rows. Prints one line per (shape, routing, config); results go to --out as JSON lines.

    torchrun --nproc-per-node 1 -m benchmarks.tune_moe_experts --out tune.jsonl \\
        --device-kind nvidia-h200

Shapes are the layer benchmark's (S tokens per rank, H, I, E experts in all, top-k) with
``--ranks`` W (default 2; a list sweeps several): rank 0's share, ``counts[q, e]`` rows from
each of the W sources for each of its E / W experts, drawn from a balanced or a Zipf(1.2)
routing of W * S tokens. With ``--down``, the second GEMM instead: the grouped down GEMM of
``moe_gemm_combine`` (its ``gemm`` phase on a world of one, each row to its own slot) through
tensor descriptors and through pointer loads, against cuBLAS per segment. Baselines: ``cublas_dense`` (gate and up as two cuBLAS GEMMs over all R received rows, one
weight: the equivalent dense problem) and ``cublas_segments`` (per (source, expert) segment
cuBLAS gate, up and SiLU-gating: what the torch path runs).
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from benchmarks.harness import hbm_read_bandwidth, time_op
from benchmarks.rows import ResultWriter
from portable_overlap import World
from portable_overlap.ops.matmul import MatmulConfig
from portable_overlap.ops.moe_experts import expert_swiglu
from portable_overlap.ops.moe_experts.api import default_config

SHAPES = [(8192, 7168, 2048, 16, 8), (8192, 4096, 14336, 8, 2), (128, 7168, 2048, 16, 8),
          (128, 4096, 14336, 8, 2)]
# (block_m, block_n, block_k, num_warps, num_stages, gather): the default first (its own
# tiles and packing), then per-source row tiles (False), the experts the device's rule packs
# (None) and every expert packed (True): ``expert_swiglu``'s ``gather``
CONFIGS = [None, (64, 128, 64, 4, 4, False), (64, 256, 64, 8, 3, False),
           (128, 128, 64, 8, 3, False), (64, 128, 64, 4, 4, None), (64, 256, 64, 8, 3, None),
           (128, 128, 64, 8, 3, None), (64, 256, 64, 8, 3, True), (128, 128, 64, 8, 3, True)]


def routing_counts(S, E, k, W, kind, gen) -> torch.Tensor:
    """counts [W, E // W]: rows rank 0's experts get from each source under ``kind``."""
    scores = torch.rand(W * S, E, generator=gen)
    if kind == "zipf":
        scores = scores.log() + 4 * torch.log(1.0 / torch.arange(1, E + 1) ** 1.2)
    ids = scores.topk(k, -1).indices.view(W, S * k)
    El = E // W
    return torch.stack([torch.bincount(ids[q], minlength=E)[:El] for q in range(W)]).int()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device-kind", default="unknown")
    ap.add_argument("--ranks", default="2", help="comma-separated world sizes to lay out")
    ap.add_argument("--down", action="store_true", help="time the down GEMM of the combine")
    ap.add_argument("--down-configs", default="",
                    help="the down GEMM's fixed tilings instead of DOWN_CONFIGS', as "
                         "BMxBNxBK/<warps>w<stages>s,...")
    ap.add_argument("--configs", default="",
                    help="the gated GEMM's tilings instead of CONFIGS' (after the default), as "
                         "BMxBNxBK/<warps>w<stages>s[g|a],... (g: every expert packed, a: "
                         "the experts the device's rule packs)")
    ap.add_argument("--combine", action="store_true",
                    help="time the combine's weighted sum (its combine phase) per token block")
    ap.add_argument("--max-tokens", type=int, default=1 << 30,
                    help="only the shapes with at most this many tokens per rank")
    ap.add_argument("--whole", action="store_true",
                    help="time every tiling of the gated GEMM also with whole K loops (split "
                         "off: the last round's tiles not cut in ranges of K steps)")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    world = World.from_env()
    dev = world.device
    writer = ResultWriter(args.out, args.device_kind, 1)
    g = torch.Generator(device=dev).manual_seed(0)
    hbm = hbm_read_bandwidth(dev)  # GB/s: the decode layouts are bound by the weights' bytes
    print(f"HBM read {hbm:.0f} GB/s", flush=True)
    lines = []
    for W, (S, H, I, E, k) in [(int(w), sh) for w in args.ranks.split(",") for sh in SHAPES
                               if sh[0] <= args.max_tokens]:
        if E % W:
            continue
        El = E // W
        if args.combine:
            if W == 1:
                lines += combine_sum(world, writer, args, S, H, I, E, k, g, hbm)
            continue
        if args.down:
            lines += down_gemm(world, writer, args, W, S, H, I, E, k, g, hbm)
            continue
        wg = (torch.randn(El, H, I, generator=g, device=dev) * H ** -0.5).bfloat16()
        wu = (torch.randn(El, H, I, generator=g, device=dev) * H ** -0.5).bfloat16()
        for kind in ("balanced", "zipf"):
            counts = routing_counts(S, E, k, W, kind, torch.Generator().manual_seed(S + E))
            R = int(counts.sum())
            x = torch.randn(R, H, generator=g, device=dev).bfloat16()
            counts_d = counts.to(dev)
            bounds = [0] + torch.cumsum(counts.flatten().long(), 0).tolist()
            ref = torch.empty(R, I, device=dev, dtype=torch.bfloat16)
            gu = torch.empty_like(ref)
            hh = torch.empty_like(ref)

            def segments():
                for s in range(W * El):
                    lo, hi = bounds[s], bounds[s + 1]
                    if hi > lo:
                        e = s % El
                        torch.matmul(x[lo:hi], wg[e], out=gu[lo:hi])
                        torch.matmul(x[lo:hi], wu[e], out=hh[lo:hi])
                        hh[lo:hi] *= F.silu(gu[lo:hi])

            def dense():
                torch.matmul(x, wg[0], out=gu)
                torch.matmul(x, wu[0], out=hh)

            segments()
            ref.copy_(hh)
            shape = {"S": S, "H": H, "I": I, "E": E, "k": k, "routing": kind, "ranks": W,
                     "rows": R}
            # gate and up weights of the experts that got rows, read once at the HBM rate
            used = int((counts.sum(0) > 0).sum())
            weights_ms = used * 2 * H * I * 2 / hbm / 1e6
            base = {}
            for name, fn in (("cublas_dense", dense), ("cublas_segments", segments)):
                t = time_op(fn, world, graph=True, iters=args.iters)
                base[name] = t["median_ms"]
                writer.write(op="moe_experts_tuning", shape=shape, dtype="bf16", impl=name,
                             graph=True, **t)
            out = torch.empty(R, I, device=dev, dtype=torch.bfloat16)
            for c, split in [(c, split) for c in gate_configs(args.configs)
                             for split in ((True, False) if args.whole else (True,))]:
                # the default: what the layer picks for S tokens per rank (its tiles, and
                # packed experts where the device finds that they pay)
                m = S * k / E  # what the layer passes as rows_per_segment
                gather = None if c is None else c[5]
                cfg = default_config(torch.bfloat16, dev, True, m) if c is None else \
                    MatmulConfig(block_m=c[0], block_n=c[1], block_k=c[2], num_warps=c[3],
                                 num_stages=c[4])
                name = ("default" if c is None else "x".join(map(str, c[:3]))
                        + f"/{c[3]}w{c[4]}s") + PACKING[gather] + ("" if split else " whole")
                try:
                    out.fill_(float("nan"))
                    # (the default passes no config: it may pick its tiles on the device)
                    expert_swiglu(x, wg, wu, counts_d, out=out, config=c and cfg,
                                  gather=gather, split=split, rows_per_segment=m)
                    torch.cuda.synchronize()
                    err = float(((out.float() - ref.float()).norm() / ref.float().norm()))
                    t = time_op(lambda: expert_swiglu(x, wg, wu, counts_d, out=out,
                                                      config=c and cfg, gather=gather,
                                                      split=split, rows_per_segment=m),
                                world, graph=True, iters=args.iters)
                except Exception as exc:  # a config that does not fit (shared memory) is skipped
                    print(f"{S}x{H}x{I}x{E}x{k} {kind} {name}: {type(exc).__name__} "
                          f"{str(exc)[:120]}", flush=True)
                    continue
                writer.write(op="moe_experts_tuning", shape=shape, dtype="bf16", impl="config",
                             graph=True, rel_err=err,
                             config=dict(cfg.__dict__, gather=gather, split=split) if c
                             else ("default" if split else "default, whole K"),
                             vs_cublas_dense=base["cublas_dense"] / t["median_ms"],
                             weights_ms_at_hbm=weights_ms, **t)
                line = (f"W{W} {S:>5}x{H}x{I:>5}x{E:>2}x{k} {kind:>8} R={R:>6} {name:>25}: "
                        f"{t['median_ms']:.3f} ms  dense cuBLAS {base['cublas_dense']:.3f} "
                        f"({base['cublas_dense'] / t['median_ms']:.2f}x)  segments "
                        f"{base['cublas_segments']:.3f}  weights {weights_ms:.3f}  err {err:.1e}")
                print(line, flush=True)
                lines.append(line)
    print("\n".join(lines))
    return 0


#: the down GEMM's tilings: the call's own pick (``MoeGemmCombine``'s default or, at decode
#: sizes, ``decode_config``) by descriptors and by pointer loads, then fixed tilings
#: (block_m, block_n, block_k, num_warps, num_stages)
DOWN_CONFIGS = [("descriptors", None), ("pointers", None), ("config", (128, 256, 64, 8, 3)),
                ("config", (64, 256, 64, 8, 3)), ("config", (64, 256, 64, 4, 4)),
                ("config", (64, 128, 64, 4, 4)), ("config", (64, 128, 128, 4, 3))]


#: the tune's names of ``expert_swiglu``'s ``gather`` (a tiling's suffix: none, g, a)
PACKING = {False: "", True: " packed", None: " auto"}


def parse_tilings(spec: str) -> list:
    """``BMxBNxBK/<warps>w<stages>s[g|a],...`` as (block_m, block_n, block_k, num_warps,
    num_stages, gather) tuples: per-source row tiles, or with ``g`` every expert packed, with
    ``a`` the experts the device's rule packs."""
    out = []
    for item in spec.split(","):
        blocks, rest = item.rstrip("ga").split("/")
        warps, stages = rest.rstrip("s").split("w")
        gather = {"g": True, "a": None}.get(item[-1], False)
        out.append((*map(int, blocks.split("x")), int(warps), int(stages), gather))
    return out


def gate_configs(spec: str) -> list:
    """``CONFIGS``, or the default and the tilings ``spec`` names."""
    return [None, *parse_tilings(spec)] if spec else CONFIGS


def combine_sum(world, writer, args, S, H, I, E, k, g, hbm) -> list:
    """The combine's weighted sum of each token's k rows (its ``combine`` phase on a world of
    one) per ``CombineConfig.block_s`` (tokens per program), against the rows' bytes at the
    HBM rate."""
    from portable_overlap.ops.moe_combine import CombineConfig, MoeGemmCombine
    from portable_overlap.ops.moe_dispatch import moe_dispatch_reference

    dev = world.device
    tokens = torch.randn(S, I, generator=g, device=dev).bfloat16()
    ids = torch.rand(S, E, generator=g, device=dev).topk(k, -1).indices
    x, counts, slots = moe_dispatch_reference(tokens, ids, E, world.group)
    w = (torch.randn(E, I, H, generator=g, device=dev) * I ** -0.5).bfloat16()
    tw = torch.softmax(torch.randn(S, k, generator=g, device=dev), -1)
    rows_ms = S * k * H * 2 / hbm / 1e6
    shape = {"S": S, "H": H, "I": I, "E": E, "k": k, "ranks": 1}
    lines = []
    for bs in (None, 1, 2, 4, 8, 16):  # None: the call's own pick (``combine_block``)
        ctx = MoeGemmCombine(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=E,
                             combine_config=CombineConfig(block_s=bs), transport="stores")
        try:
            out = torch.empty(S, H, device=dev, dtype=torch.bfloat16)
            ph = ctx.phases(x, w, counts, slots, tw, out)
            ctx.synchronize()
            t = time_op(ph["combine"], world, graph=True, iters=args.iters)
        finally:
            ctx.close()
        name = "default" if bs is None else f"block_s{bs}"
        writer.write(op="moe_combine_sum_tuning", shape=shape, dtype="bf16", impl=name,
                     graph=True, rows_ms_at_hbm=rows_ms, **t)
        line = (f"combine {S:>5}x{H}x{I:>5}x{E:>2}x{k} {name:>8}: "
                f"{t['median_ms'] * 1e3:.1f} us  rows at HBM rate {rows_ms * 1e3:.1f} us")
        print(line, flush=True)
        lines.append(line)
    return lines


def down_configs(spec: str) -> list:
    """``DOWN_CONFIGS``, or the call's own picks and the tilings ``spec`` names."""
    if not spec:
        return DOWN_CONFIGS
    return DOWN_CONFIGS[:2] + [("config", t[:5]) for t in parse_tilings(spec)]


def down_gemm(world, writer, args, W, S, H, I, E, k, g, hbm) -> list:
    """The combine's grouped down GEMM ([R, I] rows @ w[e] [I, H]) at rank 0's rows, as its
    ``gemm`` phase on a world of one: the W sources' rows of each expert as one segment (or
    source 0's rows alone), each row its own slot (top-k 1), with each tiling of
    ``DOWN_CONFIGS``. On one rank the call picks its decode tiles only where an expert gets 64
    rows or fewer in all; the fixed tilings show what they would do at the other layouts."""
    from portable_overlap.ops.moe_combine import MoeGemmCombine

    dev, El = world.device, E // W
    w = (torch.randn(El, I, H, generator=g, device=dev) * I ** -0.5).bfloat16()
    lines = []
    # and one source's rows alone ("balanced-1src"): the segment sizes of a per-source walk
    for kind, one in (("balanced", False), ("zipf", False), ("balanced", True)):
        c_all = routing_counts(S, E, k, W, kind, torch.Generator().manual_seed(S + E))
        per_e = c_all[0] if one else c_all.sum(0)
        kind = kind + ("-1src" if one else "")
        R = int(per_e.sum())
        counts = per_e.view(1, El).int().to(dev)
        bounds = [0] + torch.cumsum(per_e.long(), 0).tolist()
        x = torch.randn(R, I, generator=g, device=dev).bfloat16()
        y = torch.empty(R, H, device=dev, dtype=torch.bfloat16)
        slots = torch.arange(R, dtype=torch.int32, device=dev)
        tw = torch.ones(R, 1, device=dev)

        def segments():
            for e in range(El):
                torch.matmul(x[bounds[e]:bounds[e + 1]], w[e], out=y[bounds[e]:bounds[e + 1]])

        shape = {"S": S, "H": H, "I": I, "E": E, "k": k, "routing": kind, "ranks": W, "rows": R}
        weights_ms = int((per_e > 0).sum()) * I * H * 2 / hbm / 1e6  # each used expert once
        t_cublas = time_op(segments, world, graph=True, iters=args.iters)
        writer.write(op="moe_down_gemm_tuning", shape=shape, dtype="bf16",
                     impl="cublas_segments", graph=True, **t_cublas)
        ref = y.clone()
        for impl, c in down_configs(args.down_configs):
            cfg = None if c is None else MatmulConfig(block_m=c[0], block_n=c[1], block_k=c[2],
                                                      num_warps=c[3], num_stages=c[4])
            ctx = MoeGemmCombine(world, max_tokens=R, top_k=1, hidden=H, experts_per_rank=El,
                                 config=cfg, transport="stores")
            if impl == "pointers":  # this context only: its plans then load by pointers
                ctx.kernel()._descriptors = lambda x_, w_, cfg_: (None, None)
            try:
                out = torch.full((R, H), float("nan"), device=dev, dtype=torch.bfloat16)
                ctx(x, w, counts, slots, tw, out=out)
                ctx.synchronize()
                err = float((out.float() - ref.float()).norm() / ref.float().norm())
                ph = ctx.phases(x, w, counts, slots, tw, out)
                t = time_op(ph["gemm"], world, graph=True, iters=args.iters)
                kern = ph["gemm_kernel"]
            except Exception as exc:  # a config that does not fit (shared memory) is skipped
                print(f"down {S}x{H}x{I}x{E}x{k} {kind} {impl}: {type(exc).__name__} "
                      f"{str(exc)[:120]}", flush=True)
                continue
            finally:
                ctx.close()
            impl = impl if c is None else "x".join(map(str, c[:3])) + f"/{c[3]}w{c[4]}s"
            writer.write(op="moe_down_gemm_tuning", shape=shape, dtype="bf16", impl=impl,
                         graph=True, rel_err=err, registers=kern.n_regs, spills=kern.n_spills,
                         vs_cublas=t_cublas["median_ms"] / t["median_ms"],
                         weights_ms_at_hbm=weights_ms, **t)
            line = (f"down W{W} {S:>5}x{H}x{I:>5}x{E:>2}x{k} {kind:>8} R={R:>6} {impl:>16}: "
                    f"{t['median_ms']:.3f} ms  cuBLAS segments {t_cublas['median_ms']:.3f} "
                    f"({t_cublas['median_ms'] / t['median_ms']:.2f}x)  weights "
                    f"{weights_ms:.3f}  regs {kern.n_regs} spills {kern.n_spills}  "
                    f"err {err:.1e}")
            print(line, flush=True)
            lines.append(line)
    return lines


if __name__ == "__main__":
    sys.exit(main())
