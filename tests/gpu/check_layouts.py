"""GPU checks of odd operand layouts and of tensors past 2**31 elements, through the compiled
kernels (the CPU tests run the same layouts under the interpreter, which never specializes on
alignment, never builds a tensor descriptor and never meets an int32 offset that wraps):

    torchrun --nproc-per-node 1 tests/gpu/check_layouts.py [--parts layouts,big]

Every public op is called with the layouts of ``portable_overlap.testing.layouts`` (transposed
views, every other column, stride 0, a base one element past an aligned one, padded rows) in
every dtype, and once with its largest operand past 2**31 elements, against the torch
reference on fresh random inputs with the output poisoned first. An op may refuse a layout with
a ValueError / TypeError (the line says which, so refusals can be read); anything else, a wrong
or partial result or another exception, fails. Runs on any number of GPUs (a world of one
runs every kernel on its own rows). Prints ``PASS``/``FAIL`` per case on rank 0; exit code 1 if
any case failed on any rank. (Not collected by pytest.)"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

import portable_overlap as po
from portable_overlap import World
from portable_overlap.ops.allgather_gemm import all_gather_matmul_reference
from portable_overlap.ops.moe_experts import expert_swiglu, expert_swiglu_reference
from portable_overlap.ops.pattern import transport_unavailable
from portable_overlap.testing.check_log import CheckLog
from portable_overlap.testing.compare import rel_err
from portable_overlap.testing.layouts import ODD_GEMMS, laid_out
from portable_overlap.testing.patterns import GEMM_PATTERNS

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
LOG = CheckLog(70)
record = LOG.record
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: past 2**31 elements: where an int32 element offset wraps
BIG = 2 ** 31 + 2 ** 24


def _short(dt) -> str:
    return str(dt)[6:]


def _named(how: dict) -> str:
    """A case's layouts as its name says them: "a offset b transposed", or "contiguous"."""
    return " ".join(f"{k} {v}" for k, v in how.items()) or "contiguous"


def _outcome(name: str, call, ref, out, tol: float, rows=None) -> None:
    """Run ``call()`` (which fills the poisoned ``out``): PASS when ``out`` (its first ``rows``
    rows, the others left poisoned) matches ``ref()`` within ``tol``, or when the call refuses
    with a ValueError / TypeError; FAIL otherwise."""
    try:
        call()
        torch.cuda.synchronize()
    except (ValueError, TypeError) as e:
        record(name, True, f"refused: {type(e).__name__}: {e}"[:160])
        return
    except Exception as e:  # noqa: BLE001  (a device fault or an op error is this case's failure)
        record(name, False, f"raised {type(e).__name__}: {e}"[:300])
        return
    kept = True
    if rows is not None:
        kept = bool(torch.isnan(out[rows:]).all())
        out = out[:rows]
    err = rel_err(out.float(), ref().float())
    record(name, bool(torch.isfinite(out).all()) and err < tol and kept,
           f"rel_err={err:.1e}" + ("" if kept else ", rows past the call's overwritten"))


# --- the GEMM patterns ------------------------------------------------------------------------

