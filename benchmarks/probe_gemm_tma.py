"""Probe (one GPU): does the persistent tile GEMM get closer to cuBLAS with TMA tensor
descriptors than with the pointer loads of ``tiles.gemm.gemm_tile``? Times, at the signal
benchmark's per-rank shapes, cuBLAS, the library's persistent matmul (tensor descriptors where
the operands allow, pointer loads otherwise) and persistent kernels whose main loop loads
through host-built ``TensorDescriptor``s, on the full grid and on a 116-program grid (16 of 132
SMs left to NCCL, as with ``SignalConfig(reserve_sms=16)``). Prints a table; results to --out as
JSON lines.

    python -m benchmarks.probe_gemm_tma --out probe.jsonl --device-kind nvidia-h200
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from benchmarks.harness import check_and_time
from benchmarks.rows import ResultWriter
from portable_overlap import World
from portable_overlap.ops.matmul import persistent_matmul
from portable_overlap.tiles.gemm import grouped_tile

SHAPES = [(8192, 8192, 4096), (4096, 8192, 4096), (16384, 8192, 4096), (16384, 7168, 2048)]


@triton.jit
def desc_matmul_kernel(a_desc, b_desc, c_ptr, M, N, K, stride_cm, G,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr, FLATTEN: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    n_tiles = num_pid_m * num_pid_n
    for t in tl.range(pid, n_tiles, G, flatten=FLATTEN):
        pid_m, pid_n = grouped_tile(t, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            a = a_desc.load([pid_m * BLOCK_M, k0])
            b = b_desc.load([k0, pid_n * BLOCK_N])
            acc = tl.dot(a, b, acc)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :],
                 acc.to(c_ptr.dtype.element_ty),
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def desc_matmul(a, b, c, G, bm, bn, bk, stages, warps, flatten, group_m=8):
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, K = a.shape
    N = b.shape[1]
    ad = TensorDescriptor.from_tensor(a, [bm, bk])
    bd = TensorDescriptor.from_tensor(b, [bk, bn])
    desc_matmul_kernel[(G,)](ad, bd, c, M, N, K, c.stride(0), G, BLOCK_M=bm, BLOCK_N=bn,
                             BLOCK_K=bk, GROUP_M=group_m, NUM_STAGES=stages, FLATTEN=flatten,
                             num_warps=warps, num_stages=stages)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device-kind", default="unknown")
    args = ap.parse_args()
    world = World.from_env()
    dev = world.device
    writer = ResultWriter(args.out, args.device_kind, 1)
    sms = world.facts.sm_count
    rows = []
    for M, N, K in SHAPES:
        g = torch.Generator(device=dev).manual_seed(M + N + K)
        a = torch.randn(M, K, generator=g, device=dev).bfloat16()
        b = torch.randn(K, N, generator=g, device=dev).bfloat16()
        c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        ref = (a.float() @ b.float())
        shape = {"M": M, "N": N, "K": K}
        impls = {"cublas": lambda: torch.matmul(a, b, out=c)}
        for G in (sms, 116):
            impls[f"library G{G}"] = (lambda G=G: persistent_matmul(a, b, programs=G, out=c))
            for bm, bn, bk, st, w, fl in [(128, 256, 64, 3, 8, False), (128, 256, 64, 4, 8, False),
                                          (128, 256, 64, 3, 8, True), (128, 128, 64, 4, 4, False),
                                          (128, 256, 64, 4, 8, True)]:
                impls[f"desc G{G} {bm}x{bn}x{bk} s{st} w{w}{' flat' if fl else ''}"] = (
                    lambda G=G, cfg=(bm, bn, bk, st, w, fl): desc_matmul(a, b, c, G, *cfg))
        for name, fn in impls.items():
            try:
                err, t = check_and_time(fn, c, ref, world, tol=1e-2, iters=30, warmup=5)
            except Exception as e:
                print(f"{M}x{N}x{K} {name}: failed {type(e).__name__}: {str(e)[:300]}",
                      flush=True)
                continue
            tf = 2 * M * N * K / t["median_ms"] / 1e9
            rows.append((f"{M}x{N}x{K}", name, t["median_ms"], tf))
            writer.write(op="gemm_core_probe", shape=shape, dtype="bf16", impl=name, graph=True,
                         rel_err=err, tflops=tf, **t)
            print(f"{M}x{N}x{K} {name:>36}: {t['median_ms']:.3f} ms {tf:6.0f} TFLOP/s",
                  flush=True)
    print("\nshape, impl, ms, TFLOP/s, vs cuBLAS")
    base = {s: ms for s, n, ms, _ in rows if n == "cublas"}
    for s, n, ms, tf in rows:
        print(f"{s:>16} {n:>36} {ms:7.3f} {tf:6.0f} {base[s] / ms:6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
