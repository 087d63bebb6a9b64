"""GPU checks of GEMM with tile-group signals (host-collective transport), run by ci/gpu.sh:

    torchrun --nproc-per-node 2 tests/gpu/check_gemm_signal.py

Each check prints ``PASS``/``FAIL`` on rank 0 (the gpu_checks.py style); the exit code is 1 if
any check failed on any rank. A stuck stream wait would hang: faulthandler prints every thread's
stack and exits after PO_SIG_CHECK_TIMEOUT seconds (default 300).
(Not collected by pytest: it needs one process per GPU.)
"""
from __future__ import annotations

import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from portable_overlap.testing.check_log import CheckLog
from portable_overlap import World
from portable_overlap.testing.signal_calls import (gemm_all_reduce, gemm_all_to_all_signal,
                                                   gemm_reduce_scatter)
from portable_overlap.ops.gemm_signal import (GemmSignal, SignalConfig, gemm_all_reduce_reference,
                                              gemm_all_to_all_signal_reference,
                                              gemm_reduce_scatter_reference)
from portable_overlap.testing.compare import rel_err

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
OPS = {"all_reduce": (gemm_all_reduce, gemm_all_reduce_reference),
       "reduce_scatter": (gemm_reduce_scatter, gemm_reduce_scatter_reference),
       "all_to_all": (gemm_all_to_all_signal, gemm_all_to_all_signal_reference)}
LOG = CheckLog(52)
results, record = LOG.results, LOG.record


def rand(shape, dtype, device, gen):
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def same_on_all_ranks(world: World, y: torch.Tensor) -> bool:
    gathered = [torch.empty_like(y) for _ in range(world.world_size)]
    dist.all_gather(gathered, y.contiguous(), group=world.group)
    return all(torch.equal(g.view(torch.uint8), gathered[0].view(torch.uint8)) for g in gathered)


def out_rows(kind, M, W):
    return M // W if kind == "reduce_scatter" else M


def one(world, ctx, kind, dtype, M, N, K, gen, *, config=None, fused=False, bt=False):
    """Two calls against the reference, fresh inputs and a poisoned output each time (the first
    call of a plan runs unguarded, the second waits on the group counters); returns (worst
    rel_err, output fully written both times, the last output)."""
    fn, ref_fn = OPS[kind]
    dev = world.device
    rows = out_rows(kind, M, world.world_size)
    worst, full = 0.0, True
    for _ in range(2):
        a = rand((M, K), dtype, dev, gen)
        b = rand((N, K), dtype, dev, gen).t() if bt else rand((K, N), dtype, dev, gen)
        bias = rand((N,), dtype, dev, gen) if fused else None
        res = rand((rows, N), dtype, dev, gen) if fused else None
        out = torch.full((rows, N), float("nan"), dtype=dtype, device=dev)
        fn(a, b, ctx, out, bias=bias, residual=res, config=config)
        ctx.synchronize()
        ref = ref_fn(a, b, world.group, bias=bias, residual=res)
        worst = max(worst, rel_err(out, ref))
        full &= not bool(torch.isnan(out).any())
    return worst, full, out


def check_shapes(world, ctx, gen) -> None:
    W = world.world_size
    for kind in OPS:  # bf16 on three shapes, fp16 on one (each new shape compiles kernels)
        for dtype, M, N, K, bt, fused in ((torch.bfloat16, 1024, 2048, 512, False, False),
                                          (torch.bfloat16, 8 * W * 129, 1000, 776, True, False),
                                          (torch.bfloat16, 4096, 4096, 2048, False, True),
                                          (torch.float16, 1024, 2048, 512, False, True)):
            if kind == "all_reduce" and M % 2 == 0 and N == 1000:
                M += 1  # odd M where the op allows it
            err, full, out = one(world, ctx, kind, dtype, M, N, K, gen, bt=bt, fused=fused)
            # identical bits on every rank (each rank's bias / residual differ: not then)
            same = same_on_all_ranks(world, out) if kind == "all_reduce" and not fused else True
            record(f"{kind} {str(dtype)[6:]} {M}x{N}x{K}{' bt' if bt else ''}"
                   f"{' +bias+res' if fused else ''}", err < TOL[dtype] and full and same,
                   f"rel_err={err:.2e} full={full} same_on_ranks={same}")


