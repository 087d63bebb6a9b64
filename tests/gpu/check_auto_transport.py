"""GPU checks of ``transport="auto"`` (ops/planner.py), under torchrun (2 ranks or more):

    torchrun --nproc-per-node 2 tests/gpu/check_auto_transport.py

For each multi-transport pattern at a prefill-sized and a decode-sized shape (bf16): the first
call times every candidate as plain calls and as graph replays and writes a correct result
into the poisoned ``out``; each mode's pick is the same on every rank, the fastest measured in
that mode (``"sequential"`` within the tie margin); the second call times nothing; the decided
call captured in a CUDA graph (which runs the replays' pick) replays correctly with fresh
inputs. Then a ``graph=True`` context, and an undecided call under capture, which must
raise. Then what a context made without ``transport=`` runs (``"auto"``), and what the
agreement adds to an eager call of a decided ``"sequential"`` key. Each check prints
``PASS``/``FAIL`` on rank 0 with the candidates' times; the exit code is 1 if any failed on
any rank. (Not collected by pytest: it needs one process per GPU.)
"""
from __future__ import annotations

import os
import sys
import traceback

import torch

import portable_overlap as po
from portable_overlap.testing.check_log import CheckLog
from portable_overlap.ops import planner
from portable_overlap.schedule import tuning
from portable_overlap.testing.compare import rel_err
from portable_overlap.testing.patterns import GEMM_PATTERNS

TOL = 2e-2  # bf16
LOG = CheckLog(44)
results, record = LOG.results, LOG.record


class Counted:
    """``tuning.time_call``, counted."""

    def __init__(self):
        self.count, self.real = 0, tuning.time_call

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self.real(*args, **kwargs)


