"""GPU checks of embedding pooling + All-to-All, run by ci/gpu.sh under torchrun:

    torchrun --nproc-per-node 2 tests/gpu/check_embedding_alltoall.py

Correctness against F.embedding_bag per table + all_to_all_single for fp32 / fp16 / bf16, sum and
mean, per-index weights, uneven batch splits, a rank without tables, int32 and int64 indices,
back-to-back calls with changing shapes, CUDA-graph replay, backward, bad input and ranks that
disagree, on the fused ``"stores"`` transport; the forward matrix on ``"sequential"`` too,
``"shmem"`` in a check of its own, ``"auto"`` eager and replayed in ``check_auto``. Each check
prints ``PASS``/``FAIL`` on rank 0; exit code 1 if any failed on any rank.
Every wait inside the kernel is bounded (10 s, 2 s for the mismatch check), so a broken kernel
reports instead of hanging. (Not collected by pytest: one process per GPU.)
"""
from __future__ import annotations

import os
import sys
import time
import traceback

import torch

from portable_overlap.testing.check_log import CheckLog
from portable_overlap import (EmbeddingAllToAll, PortableOverlapError, World,
                              embedding_all_to_all, embedding_all_to_all_reference)
from portable_overlap.testing.compare import rel_err

TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 1e-5}
SEQ_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}
LOG = CheckLog(55)
results, record = LOG.results, LOG.record


def make_input(ctx, splits, dtype, gen, pf=4, weighted=False, idx_dtype=torch.int64):
    """This rank's packed tables and its tables' jagged features for the global batch; bag
    lengths uniform in 0..2·pf (empty bags included)."""
    dev = ctx.world.device
    B = sum(splits)
    weight = torch.randn(ctx.weight_rows, ctx.dim, generator=gen, device=dev).to(dtype)
    lengths = torch.randint(0, 2 * pf + 1, (ctx.n_loc * B,), generator=gen, device=dev)
    parts = []
    for j, t in enumerate(ctx.local_tables):
        n = int(lengths[j * B:(j + 1) * B].sum())
        parts.append(torch.randint(0, ctx.plan.table_rows[t], (n,), generator=gen, device=dev))
    indices = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=dev)
    psw = (torch.rand(indices.numel(), generator=gen, device=dev) + 0.5) if weighted else None
    return weight, lengths.to(idx_dtype), indices.to(idx_dtype), psw


def check_forward(world, gen) -> None:
    W = world.world_size
    uneven = [max(1, 37 * (q + 1) - 5 * q * q) for q in range(W)]
    cases = [  # (table rows, D, splits, table_ranks)
        ([1000, 5000, 300, 20000, 7, 4096, 999, 12000], 128, [256] * W, None),
        ([1000, 5000, 300, 20000, 7, 4096, 999, 12000], 64, uneven, None),
        ([3000] * 5, 92, uneven, None),  # D not a power of two
        ([500, 600, 700], 32, [64] * W, [0, 0, 0]),  # ranks other than 0 hold no tables
    ]
    runs = [(c, t) for t in ("stores", "sequential") for c in cases]
    for (rows, D, splits, ranks), transport in runs:
        ctx = EmbeddingAllToAll(world, rows, D, max(splits), table_ranks=ranks,
                                transport=transport)
        # the sequential transport pools in the tables' dtype (F.embedding_bag)
        tol = TOL if transport == "stores" else SEQ_TOL
        try:
            for dt in (torch.float32, torch.float16, torch.bfloat16):
                for pooling, weighted, idx_dt in (("sum", False, torch.int64),
                                                  ("mean", False, torch.int32),
                                                  ("sum", True, torch.int32)):
                    w, ln, ix, psw = make_input(ctx, splits, dt, gen, weighted=weighted,
                                                idx_dtype=idx_dt)
                    out = torch.full(ctx.output_shape(splits), float("nan"), dtype=dt,
                                     device=world.device)
                    ctx(w, ln, ix, psw, batch_splits=splits, pooling=pooling, out=out)
                    ctx.synchronize()
                    ref = embedding_all_to_all_reference(w, ln, ix, psw, ctx.plan, world.rank,
                                                         splits, pooling, world.group)
                    err = rel_err(out, ref)
                    record(f"fwd {transport} T={len(rows)} D={D} splits={splits[:4]} "
                           f"{str(dt)[6:]} {pooling}{' weighted' if weighted else ''}",
                           err < tol[dt] and not torch.isnan(out).any(), f"rel_err={err:.2e}")
        finally:
            ctx.close()


