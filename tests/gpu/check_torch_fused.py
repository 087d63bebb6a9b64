"""GPU checks of ``transport="torch_fused"`` (ops/torch_fused.py: torch's
``fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``), under torchrun on the GPUs of one
host, any number of ranks, one included:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        timeout 600 torchrun --nproc-per-node N tests/gpu/check_torch_fused.py

Where the transport runs (``PatternContext.unavailable`` says so): for AllGather + GEMM and
GEMM + ReduceScatter, in bf16, fp16 and fp32, at odd shapes (rows, K and N off every tile; the
ReduceScatter K shards differ by rank), fresh random inputs, the poisoned ``out`` written by the
call and torch's own result tensor without ``out``, both against the torch reference (fp32
product, then the collective), with bias and residual; a call captured in a CUDA graph and
replayed with fresh inputs into a poisoned ``out`` (the workspace is sized at creation, so no
call allocates it); a bad call (the same on every rank) raising ``ValueError`` and the context
working on after it; ``transport="auto"`` with every transport a candidate timing it, and
``candidates=("torch_fused",)``. Where it does not run (e.g. ranks on several
hosts), that making it raises ``BackendUnavailable`` with the reason and that ``"auto"`` leaves
it out; the reason is printed.

Every wait is bounded: torch's barriers have no deadline, so the whole script runs under a
watchdog (``PO_TORCH_FUSED_CHECK_TIMEOUT``, default 420 s) that prints every thread's stack and
exits; the ``timeout`` above bounds torchrun as well. Each check prints ``PASS``/``FAIL`` on
rank 0; the exit code is 1 if any failed on any rank. (Not collected by pytest: it needs one
process per GPU.)
"""
from __future__ import annotations

import os
import sys
import traceback

import torch

import portable_overlap as po
from portable_overlap.errors import BackendUnavailable
from portable_overlap.testing.check_log import CheckLog
from portable_overlap.testing.compare import rel_err
from portable_overlap.testing.graphs import worst_over_graph_replays
from portable_overlap.testing.patterns import GEMM_PATTERNS

#: bf16 / fp16: torch rounds each peer's partial before the sum (as NCCL does), then bias and
#: residual add one rounding each; fp32 runs without TF32 (torch's default)
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LOG = CheckLog(52)
record = LOG.record
RS_REFERENCE = GEMM_PATTERNS["matmul_reduce_scatter"][1]  # (a, b, group, bias, residual)


def rand(shape, dtype, world, gen, scale=1.0):
    return (torch.randn(shape, device=world.device, generator=gen) * scale).to(dtype)


def poisoned(shape, dtype, world):
    return torch.full(shape, float("nan"), dtype=dtype, device=world.device)


def ag_shapes(world):
    """(m, K, N) of the shard: odd rows, K and N; one row; a wide N."""
    return [(37, 100, 53), (1, 7, 3), (256, 1024, 768), (5, 4096, 33)]


def rs_shapes(world):
    """(M, N, K of this rank): M a multiple of W (rows split evenly), K shards differing by
    rank, odd N."""
    W, r = world.world_size, world.rank
    return [(37 * W, 53, 100 + r), (W, 3, 7 + 2 * r), (256 * W, 768, 512), (5 * W, 4096, 33)]


def check_all_gather(world, gen) -> None:
    W = world.world_size
    shapes = ag_shapes(world)
    for dtype in DTYPES:
        dt = str(dtype)[6:]
        ctx = po.AllGatherMatmul(world, max(m * K for m, K, _ in shapes),
                                 transport="torch_fused")
        try:
            for m, K, N in shapes:
                a, b = rand((m, K), dtype, world, gen), rand((K, N), dtype, world, gen, K ** -0.5)
                out = poisoned((W * m, N), dtype, world)
                y = po.all_gather_matmul(a, b, ctx, out)
                own = po.all_gather_matmul(a, b, ctx)  # torch's result tensor, no copy
                ctx.synchronize()
                ref = po.all_gather_matmul_reference(a, b, world.group)
                err, err_own = rel_err(out, ref), rel_err(own, ref)
                record(f"all_gather_matmul {m}x{K}x{N} {dt}",
                       y is out and tuple(own.shape) == (W * m, N) and err < TOL[dtype]
                       and err_own < TOL[dtype], f"rel_err={err:.1e} (no out: {err_own:.1e})")
            m, K, N = shapes[2]
            a, b = rand((m, K), dtype, world, gen), rand((K, N), dtype, world, gen, K ** -0.5)
            out = poisoned((W * m, N), dtype, world)
            worst = worst_over_graph_replays(ctx, lambda: po.all_gather_matmul(a, b, ctx, out), a, out,
                             lambda: po.all_gather_matmul_reference(a, b, world.group), gen)
            record(f"all_gather_matmul {m}x{K}x{N} {dt} graph replays", worst < TOL[dtype],
                   f"worst rel_err={worst:.1e}")
        finally:
            ctx.close()


