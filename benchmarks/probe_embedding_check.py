"""Probe (one GPU): what does the device-side index check cost the pooled lookup, by where it
sits? The lookup alone (the fused op's task loop with every tile stored locally, one rank's
tables for the whole global batch at world 2: T / 2 tables), graph replay, at the embedding
benchmark's shapes, for these forms of the check:

- ``none``: no check (an index outside its table reads whatever lies there);
- ``scan_before``: the library's check, ``indices_outside`` (pool.py) over the tile's index
  range before the gather (a tile with a bad index is not pooled);
- ``pipelined``: the first SCAN indices of a program's next tile are loaded before the current
  tile's gather and compared after it (their latency hides under the gather; the offsets are
  loaded one tile further ahead), the rest of a longer range scanned four chunks at a time;
- ``col_none`` / ``col_check``: the gather with every per-bag quantity a [BLOCK_B, 1] column,
  without and with the check folded into it (a bad index reads row 0 and flags its bag).

Every form is checked against ``F.embedding_bag`` first; the checking forms must also count an
index planted outside its table. Prints a table (ms, and each form over ``none``) with the
compiled kernels' registers, spills and resident programs; rows to --out as JSON lines.

    python -m benchmarks.probe_embedding_check --out probe.jsonl --device-kind nvidia-h200
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from benchmarks.bench_embedding_alltoall import DTYPES, SHAPES, make_indices
from benchmarks.harness import time_op
from benchmarks.rows import ResultWriter
from portable_overlap import World
from portable_overlap.ops.embedding_alltoall.fused import (default_block_b, default_num_warps,
                                                           triton_next_pow2)
from portable_overlap.ops.embedding_alltoall.pool import SCAN, indices_outside, pooled_rows
from portable_overlap.ops.launch import resident_programs

FORMS = {"none": 0, "scan_before": 1, "pipelined": 4, "col_none": 6, "col_check": 7}
RUNS = ["none", "scan_before", "pipelined", "col_none", "col_check"]


@triton.jit
def pooled_rows_col(weight_ptr, row_base, n_rows, indices_ptr, offsets_ptr, bag0, n_bags, D,
                    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, CHECK: tl.constexpr):
    """``pooled_rows`` with every per-bag quantity a [BLOCK_B, 1] column (the 2-D tile's own
    layout), and the index check folded into the gather: an index outside the table reads row
    0 instead and sets its bag's flag; returns (sums, how many bags met one)."""
    b = tl.arange(0, BLOCK_B)[:, None]
    live_bag = b < n_bags
    start = tl.load(offsets_ptr + bag0 + b, mask=live_bag, other=0)
    n = tl.load(offsets_ptr + bag0 + b + 1, mask=live_bag, other=0) - start
    cols = tl.arange(0, BLOCK_D)[None, :]
    col_ok = cols < D
    acc = tl.zeros((BLOCK_B, BLOCK_D), dtype=tl.float32)
    longest = tl.max(tl.max(n, axis=1), axis=0)
    limit = n_rows.to(tl.uint64)
    outside = tl.zeros((BLOCK_B, 1), dtype=tl.int32)
    k = 0
    while k < longest:
        live0 = k < n
        live1 = k + 1 < n
        i0 = tl.load(indices_ptr + start + k, mask=live0, other=0).to(tl.int64)
        i1 = tl.load(indices_ptr + start + k + 1, mask=live1, other=0).to(tl.int64)
        if CHECK:
            out0 = live0 & (i0.to(tl.uint64) >= limit)
            out1 = live1 & (i1.to(tl.uint64) >= limit)
            outside = outside | out0.to(tl.int32) | out1.to(tl.int32)
            i0 = tl.where(out0, 0, i0)
            i1 = tl.where(out1, 0, i1)
        r0 = tl.load(weight_ptr + (row_base + i0) * D + cols, mask=live0 & col_ok,
                     other=0.0).to(tl.float32)
        r1 = tl.load(weight_ptr + (row_base + i1) * D + cols, mask=live1 & col_ok,
                     other=0.0).to(tl.float32)
        acc += r0
        acc += r1
        k += 2
    return acc, tl.sum(tl.sum(outside, axis=1), axis=0)


