"""Speedup over the sequential baseline at two world sizes, from the results files.

    python -m benchmarks.compare_worlds benchmarks/results/nvidia-h200-x2.jsonl \\
        benchmarks/results/nvidia-h200-x4.jsonl [--plain] [--markdown] [--barrier device]

For every fused op and problem (the layer's shape: the fields that depend on the world, such as
``K_local`` or ``tables_per_rank``, are left out of the match) it takes the newest row of each
impl in each file, CUDA-graph replay unless ``--plain``, and prints fused / sequential /
compute alone / communication alone and ``speedup = sequential / fused`` for both worlds, with
``ideal = sequential / max(compute, comm)``, the most that overlap can give. Only rows timed
with one kind of barrier are compared (``--barrier``: ``host``, the default, where rows that
name none count as host-barrier rows; ``device``; ``any``): ops that wait for their peers time
tens of microseconds slower behind a host barrier (``benchmarks/harness.py``).
"""
from __future__ import annotations

import argparse
import json
import sys

from benchmarks.rows import json_rows, load_results, refuses_unreadable_results

OPS = ("gemv_allreduce", "gemm_alltoall", "allgather_gemm", "gemm_reduce_scatter",
       "gemm_all_reduce", "moe_gemm_combine", "gemm_allreduce_signal",
       "gemm_reducescatter_signal", "embedding_alltoall")
PER_WORLD = ("K_local", "tables_per_rank")  # shape fields that change with the world size
IMPLS = ("fused", "sequential", "compute", "comm")


def _key(row):
    shape = {k: v for k, v in row["shape"].items() if k not in PER_WORLD}
    return row["op"], json.dumps(shape, sort_keys=True), row.get("dtype")


def newest_rows(path, graph, barrier="host", ops=OPS, impls=None):
    """``({(op, problem, dtype): {impl: row}}, world)``: the newest timed row of each impl of
    ``ops`` (every impl, or those of ``impls``), CUDA-graph replay or plain launches
    (``graph``), timed with ``barrier`` (``"any"``: every row; rows that name none are
    host-barrier rows). The problem leaves out the shape's per-world fields."""
    table, world = {}, None
    for _, row in json_rows(path):
        if row.get("op") not in ops or not row.get("impl") \
                or (impls is not None and row["impl"] not in impls) \
                or bool(row.get("graph")) != graph or "median_ms" not in row \
                or barrier not in ("any", row.get("barrier", "host")):
            continue
        world = row["world"]
        table.setdefault(_key(row), {})[row["impl"]] = row
    return table, world


def load(path, graph, barrier="host"):
    """{(op, shape, dtype): {impl: (median_ms, commit)}}, newest row per impl timed with
    ``barrier`` (or any); and the world."""
    table, world = newest_rows(path, graph, barrier, impls=IMPLS)
    return {k: {i: (r["median_ms"], r["commit"]) for i, r in v.items()}
            for k, v in table.items()}, world


def _cells(entry):
    t = {k: v[0] for k, v in entry.items()}
    if not all(k in t for k in IMPLS):
        return None
    return (t["fused"], t["sequential"], t["compute"], t["comm"],
            t["sequential"] / t["fused"], t["sequential"] / max(t["compute"], t["comm"]))


@refuses_unreadable_results("compare_worlds")
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("small")
    p.add_argument("large")
    p.add_argument("--plain", action="store_true", help="plain launches instead of graph replay")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--barrier", choices=("host", "device", "any"), default="host",
                   help="compare only rows timed with this barrier (default: %(default)s)")
    args = p.parse_args()
    a, wa = load_results(args.small, load, not args.plain, args.barrier)
    b, wb = load_results(args.large, load, not args.plain, args.barrier)
    cols = ["fused", "seq", "comp", "comm", "speedup", "ideal"]
    head = ["op", "shape", "dtype"] + [f"{c} W={w}" for w in (wa, wb) for c in cols]
    rows = []
    for key in sorted(set(a) & set(b)):
        ca, cb = _cells(a[key]), _cells(b[key])
        if ca is None or cb is None:
            continue
        shape = " ".join(f"{k}={v}" for k, v in json.loads(key[1]).items())
        rows.append([key[0], shape, key[2] or ""] + [f"{x:.3f}" for x in ca + cb])
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
        for r in [head] + rows:
            print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