def check_rmsnorm(world, ctx, gen) -> None:
    """The reorder fused with bias, residual and RMSNorm over whole rows."""
    dev = world.device
    for kind, M, N, K in (("all_reduce", 2048, 4096, 1024), ("reduce_scatter", 2048, 5000, 512)):
        fn, ref_fn = OPS[kind]
        a, b = rand((M, K), torch.bfloat16, dev, gen), rand((K, N), torch.bfloat16, dev, gen)
        rows = out_rows(kind, M, world.world_size)
        bias, w = rand((N,), torch.bfloat16, dev, gen), rand((N,), torch.bfloat16, dev, gen)
        res = rand((rows, N), torch.bfloat16, dev, gen)
        worst = 0.0
        for _ in range(3):  # the first call of a plan runs unguarded, later ones wait
            h, normed = fn(a, b, ctx, bias=bias, residual=res, rms_weight=w, eps=1e-5)
            ctx.synchronize()
            ref_h, ref_n = ref_fn(a, b, world.group, bias=bias, residual=res, rms_weight=w,
                                  eps=1e-5)
            worst = max(worst, rel_err(h, ref_h), rel_err(normed, ref_n))
        record(f"{kind} bf16 {M}x{N}x{K} +bias+res+rmsnorm", worst < 1e-2,
               f"worst rel_err={worst:.2e}")


