"""Probe (one GPU): where the GEMV + AllReduce kernel's GEMV loses to cuBLAS at short K. Times,
at one N and M and a range of K (a decode layer's K over 1 to 16 ranks), bf16, graph replay:
cuBLAS (``torch.mm``), the library's kernel on a world of one (``GemvAllReduce`` with the
``"stores"`` (two-shot) and ``"one_shot"`` transports: the persistent loop, the flag rounds,
the partials' round trip through memory and the deadlines, no peer) and a plain launch of the
same GEMV tile (``tiles.gemv.gemv_tile``, one program per block of N, nothing else), each at a
few launch configurations, and fits ``t = fixed + bytes(W) / rate`` to each one's fastest per K:
a fixed cost that the kernel adds shows in ``fixed``, a slower stream in ``rate``. Prints a
table; rows to --out as JSON lines.

    torchrun --nproc-per-node 1 -m benchmarks.probe_gemv_fixed_cost --out probe.jsonl \\
        --device-kind nvidia-h200 [--cols 8192] [--rows 1]
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from benchmarks.harness import check_and_time
from benchmarks.rows import ResultWriter
from portable_overlap import GemvAllReduce, GemvConfig, World
from portable_overlap import language as pol
from portable_overlap.ops.context import G_MAX
from portable_overlap.shmem import device as _shmem
from portable_overlap.shmem.device import CALL_SHIFT
from portable_overlap.tiles.gemv import dot_precision, dot_upcast, gemv_tile

KS = (1792, 3584, 7168, 14336, 28672)
#: (block_n, block_k, num_warps, num_stages): the sweep's fastest on 4 and 2 H200s and around
CONFIGS = ((64, 128, 4, 6), (64, 256, 4, 4), (32, 256, 4, 4), (128, 128, 4, 4), (32, 128, 4, 6))


@triton.jit
def plain_gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                      PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    acc = gemv_tile(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, n0, BLOCK_M, BLOCK_N, BLOCK_K,
                    NUM_STAGES, EVEN_K, EVEN_N, PRECISION, UPCAST)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def end_call_relaxed(ctx, call):
    """``pol.end_call`` with a relaxed ticket: a program does not wait for its stores to land
    before it counts itself out (what the acquire-release ticket costs, ``LEVELS``)."""
    ticket = tl.atomic_add(ctx + pol.CTX_EPOCH + 1, 1, sem="relaxed", scope="gpu")
    last = ticket == pol.num_programs() - 1
    tl.atomic_xchg(ctx + pol.CTX_EPOCH + 1, 0, mask=last, sem="relaxed", scope="gpu")
    tl.atomic_xchg(ctx + pol.CTX_EPOCH, call.to(tl.int64) << CALL_SHIFT, mask=last, sem="release",
                   scope="gpu")


#: a call's weight in ``end_call_weighted``'s counter: more than any grid's programs
WEIGHT_SHIFT = tl.constexpr(20)


@triton.jit
def begin_call_weighted(counter_ptr):
    """The call number from a counter that every program of each launch adds to without reading
    it back (``end_call_weighted``): a whole launch adds ``1 << WEIGHT_SHIFT``, any part of one
    less, so every program of a launch reads the number of the launches before it."""
    return (tl.atomic_add(counter_ptr, 0, sem="relaxed", scope="gpu") >> WEIGHT_SHIFT) + 1


@triton.jit
def end_call_weighted(counter_ptr, G):
    """Count this program out with an add whose result nobody reads (a reduction the program
    does not wait for, instead of the ticket's round trip on one contended word): program 0
    adds ``(1 << WEIGHT_SHIFT) - (G - 1)``, the others 1."""
    pid = tl.program_id(0)
    weight = tl.where(pid == 0, (1 << WEIGHT_SHIFT) - (G - 1), 1).to(tl.int64)
    tl.atomic_add(counter_ptr, weight, sem="release", scope="gpu")


@triton.jit
def end_call_tree(ctx, call, counters_ptr, FAN: tl.constexpr):
    """``pol.end_call`` with its ticket in two levels: program pid counts itself out on counter
    ``pid % FAN`` of ``counters_ptr`` (``FAN`` words, then the top one), the last of each such
    group on the top counter, and the last there is the launch's last: each word takes about
    ``G / FAN`` or ``FAN`` atomics instead of all ``G`` (whether the ticket's cost is the
    contention on one word or each program's round trip)."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    j = pid % FAN
    size = (G - j + FAN - 1) // FAN  # programs j, j + FAN, ... < G
    ticket = tl.atomic_add(counters_ptr + j, 1, sem="acq_rel", scope="gpu")
    sub_last = ticket == size - 1
    tl.atomic_xchg(counters_ptr + j, 0, mask=sub_last, sem="relaxed", scope="gpu")
    groups = tl.minimum(G, FAN)
    top = tl.atomic_add(counters_ptr + FAN, 1, mask=sub_last, sem="acq_rel", scope="gpu")
    last = sub_last & (top == groups - 1)
    tl.atomic_xchg(counters_ptr + FAN, 0, mask=last, sem="relaxed", scope="gpu")
    tl.atomic_xchg(ctx + pol.CTX_EPOCH, call.to(tl.int64) << CALL_SHIFT, mask=last, sem="release",
                   scope="gpu")


@triton.jit
def pieces_kernel(x_ptr, w_ptr, out_ptr, partial_ptr, ready_ptr, ctx, consumed_ptr, M, N, K,
                  stride_xm, stride_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr,
                  EVEN_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                  G_MAX: tl.constexpr, LEVEL: tl.constexpr):
    """The plain tile with the library kernel's pieces added one at a time (``LEVELS``), on a
    world of one's workspace: what each piece costs a call."""
    pid = tl.program_id(0)
    call = 0
    ok = True
    if LEVEL == 8 or LEVEL == 9:  # the counter: this rank's own "consumed" word, which no
        call = begin_call_weighted(consumed_ptr)  # level here sets
        ok = pol.is_live(ctx)
    elif LEVEL >= 1:
        call = pol.begin_call(ctx)
        ok = pol.is_live(ctx)
    n0 = pid * BLOCK_N
    acc = gemv_tile(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, n0, BLOCK_M, BLOCK_N, BLOCK_K,
                    NUM_STAGES, EVEN_K, EVEN_N, PRECISION, UPCAST)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tile = offs_m[:, None] * N + offs_n[None, :]
    if LEVEL >= 3 and LEVEL != 5 and LEVEL != 8 and LEVEL < 10:  # the partial through the
        # heap, one flag round (no peer)
        tl.store(partial_ptr + tile, acc, mask=mask)
        pol.signal_all(ctx, ready_ptr + pid, call, ok)
        if LEVEL >= 6:  # the one-shot kernel's two other waits (each reads is_live first)
            ok = ok & pol.wait_peers_reached(ctx, ready_ptr, G_MAX, call - 1, call)
        ok = pol.wait_peers(ctx, ready_ptr + pid, G_MAX, call)
        if LEVEL >= 6:
            ok = ok & pol.wait_peers(ctx, ready_ptr + pid, G_MAX, call, ARRIVED_ONLY=True)
        acc = tl.load(partial_ptr + tile, mask=mask & ok, other=0.0)
    tl.store(out_ptr + tile, acc.to(out_ptr.dtype.element_ty), mask=mask)
    if LEVEL == 12:
        pol.end_call_last(ctx, call)
    elif LEVEL == 13:
        _shmem.count_out(ctx + pol.CTX_EPOCH, pid, tl.num_programs(0), False)
    elif LEVEL >= 10:  # the tree's counters: flag words of programs no grid here has
        end_call_tree(ctx, call, ready_ptr + G_MAX - 32, 8 if LEVEL == 10 else 16)
    elif LEVEL >= 8:
        end_call_weighted(consumed_ptr, tl.num_programs(0))
    elif LEVEL == 5 or LEVEL == 7:
        end_call_relaxed(ctx, call)
    elif LEVEL >= 4:
        pol.end_call_consumed(ctx, call, consumed_ptr)
    elif LEVEL >= 2:
        pol.end_call(ctx, call)


#: what each level of ``pieces_kernel`` adds to the one before
LEVELS = {1: "begin_call + is_live", 2: "+ end_call (the counter's add, no ticket)",
          3: "+ partial round trip, flag round",
          4: "end_call_consumed for end_call", 5: "level 2 with a relaxed ticket",
          6: "level 4 + the one-shot kernel's two other waits",
          7: "level 6 with a relaxed ticket (no consumed signal)",
          8: "level 1, then end_call_weighted for end_call (no ticket)",
          9: "level 6 with begin/end_call_weighted (no ticket, no consumed signal)",
          10: "level 2 with the ticket in two levels of 8 (end_call_tree)",
          11: "level 2 with the ticket in two levels of 16",
          12: "level 2 with the ticket (end_call_last)",
          13: "level 2 with the counter's add released at device scope, not system"}


def _words(ws):
    """A word for the levels' own counters and "consumed" signals (a world of one signals no
    peer), one per workspace."""
    if not hasattr(ws, "_probe_words"):
        ws._probe_words = torch.zeros(8, dtype=torch.int64, device=ws.ctx.device)
    return ws._probe_words


def pieces_gemv(x, w, out, cfg, ws, level):
    bn, bk, warps, stages = cfg
    M, K = x.shape
    N = w.shape[0]
    pieces_kernel[(triton.cdiv(N, bn),)](
        x, w, out, ws.partial, ws.ready, ws.ctx, _words(ws), M, N, K, x.stride(0), w.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages,
        EVEN_K=K % bk == 0, EVEN_N=N % bn == 0, PRECISION=dot_precision(x.dtype),
        UPCAST=dot_upcast(x.dtype), G_MAX=G_MAX, LEVEL=level, num_warps=warps,
        num_stages=stages)
    return out


def plain_gemv(x, w, out, cfg):
    bn, bk, warps, stages = cfg
    M, K = x.shape
    N = w.shape[0]
    plain_gemv_kernel[(triton.cdiv(N, bn),)](
        x, w, out, M, N, K, x.stride(0), w.stride(0), BLOCK_M=max(16, triton.next_power_of_2(M)),
        BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages, EVEN_K=K % bk == 0, EVEN_N=N % bn == 0,
        PRECISION=dot_precision(x.dtype), UPCAST=dot_upcast(x.dtype), num_warps=warps,
        num_stages=stages)
    return out


def fit(points):
    """Least squares of ``t = fixed + bytes / rate`` over ``(bytes, ms)``: (fixed µs, TB/s)."""
    n = len(points)
    mx = sum(b for b, _ in points) / n
    my = sum(t for _, t in points) / n
    slope = sum((b - mx) * (t - my) for b, t in points) / sum((b - mx) ** 2 for b, _ in points)
    return (my - slope * mx) * 1e3, 1e-9 / slope  # ms -> µs; bytes per ms -> TB/s


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device-kind", default="unknown")
    ap.add_argument("--cols", type=int, default=8192, help="N")
    ap.add_argument("--rows", type=int, default=1, help="M")
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)),
                    help="the pieces' levels to time (comma-separated)")
    ap.add_argument("--configs", type=int, default=len(CONFIGS),
                    help="time the first this many of CONFIGS")
    args = ap.parse_args()
    levels = [int(v) for v in args.levels.split(",") if v]
    configs = CONFIGS[:args.configs]
    world = World.from_env()
    dev, N, M = world.device, args.cols, args.rows
    writer = ResultWriter(args.out, args.device_kind, 1)
    ctxs = {t: GemvAllReduce(world, max_n=N, transport=t) for t in ("stores", "one_shot")}
    # a workspace of its own for the pieces' kernels (they advance its call counter)
    pieces_ws = GemvAllReduce(world, max_n=N, transport="one_shot")
    ctxs["pieces"] = pieces_ws
    best: dict = {}
    try:
        for K in KS:
            g = torch.Generator(device=dev).manual_seed(K)
            x = torch.randn(M, K, generator=g, device=dev).bfloat16()
            w = (torch.randn(N, K, generator=g, device=dev) / K ** 0.5).bfloat16()
            out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ w.float().t()
            impls = {"cublas": lambda: torch.mm(x, w.t(), out=out)}
            for cfg in configs:
                impls[f"plain {cfg}"] = lambda cfg=cfg: plain_gemv(x, w, out, cfg)
                for level in levels:
                    impls[f"level{level} {cfg}"] = (
                        lambda cfg=cfg, level=level: pieces_gemv(x, w, out, cfg,
                                                                 pieces_ws.impl, level))
                for t, ctx in ((t, c) for t, c in ctxs.items() if t != "pieces"):
                    for pps in (1, 2):
                        gc = GemvConfig(*cfg, programs_per_sm=pps)
                        impls[f"{t} {cfg} pps{pps}"] = (
                            lambda gc=gc, ctx=ctx: ctx(x, w, out, config=gc))
            shape = {"M": M, "N": N, "K": K}
            for name, fn in impls.items():
                try:
                    err, t = check_and_time(fn, out, ref, world, tol=2e-2, iters=50, warmup=10)
                except Exception as e:  # noqa: BLE001  (a config that cannot run is a finding)
                    print(f"K={K} {name}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                writer.write(op="gemv_fixed_cost_probe", shape=shape, dtype="bf16", impl=name,
                             graph=True, rel_err=err, **t)
                kind = name.split(" ")[0]
                ms = t["median_ms"]
                if ms < best.get((kind, K), (float("inf"),))[0]:
                    best[(kind, K)] = (ms, name)
    finally:
        for ctx in ctxs.values():
            ctx.close()
    print(f"\nM={M} N={N} bf16, graph replay: the fastest config per K, µs")
    kinds = ("cublas", "plain", *(f"level{v}" for v in levels), "stores", "one_shot")
    print(f"{'':>8} " + " ".join(f"{K:>7}" for K in KS))
    for k in kinds:
        print(f"{k:>8} " + " ".join(f"{best.get((k, K), (float('nan'),))[0] * 1e3:7.1f}"
                                    for K in KS))
    for v in levels:
        print(f"  level{v}: {LEVELS[v]}")
    print("\nfit t = fixed + bytes / rate over the K above")
    for k in kinds:
        pts = [(2 * N * K, best[(k, K)][0]) for K in KS if (k, K) in best]
        if len(pts) >= 2:
            fixed, rate = fit(pts)
            print(f"{k:>8}: fixed {fixed:5.1f} µs, rate {rate:4.2f} TB/s")
            writer.write(op="gemv_fixed_cost_fit", shape={"M": M, "N": N}, dtype="bf16",
                         impl=k, graph=True, fixed_us=round(fixed, 2), rate_tbs=round(rate, 3),
                         ks=list(KS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
