"""Probe: the gated expert GEMM (``h = silu(x @ w_gate[e]) * (x @ w_up[e])`` per expert's rows)
at decode sizes, with each expert's last, partial row tile computed by a narrower tile.

Why: at a decode layout an expert holds a few hundred rows (8 ranks of a DeepSeek-like layer,
128 tokens per rank: 2 local experts of about 515 rows). In 128-row tiles each expert ends in a
tile of a few rows that costs a whole tile's tensor-core time, and the tiles number 160 for 132
processors: a second round with 28 tiles, which doubles the call (``docs/moe.md``: 148 µs for
the packed rows in 128 x 128 tiles against cuBLAS's 90-100 µs on the same rows as one dense
GEMM). Here an expert's rows past its last full tile go to tiles of ``BLOCK_T`` rows (16, 32 or
64), a fraction of a full tile's tensor work, and the programs take tiles from a shared counter
(``--dynamic``), so the ones that drew short tiles take more.

Prediction (8-rank layout, rows 515 / 514): the 128 full tiles fill one round (about 92 µs, one
tile per processor) and the 32 narrow tiles ride on the 4 idle processors and the first to
finish: 100-115 µs, against 148 for all 160 tiles of 128 rows, i.e. 0.8-0.9 of cuBLAS's dense
GEMM where today's default runs at 0.65.

One GPU, bf16, graph replay, each variant checked against a float32 reference before it is
timed. Rows per expert come from ``--cases`` (``H,width,r0/r1/...``: hidden, expert width, each
local expert's rows). Baselines: cuBLAS's gate and up GEMMs over all rows with one expert's
weights (``dense``: the grouped-GEMM target's yardstick) and per expert (``per_expert``, with
the SiLU-gating). The tile table is built on the host here (a probe); the op would build it on
the device from the routing counts.

    torchrun --nproc-per-node 1 -m benchmarks.probe_tail_tiles --out rows.jsonl \\
        --device-kind nvidia-h200
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from portable_overlap.ops.moe_experts.kernel import store_swiglu
from portable_overlap.tiles.gemm import gemm_tile_pair, gemm_tile_pair_desc
from portable_overlap.tiles.gemv import dot_upcast

#: (H, width, rows of each local expert): 128 tokens per rank, balanced routing, rank 0 of the
#: DeepSeek-like layer (E 16, top-8) on 8 / 4 / 2 ranks and the Mixtral-like one (E 8, top-2)
#: on 8 / 2 ranks
CASES = ("7168,2048,515/514;7168,2048,259/256/258/257;7168,2048,127/130/128/126/129/131/128/124;"
         "4096,14336,256;4096,14336,131/126/129/126")


@triton.jit
def _gated(x_ptr, wg_ptr, wu_ptr, x_desc, wg_desc, wu_desc, h_ptr, e, row0, nrows, pid_n, R, H,
           width, stride_xm, stride_wk, stride_hm, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, USE_DESC: tl.constexpr,
           UPCAST: tl.constexpr):
    if USE_DESC:
        g, u = gemm_tile_pair_desc(x_desc, wg_desc, wu_desc, row0, e * H, pid_n * BLOCK_N, 0, H,
                                   BLOCK, BLOCK_N, BLOCK_K, NUM_STAGES, "tf32")
    else:  # (the interpreter's path: pointer loads of the rows from row0 on)
        g, u = gemm_tile_pair(x_ptr + row0.to(tl.int64) * stride_xm,
                              wg_ptr + (e * H).to(tl.int64) * stride_wk,
                              wu_ptr + (e * H).to(tl.int64) * stride_wk, nrows, width, 0, H,
                              stride_xm, 1, stride_wk, 1, 0, pid_n, BLOCK, BLOCK_N, BLOCK_K,
                              NUM_STAGES, False, "tf32", UPCAST)
    r = tl.arange(0, BLOCK)
    store_swiglu(g, u, row0 + r, r < nrows, pid_n * BLOCK_N + tl.arange(0, BLOCK_N), h_ptr,
                 width, stride_hm)


@triton.jit
def tail_tiles_kernel(x_ptr, wg_ptr, wu_ptr, x_desc, xt_desc, wg_desc, wu_desc, h_ptr, table_ptr,
                      n_tiles, counter_ptr, R, H, width, stride_xm, stride_wk, stride_hm,
                      BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, DYNAMIC: tl.constexpr,
                      USE_DESC: tl.constexpr, UPCAST: tl.constexpr):
    """Persistent: each program runs tiles of ``table`` (rows of (expert, first row, rows, column
    block)) until none is left: tiles ``pid, pid + G, ...``, or with DYNAMIC the next index of
    ``counter`` (zeroed before the launch). Where BLOCK_T < BLOCK_M a tile of more than BLOCK_T
    rows runs BLOCK_M rows and others BLOCK_T, else every tile BLOCK_M; rows past the tile's
    own are masked at the store."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    if DYNAMIC:
        t = tl.atomic_add(counter_ptr, 1)
    else:
        t = pid
    while t < n_tiles:
        e = tl.load(table_ptr + 4 * t)
        row0 = tl.load(table_ptr + 4 * t + 1)
        nrows = tl.load(table_ptr + 4 * t + 2)
        pid_n = tl.load(table_ptr + 4 * t + 3)
        if BLOCK_T >= BLOCK_M or nrows > BLOCK_T:  # (one tile shape: one pipeline's smem)
            _gated(x_ptr, wg_ptr, wu_ptr, x_desc, wg_desc, wu_desc, h_ptr, e, row0, nrows, pid_n,
                   R, H, width, stride_xm, stride_wk, stride_hm, BLOCK_M, BLOCK_N, BLOCK_K,
                   NUM_STAGES, USE_DESC, UPCAST)
        else:
            _gated(x_ptr, wg_ptr, wu_ptr, xt_desc, wg_desc, wu_desc, h_ptr, e, row0, nrows,
                   pid_n, R, H, width, stride_xm, stride_wk, stride_hm, BLOCK_T, BLOCK_N,
                   BLOCK_K, NUM_STAGES, USE_DESC, UPCAST)
        if DYNAMIC:
            t = tl.atomic_add(counter_ptr, 1)
        else:
            t += G