def check_reduce_scatter(world, gen) -> None:
    W = world.world_size
    shapes = rs_shapes(world)
    for dtype in DTYPES:
        dt = str(dtype)[6:]
        ctx = po.MatmulReduceScatter(world, max(s[0] for s in shapes),
                                     max(s[1] for s in shapes), transport="torch_fused")
        try:
            for i, (M, N, K) in enumerate(shapes):
                a, b = rand((M, K), dtype, world, gen), rand((K, N), dtype, world, gen, K ** -0.5)
                bias = rand((N,), dtype, world, gen) if i % 2 == 0 else None
                res = rand((M // W, N), dtype, world, gen) if i < 2 else None
                out = poisoned((M // W, N), dtype, world)
                y = po.matmul_reduce_scatter(a, b, ctx, out, bias=bias, residual=res)
                own = po.matmul_reduce_scatter(a, b, ctx)
                ctx.synchronize()
                err = rel_err(out, RS_REFERENCE(a, b, world.group, bias, res))
                err_own = rel_err(own, RS_REFERENCE(a, b, world.group, None, None))
                record(f"matmul_reduce_scatter {M}x{N}x{K} {dt}"
                       f"{' +bias' if bias is not None else ''}"
                       f"{' +residual' if res is not None else ''}",
                       y is out and tuple(own.shape) == (M // W, N) and err < TOL[dtype]
                       and err_own < TOL[dtype], f"rel_err={err:.1e} (no out: {err_own:.1e})")
            M, N, K = shapes[2]
            a, b = rand((M, K), dtype, world, gen), rand((K, N), dtype, world, gen, K ** -0.5)
            bias, out = rand((N,), dtype, world, gen), poisoned((M // W, N), dtype, world)
            worst = worst_over_graph_replays(ctx, lambda: po.matmul_reduce_scatter(a, b, ctx, out, bias=bias), a,
                             out, lambda: RS_REFERENCE(a, b, world.group, bias, None), gen)
            record(f"matmul_reduce_scatter {M}x{N}x{K} {dt} graph replays", worst < TOL[dtype],
                   f"worst rel_err={worst:.1e}")
        finally:
            ctx.close()


def check_bad_input(world, gen) -> None:
    """The same bad call on every rank: the other transports' ValueError, before torch's op
    (so no rank waits in torch's barrier), and the context works on."""
    W = world.world_size
    with po.MatmulReduceScatter(world, 8 * W, 16, transport="torch_fused") as ctx:
        a, b = rand((8 * W, 32), torch.bfloat16, world, gen), rand((32, 16), torch.bfloat16,
                                                                   world, gen)
        msg = ""
        try:
            po.matmul_reduce_scatter(a, b, ctx, bias=rand((15,), torch.bfloat16, world, gen))
        except ValueError as e:
            msg = str(e)
        y = po.matmul_reduce_scatter(a, b, ctx)
        ctx.synchronize()
        err = rel_err(y, RS_REFERENCE(a, b, world.group, None, None))
        record("bad input: ValueError, then a good call", msg.startswith(
            "matmul_reduce_scatter: bias must be") and err < TOL[torch.bfloat16],
            f"{msg[:60]!r} rel_err={err:.1e}")


def check_auto(world, gen) -> None:
    """``"auto"``: torch_fused among the candidates, timed at the first call of a key
    (not failed), a correct result whatever the pick; named as the one candidate, it runs."""
    W = world.world_size
    dtype = torch.bfloat16
    m, K, N = 512, 2048, 1024
    cases = [
        ("all_gather_matmul", lambda **kw: po.AllGatherMatmul(world, m * K, **kw),
         lambda: (rand((m, K), dtype, world, gen), rand((K, N), dtype, world, gen, K ** -0.5)),
         (W * m, N), lambda a, b: po.all_gather_matmul_reference(a, b, world.group)),
        ("matmul_reduce_scatter", lambda **kw: po.MatmulReduceScatter(world, m * W, N, **kw),
         lambda: (rand((m * W, K), dtype, world, gen),
                  rand((K, N), dtype, world, gen, K ** -0.5)),
         (m, N), lambda a, b: po.matmul_reduce_scatter_reference(a, b, world.group)),
    ]
    for name, make, inputs, rows, ref in cases:
        fn = getattr(po, name)
        every = (po.AllGatherMatmul if name == "all_gather_matmul" else
                 po.MatmulReduceScatter).TRANSPORTS
        with make(transport="auto", candidates=every) as ctx:
            a, b = inputs()
            out = poisoned(rows, dtype, world)
            fn(a, b, ctx, out)
            ctx.synchronize()
            err = rel_err(out, ref(a, b))
            decision = list(ctx.decisions.values())[-1]
            ms = ", ".join(f"{t} {v:.3f}" for t, v in decision["ms"].items())
            record(f"{name} auto {rows[0]}x{N}x{K}", "torch_fused" in ctx.planner.candidates
                   and "torch_fused" in decision["ms"] and err < TOL[dtype],
                   f"pick {ctx.choice(a, b)} [{ms} ms] failed={list(decision['failed'])} "
                   f"rel_err={err:.1e}")
        with make(transport="auto", candidates=("torch_fused",)) as ctx:
            a, b = inputs()
            out = poisoned(rows, dtype, world)
            fn(a, b, ctx, out)
            ctx.synchronize()
            err = rel_err(out, ref(a, b))
            record(f"{name} auto candidates=('torch_fused',)",
                   ctx.choice(a, b) == "torch_fused" and err < TOL[dtype], f"rel_err={err:.1e}")


def check_unavailable(world, why: str) -> None:
    """Where torch's ops do not run: named, the transport raises BackendUnavailable with the
    reason; ``"auto"`` leaves it out of its default candidates."""
    for name, make in (("all_gather_matmul", lambda **kw: po.AllGatherMatmul(world, 64, **kw)),
                       ("matmul_reduce_scatter",
                        lambda **kw: po.MatmulReduceScatter(world, 8 * world.world_size, 8,
                                                            **kw))):
        msg = ""
        try:
            make(transport="torch_fused").close()
        except BackendUnavailable as e:
            msg = str(e)
        with make(transport="auto") as ctx:
            left_out = "torch_fused" not in ctx.planner.candidates
        record(f"{name} torch_fused unavailable", why in msg and left_out, msg[:120])


def guarded(check, *args) -> None:
    try:
        check(*args)
    except Exception as e:  # noqa: BLE001  (one check's failure is one finding)
        record(check.__name__, False, f"raised {type(e).__name__}: {e}"[:300])
        traceback.print_exc()


def main() -> int:
    import faulthandler

    faulthandler.dump_traceback_later(
        int(os.environ.get("PO_TORCH_FUSED_CHECK_TIMEOUT", "420")), exit=True)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    world = po.World.from_env()
    gen = torch.Generator(device=world.device).manual_seed(5000 + world.rank)
    why = po.AllGatherMatmul.unavailable(world).get("torch_fused")
    if world.rank == 0:
        print(f"torch {torch.__version__}, world of {world.world_size} "
              f"({world.local_world_size} on this host), {world.facts.name}: torch_fused "
              f"{'runs here' if why is None else 'cannot run here: ' + why}", flush=True)
    if why is not None:
        guarded(check_unavailable, world, why)
    else:
        for check in (check_all_gather, check_reduce_scatter, check_bad_input, check_auto):
            guarded(check, world, gen)
    return LOG.finish(world, f"torch_fused gpu checks (world of {world.world_size})")


if __name__ == "__main__":
    sys.exit(main())
