"""Side-by-side medians of two results files: for every timed row present in both,
``new / old`` and whether it is within a tolerance.

    python -m benchmarks.compare_results OLD.jsonl NEW.jsonl [--tol 0.02] [--impl fused]

Rows are matched on what was measured (op, shape, dtype, world, impl, graph and the variant
keys: transport, schedule, partition, reserve_sms, kind); several rows with one key (repeated
rounds, several commits) are reduced to their median; rows without a finite positive median
(a failed timing is written as null) are left out. Prints one line per key and a summary;
exits 0 (it reports, the reader judges), 2 for a file it cannot read."""
import argparse
import json
import math
import statistics
import sys
from collections import defaultdict

from benchmarks.rows import json_rows, load_results, refuses_unreadable_results

VARIANT_KEYS = ("transport", "schedule", "partition", "reserve_sms", "kind", "comm_ctas")


def row_key(r: dict) -> tuple:
    parts = [r["op"], json.dumps(r.get("shape"), sort_keys=True), r.get("dtype"), r.get("world"),
             r.get("impl"), bool(r.get("graph"))]
    parts += [json.dumps(r.get(k), sort_keys=True) for k in VARIANT_KEYS if k in r]
    return tuple(parts)


def load(path: str, impls: set) -> dict:
    """key -> list of median_ms over the timed rows of ``path`` whose impl is in ``impls``
    (all impls when empty)."""
    out = defaultdict(list)
    for _, r in json_rows(path):
        if "median_ms" not in r or r.get("op", "").endswith(("_tuning", "_probe")):
            continue
        if impls and r.get("impl") not in impls:
            continue
        ms = r["median_ms"]
        if not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms <= 0:
            continue  # (not timed: no ratio to take)
        out[row_key(r)].append(float(ms))
    return out


def compare(old: dict, new: dict, tol: float):
    """[(key, old_ms, new_ms, ratio)] for the keys in both, and the keys in one only."""
    both = [(k, statistics.median(old[k]), statistics.median(new[k])) for k in old if k in new]
    rows = [(k, o, n, n / o) for k, o, n in both]
    return rows, sorted(set(old) ^ set(new))


def _tolerance(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of 0 or more, got {text}")
    return value


@refuses_unreadable_results("compare_results")
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--tol", type=_tolerance, default=0.02,
                    help="relative tolerance, 0 or more (0.02 = 2%%)")
    ap.add_argument("--impl", default="", help="comma-separated impls to compare (default all)")
    args = ap.parse_args(argv)
    impls = {s for s in args.impl.split(",") if s}
    old, new = load_results(args.old, load, impls), load_results(args.new, load, impls)
    rows, unmatched = compare(old, new, args.tol)
    rows.sort(key=lambda x: x[0])
    print(f"{'op':<26} {'shape':<44} {'impl':<11} {'graph':<5} {'variant':<22} "
          f"{'old ms':>9} {'new ms':>9} {'new/old':>8}")
    for k, o, n, ratio in rows:
        flag = "" if ratio <= 1 + args.tol else "  > tol"
        variant = ",".join(str(v) for v in k[6:])[:22]
        print(f"{k[0]:<26} {k[1][:44]:<44} {str(k[4]):<11} {str(k[5]):<5} {variant:<22} "
              f"{o:9.4f} {n:9.4f} {ratio:8.3f}{flag}")
    if rows:
        ratios = [r[3] for r in rows]
        over = sum(r > 1 + args.tol for r in ratios)
        print(f"{len(rows)} rows matched: new/old median {statistics.median(ratios):.3f}, "
              f"geomean {statistics.geometric_mean(ratios):.3f}, "
              f"max {max(ratios):.3f}; {over} over {1 + args.tol:.2f}; {len(unmatched)} unmatched")
    else:
        print("no rows matched", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