def cases(W):
    """(op, context, reference(a, b, group, bias), shapes (M, N, K) per rank, rows of the
    result, context sizes); for AllGather + GEMM M is the shard's rows."""
    def ref(name):
        return lambda a, b, g, bias: GEMM_PATTERNS[name][1](a, b, g, bias, None)

    return [
        ("all_gather_matmul", po.AllGatherMatmul,
         lambda a, b, g, bias: po.all_gather_matmul_reference(a, b, g),
         [(2048, 4096, 4096), (32, 4096, 4096)], lambda m: W * m, (2048 * 4096,)),
        ("matmul_reduce_scatter", po.MatmulReduceScatter, ref("matmul_reduce_scatter"),
         [(4096, 4096, 4096 // W), (64 * W, 4096, 8192 // W)], lambda M: M // W, (4096, 4096)),
        ("matmul_all_reduce", po.MatmulAllReduce, ref("matmul_all_reduce"),
         [(4096, 4096, 4096 // W), (16, 4096, 8192 // W)], lambda M: M, (4096, 4096)),
        ("matmul_all_to_all", po.MatmulAllToAll, ref("matmul_all_to_all"),
         [(4096, 4096, 2048), (64 * W, 4096, 2048)], lambda M: M, (4096, 4096)),
    ]


def inputs(world, name, M, N, K, gen, bias):
    dev = world.device
    a = torch.randn(M, K, device=dev, generator=gen).to(torch.bfloat16)
    b = torch.randn(K, N, device=dev, generator=gen).to(torch.bfloat16) / K ** 0.5
    if name == "all_gather_matmul":
        return a, b, None
    return a, b, torch.randn(N, device=dev, generator=gen).to(torch.bfloat16) if bias else None


def call(name, ctx, a, b, bias, out=None):
    fn = getattr(po, name)
    return fn(a, b, ctx, out) if name == "all_gather_matmul" else fn(a, b, ctx, out, bias=bias)


def check_pattern(world, gen, name, make, ref, shapes, rows, sizes) -> None:
    counted = Counted()
    ctx = make(world, *sizes, transport="auto")
    tuning.time_call = counted
    try:
        for M, N, K in shapes:
            label = f"{name} {M}x{N}x{K}"
            a, b, bias = inputs(world, name, M, N, K, gen, bias=True)
            out = torch.full((rows(M), N), float("nan"), device=world.device,
                             dtype=torch.bfloat16)
            call(name, ctx, a, b, bias, out)
            ctx.synchronize()
            err = rel_err(out, ref(a, b, world.group, bias))
            args = (a, b) if name == "all_gather_matmul" else (a, b, bias)
            pick, picks_ = ctx.choice(*args), ctx.choices(*args)
            decision = list(ctx.decisions.values())[-1]
            ms = decision["ms"]
            # both timing modes by default: plain calls, and graph replays for captured calls
            captured_ms = decision.get("captured", {}).get("ms")
            want = fastest(ms)
            want_captured = fastest(captured_ms) if captured_ms else want
            picks = world.all_gather_object(picks_)
            timed = counted.count
            # the second call, fresh inputs: no timing
            a2, b2, bias2 = inputs(world, name, M, N, K, gen, bias=True)
            y = call(name, ctx, a2, b2, bias2)
            ctx.synchronize()
            err2 = rel_err(y, ref(a2, b2, world.group, bias2))
            again = counted.count - timed
            times = ", ".join(f"{t} {v:.3f}" for t, v in ms.items())
            if captured_ms:
                times += "; replays: " + ", ".join(f"{t} {v:.3f}"
                                                   for t, v in captured_ms.items())
            record(f"{label} pick", pick == want
                   and picks_ == {"plain": want, "captured": want_captured}
                   and all(p == picks_ for p in picks)
                   and timed == planner.ROUNDS * (len(ms) + len(captured_ms or {}))
                   and again == 0
                   and err < TOL and err2 < TOL,
                   f"{picks_} [{times} ms] failed={list(decision['failed'])} "
                   f"rel_err={err:.1e}/{err2:.1e}")
            counted.count = 0
            # the decided call in a CUDA graph, replayed with fresh inputs
            graph_out = torch.empty_like(out)
            call(name, ctx, a, b, bias, graph_out)  # (plans for graph_out's address)
            ctx.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                call(name, ctx, a, b, bias, graph_out)
            worst = 0.0
            for _ in range(3):
                a.copy_(torch.randn(a.shape, device=a.device, generator=gen).to(a.dtype))
                graph_out.fill_(float("nan"))
                g.replay()
                ctx.synchronize()
                worst = max(worst, rel_err(graph_out, ref(a, b, world.group, bias)))
            record(f"{label} graph replay", worst < TOL and counted.count == 0,
                   f"{want_captured} worst rel_err={worst:.1e}")
    finally:
        tuning.time_call = counted.real
        ctx.close()


def fastest(ms: dict) -> str:
    """What ``"auto"`` must pick from one timing mode's times (``planner.TIE``)."""
    best = min(ms, key=ms.get)
    return ("sequential" if "sequential" in ms
            and ms["sequential"] <= ms[best] * (1 + planner.TIE) else best)


def check_graph_timing_and_capture(world, gen) -> None:
    """graph=True times graph replays; an undecided call under capture raises."""
    W = world.world_size
    M, N, K = 2048, 4096, 4096 // W
    ctx = po.MatmulAllReduce(world, M, N, transport="auto", graph=True)
    try:
        a, b, bias = inputs(world, "matmul_all_reduce", M, N, K, gen, bias=False)
        y = po.matmul_all_reduce(a, b, ctx)
        ctx.synchronize()
        err = rel_err(y, po.matmul_all_reduce_reference(a, b, world.group))
        ms = list(ctx.decisions.values())[0]["ms"]
        record(f"graph=True {M}x{N}x{K}", err < TOL,
               f"{ctx.choice(a, b)} [{', '.join(f'{t} {v:.3f}' for t, v in ms.items())} ms]")
        a2 = a[: M // 2].contiguous()  # a new key
        g = torch.cuda.CUDAGraph()
        msg = ""
        try:
            with torch.cuda.graph(g):
                po.matmul_all_reduce(a2, b, ctx)
        except RuntimeError as e:
            msg = str(e)
        torch.cuda.synchronize()
        y = po.matmul_all_reduce(a, b, ctx)  # still usable
        ctx.synchronize()
        err = rel_err(y, po.matmul_all_reduce_reference(a, b, world.group))
        record("undecided call under capture raises", "make one eager call" in msg
               and err < TOL, msg[:90])
    finally:
        ctx.close()


def check_defaults(world, gen) -> None:
    """A context made without ``transport=`` is ``"auto"`` on a GPU world (the modules' too):
    its first call times the candidates (the seconds it took are printed) and gives the right
    result, and so does a later one."""
    import time

    W = world.world_size
    for name, make, _, _, _, sizes in cases(W):
        ctx = make(world, *sizes)
        try:
            record(f"{name} default transport", ctx.transport == "auto", repr(ctx))
        finally:
            ctx.close()
    layer = po.RowParallelLinear(4096 * W, 4096, world, dtype=torch.bfloat16)
    try:
        record("RowParallelLinear default transport", layer.ctx.transport == "auto",
               repr(layer.ctx))
    finally:
        layer.close()
    ctx = po.GemvAllReduce(world, 4096)
    try:
        for M, N, K in ((1, 4096, 14336 // W), (8, 4096, 14336 // W)):
            x = torch.randn(M, K, device=world.device, generator=gen).to(torch.bfloat16)
            w = (torch.randn(N, K, device=world.device, generator=gen) / K ** 0.5).to(
                torch.bfloat16)
            ref = po.gemv_all_reduce_reference(x, w, world.group)
            times, err = [], 0.0
            for _ in range(2):  # the first call decides, the second runs the pick
                out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=world.device)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                y = ctx(x, w, out)
                ctx.synchronize()
                times.append(time.perf_counter() - t0)
                err = max(err, rel_err(y, ref))
            dec = list(ctx.decisions.values())[-1]  # this shape's (the newest)
            record(f"gemv_all_reduce default {M}x{N}x{K}", err < TOL,
                   f"{ctx.choices(x, w)}; first call {times[0]:.2f} s, second "
                   f"{times[1] * 1e3:.2f} ms, rel_err {err:.1e}; plain ms "
                   f"{ {t: round(v, 4) for t, v in dec['ms'].items()} }, replays "
                   f"{ {t: round(v, 4) for t, v in dec['captured']['ms'].items()} }")
    finally:
        ctx.close()
    # what an eager call of a decided "sequential" key adds: the agreement through the store
    x = torch.randn(1, 1024, device=world.device, generator=gen).to(torch.bfloat16)
    w = torch.randn(4096, 1024, device=world.device, generator=gen).to(torch.bfloat16)
    ref = po.gemv_all_reduce_reference(x, w, world.group)
    per_call, errs = {}, []
    for label, kw in (("named", {"transport": "sequential"}),
                      ("auto", {"transport": "auto", "candidates": ("sequential",)})):
        ctx = po.GemvAllReduce(world, 4096, **kw)
        try:
            for _ in range(3):
                errs.append(rel_err(ctx(x, w), ref))
            torch.cuda.synchronize()
            world.barrier()
            t0 = time.perf_counter()
            for _ in range(50):
                ctx(x, w)
            torch.cuda.synchronize()
            per_call[label] = (time.perf_counter() - t0) / 50 * 1e3
        finally:
            ctx.close()
    record("eager sequential call: named vs auto", max(errs) < TOL,
           f"{per_call['named']:.3f} vs {per_call['auto']:.3f} ms per call (the agreement: "
           f"{per_call['auto'] - per_call['named']:.3f} ms)")


def main() -> int:
    import faulthandler

    faulthandler.dump_traceback_later(int(os.environ.get("PO_AUTO_CHECK_TIMEOUT", "540")),
                                      exit=True)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    world = po.World.from_env()
    gen = torch.Generator(device=world.device).manual_seed(3000 + world.rank)
    for case in cases(world.world_size):
        try:
            check_pattern(world, gen, *case)
        except Exception as e:
            record(case[0], False, f"raised {type(e).__name__}: {e}"[:300])
            traceback.print_exc()
    try:
        check_defaults(world, gen)
    except Exception as e:
        record("defaults", False, f"raised {type(e).__name__}: {e}"[:300])
        traceback.print_exc()
    try:
        check_graph_timing_and_capture(world, gen)
    except Exception as e:
        record("graph timing", False, f"raised {type(e).__name__}: {e}"[:300])
        traceback.print_exc()
    return LOG.finish(world, "auto transport gpu checks")


if __name__ == "__main__":
    sys.exit(main())