def partitions(n_tiles, programs, dests):
    """A few partitions of n_tiles (multiples of dests): one group, one wave per group,
    uneven, many small groups."""
    wave = max(dests, programs - programs % dests)
    parts = {"one group": (n_tiles,)}
    waves = [wave] * (n_tiles // wave)
    if n_tiles % wave:
        waves.append(n_tiles % wave)
    parts["one wave each"] = tuple(waves)
    if n_tiles >= 4 * dests:
        q = n_tiles // dests
        parts["uneven 1/8 + rest - 2 + 2"] = (dests * max(1, q // 8),
                                               dests * (q - max(1, q // 8) - 2), dests * 2)
        small = [dests * 4] * (q // 4)
        if q % 4:
            small.append(dests * (q % 4))
        parts[f"{len(small)} small groups"] = tuple(small)
    return parts


def check_partitions(world, ctx, gen) -> None:
    W = world.world_size
    M, N, K = 2048, 4096, 1024
    programs = ctx.grid_programs(ctx.config)
    for kind in ("all_reduce", "reduce_scatter"):
        dests = 1 if kind == "all_reduce" else W
        n_tiles = dests * -(-(M // dests) // 128) * (N // 256)  # the default bf16 tiling
        for name, part in partitions(n_tiles, programs, dests).items():
            cfg = SignalConfig(partition=part)
            err, full, _ = one(world, ctx, kind, torch.bfloat16, M, N, K, gen, config=cfg)
            record(f"{kind} partition: {name} ({len(part)} groups)", err < 1e-2 and full,
                   f"rel_err={err:.2e} sizes={part[:6]}{'...' if len(part) > 6 else ''}")


def check_back_to_back(world, ctx, gen, calls: int = 300) -> None:
    """Many calls without a sync, inputs cycling over 8 sets, every kind in turn (plans switch,
    counters must be reset by each call's waits)."""
    dev = world.device
    M, N, K = 512, 2048, 1024
    sets = [(rand((M, K), torch.bfloat16, dev, gen), rand((K, N), torch.bfloat16, dev, gen))
            for _ in range(8)]
    kinds = list(OPS)
    refs = {(k, i): OPS[k][1](a, b, world.group) for k in kinds for i, (a, b) in enumerate(sets)}
    outs = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for c in range(calls):
        k, i = kinds[c % 3], c % 8
        outs.append((k, i, OPS[k][0](*sets[i], ctx)))
    ctx.synchronize()
    dt = time.perf_counter() - t0
    worst = max(rel_err(o, refs[(k, i)]) for k, i, o in outs)
    zero = bool((ctx.counters.values() == 0).all())
    record(f"{calls} back-to-back calls, 3 kinds interleaved", worst < 1e-2 and zero,
           f"worst rel_err={worst:.2e} counters_zero={zero} {dt / calls * 1e6:.0f} us/call")


def check_graph(world, ctx, gen, replays: int = 50) -> None:
    """Capture and replay: the value gate (stream value waits in the graph) for the three kinds,
    and the event gate (no value ops: the fallback if they cannot be captured) for AllReduce."""
    for kind, gate in (("all_reduce", "value"), ("reduce_scatter", "value"),
                       ("all_to_all", "value"), ("all_reduce", "event")):
        cfg = SignalConfig(gate=gate)
        # a context of its own: a failed capture breaks the context it was captured on
        gctx = GemmSignal(world)
        try:
            _graph_case(world, gctx, gen, kind, gate, cfg, replays)
        finally:
            gctx.close()


def _graph_case(world, ctx, gen, kind, gate, cfg, replays) -> None:
    dev = world.device
    M, N, K = 2048, 4096, 1024
    fn, ref_fn = OPS[kind]
    a = rand((M, K), torch.bfloat16, dev, gen)
    b = rand((K, N), torch.bfloat16, dev, gen)
    out = torch.empty((out_rows(kind, M, world.world_size), N), dtype=torch.bfloat16,
                      device=dev)
    fn(a, b, ctx, out, config=cfg)  # plans, loads kernels, checks the ranks: not captured
    ctx.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn(a, b, ctx, out, config=cfg)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            fn(a, b, ctx, out, config=cfg)
    except Exception as e:
        record(f"CUDA graph capture: {kind}, {gate} gate", False,
               f"capture raised {type(e).__name__}: {str(e)[:200]}")
        torch.cuda.synchronize()
        return
    worst = 0.0
    for _ in range(replays):
        a.copy_(rand((M, K), torch.bfloat16, dev, gen))
        out.fill_(float("nan"))
        world.barrier()
        g.replay()
        torch.cuda.synchronize()
        worst = max(worst, rel_err(out, ref_fn(a, b, world.group)))
    zero = bool((ctx.counters.values() == 0).all())
    record(f"CUDA graph: {kind}, {gate} gate, {replays} replays", worst < 1e-2 and zero,
           f"worst rel_err={worst:.2e} counters_zero={zero}")


def check_large(world, ctx, gen) -> None:
    """The benchmark's shape once, with a rough timing against the sequential baseline."""
    W = world.world_size
    M, N, K = 8192, 8192, 8192 // W
    dev = world.device
    a, b = rand((M, K), torch.bfloat16, dev, gen), rand((K, N), torch.bfloat16, dev, gen)
    out = torch.empty((M, N), dtype=torch.bfloat16, device=dev)
    gemm_all_reduce(a, b, ctx, out)
    ctx.synchronize()
    err = rel_err(out, gemm_all_reduce_reference(a, b, world.group))
    times = {}
    for name, fn in (("fused", lambda: gemm_all_reduce(a, b, ctx, out)),
                     ("sequential", lambda: dist.all_reduce(torch.mm(a, b, out=out)))):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        world.barrier()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(20):
            fn()
        e1.record()
        torch.cuda.synchronize()
        times[name] = e0.elapsed_time(e1) / 20
    record(f"all_reduce {M}x{N}x{K} (bench shape)", err < 1e-2,
           f"rel_err={err:.2e} fused {times['fused']:.3f} ms vs sequential "
           f"{times['sequential']:.3f} ms (rough, back-to-back)")


def check_bad_input(world, ctx) -> None:
    dev = world.device
    a = torch.randn(64, 32, device=dev, dtype=torch.bfloat16)
    msgs = []
    for fn, x, y, kw in ((gemm_all_reduce, a, torch.randn(31, 64, device=dev,
                                                          dtype=torch.bfloat16), {}),
                         # M % W (on one rank every M splits: a 3-D operand instead)
                         (gemm_reduce_scatter, a[:63] if world.world_size > 1 else a[None],
                          torch.randn(32, 64, device=dev, dtype=torch.bfloat16), {}),
                         (gemm_all_reduce, a, torch.randn(32, 64, device=dev), {}),
                         (gemm_all_reduce, a.cpu(), torch.randn(32, 64, dtype=torch.bfloat16),
                          {})):
        try:
            fn(x, y, ctx, **kw)
            msgs.append(None)
        except (ValueError, TypeError) as e:
            msgs.append(str(e))
    ok = all(m and m.startswith("matmul_") for m in msgs)
    # and the context still works
    err, full, _ = one(world, ctx, "all_reduce", torch.bfloat16, 256, 512, 128,
                       torch.Generator(device=dev).manual_seed(5))
    record("bad input refused before any launch", ok and err < 1e-2 and full,
           f"{sum(m is not None for m in msgs)}/4 refused; then rel_err={err:.2e}")


def check_copy_engine(world, gen, replays: int = 20) -> None:
    """GEMM + ReduceScatter with the counters gating copy-engine transfers
    (ops/gemm_signal/copy_engine.py): odd and bench shapes, bias + residual, back-to-back calls
    and CUDA-graph replays (the flags' epochs and the counters' resets across replays)."""
    from portable_overlap.ops.gemm_signal.copy_engine import GemmReduceScatterCE

    W, dev = world.world_size, world.device
    ctx = GemmReduceScatterCE(world, GemmReduceScatterCE.elems_needed(8192, 8192, W, 128, 256))
    try:
        for dtype, M, N, K, epi in ((torch.bfloat16, 8192, 8192, 8192, False),
                                    (torch.bfloat16, 2064, 1000, 776, True),
                                    (torch.float16, 1024, 2048, 512, True),
                                    (torch.float32, 512, 256, 96, False)):
            Kl = K // W
            a, b = rand((M, Kl), dtype, dev, gen), rand((Kl, N), dtype, dev, gen)
            rows = M // W
            bias = rand((N,), dtype, dev, gen) if epi else None
            res = rand((rows, N), dtype, dev, gen) if epi else None
            worst = 0.0
            for _ in range(3):  # back to back on one context
                out = torch.full((rows, N), float("nan"), dtype=dtype, device=dev)
                ctx.reduce_scatter(a, b, out, bias=bias, residual=res)
                ctx.synchronize()
                ref = gemm_reduce_scatter_reference(a, b, world.group).double()
                if epi:
                    ref = ref + bias.double() + res.double()
                worst = max(worst, rel_err(out, ref))
            record(f"copy engine RS {str(dtype)[6:]} {M}x{N}x{K}{' +bias+res' if epi else ''}",
                   worst < 1e-2, f"worst rel_err={worst:.2e} (3 calls)")
        M, N, K = 4096, 4096, 2048
        a = rand((M, K // W), torch.bfloat16, dev, gen)
        b = rand((K // W, N), torch.bfloat16, dev, gen)
        out = torch.empty(M // W, N, dtype=torch.bfloat16, device=dev)
        ctx.reduce_scatter(a, b, out)
        ctx.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ctx.reduce_scatter(a, b, out)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            ctx.reduce_scatter(a, b, out)
        worst = 0.0
        for _ in range(replays):
            a.copy_(rand(a.shape, a.dtype, dev, gen))
            out.fill_(float("nan"))
            g.replay()
            ctx.synchronize()
            worst = max(worst, rel_err(out, gemm_reduce_scatter_reference(a, b, world.group)
                                       .double()))
        record(f"copy engine RS: CUDA graph, {replays} replays", worst < 1e-2,
               f"worst rel_err={worst:.2e}")
    finally:
        torch.cuda.synchronize()
        ctx.close()


def main() -> int:
    import faulthandler

    faulthandler.dump_traceback_later(int(os.environ.get("PO_SIG_CHECK_TIMEOUT", "300")),
                                      exit=True)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    world = World.from_env()
    gen = torch.Generator(device=world.device).manual_seed(2000 + world.rank)
    if world.rank == 0:
        print(f"[rank 0] CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', '(default)')}"
              f" sm_count={world.facts.sm_count}", flush=True)
    ctx = GemmSignal(world)
    for check in (check_shapes, check_rmsnorm, check_partitions, check_back_to_back, check_graph,
                  check_large, check_copy_engine):
        try:
            check(world, gen) if check is check_copy_engine else check(world, ctx, gen)
        except Exception as e:
            record(check.__name__, False, f"raised {type(e).__name__}: {e}"[:300])
            traceback.print_exc()
    try:
        check_bad_input(world, ctx)
    except Exception as e:
        record("bad input", False, f"raised {type(e).__name__}: {e}"[:300])
    ctx.close()
    return LOG.finish(world, "gemm_signal gpu checks")


if __name__ == "__main__":
    sys.exit(main())
