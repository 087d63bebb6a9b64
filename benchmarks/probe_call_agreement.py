"""Probe: what ``transport="auto"`` adds on the host to an eager call of a decided
``"sequential"`` key (its agreement with the peers, ``ops/planner.py``), with the agreement on
the call board (shared host memory, ``ops/call_board.py``) and through the process group's
store, against the named ``"sequential"`` transport. CPU-emulated ranks (gloo, the Triton
interpreter), so it runs on any machine; give it idle cores, one per rank at least: the
figures are host times, which a busy machine stretches.

Per world size: a GEMV + AllReduce context of each kind, ``--calls`` eager calls each after a
barrier, the wall time of each call on the host; each kind in ``--rounds`` rounds (the order
rotated), its median round kept, the slowest rank's median. Rows to --out (op
``auto_agreement``, impl ``named`` / ``board`` / ``store``).

    python -m benchmarks.probe_call_agreement --out rows.jsonl --device-kind nvidia-h200 \\
        [--worlds 2,4,8] [--calls 300] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import portable_overlap as po
from benchmarks.rows import ResultWriter
from portable_overlap.ops.call_board import CallBoard
from portable_overlap.testing.emulated import EmulatedWorld

KINDS = ("named", "board", "store")


def _make(world, kind):
    if kind == "named":
        return po.GemvAllReduce(world, 64, transport="sequential")
    make = CallBoard.__dict__["make"]
    if kind == "store":  # as where the ranks run on several machines
        CallBoard.make = classmethod(lambda cls, *a: None)
    try:
        ctx = po.GemvAllReduce(world, 64, transport="auto", candidates=("sequential",),
                               iters=1, warmup=0)
    finally:
        CallBoard.make = make
    assert (ctx.planner._board is not None) == (kind == "board")
    return ctx


def _rank(world, calls, rounds):
    """{kind: [per-round median ms]} on this rank, each kind checked against the reference."""
    g = torch.Generator().manual_seed(world.rank)
    x, w = torch.randn(1, 128, generator=g), torch.randn(64, 128, generator=g)
    ref = x @ w.t()
    torch.distributed.all_reduce(ref, group=world.group)
    found = {k: [] for k in KINDS}
    for r in range(rounds):
        for kind in KINDS[r % 3:] + KINDS[:r % 3]:
            ctx = _make(world, kind)
            try:
                y = ctx(x, w)  # the key's decision (auto), and a check of the result
                if not torch.allclose(y, ref, rtol=1e-5, atol=1e-5):
                    raise RuntimeError(f"{kind}: wrong result")
                ts = []
                for _ in range(calls):
                    world.barrier()
                    t0 = time.perf_counter()
                    ctx(x, w)
                    ts.append(time.perf_counter() - t0)
                found[kind].append(statistics.median(ts) * 1e3)
            finally:
                ctx.close()
    return found


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device-kind", default="unknown")
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cores = os.cpu_count()
    print(f"{'ranks':>5} | " + " | ".join(f"{k:>9}" for k in KINDS)
          + " | board - named | store - named   (ms, host, slowest rank's median round)")
    for W in (int(v) for v in args.worlds.split(",")):
        with EmulatedWorld(W) as ew:
            per_rank = ew.run(_rank, args.calls, args.rounds, timeout=1800)
        ms = {k: max(statistics.median(r[k]) for r in per_rank) for k in KINDS}
        writer = ResultWriter(args.out, args.device_kind, W)
        for k in KINDS:
            writer.write(op="auto_agreement", shape={"M": 1, "N": 64, "K": 128},
                         dtype="float32", impl=k, graph=False, median_ms=round(ms[k], 4),
                         device_detail=f"CPU-emulated ranks, {cores} cores",
                         rounds=[round(max(r[k][i] for r in per_rank), 4)
                                 for i in range(args.rounds)])
        print(f"{W:>5} | " + " | ".join(f"{ms[k]:9.3f}" for k in KINDS)
              + f" | {ms['board'] - ms['named']:13.3f} | {ms['store'] - ms['named']:13.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
