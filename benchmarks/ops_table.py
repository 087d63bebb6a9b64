"""Every op beside its baselines and torch's fused op, at one or more world sizes, from the
results files (the tables of docs/scaling.md).

    python -m benchmarks.ops_table benchmarks/results/nvidia-h200-x2.jsonl \\
        benchmarks/results/nvidia-h200-x4.jsonl [--plain] [--barrier device|host|any]

For each file (one world) and each problem of the GEMM / GEMV patterns it takes the newest row
of each impl timed with ``--barrier`` (default ``device``, the stream barrier), CUDA-graph
replay unless ``--plain``, and prints, in milliseconds: compute alone, NCCL alone, the
sequential path, torch's fused op, "ours" (the fastest of the rows named ``fused...``, this
library's transports, with the transport's name) and ``auto`` (what ``transport="auto"`` ran,
with its pick), then three ratios: torch's time over ours (for GEMM + AllReduce, which torch
has no fused op for, the sequential path's), the fastest of every candidate over ``auto``, and
``max(compute, comm)`` over ours. With more than one file a last table puts the worlds side by
side: ours over sequential and torch's time over ours, per world.
"""
from __future__ import annotations

import argparse
import json
import sys

from benchmarks.compare_worlds import newest_rows
from benchmarks.rows import load_results, refuses_unreadable_results

OPS = {"allgather_gemm": "AllGather + GEMM", "gemm_reduce_scatter": "GEMM + ReduceScatter",
       "gemm_all_reduce": "GEMM + AllReduce", "gemv_allreduce": "GEMV + AllReduce"}
#: the transport behind each ``fused`` row name; ``fused_nocomm`` (the GEMV kernel without its
#: exchange) is not a transport and stays out
NAMES = {("allgather_gemm", "fused"): "copy engine",
         ("gemm_reduce_scatter", "fused"): "copy engine",
         ("gemm_all_reduce", "fused"): "copy engine", ("gemv_allreduce", "fused"): "two-shot",
         ("gemv_allreduce", "fused_one_shot"): "one-shot"}
BASE = ("compute", "comm", "sequential")


def _name(op: str, impl: str) -> str:
    if (op, impl) in NAMES:
        return NAMES[(op, impl)]
    inner = impl[len("fused["):-1] if impl.startswith("fused[") else impl
    return inner.split(",")[0].replace("pull", "pulls")


def load(path: str, graph: bool, barrier: str):
    """``({(op, shape, dtype): {impl: row}}, world)``: the newest row of each impl."""
    return newest_rows(path, graph, barrier, ops=OPS)


def summarize(op: str, rows: dict):
    """The row of the table for one problem, or None where a baseline is missing."""
    ms = {impl: r["median_ms"] for impl, r in rows.items()}
    if not all(b in ms for b in BASE):
        return None
    ours = {i: v for i, v in ms.items() if i.startswith("fused") and i != "fused_nocomm"}
    if not ours:
        return None
    best = min(ours, key=ours.get)
    torch_ms = ms.get("torch_fused")
    auto = rows.get("auto")
    pick = auto.get("pick", {}).get("captured" if auto.get("graph") else "plain") if auto else None
    fastest = min(v for i, v in ms.items()
                  if i not in ("compute", "comm", "fused_nocomm", "auto"))
    return {"compute": ms["compute"], "comm": ms["comm"], "sequential": ms["sequential"],
            "torch": torch_ms, "ours": ours[best], "which": _name(op, best),
            "auto": auto["median_ms"] if auto else None, "pick": pick,
            "vs": (torch_ms if torch_ms else ms["sequential"]) / ours[best],
            "fastest_over_auto": fastest / auto["median_ms"] if auto else None,
            "ideal_over_ours": max(ms["compute"], ms["comm"]) / ours[best]}


def _shape(key) -> str:
    s = json.loads(key[1])
    return f"{s['M']}×{s['N']}×{s['K']}"


def _f(v, fmt="{:.3f}") -> str:
    return "—" if v is None else fmt.format(v)


def world_table(table: dict) -> list:
    lines = ["| op | M×N×K | compute | comm (NCCL) | sequential | torch fused | ours (which) | "
             "auto (pick) | ours vs torch | fastest / auto | ideal / ours |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(table, key=lambda k: (list(OPS).index(k[0]), k[1])):
        s = summarize(key[0], table[key])
        if s is None:
            continue
        vs = _f(s["vs"], "{:.2f}") + (" (vs seq)" if s["torch"] is None else "")
        auto = "—" if s["auto"] is None else f"{s['auto']:.3f} ({s['pick']})"
        lines.append(f"| {OPS[key[0]]} | {_shape(key)} | {s['compute']:.3f} | {s['comm']:.3f} | "
                     f"{s['sequential']:.3f} | {_f(s['torch'])} | {s['ours']:.3f} "
                     f"({s['which']}) | {auto} | {vs} | {_f(s['fastest_over_auto'], '{:.2f}')} "
                     f"| {s['ideal_over_ours']:.2f} |")
    return lines


def side_by_side(tables: list) -> list:
    worlds = [w for _, w in tables]
    head = " | ".join(f"seq / ours W={w} | torch / ours W={w}" for w in worlds)
    lines = [f"| op | M×N×K | {head} |", "|---|---|" + "---|---|" * len(worlds)]
    keys = sorted(set().union(*(t for t, _ in tables)),
                  key=lambda k: (list(OPS).index(k[0]), k[1]))
    for key in keys:
        cells, any_row = [], False
        for t, _ in tables:
            s = summarize(key[0], t[key]) if key in t else None
            any_row |= s is not None
            cells += ["—", "—"] if s is None else [
                f"{s['sequential'] / s['ours']:.2f}",
                "—" if s["torch"] is None else f"{s['torch'] / s['ours']:.2f}"]
        if any_row:
            lines.append(f"| {OPS[key[0]]} | {_shape(key)} | " + " | ".join(cells) + " |")
    return lines


@refuses_unreadable_results("ops_table")
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--plain", action="store_true", help="plain launches instead of graph replay")
    p.add_argument("--barrier", choices=("device", "host", "any"), default="device")
    args = p.parse_args()
    tables = [load_results(f, load, not args.plain, args.barrier) for f in args.files]
    for (table, world), path in zip(tables, args.files):
        print(f"\n{path} (world {world}, {'plain launches' if args.plain else 'graph replay'}, "
              f"barrier {args.barrier})\n")
        print("\n".join(world_table(table)))
    if len(tables) > 1:
        print("\nside by side\n")
        print("\n".join(side_by_side(tables)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