def _gemm_cases(W: int) -> list:
    """(name, (M, N, K), layouts, dtypes): ``ODD_GEMMS`` (M scaled to W ranks) in bf16, and
    sizes of real tiles, past a block in every dimension, contiguous in every dtype and in
    the odd layouts in bf16."""
    cases = [(n, (M // 2 * W, N, K), how, (torch.bfloat16,)) for n, (M, N, K), how in ODD_GEMMS]
    for how in ({}, {"a": "offset"}, {"b": "transposed"}, {"b": "padded_rows"},
                {"out": "offset"}, {"a": "padded_rows", "res": "offset"}):
        name = "1000x777x4099 " + _named(how)
        cases.append((name, (500 * W, 777, 4099), how, DTYPES if not how else (torch.bfloat16,)))
    return cases


def check_gemm_patterns(world: World, gen) -> None:
    W, dev = world.world_size, world.device
    cases = _gemm_cases(W)
    max_m = max(M for _, (M, _, _), _, _ in cases)
    max_n = max(N for _, (_, N, _), _, _ in cases)
    for op, (make, ref_fn, rows_of) in GEMM_PATTERNS.items():
        fn = getattr(po, op)
        for transport in make.TRANSPORTS:
            why = transport_unavailable(world, transport)
            if why is not None:
                LOG.skip(f"{op}[{transport}]", why[:200])
                continue
            ctx = make(world, max_m, max_n, transport=transport)
            try:
                for name, (M, N, K), how, dtypes in cases:
                    for dt in dtypes:
                        rows = rows_of(M, W)
                        a = laid_out((M, K), how.get("a"), dtype=dt, device=dev, gen=gen)
                        b = laid_out((K, N), how.get("b"), dtype=dt, device=dev, gen=gen)
                        res = laid_out((rows, N), how.get("res"), dtype=dt, device=dev, gen=gen)
                        bias = laid_out((1, N), dtype=dt, device=dev, gen=gen)[0]
                        out = laid_out((rows, N), how.get("out"), dtype=dt, device=dev,
                                       gen=gen).fill_(float("nan"))
                        _outcome(f"{op}[{transport}] {name} {_short(dt)}",
                                 lambda: fn(a, b, ctx, out, bias=bias, residual=res),
                                 lambda: ref_fn(a, b, world.group, bias, res), out, TOL[dt])
            finally:
                ctx.close()
    # AllGather + GEMM: a is this rank's shard (copied whole), no bias or residual
    for transport in po.AllGatherMatmul.TRANSPORTS:
        why = transport_unavailable(world, transport)
        if why is not None:
            LOG.skip(f"all_gather_matmul[{transport}]", why[:200])
            continue
        ctx = po.AllGatherMatmul(world, max_m * 4099, transport=transport)
        try:
            for name, (M, N, K), how, dtypes in cases:
                if "res" in how:
                    continue
                for dt in dtypes:
                    m = M // W
                    a = laid_out((m, K), how.get("a"), dtype=dt, device=dev, gen=gen)
                    b = laid_out((K, N), how.get("b"), dtype=dt, device=dev, gen=gen)
                    out = laid_out((W * m, N), how.get("out"), dtype=dt, device=dev,
                                   gen=gen).fill_(float("nan"))
                    _outcome(f"all_gather_matmul[{transport}] {name} {_short(dt)}",
                             lambda: po.all_gather_matmul(a, b, ctx, out),
                             lambda: all_gather_matmul_reference(a, b, world.group), out,
                             TOL[dt])
        finally:
            ctx.close()


# --- GEMV + AllReduce -------------------------------------------------------------------------

def check_gemv(world: World, gen) -> None:
    dev = world.device
    shapes = ((1, 1, 1), (64, 13, 7), (3, 8192, 97), (1, 5000, 14336), (8, 4096, 7169))
    layouts = ({}, {"x": "offset"}, {"x": "transposed"}, {"w": "offset"}, {"x": "padded_rows"},
               {"w": "padded_rows"})
    for transport in ("stores", "one_shot"):
        ctx = po.GemvAllReduce(world, max_n=8192, transport=transport)
        try:
            for M, N, K in shapes:
                for how in layouts:
                    for dt in DTYPES:
                        x = laid_out((M, K), how.get("x"), dtype=dt, device=dev, gen=gen)
                        w = laid_out((N, K), how.get("w"), dtype=dt, device=dev, gen=gen)
                        out = torch.full((M, N), float("nan"), dtype=dt, device=dev)
                        lay = _named(how)
                        _outcome(f"gemv_all_reduce[{transport}] {M}x{N}x{K} {lay} {_short(dt)}",
                                 lambda: po.gemv_all_reduce(x, w, ctx, out),
                                 lambda: po.gemv_all_reduce_reference(x, w, world.group), out,
                                 TOL[dt])
        finally:
            ctx.close()


# --- the MoE ops ------------------------------------------------------------------------------

def _experts(E: int, rows: int, cols: int, how, dt, dev, gen) -> torch.Tensor:
    """[E, rows, cols] weights: contiguous, each expert's matrix transposed (column-major), or
    a base one element past an aligned one."""
    def fresh(*s):
        return torch.randn(*s, generator=gen, device=dev).to(dt) / rows ** 0.5

    if how == "transposed":
        return fresh(E, cols, rows).transpose(1, 2)
    if how == "offset":
        return fresh(E * rows * cols + 1)[1:].view(E, rows, cols)
    return fresh(E, rows, cols)


def check_moe(world: World, gen) -> None:
    W, r, dev = world.world_size, world.rank, world.device
    g = torch.Generator().manual_seed(11 + r)  # routing: the same draws on every rank's host
    El, k = 3, 2
    # the gated grouped GEMM alone (every rank its own rows): H past and off the K block
    for H, I in ((1000, 333), (7168, 2048)):
        counts = torch.randint(20, 90, (W, El), generator=g).to(torch.int32).to(dev)
        R = int(counts.sum())
        for how in ({}, {"x": "offset"}, {"x": "padded_rows"}, {"w": "transposed"},
                    {"w": "offset"}, {"out": "offset"}):
            for dt in DTYPES:
                x = laid_out((R + 5, H), how.get("x"), dtype=dt, device=dev, gen=gen)
                wg, wu = (_experts(El, H, I, how.get("w"), dt, dev, gen) for _ in range(2))
                out = laid_out((R + 5, I), how.get("out"), dtype=dt, device=dev,
                               gen=gen).fill_(float("nan"))
                lay = _named(how)
                _outcome(f"expert_swiglu H={H} I={I} {lay} {_short(dt)}",
                         lambda: expert_swiglu(x, wg, wu, counts, out),
                         lambda: expert_swiglu_reference(x, wg, wu, counts), out, TOL[dt], R)
    # dispatch, then the down GEMM + combine, with odd layouts of their inputs
    H, I, S = 520, 264, 77
    disp = po.MoeDispatch(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El,
                          dtype=torch.bfloat16)
    comb = po.MoeGemmCombine(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El)
    try:
        for how in ({}, {"tokens": "offset"}, {"tokens": "padded_rows"}, {"ids": "transposed"},
                    {"x": "offset"}, {"w": "transposed"}, {"w": "offset"},
                    {"weights": "transposed"}, {"weights": "every_other_column"}):
            lay = _named(how)
            ids = torch.rand(S, El * W, generator=g).topk(k, 1).indices
            if how.get("ids") == "transposed":
                ids = ids.t().contiguous().t()
            ids = ids.to(dev)
            tokens = laid_out((S, H), how.get("tokens"), dtype=torch.bfloat16, device=dev,
                              gen=gen)
            try:
                x, counts, slots = po.moe_dispatch(tokens, ids, disp)
                disp.synchronize()
                xr, cr, sr = po.moe_dispatch_reference(tokens, ids, El, world.group)
                n = xr.shape[0]
                ok = torch.equal(counts, cr) and torch.equal(slots[:n], sr) \
                    and torch.equal(x[:n], xr)
                record(f"moe_dispatch {lay}", ok, f"{n} rows")
            except (ValueError, TypeError) as e:
                record(f"moe_dispatch {lay}", True, f"refused: {type(e).__name__}: {e}"[:160])
                xr, cr, sr = po.moe_dispatch_reference(tokens, ids, El, world.group)
            n = xr.shape[0]
            h = laid_out((n, I), how.get("x"), dtype=torch.bfloat16, device=dev, gen=gen)
            w = _experts(El, I, H, how.get("w"), torch.bfloat16, dev, gen)
            tw = torch.softmax(torch.randn(S, k, generator=gen, device=dev), 1)
            if how.get("weights") == "transposed":
                tw = tw.t().contiguous().t()
            elif how.get("weights") == "every_other_column":
                tw = torch.stack([tw, tw], 2).view(S, 2 * k)[:, ::2]
            out = torch.full((S, H), float("nan"), dtype=torch.bfloat16, device=dev)
            _outcome(f"moe_gemm_combine {lay}",
                     lambda: po.moe_gemm_combine(h, w, cr, sr, tw, comb, out),
                     lambda: po.moe_gemm_combine_reference(h, w, cr, sr, tw, world.group),
                     out, TOL[torch.bfloat16])
    finally:
        disp.close()
        comb.close()


# --- embedding + All-to-All -------------------------------------------------------------------

def check_embedding(world: World, gen) -> None:
    W, dev = world.world_size, world.device
    rows, D, B = [1000, 333, 7000], 96, 64
    ctx = po.EmbeddingAllToAll(world, rows, D, B)
    try:
        splits = [B] * W
        for how in ({}, {"weight": "offset"}, {"weight": "padded_rows"},
                    {"weights": "every_other"}):
            for dt in DTYPES:
                weight = laid_out((ctx.weight_rows, D), how.get("weight"), dtype=dt,
                                  device=dev, gen=gen)
                lengths = torch.randint(0, 9, (ctx.n_loc * B * W,), generator=gen, device=dev)
                parts = []
                for j, t in enumerate(ctx.local_tables):
                    n = int(lengths[j * B * W:(j + 1) * B * W].sum())
                    parts.append(torch.randint(0, rows[t], (n,), generator=gen, device=dev))
                indices = torch.cat(parts) if parts else \
                    torch.zeros(0, dtype=torch.int64, device=dev)
                psw = None
                if how.get("weights"):
                    psw = torch.rand(2 * indices.numel(), generator=gen, device=dev)[::2]
                out = torch.full(ctx.output_shape(splits), float("nan"), dtype=dt, device=dev)
                lay = _named(how)
                _outcome(f"embedding_all_to_all {lay} {_short(dt)}",
                         lambda: ctx(weight, lengths, indices, psw, batch_splits=splits,
                                     out=out),
                         lambda: po.embedding_all_to_all_reference(
                             weight, lengths, indices, psw, ctx.plan, world.rank, splits,
                             "sum", world.group), out, 1.5e-2 if dt == torch.bfloat16 else
                         TOL[dt])
    finally:
        ctx.close()


# --- past 2**31 elements ----------------------------------------------------------------------

def _big_gemms(world: World, gen) -> None:
    """The GEMM patterns with a [M, K] past 2**31 elements (K 16384), and AllGather + GEMM with
    out [W * m, N] past it (N 131072, a vocabulary-sized projection)."""
    W, dev, bf = world.world_size, world.device, torch.bfloat16
    K = 16384
    M = -(-BIG // K) // W * W + W
    a = laid_out((M, K), dtype=bf, device=dev, gen=gen)
    b = laid_out((K, 48), dtype=bf, device=dev, gen=gen)
    for op, (make, ref_fn, rows_of) in GEMM_PATTERNS.items():
        ctx = make(world, M, 48, transport="stores")
        try:
            out = torch.full((rows_of(M, W), 48), float("nan"), dtype=bf, device=dev)
            _outcome(f"{op}[stores] a {M}x{K} past 2**31",
                     lambda: getattr(po, op)(a, b, ctx, out),
                     lambda: ref_fn(a, b, world.group, None, None), out, TOL[bf])
        finally:
            ctx.close()
    N = 131072
    m = -(-BIG // N) // W + 1
    a2, b2 = (laid_out(s, dtype=bf, device=dev, gen=gen) for s in ((m, 64), (64, N)))
    for transport in ("stores", "copy_engine"):
        ctx = po.AllGatherMatmul(world, m * 64, transport=transport)
        try:
            out = torch.full((W * m, N), float("nan"), dtype=bf, device=dev)
            _outcome(f"all_gather_matmul[{transport}] out {W * m}x{N} past 2**31",
                     lambda: po.all_gather_matmul(a2, b2, ctx, out),
                     lambda: all_gather_matmul_reference(a2, b2, world.group), out, TOL[bf])
        finally:
            ctx.close()


def _big_k_stride(world: World, gen) -> None:
    """The GEMM patterns with a column-major a [M, K] of 36 M rows (K 128, bf16: 9.2 GB): its K
    stride times a K block is past 2**31, where the tiles' int32 K step would wrap (such an
    ``a`` takes the pointer loads: no descriptor for a column-major operand). The fused
    transports refuse it (``matmul.api.check_k_steps``)."""
    W, dev, bf = world.world_size, world.device, torch.bfloat16
    M, K, N = 36_000_000 // W * W, 128, 48
    a = laid_out((M, K), "transposed", dtype=bf, device=dev, gen=gen)
    b = laid_out((K, N), dtype=bf, device=dev, gen=gen)
    for op, (make, ref_fn, rows_of) in GEMM_PATTERNS.items():
        ctx = make(world, M, N, transport="stores")
        try:
            out = torch.full((rows_of(M, W), N), float("nan"), dtype=bf, device=dev)
            _outcome(f"{op}[stores] column-major a {M}x{K}, K stride x block past 2**31",
                     lambda: getattr(po, op)(a, b, ctx, out),
                     lambda: ref_fn(a, b, world.group, None, None), out, TOL[bf])
        finally:
            ctx.close()


def _big_gemv(world: World, gen) -> None:
    """GEMV + AllReduce with w [N, K] past 2**31 elements (a vocabulary-sized projection)."""
    dev, bf = world.device, torch.bfloat16
    N, K = 131072, -(-BIG // 131072)
    w = laid_out((N, K), dtype=bf, device=dev, gen=gen)
    x = laid_out((2, K), dtype=bf, device=dev, gen=gen)
    for transport in ("stores", "one_shot"):
        ctx = po.GemvAllReduce(world, max_n=N, transport=transport)
        try:
            out = torch.full((2, N), float("nan"), dtype=bf, device=dev)
            _outcome(f"gemv_all_reduce[{transport}] w {N}x{K} past 2**31",
                     lambda: po.gemv_all_reduce(x, w, ctx, out),
                     lambda: po.gemv_all_reduce_reference(x, w, world.group), out, TOL[bf])
        finally:
            ctx.close()


def _big_experts(world: World, gen) -> None:
    """The gated grouped GEMM with x [R, H] past 2**31 elements, over 2 experts, W sources."""
    W, dev, bf = world.world_size, world.device, torch.bfloat16
    H, I = 7168, 256
    R = -(-BIG // H)
    counts = torch.full((W, 2), R // (2 * W), dtype=torch.int32, device=dev)
    counts[-1, -1] += R - int(counts.sum())
    x = laid_out((R + 3, H), dtype=bf, device=dev, gen=gen)
    wg, wu = (_experts(2, H, I, None, bf, dev, gen) for _ in range(2))
    out = torch.full((R + 3, I), float("nan"), dtype=bf, device=dev)
    _outcome(f"expert_swiglu x {R}x{H} past 2**31",
             lambda: expert_swiglu(x, wg, wu, counts, out),
             lambda: expert_swiglu_reference(x, wg, wu, counts), out, TOL[bf], R)


def _big_moe_buffers(world: World, gen) -> None:
    """The dispatch's receive buffer and the combine's buffer past 2**31 elements: each rank
    receives about S * k rows of H (a random top-8 of 8 experts per rank)."""
    W, dev, bf = world.world_size, world.device, torch.bfloat16
    k, H, El = 8, 7168, 8
    S = -(-BIG // (k * H)) + 1
    tokens = laid_out((S, H), dtype=bf, device=dev, gen=gen)
    g = torch.Generator().manual_seed(5 + world.rank)
    ids = torch.rand(S, El * W, generator=g).topk(k, 1).indices.to(dev)
    disp = po.MoeDispatch(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El,
                          dtype=bf, capacity=min(W, 2) * S * k)
    try:
        x, counts, slots = po.moe_dispatch(tokens, ids, disp)
        disp.synchronize()
        xr, cr, sr = po.moe_dispatch_reference(tokens, ids, El, world.group)
        n = xr.shape[0]
        record(f"moe_dispatch {n}x{H} rows past 2**31",
               torch.equal(counts, cr) and torch.equal(slots[:n], sr) and torch.equal(x[:n], xr),
               f"{n} rows")
    finally:
        disp.close()
    del x, xr, tokens
    torch.cuda.empty_cache()
    I = 64
    h = laid_out((int(cr.sum()), I), dtype=bf, device=dev, gen=gen)
    w = _experts(El, I, H, None, bf, dev, gen)
    tw = torch.softmax(torch.randn(S, k, generator=gen, device=dev), 1)
    comb = po.MoeGemmCombine(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El)
    try:
        out = torch.full((S, H), float("nan"), dtype=bf, device=dev)
        _outcome(f"moe_gemm_combine {S * k}x{H} buffer past 2**31",
                 lambda: po.moe_gemm_combine(h, w, cr, sr, tw, comb, out),
                 lambda: po.moe_gemm_combine_reference(h, w, cr, sr, tw, world.group),
                 out, TOL[bf])
    finally:
        comb.close()


def _big_embedding(world: World, gen) -> None:
    """A table past 2**31 elements (fp32: 8.6 GB) on every rank, bags reading its last rows."""
    W, dev = world.world_size, world.device
    D, B = 128, 32
    rows = [-(-BIG // D) + 1000] * W
    ctx = po.EmbeddingAllToAll(world, rows, D, B, table_ranks=list(range(W)))
    try:
        weight = torch.randn(ctx.weight_rows, D, generator=gen, device=dev)
        lengths = torch.randint(1, 5, (ctx.n_loc * B * W,), generator=gen, device=dev)
        n = int(lengths.sum())
        indices = rows[0] - 1 - torch.randint(0, 2000, (n,), generator=gen, device=dev)
        out = torch.full(ctx.output_shape([B] * W), float("nan"), device=dev)
        _outcome(f"embedding_all_to_all table {rows[0]}x{D} past 2**31",
                 lambda: ctx(weight, lengths, indices, batch_splits=[B] * W, out=out),
                 lambda: po.embedding_all_to_all_reference(weight, lengths, indices, None,
                                                           ctx.plan, world.rank, [B] * W,
                                                           "sum", world.group), out, 1e-5)
    finally:
        ctx.close()


def check_big(world: World, gen) -> None:
    """Each op once with its largest operand past 2**31 elements (bf16: 4.3 GB), its other
    operands small, so the products stay short; the rows past 2**31 elements are the ones an
    int32 offset would get wrong. One op at a time, its memory freed before the next."""
    for part in (_big_gemms, _big_k_stride, _big_gemv, _big_experts, _big_moe_buffers,
                 _big_embedding):
        try:
            part(world, gen)
        except Exception as e:  # noqa: BLE001  (one op's failure; the next op runs)
            record(part.__name__, False, f"raised {type(e).__name__}: {e}"[:300])
            traceback.print_exc()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


PARTS = {"gemm": check_gemm_patterns, "gemv": check_gemv, "moe": check_moe,
         "embedding": check_embedding, "big": check_big}


def main() -> int:
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ.get("PO_LAYOUTS_TIMEOUT_S", "840")),
                                      exit=True)
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default=",".join(PARTS))
    args = ap.parse_args()
    world = World.from_env()
    gen = torch.Generator(device=world.device).manual_seed(2000 + world.rank)
    for part in args.parts.split(","):
        t0 = time.perf_counter()
        try:
            PARTS[part](world, gen)
        except Exception as e:  # noqa: BLE001  (one part's failure; the next part runs)
            record(part, False, f"raised {type(e).__name__}: {e}"[:300])
            traceback.print_exc()
        if world.rank == 0:
            print(f"[rank 0] part {part}: {time.perf_counter() - t0:.0f} s", flush=True)
    return LOG.finish(world, "layout checks")


if __name__ == "__main__":
    sys.exit(main())