def tile_table(rows, width, block_m, block_t, block_n, tails_first=False) -> list:
    """[(expert, first row, rows, column block)]: each expert's full ``block_m`` row tiles (all
    experts' tiles of one column block together, so a weight column block is read from memory
    once), then its rows past them in ``block_t`` tiles; with ``tails_first`` the narrow tiles
    lead. ``block_t == block_m``: the last tile of an expert is a partial full one."""
    full, tails = [], []
    starts = [sum(rows[:e]) for e in range(len(rows))]
    for n in range(triton.cdiv(width, block_n)):
        for e, r in enumerate(rows):
            whole = r // block_m * block_m if block_t < block_m else r
            for m0 in range(0, whole, block_m):
                full.append((e, starts[e] + m0, min(block_m, whole - m0), n))
            for m0 in range(whole, r, block_t):
                tails.append((e, starts[e] + m0, min(block_t, r - m0), n))
    return tails + full if tails_first else full + tails


class Variant:
    """One tiling of the probe's kernel over one case's rows (tensors made once)."""

    def __init__(self, x, wg, wu, h, rows, block_m, block_t, dynamic, tails_first, programs,
                 block_n=128, block_k=64, warps=8, stages=3):
        self.x, self.wg, self.wu, self.h = x, wg, wu, h
        self.H, self.width = x.shape[1], wg.shape[1]
        self.meta = dict(BLOCK_M=block_m, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k,
                         NUM_STAGES=stages, DYNAMIC=dynamic, num_warps=warps)
        table = tile_table(rows, self.width, block_m, block_t, block_n, tails_first)
        self.n_tiles = len(table)
        self.table = torch.tensor(table, dtype=torch.int32, device=x.device).view(-1)
        self.counter = torch.zeros(1, dtype=torch.int32, device=x.device)
        self.grid = (min(programs, self.n_tiles),)
        self.use_desc = x.is_cuda
        if self.use_desc:
            from triton.tools.tensor_descriptor import TensorDescriptor

            self.descs = (TensorDescriptor.from_tensor(x, [block_m, block_k]),
                          TensorDescriptor.from_tensor(x, [block_t, block_k]),
                          TensorDescriptor.from_tensor(wg, [block_k, block_n]),
                          TensorDescriptor.from_tensor(wu, [block_k, block_n]))
        else:
            self.descs = (None,) * 4

    def __call__(self):
        if self.meta["DYNAMIC"]:
            self.counter.zero_()
        tail_tiles_kernel[self.grid](
            self.x, self.wg, self.wu, *self.descs, self.h, self.table, self.n_tiles,
            self.counter, self.x.shape[0], self.H, self.width, self.x.stride(0),
            self.wg.stride(0), self.h.stride(0), USE_DESC=self.use_desc,
            UPCAST=dot_upcast(self.x.dtype), **self.meta)
        return self.h