@triton.jit
def any_outside(indices_ptr, lo, hi, n_rows, UNROLL: tl.constexpr):
    """How many SCAN-lanes saw an index of ``indices[lo:hi]`` outside ``[0, n_rows)`` (0 if
    none): one flag per lane, UNROLL chunks of SCAN indices loaded before any is compared."""
    r = tl.arange(0, SCAN)
    limit = n_rows.to(tl.uint64)
    flag = tl.zeros((SCAN,), dtype=tl.int1)
    c = lo
    while c < hi:
        for u in tl.static_range(UNROLL):
            m = c + u * SCAN + r < hi
            i = tl.load(indices_ptr + c + u * SCAN + r, mask=m, other=0)
            flag = flag | (m & (i.to(tl.uint64) >= limit))
        c += UNROLL * SCAN
    return tl.sum(flag.to(tl.int32), axis=0)


@triton.jit
def tile_range(offsets_ptr, t, n_tasks, n_blk, B, BLOCK_B: tl.constexpr):
    """The index range ``[lo, hi)`` of tile ``t`` (empty past the last tile)."""
    live = t < n_tasks
    j = t // n_blk
    s0 = (t % n_blk) * BLOCK_B
    bag0 = j * B + s0
    lo = tl.load(offsets_ptr + bag0, mask=live, other=0)
    hi = tl.load(offsets_ptr + bag0 + tl.minimum(B - s0, BLOCK_B), mask=live, other=0)
    return lo, hi


