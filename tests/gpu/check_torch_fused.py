"""GPU checks of ``transport="torch_fused"`` (ops/torch_fused.py: torch's
``fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``, and for GEMV + AllReduce
``torch.mm`` into a symmetric buffer then ``one_shot_all_reduce_out``), under torchrun on the GPUs
of one host, any number of ranks, one included:

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
``candidates=("torch_fused",)``. GEMV + AllReduce: M = 1, 8, 33, N = 4160, 1000, 999 (so
some calls reduce a rounded length through the staging buffer), K differing by rank, bf16, fp16
(the process group's all_reduce) and fp32, ``out`` poisoned, not given, and 2 bytes off 16-byte
alignment, against the fp32 reference and the same bits on every rank; CUDA-graph replays with
fresh inputs (straight and staged); a wrong-dtype ``w`` and N > max_n raising what
``transport="stores"`` raises, the context working on after them; ``transport="auto"`` with
``candidates=("one_shot", "torch_fused", "sequential")``; and whether torch's one-shot op takes
fp16 (printed, not a check). Where it does not run (e.g. ranks on several
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
import torch.distributed as dist

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
            worst = worst_over_graph_replays(
                ctx, lambda: po.all_gather_matmul(a, b, ctx, out), a, out,
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
            worst = worst_over_graph_replays(
                ctx, lambda: po.matmul_reduce_scatter(a, b, ctx, out, bias=bias), a, out,
                lambda: RS_REFERENCE(a, b, world.group, bias, None), gen)
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


GEMV_SHAPES = [(M, N) for M in (1, 8, 33) for N in (4160, 1000, 999)]
GEMV_MAX_N = 4160


def same_on_all_ranks(world, y: torch.Tensor) -> bool:
    gathered = [torch.empty_like(y) for _ in range(world.world_size)]
    dist.all_gather(gathered, y.contiguous(), group=world.group)
    return all(torch.equal(g.view(torch.uint8), gathered[0].view(torch.uint8)) for g in gathered)


def gemv_inputs(world, gen, M, N, dtype):
    K = 1024 + 16 * world.rank  # the K shards differ by rank
    return rand((M, K), dtype, world, gen), rand((N, K), dtype, world, gen, K ** -0.5)


def gemv_reference(x, w, world):
    return po.gemv_all_reduce_reference(x, w, world.group)


def check_gemv(world, gen) -> None:
    """Every shape and dtype: ``out`` poisoned, not given, and 2 bytes off alignment (staged)."""
    for dtype in DTYPES:
        dt = str(dtype)[6:]
        with po.GemvAllReduce(world, GEMV_MAX_N, transport="torch_fused") as ctx:
            for M, N in GEMV_SHAPES:
                x, w = gemv_inputs(world, gen, M, N, dtype)
                out = poisoned((M, N), dtype, world)
                y = po.gemv_all_reduce(x, w, ctx, out)
                own = po.gemv_all_reduce(x, w, ctx)
                ctx.synchronize()
                ref = gemv_reference(x, w, world)
                err, err_own = rel_err(out, ref), rel_err(own, ref)
                same = same_on_all_ranks(world, out)
                record(f"gemv_all_reduce {M}x{N} {dt}",
                       y is out and tuple(own.shape) == (M, N) and own.is_contiguous()
                       and err < TOL[dtype] and err_own < TOL[dtype] and same,
                       f"rel_err={err:.1e} (no out: {err_own:.1e}) same_on_ranks={same}")
                if (M, N) != (8, 1000):
                    continue
                # the same call into an out 2 (fp16, bf16) or 4 (fp32) bytes past a 16-byte
                # boundary: staged, then copied; the memory around out stays as it was
                skip = 16 // out.element_size() + 1
                room = poisoned((M * N + 2 * skip,), dtype, world)
                off = room[skip:skip + M * N].view(M, N)
                y = po.gemv_all_reduce(x, w, ctx, off)
                ctx.synchronize()
                err = rel_err(off, ref)
                untouched = bool(room[:skip].isnan().all()) and bool(
                    room[skip + M * N:].isnan().all())
                record(f"gemv_all_reduce {M}x{N} {dt} out off 16-byte alignment",
                       y is off and off.data_ptr() % 16 != 0 and err < TOL[dtype] and untouched,
                       f"rel_err={err:.1e} outside out untouched={untouched}")


def check_gemv_graph(world, gen) -> None:
    """A captured call replayed with fresh inputs: straight into ``out`` and staged."""
    for dtype, (M, N) in [(torch.bfloat16, (8, 4160)), (torch.float16, (8, 4160)),
                          (torch.float32, (8, 4160)), (torch.bfloat16, (33, 999))]:
        with po.GemvAllReduce(world, GEMV_MAX_N, transport="torch_fused") as ctx:
            x, w = gemv_inputs(world, gen, M, N, dtype)
            out = poisoned((M, N), dtype, world)
            worst = worst_over_graph_replays(ctx, lambda: po.gemv_all_reduce(x, w, ctx, out), x,
                                             out, lambda: gemv_reference(x, w, world), gen)
            record(f"gemv_all_reduce {M}x{N} {str(dtype)[6:]} graph replays", worst < TOL[dtype],
                   f"worst rel_err={worst:.1e}")


def check_gemv_bad_input(world, gen) -> None:
    """The same bad calls on every rank: the errors ``"stores"`` raises, before torch's op (so
    no rank waits in torch's barrier), and the context works on."""
    dtype = torch.bfloat16
    x, w = gemv_inputs(world, gen, 4, 256, dtype)
    cases = {"w dtype differs": lambda c: po.gemv_all_reduce(x, w.float(), c),
             "N > max_n": lambda c: po.gemv_all_reduce(
                 x, rand((GEMV_MAX_N + 1, x.shape[1]), dtype, world, gen), c)}
    found = {}
    for transport in ("stores", "torch_fused"):
        with po.GemvAllReduce(world, GEMV_MAX_N, transport=transport) as ctx:
            for label, call in cases.items():
                try:
                    call(ctx)
                    found[(transport, label)] = "no error"
                except Exception as e:  # noqa: BLE001  (the kind is the finding)
                    found[(transport, label)] = type(e).__name__
            if transport == "torch_fused":
                y = po.gemv_all_reduce(x, w, ctx)
                ctx.synchronize()
                err = rel_err(y, gemv_reference(x, w, world))
    for label in cases:
        got, want = found[("torch_fused", label)], found[("stores", label)]
        record(f"gemv_all_reduce bad input: {label}", got == want and want != "no error",
               f"torch_fused {got}, stores {want}")
    record("gemv_all_reduce good call after bad ones", err < TOL[dtype], f"rel_err={err:.1e}")


