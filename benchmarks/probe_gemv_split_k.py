"""Probe (one GPU): the GEMV + AllReduce kernel's K split (``GemvConfig.split_k``, the one-shot
transport) at narrow N, where the column blocks alone leave SMs without a program, against
cuBLAS. A world of one process (no torchrun: ``World.from_env`` makes it), ``transport=
"one_shot"``, bf16; per shape: cuBLAS (``torch.mm``), the rule's pick (``pick_config`` with the
one-shot partial room: its own split), the rule's tile with split 1, 2 and 4, and the op's own
plan (no config: the rule's pick, or split 1 where its grid is not resident at once). Each
variant is checked against the fp32 product on a poisoned output before it is timed; timed as
a CUDA graph of 20 calls, the median of 30 replays, in µs per call. Prints a table; one JSON
line per variant to ``--out``.

    timeout 300 python -m benchmarks.probe_gemv_split_k --out probe.jsonl
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

import torch

#: (M, N, K): narrow N (1024-2048 columns: 64-128 16-column blocks for 132 SMs), then wide N
SHAPES = ((1, 1024, 8192), (32, 1024, 8192), (1, 2048, 4096), (8, 1024, 4096), (1, 1536, 7168),
          (1, 8192, 3584), (8, 8192, 3584))
MAX_N = 8192
REPS, ROUNDS = 20, 30


def timed(fn, reps: int = REPS, rounds: int = ROUNDS) -> float:
    """µs per call of ``fn``: a CUDA graph of ``reps`` calls, the median of ``rounds``
    replays (warmed up on a side stream before the capture)."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    ts = []
    for _ in range(rounds):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / reps * 1e3)
    return statistics.median(ts)


def variants(pick, n: int, sm_count: int):
    """(label, config) per variant: ``None`` is the op's own plan. A split's grid is one
    program per (column block, K slice), all resident at once: its ``programs_per_sm`` is
    raised to what that grid needs (at most 8; the plan refuses a grid that does not fit)."""
    rows = [("rule", pick), ("op-plan", None)]
    n_blocks = -(-n // pick.block_n)
    for s in (1, 2, 4):
        per_sm = min(8, max(pick.programs_per_sm, -(-n_blocks * s // sm_count)))
        rows.append((f"split{s}", dataclasses.replace(
            pick, split_k=s, programs_per_sm=per_sm if s > 1 else pick.programs_per_sm)))
    return rows


def parse_shapes(text: str) -> tuple:
    """``"1x1024x8192,8x1024x4096"`` -> ((1, 1024, 8192), (8, 1024, 4096))."""
    return tuple(tuple(int(v) for v in s.split("x")) for s in text.split(",") if s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON lines, one per (shape, variant)")
    ap.add_argument("--shapes", type=parse_shapes, default=SHAPES,
                    help="MxNxK[,MxNxK...] (default: the seven of SHAPES)")
    args = ap.parse_args(argv)

    import portable_overlap as po
    from portable_overlap.ops.gemv_allreduce.api import MAX_M
    from portable_overlap.ops.gemv_allreduce.config import pick_config

    world = po.World.from_env()
    dev, facts = world.device, world.facts
    dtype = torch.bfloat16
    ctx = po.GemvAllReduce(world, MAX_N, transport="one_shot")
    torch.manual_seed(0)
    print(f"{facts.name} ({facts.arch}, {facts.sm_count} SMs), world {world.world_size}, "
          f"one_shot, bf16; graph of {REPS} calls, median of {ROUNDS} replays, us per call",
          flush=True)
    try:
        with open(args.out, "a") as sink:
            def emit(row):
                sink.write(json.dumps(row) + "\n")
                sink.flush()

            for M, N, K in args.shapes:
                x = torch.randn(M, K, device=dev, dtype=dtype)
                w = torch.randn(N, K, device=dev, dtype=dtype)
                ref = x.float() @ w.float().t()
                y = torch.empty(M, N, device=dev, dtype=dtype)
                out = torch.empty_like(y)
                base = dict(probe="gemv_split_k", M=M, N=N, K=K, dtype="bf16",
                            device=facts.name, arch=facts.arch, sm_count=facts.sm_count,
                            world=world.world_size, transport="one_shot")
                cub = timed(lambda: torch.mm(x, w.t(), out=y))
                emit(dict(base, variant="cublas", config=None, us=round(cub, 2), vs_cublas=1.0))
                pick = pick_config(M, N, K, dtype, facts.arch, facts.sm_count,
                                   world.world_size, facts.shared_per_program, MAX_M * MAX_N)
                lines = [f"{M}x{N}x{K}: cuBLAS {cub:.1f} us; rule {pick}"]
                for label, cfg in variants(pick, N, facts.sm_count):
                    given = {} if cfg is None else {"config": cfg}
                    row = dict(base, variant=label,
                               config=None if cfg is None else dataclasses.asdict(cfg))
                    try:
                        out.fill_(float("nan"))
                        ctx(x, w, out=out, **given)
                        torch.cuda.synchronize()
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        row["rel_err"] = err
                        if not err < 1e-2:  # NaN (a block never written) fails too
                            row["error"] = f"wrong result: rel err {err:.2e}"
                        else:
                            t = timed(lambda: ctx(x, w, out=out, **given))
                            row.update(us=round(t, 2), vs_cublas=round(cub / t, 3))
                    except Exception as e:  # a split refused here (grid, room): recorded
                        row["error"] = f"{type(e).__name__}: {e}"
                    emit(row)
                    split = "" if cfg is None else f" split {cfg.split_k} x{cfg.programs_per_sm}"
                    lines.append(f"  {label:8s}{split:13s} " + (
                        f"{row['us']:7.1f} us ({row['vs_cublas']:.2f} of cuBLAS)"
                        if "us" in row else row["error"][:100]))
                print("\n".join(lines), flush=True)
    finally:
        ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