def reference(x, wg, wu, rows) -> torch.Tensor:
    """float32 ``silu(x_e @ w_gate[e]) * (x_e @ w_up[e])`` per expert's rows."""
    H = x.shape[1]
    out, r0 = [], 0
    for e, r in enumerate(rows):
        xe = x[r0:r0 + r].float()
        wge, wue = wg[e * H:(e + 1) * H].float(), wu[e * H:(e + 1) * H].float()
        out.append(F.silu(xe @ wge) * (xe @ wue))
        r0 += r
    return torch.cat(out)


def parse_cases(text: str) -> list:
    """``"H,width,r0/r1;..."`` -> [(H, width, [r0, r1, ...])]."""
    cases = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        H, width, rows = item.split(",")
        cases.append((int(H), int(width), [int(r) for r in rows.split("/")]))
    return cases


def make_case(H, width, rows, device, dtype=torch.bfloat16, seed=0):
    """Random rows and stacked [E * H, width] gate / up weights, and a poisoned output."""
    g = torch.Generator(device=device).manual_seed(seed)
    R, E = sum(rows), len(rows)
    x = torch.randn(R, H, generator=g, device=device).to(dtype)
    wg = (torch.randn(E * H, width, generator=g, device=device) / H ** 0.5).to(dtype)
    wu = (torch.randn(E * H, width, generator=g, device=device) / H ** 0.5).to(dtype)
    h = torch.full((R, width), float("nan"), device=device, dtype=dtype)
    return x, wg, wu, h


def variants(block_ts=(128, 64, 32, 16)) -> list:
    """(name, block_m, block_t, dynamic, tails_first): 128-row tiles everywhere (the op's
    packed tiling), then narrow last tiles, static and dynamic, narrow tiles last and first."""
    out = [("all128", 128, 128, False, False), ("all128_dyn", 128, 128, True, False)]
    for bt in block_ts:
        if bt < 128:
            for dyn in (False, True):
                for first in (False, True):
                    out.append((f"t{bt}{'_dyn' if dyn else ''}{'_first' if first else ''}", 128,
                                bt, dyn, first))
    return out


def main() -> int:
    from benchmarks.harness import time_op
    from benchmarks.rows import ResultWriter
    from portable_overlap import World

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device-kind", default="unknown")
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    world = World.from_env()
    dev = world.device
    writer = ResultWriter(args.out, args.device_kind, 1)
    programs = world.facts.sm_count
    for H, width, rows in parse_cases(args.cases):
        x, wg, wu, h = make_case(H, width, rows, dev)
        R = x.shape[0]
        ref = reference(x, wg, wu, rows)
        impls = {}
        for name, bm, bt, dyn, first in variants():
            v = Variant(x, wg, wu, h, rows, bm, bt, dyn, first, programs)
            h.fill_(float("nan"))
            got = v().float()
            err = ((got - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                print(f"{name}: rel err {err:.2e}: WRONG, not timed", flush=True)
                continue
            impls[name] = (v, err, v.n_tiles)
        w0g, w0u = wg[:H], wu[:H]
        impls["dense"] = (lambda: (torch.mm(x, w0g), torch.mm(x, w0u)), None, None)
        starts = [sum(rows[:e]) for e in range(len(rows))]

        def per_expert():
            for e, r in enumerate(rows):
                xe = x[starts[e]:starts[e] + r]
                h[starts[e]:starts[e] + r] = F.silu(xe @ wg[e * H:(e + 1) * H]) * \
                    (xe @ wu[e * H:(e + 1) * H])
        impls["per_expert"] = (per_expert, None, None)
        times = {n: [] for n in impls}
        names = list(impls)
        for k in range(args.rounds):
            for n in names[k % len(names):] + names[:k % len(names)]:
                times[n].append(time_op(impls[n][0], world, graph=True, iters=args.iters,
                                        warmup=10)["median_ms"])
        med = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
        label = f"{H}x{width} rows {'/'.join(map(str, rows))}"
        for n, ms in med.items():
            writer.write(op="expert_swiglu_tail_tiles", shape={"H": H, "I": width, "rows": rows},
                         dtype="bf16", impl=n, graph=True, median_ms=round(ms, 4),
                         rel_err=impls[n][1], tiles=impls[n][2], rounds=args.rounds)
        best = min((n for n in med if n not in ("dense", "per_expert")), key=med.get)
        print(f"{label} R={R}: dense cuBLAS {med['dense']:.4f} ms, per-expert cuBLAS "
              f"{med['per_expert']:.4f}; " + ", ".join(
                  f"{n} {med[n]:.4f}" for n in med if n not in ("dense", "per_expert")) +
              f"; best {best} {med[best]:.4f} ({med['dense'] / med[best]:.2f} of dense)",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
