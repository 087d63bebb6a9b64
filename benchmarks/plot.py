"""Plots and tables of benchmark results (the JSONL rows of benchmarks/results/):

    python -m benchmarks.plot benchmarks/results/*.jsonl --out docs/plots

Rows are grouped by (op, shape, dtype, world, device, graph); in each group the latest row of
every impl counts (by ``date``, then by position: a later file on the command line, a later line
in a file). Per group: ``speedup = sequential / fused``, ``speedup over torch = torch_fused /
fused`` and ``fraction of ideal = (sequential - fused) / (sequential - max(compute, comm))``,
each where its rows exist. Groups without both a ``fused`` row and a ``sequential`` or
``torch_fused`` row are left out.

Writes into ``--out``: ``<op>.png`` per op (bars per shape, one series per world and device,
CUDA-graph replay rows unless ``--plain``; a line at 1.0; panels for the speedup over torch's
fused op and the fraction of ideal where those exist), ``scaling.png`` (per op, the geometric
mean speedup over the shapes every world measured), and ``speedups.md`` / ``speedups.csv`` (every
group, both graph modes). The reduction needs only the standard library; matplotlib
(``pip install portable_overlap[plot]``) only for the PNGs.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from typing import Iterable, Optional, Sequence

try:
    from benchmarks.metrics import summarize
    from benchmarks.rows import json_rows, load_results, refuses_unreadable_results
except ImportError:  # started as ``python benchmarks/plot.py``: its folder is on the path
    from metrics import summarize
    from rows import json_rows, load_results, refuses_unreadable_results

#: shape fields that change with the world size for the same layer (the per-rank share): left
#: out when shapes of different worlds are matched
PER_WORLD_SUFFIXES = ("_local", "_per_rank")
METRICS = ("speedup", "speedup_vs_torch", "fraction_of_ideal")
TITLES = {"speedup": "speedup over sequential (sequential / fused)",
          "speedup_vs_torch": "speedup over torch's fused op (torch_fused / fused)",
          "fraction_of_ideal": "fraction of ideal (seq - fused) / (seq - max(compute, comm))"}
TABLE_KEYS = ("op", "shape", "dtype", "world", "device", "graph", "fused_ms", "sequential_ms",
              "torch_fused_ms", "compute_ms", "comm_ms", "speedup", "speedup_vs_torch",
              "fraction_of_ideal", "date")


def read_rows(paths: Sequence[str]) -> list:
    """Every JSON object of the files, in order; each gets ``_pos`` = (file index, line
    number). Blank lines and lines that are not a JSON object (a run's torn last line) are
    skipped; a missing file, or one without a row, raises ``rows.UnreadableResults``."""
    rows = []
    for i, path in enumerate(paths):
        for n, row in load_results(path, lambda p: list(json_rows(p, skip_unreadable=True))):
            row["_pos"] = (i, n - 1)  # (the line index, from 0)
            rows.append(row)
    return rows


def layer_shape(shape: dict) -> dict:
    """``shape`` without its per-rank fields (``PER_WORLD_SUFFIXES``)."""
    return {k: v for k, v in shape.items() if not k.endswith(PER_WORLD_SUFFIXES)}


def shape_label(shape: dict) -> str:
    """Integer sizes joined by ``x``, then the other values: ``8192x8192x4096``,
    ``8192x2048x1536x8x2 zipf``."""
    nums = [str(v) for v in shape.values() if isinstance(v, int) and not isinstance(v, bool)]
    rest = [str(v) for v in shape.values() if not (isinstance(v, int) and not isinstance(v, bool))]
    return " ".join(x for x in ["x".join(nums)] + rest if x)


def _timed(row: dict) -> bool:
    t = row.get("median_ms")
    return (isinstance(row.get("impl"), str) and isinstance(row.get("shape"), dict)
            and isinstance(row.get("graph"), bool) and isinstance(row.get("world"), int)
            and isinstance(t, (int, float)) and math.isfinite(t) and t > 0)


def latest(rows: Iterable[dict]) -> dict:
    """{group key: {impl: row}} with the latest row per impl (``date``, then ``_pos``); the key
    is (op, layer shape as sorted JSON, dtype, world, device, graph)."""
    groups: dict = {}
    for row in rows:
        if not _timed(row):
            continue
        key = (row["op"], json.dumps(layer_shape(row["shape"]), sort_keys=True),
               row.get("dtype"), row["world"], row.get("device"), row["graph"])
        best = groups.setdefault(key, {}).get(row["impl"])
        if best is None or (str(row.get("date") or ""), row.get("_pos", (0, 0))) >= \
                (str(best.get("date") or ""), best.get("_pos", (0, 0))):
            groups[key][row["impl"]] = row
    return groups


def reduce_rows(rows: Sequence[dict]) -> list:
    """One entry per group that has a ``fused`` row and a ``sequential`` or ``torch_fused``
    row: op, shape (the layer's, as first seen), label, dtype, world, device, graph, times
    ({impl: ms}), date (the newest of its rows), the figures of ``metrics.summarize``. Entries
    come in the order their groups first appear."""
    first = {}
    for row in rows:
        if _timed(row):
            key = (row["op"], json.dumps(layer_shape(row["shape"]), sort_keys=True))
            first.setdefault(key, (len(first), layer_shape(row["shape"])))
    out = []
    for key, impls in latest(rows).items():
        if "fused" not in impls or not ({"sequential", "torch_fused"} & set(impls)):
            continue
        op, shape_key, dtype, world, device, graph = key
        order, shape = first[(op, shape_key)]
        times = {name: r["median_ms"] for name, r in impls.items()}
        entry = {"op": op, "shape": shape, "label": shape_label(shape), "dtype": dtype,
                 "world": world, "device": device, "graph": graph, "times": times,
                 "date": max(str(r.get("date") or "") for r in impls.values()),
                 "_order": order}
        entry.update(summarize(times))
        out.append(entry)
    out.sort(key=lambda e: (e["op"], e["_order"], str(e["dtype"]), e["world"],
                            str(e["device"]), not e["graph"]))
    return out


def series_name(world: int, device: Optional[str]) -> str:
    return f"W={world} ({device})" if device else f"W={world}"


def figure_data(entries: Sequence[dict], op: str, graph: bool = True) -> dict:
    """What ``<op>.png`` shows: ``categories`` (shape labels, with the dtype when the op has
    several), ``series`` ((world, device) pairs, sorted) and per metric of ``METRICS``
    {series: [value or None per category]}; ``panels``: the metrics with at least one value."""
    mine = [e for e in entries if e["op"] == op and e["graph"] == graph]
    dtypes = {e["dtype"] for e in mine}
    cat = (lambda e: f"{e['label']} {e['dtype']}") if len(dtypes) > 1 else (lambda e: e["label"])
    categories = list(dict.fromkeys(cat(e) for e in mine))
    series = sorted({(e["world"], str(e["device"] or "")) for e in mine})
    values = {m: {s: [None] * len(categories) for s in series} for m in METRICS}
    for e in mine:
        i, s = categories.index(cat(e)), (e["world"], str(e["device"] or ""))
        for m in METRICS:
            values[m][s][i] = e[m]
    panels = [m for m in METRICS if any(v is not None for vs in values[m].values() for v in vs)]
    return {"op": op, "graph": graph, "categories": categories, "series": series,
            "values": values, "panels": panels}


def geomean(xs: Sequence[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def scaling_data(entries: Sequence[dict], graph: bool = True) -> dict:
    """What ``scaling.png`` shows: per op, the geometric mean speedup over sequential of every
    (world, device) series over the (shape, dtype) cases that all its series measured. While
    the series share no case, the one sharing the fewest cases with any other is dropped.
    Returns {"ops": [...], "series": [...], "values": {series: [value or None per op]},
    "cases": [number of shared cases per op]}."""
    per_op: dict = {}
    for e in entries:
        if e["graph"] == graph and e["speedup"] is not None:
            s = (e["world"], str(e["device"] or ""))
            per_op.setdefault(e["op"], {}).setdefault(s, {})[(e["label"], e["dtype"])] = \
                e["speedup"]
    ops, cases, kept = [], [], {}
    for op, by_series in per_op.items():
        live = {s: v for s, v in by_series.items()}
        shared = set.intersection(*(set(v) for v in live.values()))
        while not shared:
            def overlap(s):
                return max(len(set(live[s]) & set(live[t])) for t in live if t != s)

            live.pop(min(live, key=lambda s: (overlap(s), len(live[s]), s)))
            shared = set.intersection(*(set(v) for v in live.values()))
        ops.append(op)
        cases.append(len(shared))
        kept[op] = {s: geomean([v[c] for c in shared]) for s, v in live.items()}
    series = sorted({s for k in kept.values() for s in k})
    values = {s: [kept[op].get(s) for op in ops] for s in series}
    return {"ops": ops, "series": series, "values": values, "cases": cases, "graph": graph}


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3f}"
    if isinstance(x, bool):
        return "graph" if x else "plain"
    return "" if x is None else str(x)


def table_rows(entries: Sequence[dict]) -> list:
    """The table's rows: one list of strings per entry, in ``TABLE_KEYS`` order."""
    return [[_fmt(e["label"] if k == "shape" else e[k]) for k in TABLE_KEYS] for e in entries]


def write_tables(entries: Sequence[dict], out_dir: str) -> list:
    """Writes ``speedups.csv`` and ``speedups.md`` into ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    rows = table_rows(entries)
    csv_path = os.path.join(out_dir, "speedups.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(TABLE_KEYS)
        w.writerows(rows)
    md_path = os.path.join(out_dir, "speedups.md")
    with open(md_path, "w") as f:
        f.write("# Speedups of the fused ops\n\n"
                "Made by `benchmarks/plot.py` from `benchmarks/results/*.jsonl`: per op, shape, "
                "dtype, world, device and graph mode the latest row of each impl; times in ms "
                "(slowest rank's median); `speedup = sequential / fused`, `speedup_vs_torch = "
                "torch_fused / fused`, `fraction_of_ideal = (sequential - fused) / (sequential - "
                "max(compute, comm))`; empty where a row is missing.\n\n")
        f.write("| " + " | ".join(TABLE_KEYS) + " |\n")
        f.write("|" + "---|" * len(TABLE_KEYS) + "\n")
        for r in rows:
            f.write("| " + " | ".join(r) + " |\n")
    return [csv_path, md_path]


def render(entries: Sequence[dict], out_dir: str, graph: bool = True, dpi: int = 100) -> list:
    """Writes ``<op>.png`` per op and ``scaling.png`` into ``out_dir``; returns their paths.
    Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    mode = "CUDA-graph replay" if graph else "plain launches"
    paths = []
    for op in dict.fromkeys(e["op"] for e in entries):
        d = figure_data(entries, op, graph)
        if not d["categories"] or not d["panels"]:
            continue
        n_cat, n_ser = len(d["categories"]), len(d["series"])
        width = min(18.0, max(7.0, 1.5 + n_cat * (0.32 * n_ser + 0.5)))
        fig, axes = plt.subplots(len(d["panels"]), 1, figsize=(width, 2.9 * len(d["panels"]) + 0.6),
                                 squeeze=False)
        for ax, metric in zip(axes[:, 0], d["panels"]):
            # a fraction far outside [0, 1] (a sequential path barely slower than the ideal)
            # says little more than its label does
            _bars(ax, d["categories"], d["series"], d["values"][metric], n_ser,
                  (-1.5, 2.0) if metric == "fraction_of_ideal" else (None, None))
            ax.set_title(TITLES[metric], fontsize=9)
            ax.axhline(1.0, color="black", linewidth=0.8)
            if metric == "fraction_of_ideal":
                ax.axhline(0.0, color="grey", linewidth=0.6)
        axes[0, 0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.suptitle(f"{op}: {mode}, slowest rank's median", fontsize=10)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{op}.png")
        fig.savefig(path, dpi=dpi, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    s = scaling_data(entries, graph)
    if s["ops"]:
        fig, ax = plt.subplots(figsize=(max(7.0, 1.5 + 1.1 * len(s["ops"])), 3.8))
        cats = [f"{op}\n({n} case{'s' if n != 1 else ''})" for op, n in zip(s["ops"], s["cases"])]
        _bars(ax, cats, s["series"], s["values"], len(s["series"]))
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"speedup over sequential per world: geometric mean over the cases every "
                     f"world measured ({mode})", fontsize=9)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        plt.setp(ax.get_xticklabels(), rotation=20, ha="right", fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, "scaling.png")
        fig.savefig(path, dpi=dpi, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def _bars(ax, categories, series, values, n_ser, limits=(None, None)) -> None:
    """Grouped bars: one group per category, one bar per series, each labelled with its value.
    ``limits`` (low, high) cut the y range so that one outlier does not flatten the rest; a cut
    bar keeps its label, inside the range."""
    step = 0.8 / max(1, n_ser)
    floor = -math.inf if limits[0] is None else limits[0]
    ceil = math.inf if limits[1] is None else limits[1]
    lo, hi = 0.0, 1.2
    for j, s in enumerate(series):
        xs = [i - 0.4 + step * (j + 0.5) for i in range(len(categories))]
        ys = [v if v is not None else math.nan for v in values[s]]
        bars = ax.bar(xs, ys, width=step * 0.95, label=series_name(*s))
        ax.bar_label(bars, labels=["" if math.isnan(y) or not floor <= y <= ceil else f"{y:.2f}"
                                   for y in ys], fontsize=5.5, padding=1)
        for x, y in zip(xs, ys):
            if y < floor or y > ceil:
                ax.text(x, floor + 0.05 if y < floor else ceil - 0.05, f"{y:.2f}", ha="center",
                        va="bottom" if y < floor else "top", fontsize=5.5)
        finite = [y for y in ys if not math.isnan(y)]
        if finite:
            lo, hi = min(lo, min(finite)), max(hi, max(finite))
    ax.set_ylim(max(lo, floor) - 0.05 if lo < 0 else 0, min(hi * 1.1, ceil))
    ax.set_xticks(range(len(categories)))
    ax.set_xticklabels(categories, fontsize=7, rotation=20 if len(categories) > 4 else 0,
                       ha="right" if len(categories) > 4 else "center")
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="y", linewidth=0.3)


@refuses_unreadable_results("plot")
def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="results JSONL files (later ones win date ties)")
    ap.add_argument("--out", required=True, help="folder for the PNGs and tables")
    ap.add_argument("--plain", action="store_true",
                    help="plot plain-launch rows instead of CUDA-graph replay")
    ap.add_argument("--dpi", type=int, default=100)
    ap.add_argument("--tables-only", action="store_true", help="no PNGs (no matplotlib needed)")
    args = ap.parse_args(argv)
    entries = reduce_rows(read_rows(args.files))
    paths = write_tables(entries, args.out)
    if not args.tables_only:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"wrote {', '.join(paths)}; the PNGs need matplotlib "
                  f"(pip install portable_overlap[plot]), or pass --tables-only", file=sys.stderr)
            return 1
        paths += render(entries, args.out, graph=not args.plain, dpi=args.dpi)
    print(f"{len(entries)} groups; wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