@triton.jit
def lookup_kernel(weight_ptr, indices_ptr, offsets_ptr, out_ptr, row_off_ptr, rows_ptr, bad_ptr,
                  B, D, n_loc, row_stride, iters, G,
                  BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, CHECK: tl.constexpr):
    pid = tl.program_id(0)
    b_rel = tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    n_blk = tl.cdiv(B, BLOCK_B)
    n_tasks = n_blk * n_loc
    total = tl.zeros((), tl.int32)
    r = tl.arange(0, SCAN)
    # pipelined: the first SCAN indices of this program's next tile are loaded before the
    # current tile's gather and compared after it; the offsets one tile further ahead
    p_lo, p_hi = tile_range(offsets_ptr, pid, n_tasks, n_blk, B, BLOCK_B)
    pre = tl.load(indices_ptr + p_lo + r, mask=r < p_hi - p_lo, other=0)
    q_lo, q_hi = tile_range(offsets_ptr, pid + G, n_tasks, n_blk, B, BLOCK_B)
    for i in range(0, iters):
        t = pid + i * G
        if t < n_tasks:
            j = t // n_blk
            s0 = (t % n_blk) * BLOCK_B
            n_bags = tl.minimum(B - s0, BLOCK_B)
            bag0 = j * B + s0
            n_rows = tl.load(rows_ptr + j)
            go = tl.full((), 1, tl.int1)
            if CHECK == 1:
                n_bad = indices_outside(indices_ptr, tl.load(offsets_ptr + bag0),
                                        tl.load(offsets_ptr + bag0 + n_bags), n_rows)
                total += n_bad
                go = n_bad == 0
            if CHECK == 4:
                m = r < p_hi - p_lo
                n_bad = tl.sum((m & (pre.to(tl.uint64) >= n_rows.to(tl.uint64))).to(tl.int32),
                               axis=0)
                if p_hi - p_lo > SCAN:
                    n_bad += any_outside(indices_ptr, p_lo + SCAN, p_hi, n_rows, 4)
                pre = tl.load(indices_ptr + q_lo + r, mask=r < q_hi - q_lo, other=0)
                p_lo, p_hi = q_lo, q_hi
                q_lo, q_hi = tile_range(offsets_ptr, t + 2 * G, n_tasks, n_blk, B, BLOCK_B)
                total += n_bad
                go = n_bad == 0
            if CHECK >= 6:
                acc, n_bad = pooled_rows_col(weight_ptr, tl.load(row_off_ptr + j), n_rows,
                                             indices_ptr, offsets_ptr, bag0, n_bags, D, BLOCK_B,
                                             BLOCK_D, CHECK == 7)
                total += n_bad
                offs = (s0 + b_rel).to(tl.int64)[:, None] * row_stride + j * D + cols[None, :]
                mask = (b_rel < n_bags)[:, None] & col_ok[None, :]
                tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask,)
                go = False
            if go:
                acc = pooled_rows(weight_ptr, tl.load(row_off_ptr + j), indices_ptr, indices_ptr,
                                  offsets_ptr, bag0, n_bags, D, BLOCK_B, BLOCK_D, False, False)
                offs = (s0 + b_rel).to(tl.int64)[:, None] * row_stride + j * D + cols[None, :]
                mask = (b_rel < n_bags)[:, None] & col_ok[None, :]
                tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(bad_ptr + pid, total)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device-kind", default="unknown")
    ap.add_argument("--world", type=int, default=2, help="tables per rank = T / world")
    args = ap.parse_args()
    world = World.from_env()
    dev, facts = world.device, world.facts
    writer = ResultWriter(args.out, args.device_kind, 1)
    table = []
    for B, T, D, pf, rows in SHAPES:
        n_loc = T // args.world
        for dname, dtype in DTYPES.items():
            for dist_name in ("uniform", "zipf"):
                gen = torch.Generator(device=dev).manual_seed(B + T + D + pf)
                weight = torch.randn(n_loc * rows, D, generator=gen, device=dev).to(dtype)
                idx = make_indices(n_loc, rows, B * pf, dist_name, gen, dev)
                offsets = torch.arange(0, n_loc * B * pf + 1, pf, device=dev)
                row_off = torch.arange(0, n_loc * rows, rows, device=dev, dtype=torch.int64)
                rows_t = torch.full((n_loc,), rows, device=dev, dtype=torch.int64)
                out = torch.empty(B, n_loc * D, device=dev, dtype=dtype)
                ref = torch.cat([F.embedding_bag(idx[j * B * pf:(j + 1) * B * pf].view(B, pf),
                                                 weight[j * rows:(j + 1) * rows].float(),
                                                 mode="sum") for j in range(n_loc)], dim=1)
                nbytes = weight.element_size()
                bb = default_block_b(D, facts.arch, nbytes)
                warps = default_num_warps(D, facts.arch, nbytes)
                bd = triton_next_pow2(D)
                n_tasks = n_loc * -(-B // bb)
                shape = {"B": B, "T": T, "D": D, "pf": pf, "rows": rows, "dist": dist_name,
                         "world": args.world}
                base = None
                for form in RUNS:
                    check = FORMS[form]
                    bad = torch.zeros(facts.sm_count * 64, device=dev, dtype=torch.int32)

                    def make(G, idx=idx, bad=bad):
                        return (weight, idx, offsets, out, row_off, rows_t, bad, B, D, n_loc,
                                n_loc * D, -(-n_tasks // G), G)

                    consts = dict(BLOCK_B=bb, BLOCK_D=bd, CHECK=check, num_warps=warps,
                                  num_stages=1)
                    G = min(n_tasks, facts.sm_count * 64)
                    k = lookup_kernel.warmup(*make(G), grid=(G,), **consts)
                    G = min(G, resident_programs(k, warps, facts))
                    k = lookup_kernel.warmup(*make(G), grid=(G,), **consts)
                    k._init_handles()

                    def fn(G=G, make=make, consts=consts):
                        lookup_kernel[(G,)](*make(G), **consts)

                    out.fill_(float("nan"))
                    fn()
                    torch.cuda.synchronize()
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    if not err < 1e-2 or int(bad.sum()) != 0:
                        raise RuntimeError(f"{shape} {dname} {form}: rel_err {err:.2e}, "
                                           f"bad {int(bad.sum())}")
                    if check and check != 6:  # a planted bad index is counted
                        idx2 = idx.clone()
                        idx2[(B * pf) // 2 + 3] = rows + 7  # in a tile's first SCAN indices
                        idx2[bb * pf * 6 - 1] = -1  # the last index of a tile
                        bad.zero_()
                        lookup_kernel[(G,)](*make(G, idx=idx2), **consts)
                        torch.cuda.synchronize()
                        if int(bad.sum()) < 2:
                            raise RuntimeError(f"{form}: planted index counted {int(bad.sum())}")
                    t = time_op(fn, world, graph=True, iters=50, warmup=10)
                    base = base or t["median_ms"]
                    k._init_handles()
                    writer.write(op="embedding_check_probe", shape=shape, dtype=dname,
                                 impl=form, graph=True, n_regs=k.n_regs, programs=G,
                                 spills=k.n_spills, **t)
                    table.append((f"{B}x{T}x{D}x{pf} {dname} {dist_name}", form, t["median_ms"],
                                  t["median_ms"] / base, k.n_regs, k.n_spills, G))
                    print(*table[-1], flush=True)
    print("\ncase, form, ms, over none, regs, spills, programs")
    for case, form, ms, rel, regs, spills, G in table:
        print(f"{case:>32} {form:>16} {ms:7.3f} {rel:6.3f} {regs:4d} {spills:3d} {G:6d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