def check_large(world, gen) -> None:
    """The benchmark's first shape (global batch 16384, 32 tables, D 128, 32 per bag)."""
    W = world.world_size
    ctx = EmbeddingAllToAll(world, [200000] * 32, 128, 16384 // W, transport="stores")
    try:
        splits = [16384 // W] * W
        w, ln, ix, _ = make_input(ctx, splits, torch.float32, gen, pf=16)
        out = torch.full(ctx.output_shape(splits), float("nan"), device=world.device)
        ctx(w, ln, ix, batch_splits=splits, out=out)
        ctx.synchronize()
        err = rel_err(out, embedding_all_to_all_reference(w, ln, ix, None, ctx.plan, world.rank,
                                                          splits, "sum", world.group))
        record("fwd large 16384x32x128 fp32", err < 1e-5, f"rel_err={err:.2e}")
    finally:
        ctx.close()


def check_shmem(world, gen) -> None:
    """The device-initiated (NVSHMEM) transport: uneven splits, D 128 / 64 / 92, the three
    dtypes and poolings spread over the cases (each combination compiles a kernel with the
    library linked: ~5 s), repeated calls on one context, and the large shape."""
    W = world.world_size
    uneven = [max(1, 37 * (q + 1) - 5 * q * q) for q in range(W)]
    tables = [1000, 5000, 300, 20000, 7, 4096, 999, 12000]
    cases = [(tables, 128, [256] * W, torch.float32, "sum", False),
             (tables, 128, [256] * W, torch.bfloat16, "sum", True),
             (tables, 64, uneven, torch.float16, "mean", False),
             ([3000] * 5, 92, uneven, torch.float32, "sum", False),
             ([200000] * 32, 128, [16384 // W] * W, torch.float32, "sum", False)]
    for rows, D, splits, dt, pooling, weighted in cases:
        ctx = EmbeddingAllToAll(world, rows, D, max(splits), transport="shmem")
        try:
            w, ln, ix, psw = make_input(ctx, splits, dt, gen, weighted=weighted)
            out = torch.full(ctx.output_shape(splits), float("nan"), dtype=dt,
                             device=world.device)
            for _ in range(2):
                ctx(w, ln, ix, psw, batch_splits=splits, pooling=pooling, out=out)
            ctx.synchronize()
            ref = embedding_all_to_all_reference(w, ln, ix, psw, ctx.plan, world.rank, splits,
                                                 pooling, world.group)
            err = rel_err(out, ref)
            record(f"shmem T={len(rows)} D={D} {str(dt)[6:]} {pooling}"
                   f"{' weighted' if weighted else ''}",
                   err < TOL[dt] and not torch.isnan(out).any(), f"rel_err={err:.2e}")
        finally:
            ctx.close()


def check_back_to_back(world, gen, calls: int = 200) -> None:
    """Many calls, splits changing every call, no sync in between: the receive buffer is reused
    only once the peer has copied the previous call out."""
    W = world.world_size
    ctx = EmbeddingAllToAll(world, [4000] * (2 * W + 1), 64, 512, transport="stores")
    try:
        g = torch.Generator().manual_seed(5)
        split_list = [[int(x) for x in torch.randint(1, 513, (W,), generator=g)]
                      for _ in range(calls)]
        inputs = [make_input(ctx, s, torch.float32, gen, pf=3) for s in split_list]
        outs = [torch.full(ctx.output_shape(s), float("nan"), device=world.device)
                for s in split_list]
        torch.cuda.synchronize()
        world.barrier()
        t0 = time.perf_counter()
        for s, (w, ln, ix, _), o in zip(split_list, inputs, outs):
            ctx(w, ln, ix, batch_splits=s, out=o, validate=False)
        ctx.synchronize()
        dt = (time.perf_counter() - t0) / calls * 1e6
        worst = 0.0
        for s, (w, ln, ix, _), o in list(zip(split_list, inputs, outs))[::20]:
            worst = max(worst, rel_err(o, embedding_all_to_all_reference(
                w, ln, ix, None, ctx.plan, world.rank, s, "sum", world.group)))
        record(f"{calls} back-to-back calls, changing splits", worst < 1e-5,
               f"worst rel_err={worst:.2e}, {dt:.0f} us/call")
    finally:
        ctx.close()


def check_graph(world, gen, replays: int = 50) -> None:
    W = world.world_size
    splits = [300 + 7 * q for q in range(W)]
    ctx = EmbeddingAllToAll(world, [5000] * (3 * W), 128, max(splits), transport="stores")
    try:
        w, ln, ix, _ = make_input(ctx, splits, torch.float16, gen, pf=8)
        ln = torch.full_like(ln, 8)  # fixed bag length: the number of indices stays the same
        ix = torch.randint(0, 5000, (ln.numel() * 8,), generator=gen, device=world.device)
        out = torch.empty(ctx.output_shape(splits), dtype=torch.float16, device=world.device)
        ctx(w, ln, ix, batch_splits=splits, out=out)  # plans and compiles outside the capture
        ctx.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            ctx(w, ln, ix, batch_splits=splits, out=out)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ctx(w, ln, ix, batch_splits=splits, out=out)
        worst = 0.0
        for i in range(replays):
            ix.copy_(torch.randint(0, 5000, ix.shape, generator=gen, device=world.device))
            graph.replay()
            if i % 10 == 9:
                ctx.synchronize()
                worst = max(worst, rel_err(out, embedding_all_to_all_reference(
                    w, ln, ix, None, ctx.plan, world.rank, splits, "sum", world.group)))
        record(f"graph replay x{replays} (fresh indices each)", worst < TOL[torch.float16],
               f"worst rel_err={worst:.2e}")
    finally:
        ctx.close()


def check_backward(world, gen) -> None:
    W = world.world_size
    splits = [100 + 13 * q for q in range(W)]
    ctx = EmbeddingAllToAll(world, [700, 1500, 90, 4000, 256], 64, max(splits),
                            transport="stores")
    try:
        for dt, pooling, weighted in ((torch.float32, "sum", True), (torch.float32, "mean", False),
                                      (torch.bfloat16, "sum", False)):
            w, ln, ix, psw = make_input(ctx, splits, dt, gen, weighted=weighted)
            g = torch.randn(ctx.output_shape(splits), generator=gen, device=world.device)
            grads = []
            for fused in (True, False):
                wr = w.clone().requires_grad_()
                pr = psw.clone().requires_grad_() if weighted else None
                if fused:
                    y = embedding_all_to_all(wr, ln, ix, ctx, pr, batch_splits=splits,
                                             pooling=pooling)
                else:
                    y = embedding_all_to_all_reference(wr, ln, ix, pr, ctx.plan, world.rank,
                                                       splits, pooling, world.group)
                (y.float() * g).sum().backward()
                grads.append((wr.grad, None if pr is None else pr.grad))
            ctx.synchronize()
            err = rel_err(grads[0][0], grads[1][0])
            errp = rel_err(grads[0][1], grads[1][1]) if weighted else 0.0
            record(f"backward {str(dt)[6:]} {pooling}{' weighted' if weighted else ''}",
                   err < TOL[dt] and errp < 5 * TOL[dt],
                   f"weight grad rel_err={err:.2e} psw grad rel_err={errp:.2e}")
    finally:
        ctx.close()


def check_bad_input(world, gen) -> None:
    ctx = EmbeddingAllToAll(world, [100, 200, 300, 400], 32, 64, transport="stores")
    try:
        W = world.world_size
        splits = [64] * W
        w, ln, ix, _ = make_input(ctx, splits, torch.float32, gen)
        bad = ix.clone()
        bad[-1] = 10_000
        msgs = []
        for name, call in (("index out of range", lambda: ctx(w, ln, bad, batch_splits=splits)),
                           ("lengths vs indices", lambda: ctx(w, ln, ix[:-1],
                                                              batch_splits=splits)),
                           ("weight shape", lambda: ctx(w[1:], ln, ix, batch_splits=splits))):
            try:
                call()
                msgs.append(f"{name}: no error")
            except ValueError:
                pass
        out = ctx(w, ln, ix, batch_splits=splits)  # still in step after the refusals
        ctx.synchronize()
        err = rel_err(out, embedding_all_to_all_reference(w, ln, ix, None, ctx.plan, world.rank,
                                                          splits, "sum", world.group))
        record("bad input raises before launch", not msgs and err < 1e-5,
               "; ".join(msgs) or f"then rel_err={err:.2e}")
    finally:
        ctx.close()


def check_mismatch(world, gen) -> None:
    W = world.world_size
    ctx = EmbeddingAllToAll(world, [100] * (2 * W), 32, 128, timeout_s=2.0,
                            transport="stores")
    splits = [64] * W
    if world.rank == 0:
        splits = [64 + 8] + [64] * (W - 2) + [56]  # same total, another split
    w, ln, ix, _ = make_input(ctx, splits, torch.float32, gen)
    t0 = time.perf_counter()
    try:
        ctx(w, ln, ix, batch_splits=splits)
        ctx.synchronize()
        r = "no error"
    except PortableOverlapError as e:
        r = type(e).__name__
    took = time.perf_counter() - t0
    ctx.close()
    record("ranks disagreeing on batch_splits raise", r in ("RankMismatchError",
                                                            "PeerTimeoutError"),
           f"{r} after {took:.2f} s")


def check_auto(world, gen, replays: int = 20) -> None:
    """``transport="auto"`` at a small batch and a large one: the eager call that decides,
    then graph replays of the decided call with fresh indices (fp16, fixed bag lengths)."""
    W = world.world_size
    for B, T, D, pf in ((256 * W, 4 * W, 64, 4), (4096 * W, 8 * W, 128, 16)):
        splits = [B // W] * W
        ctx = EmbeddingAllToAll(world, [20000] * T, D, B // W, transport="auto")
        try:
            w, ln, ix, _ = make_input(ctx, splits, torch.float16, gen, pf=pf)
            ln = torch.full_like(ln, pf)
            ix = torch.randint(0, 20000, (ln.numel() * pf,), generator=gen, device=world.device)
            out = torch.full(ctx.output_shape(splits), float("nan"), dtype=torch.float16,
                             device=world.device)
            ctx(w, ln, ix, batch_splits=splits, out=out, validate=False)  # decides
            ctx.synchronize()
            worst = rel_err(out, embedding_all_to_all_reference(
                w, ln, ix, None, ctx.plan, world.rank, splits, "sum", world.group))
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                ctx(w, ln, ix, batch_splits=splits, out=out, validate=False)
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                ctx(w, ln, ix, batch_splits=splits, out=out, validate=False)
            for i in range(replays):
                ix.copy_(torch.randint(0, 20000, ix.shape, generator=gen, device=world.device))
                out.fill_(float("nan"))
                graph.replay()
                if i % 5 == 4:
                    ctx.synchronize()
                    worst = max(worst, rel_err(out, embedding_all_to_all_reference(
                        w, ln, ix, None, ctx.plan, world.rank, splits, "sum", world.group)))
            picks = ctx.choices(w, ln, ix, batch_splits=splits, validate=False)
            ms = {k: round(v, 4) for k, v in next(iter(ctx.decisions.values()))["ms"].items()}
            record(f"auto {B}x{T}x{D}x{pf} fp16: eager + {replays} replays",
                   worst < SEQ_TOL[torch.float16],
                   f"worst rel_err={worst:.2e}, picks {picks}, plain-call ms {ms}")
        finally:
            ctx.close()


def main() -> int:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    world = World.from_env()
    gen = torch.Generator(device=world.device).manual_seed(2000 + world.rank)
    checks = [check_forward, check_large, check_shmem, check_back_to_back, check_graph,
              check_backward, check_bad_input, check_mismatch, check_auto]
    only = os.environ.get("PO_EMB_CHECKS")  # e.g. "check_forward,check_backward" (a dry run)
    if only:
        checks = [c for c in checks if c.__name__ in only.split(",")]
    if world.world_size == 1:  # one rank cannot disagree with a peer
        checks = [c for c in checks if c is not check_mismatch]
    for check in checks:
        try:
            check(world, gen)
        except Exception as e:
            record(check.__name__, False, f"raised {type(e).__name__}: {e}"[:300])
            traceback.print_exc()
            if isinstance(e, PortableOverlapError):
                break  # a peer is out of step: later collectives would not line up
    return LOG.finish(world, "embedding gpu checks")


if __name__ == "__main__":
    sys.exit(main())