def check_gemv_auto(world, gen) -> None:
    """``"auto"`` with torch_fused among the candidates: timed at the first call (not failed),
    a correct result whatever the pick, and a second call of the decided key."""
    dtype, (M, N) = torch.bfloat16, (8, 4160)
    with po.GemvAllReduce(world, GEMV_MAX_N, transport="auto",
                          candidates=("one_shot", "torch_fused", "sequential")) as ctx:
        errs = []
        for _ in range(2):
            x, w = gemv_inputs(world, gen, M, N, dtype)
            out = poisoned((M, N), dtype, world)
            po.gemv_all_reduce(x, w, ctx, out)
            ctx.synchronize()
            errs.append(rel_err(out, gemv_reference(x, w, world)))
        decision = list(ctx.decisions.values())[-1]
        ms = ", ".join(f"{t} {v:.3f}" for t, v in decision["ms"].items())
        record(f"gemv_all_reduce auto {M}x{N}", "torch_fused" in decision["ms"]
               and max(errs) < TOL[dtype],
               f"pick {ctx.choice(x, w)} [{ms} ms] failed={list(decision['failed'])} "
               f"rel_err={max(errs):.1e}")


def probe_one_shot_fp16(world, gen) -> None:
    """Whether this torch's one-shot all-reduce takes fp16 (the transport sends fp16 calls to the
    process group's all_reduce because torch's kernel dispatches fp32 and bf16): printed only.
    A dtype it refuses is refused on every rank before its launch."""
    import torch.distributed._symmetric_memory as symm_mem

    group_name = (world.group or dist.group.WORLD).group_name
    t = symm_mem.empty(64, dtype=torch.float16, device=world.device)
    symm_mem.rendezvous(t, group_name)
    t.fill_(1.0)
    try:
        y = torch.ops.symm_mem.one_shot_all_reduce(t, "sum", group_name)
        torch.cuda.synchronize(world.device)
        what = f"takes it (sum of ones = {y[0].item()})"
    except RuntimeError as e:
        what = f"refuses it: {str(e).splitlines()[0][:160]}"
    if world.rank == 0:
        print(f"torch.ops.symm_mem.one_shot_all_reduce with fp16: {what}", flush=True)


def check_unavailable(world, why: str, names=("all_gather_matmul", "matmul_reduce_scatter")
                      ) -> None:
    """Where torch's ops do not run: named, the transport raises BackendUnavailable with the
    reason; ``"auto"`` leaves it out of its default candidates."""
    makers = {"all_gather_matmul": lambda **kw: po.AllGatherMatmul(world, 64, **kw),
              "matmul_reduce_scatter": lambda **kw: po.MatmulReduceScatter(
                  world, 8 * world.world_size, 8, **kw),
              "gemv_all_reduce": lambda **kw: po.GemvAllReduce(world, 8, **kw)}
    for name in names:
        make = makers[name]
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
    why_gemv = po.GemvAllReduce.unavailable(world).get("torch_fused")
    if world.rank == 0:
        for what, reason in (("GEMM patterns", why), ("GEMV + AllReduce", why_gemv)):
            print(f"torch {torch.__version__}, world of {world.world_size} "
                  f"({world.local_world_size} on this host), {world.facts.name}: torch_fused "
                  f"of the {what} {'runs here' if reason is None else 'cannot run here: '}"
                  f"{reason or ''}", flush=True)
    if why is not None:
        guarded(check_unavailable, world, why)
    else:
        for check in (check_all_gather, check_reduce_scatter, check_bad_input, check_auto):
            guarded(check, world, gen)
    if why_gemv is not None:
        guarded(check_unavailable, world, why_gemv, ("gemv_all_reduce",))
    else:
        for check in (check_gemv, check_gemv_graph, check_gemv_bad_input, check_gemv_auto):
            guarded(check, world, gen)
        if world.world_size > 1:
            guarded(probe_one_shot_fp16, world, gen)
    return LOG.finish(world, f"torch_fused gpu checks (world of {world.world_size})")


if __name__ == "__main__":
    sys.exit(main())
