"""Offline check of the wave-group predictor's collective terms on a logged run of
benchmarks/bench_wave_predictor.py (no GPU): reads its JSON lines, predicts every logged partition
again with the logged calibration, and prints

1. the logged model (``comm_slowdown`` 1, ``group_overhead_ms`` 0): must reproduce the logged
   predictions (a check that this script computes what the run computed);
2. the model with ``comm_slowdown`` and ``group_overhead_ms`` fitted on ONE shape per collective
   (``--fit``, default the smaller shape) and evaluated on every shape: the fitting shape's
   numbers are in-sample, the others held out;
3. the same fitted the other way round (each other shape in turn), as a check that the fitted
   values do not depend on the shape they came from;
4. the same fitted on the partitions of 1 and 2 groups of every shape, evaluated on those of 3
   and 4 (the logged model's error grew with the number of groups);
5. bench_gemm_signal's partition sweep of another run (``--sweep-commit``; up to 18 groups),
   predicted with this run's calibration and the values fitted in 2 and 3: nothing of it fitted.

The fit is a grid search minimizing the mean ``|predicted - measured| / measured`` over the
fitting shape's measured partitions; every other calibration value is the logged one. Per shape:
mean and max error, the best measured partition, the search's pick (``schedule.search`` with
its defaults on the refitted calibration) with its measured time when the run measured that
partition (else ``-``: offline there is no time for it), best / pick, and best over the
measured partition that the model ranks first (``best/top``). Usage::

    python -m benchmarks.refit_wave_predictor [--jsonl benchmarks/results/nvidia-h200-x2.jsonl]
        [--commit 59875ab] [--fit 4096x8192x8192] [--sweep-commit 7199c89]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from typing import Optional

from portable_overlap.schedule.predict import Calibration, predict_ms, search

# grids of the fit: comm_slowdown geometric over [1, 1000] (1000 = no measurable progress
# beside the GEMM, the cap of invert_comm_slowdown), group_overhead_ms in steps of 1 us, not
# below minus the smallest collective's time (back-to-back collectives cannot share more of
# their per-call cost than a whole call; bench_wave_predictor clamps its measurement alike)
SLOWDOWNS = [round(1.1 ** i, 4) for i in range(73)] + [1000.0]
OVERHEADS = [i / 1000 for i in range(-50, 51)]


def shape_name(shape: dict) -> str:
    return f"{shape['M']}x{shape['N']}x{shape['K']}"


def load(path: str, commit: str) -> dict:
    """{(kind, shape name): {"cal": calibration row, "parts": [(partition, measured_ms,
    logged predicted_ms, roles)], "summary": summary row}} of one run (its commit)."""
    runs: dict = {}
    with open(path) as f:
        for line in f:
            if '"wave_predictor' not in line:
                continue
            r = json.loads(line)
            if r.get("commit") != commit or not r["op"].startswith("wave_predictor"):
                continue
            d = runs.setdefault((r["kind"], shape_name(r["shape"])), {"parts": []})
            if r["op"] == "wave_predictor_calibration":
                d["cal"] = r
            elif r["op"] == "wave_predictor_summary":
                d["summary"] = r
            elif r["op"] == "wave_predictor":
                d["parts"].append((tuple(r["partition"]), r["median_ms"], r["predicted_ms"],
                                   r["role"]))
    return {k: v for k, v in runs.items() if "cal" in v and v["parts"]}


def logged_calibration(row: dict, comm_slowdown: Optional[float] = None,
                       group_overhead_ms: Optional[float] = None) -> Calibration:
    """The calibration the run predicted with (its main variant; runs before the collective
    terms have none: 1 and 0), with the two collective terms replaced where given."""
    return Calibration(
        wave_ms=row["wave_ms"], tiles_per_wave=row["tiles_per_wave"],
        comm_curve=row["comm_curve"], slowdown=row["slowdown"], reorder_ms=row["reorder_ms"],
        comm_slowdown=(row.get("comm_slowdown", 1.0) if comm_slowdown is None
                       else comm_slowdown),
        group_overhead_ms=(row.get("group_overhead_ms", 0.0) if group_overhead_ms is None
                           else group_overhead_ms))


def errors(run: dict, cal: Calibration, keep=None) -> list:
    """Signed relative errors ``(predicted - measured) / measured`` of the measured partitions
    (those ``keep(partition)`` accepts, default all), as (n_groups, error)."""
    tb = run["cal"]["tile_bytes"]
    return [(len(p), (predict_ms(p, cal, tb) - m) / m) for p, m, _, _ in run["parts"]
            if keep is None or keep(p)]


def mean_abs(errs) -> float:
    return statistics.fmean(abs(e) for _, e in errs)


def fit(runs: list, keep=None) -> tuple:
    """(comm_slowdown, group_overhead_ms, mean |error|) minimizing the mean |error| over the
    measured partitions of ``runs`` that ``keep`` accepts (the grids above)."""
    best = None
    floor = -min(run["cal"]["comm_curve"][0][1] for run in runs)
    for f in SLOWDOWNS:
        for oh in (oh for oh in OVERHEADS if oh >= floor):
            errs = [e for run in runs
                    for e in errors(run, logged_calibration(run["cal"], f, oh), keep)]
            e = mean_abs(errs)
            if best is None or e < best[2] - 1e-12:
                best = (f, oh, e)
    return best


def evaluate(run: dict, cal: Calibration, keep=None) -> dict:
    """The per-shape figures of the module docstring for ``cal``: errors over the partitions
    ``keep`` accepts, the rest over every measured partition."""
    tb, c = run["cal"]["tile_bytes"], run["cal"]
    errs = errors(run, cal, keep)
    measured = {p: m for p, m, _, _ in run["parts"]}
    best = min(measured, key=measured.get)
    pick, _ = search(c["n_tiles"], cal, tb, multiple_of=c["dests"])
    pick = tuple(pick.sizes)
    top = min(measured, key=lambda p: predict_ms(p, cal, tb))
    by_groups = {}
    for g, e in errs:
        by_groups.setdefault(min(g, 5), []).append(abs(e))
    return {"n": len(errs), "mean": mean_abs(errs), "max": max(abs(e) for _, e in errs),
            "bias": statistics.fmean(e for _, e in errs),
            "by_groups": {g: statistics.fmean(v) for g, v in sorted(by_groups.items())},
            "best": best, "best_ms": measured[best], "pick": pick,
            "pick_ms": measured.get(pick), "top": top, "top_ms": measured[top],
            "one_ms": measured.get((c["n_tiles"],))}


def fmt(x, spec: str) -> str:
    return format(x, spec) if x is not None else format("-", ">" + spec.split(".")[0])


def table(title: str, rows: list) -> None:
    print(f"\n{title}")
    print(f"{'kind':>14} {'M x N x K':>15} {'role':>8} {'n':>3} {'mean':>6} {'max':>6} "
          f"{'bias':>6} {'best':>6} {'pick':>6} {'best/pick':>9} {'best/top':>8} "
          f"{'best/1grp':>9}  mean err by groups (1 2 3 4 5+); pick / top / best partition")
    for kind, name, role, s in rows:
        ratio = s["best_ms"] / s["pick_ms"] if s["pick_ms"] else None
        one = s["best_ms"] / s["one_ms"] if s["one_ms"] else None
        groups = " ".join(f"{s['by_groups'][g]:.1%}" if g in s["by_groups"] else "-"
                          for g in range(1, 6))
        print(f"{kind:>14} {name:>15} {role:>8} {s['n']:>3} {s['mean']:6.1%} {s['max']:6.1%} "
              f"{s['bias']:+6.1%} {s['best_ms']:6.3f} {fmt(s['pick_ms'], '6.3f')} "
              f"{fmt(ratio, '9.3f')} {s['best_ms'] / s['top_ms']:8.3f} {fmt(one, '9.3f')}  "
              f"{groups}; {list(s['pick'])} / {list(s['top'])} / {list(s['best'])}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jsonl", default="benchmarks/results/nvidia-h200-x2.jsonl")
    ap.add_argument("--commit", default="59875ab", help="the run's commit field")
    ap.add_argument("--fit", default="4096x8192x8192", help="the shape to fit on")
    ap.add_argument("--sweep-commit", default="7199c89",
                    help="the commit of a bench_gemm_signal partition sweep to check against")
    args = ap.parse_args()
    runs = load(args.jsonl, args.commit)
    if not runs:
        print(f"no wave_predictor rows of commit {args.commit} in {args.jsonl}")
        return 1
    kinds = sorted({k for k, _ in runs})
    shapes = {k: sorted((n for kk, n in runs if kk == k), key=lambda n: int(n.split("x")[0]))
              for k in kinds}
    print(f"wave-group predictor refit, offline: {args.jsonl}, commit {args.commit}; "
          f"{sum(len(r['parts']) for r in runs.values())} measured partitions (graph replay, "
          f"slowest rank's median, 2x H200). err = |predicted - measured| / measured; best/pick "
          f"= best measured / the search's pick measured (target >= 0.97, '-': the pick was "
          f"not measured in that run); best/top = best measured / the measured partition the "
          f"model ranks first; best/1grp = best measured / one group (no overlap)")

    # 1. the logged model, reproduced
    rows, worst = [], 0.0
    for kind in kinds:
        for name in shapes[kind]:
            run = runs[(kind, name)]
            cal = logged_calibration(run["cal"])
            tb = run["cal"]["tile_bytes"]
            worst = max([worst] + [abs(predict_ms(p, cal, tb) - lp) for p, _, lp, _ in
                                   run["parts"]])
            rows.append((kind, name, "logged", evaluate(run, cal)))
    table("1. the run's model and calibration as logged (comm_slowdown and group_overhead_ms "
          f"as measured, 1 and 0 before they were); largest difference from the logged "
          f"predictions {worst * 1e3:.2f} us; 'pick': this search's pick on that calibration",
          rows)
    for kind in kinds:
        for name in shapes[kind]:
            s = runs[(kind, name)].get("summary")
            if s:
                print(f"{kind:>14} {name:>15}   the run's own pick {s['pick_partition']}: "
                      f"measured {s['pick_ms']:.3f} ms, best/pick {s['best_over_pick']:.3f}")

    # 2. fitted on one shape per collective, evaluated on all
    def fitted_table(fit_names: dict, title: str) -> None:
        rows, fits, params = [], [], {}
        for kind in kinds:
            fit_name = fit_names[kind]
            f, oh, e = fit([runs[(kind, fit_name)]])
            params[kind] = (f, oh)
            fits.append(f"{kind} on {fit_name}: comm_slowdown {f:g}, group_overhead_ms "
                        f"{oh:+.3f} (in-sample mean err {e:.1%})")
            for name in shapes[kind]:
                run = runs[(kind, name)]
                cal = logged_calibration(run["cal"], f, oh)
                rows.append((kind, name, "fit" if name == fit_name else "held-out",
                             evaluate(run, cal)))
        table(title + "\n   " + "\n   ".join(fits), rows)
        return params

    missing = [k for k in kinds if args.fit not in shapes[k]]
    if missing:
        print(f"--fit {args.fit}: no such shape for {missing}")
        return 1
    fitted = {args.fit: fitted_table({k: args.fit for k in kinds},
                 f"2. comm_slowdown and group_overhead_ms fitted on {args.fit} per collective "
                 f"(rows 'fit': in-sample), the logged calibration otherwise:")}
    others = sorted({n for k in kinds for n in shapes[k] if n != args.fit},
                    key=lambda n: int(n.split("x")[0]))
    for i, other in enumerate(others):
        fitted[other] = fitted_table(
            {k: other if other in shapes[k] else args.fit for k in kinds},
            f"3.{i + 1} the same, fitted on {other} instead (a check of the fitted values' "
            f"dependence on the shape):")

    # 4. fitted on few groups, evaluated on many: the error grew with the number of groups
    few = lambda p: len(p) <= 2  # noqa: E731
    rows, fits = [], []
    for kind in kinds:
        f, oh, e = fit([runs[(kind, n)] for n in shapes[kind]], few)
        fits.append(f"{kind} on 1-2 groups of every shape: comm_slowdown {f:g}, "
                    f"group_overhead_ms {oh:+.3f} (in-sample mean err {e:.1%})")
        for name in shapes[kind]:
            run = runs[(kind, name)]
            cal = logged_calibration(run["cal"], f, oh)
            rows.append((kind, name, "3+ grps", evaluate(run, cal, lambda p: len(p) > 2)))
    table("4. fitted on the partitions of 1 and 2 groups, errors over those of 3 or more "
          "(held out; best / pick / top over every measured partition):\n   "
          + "\n   ".join(fits), rows)

    # 5. another run's partitions (more groups than the candidates have), nothing refitted
    sweep = load_sweep(args.jsonl, args.sweep_commit)
    sweep = [r for r in sweep if (r[0], r[1]) in runs]
    if sweep:
        names = list(fitted)
        print(f"\n5. bench_gemm_signal's partition sweep of commit {args.sweep_commit} (another "
              f"run of the same op code, graph replay), predicted with this run's calibration "
              f"of the shape: as logged, and with the values fitted in 2 and 3 (held out "
              f"entirely: none of these times was used)")
        print(f"{'kind':>14} {'M x N x K':>15} {'partition':>20} {'grps':>4} {'measured':>8} "
              f"{'logged':>15} " + " ".join(f"{'fit ' + n.split('x')[0]:>15}" for n in names))
        errs: dict = {}
        for kind, name, impl, part, ms in sweep:
            cal = logged_calibration(runs[(kind, name)]["cal"])
            tb = runs[(kind, name)]["cal"]["tile_bytes"]
            cals = [("logged", cal)] + [(n, dataclasses.replace(
                cal, comm_slowdown=fitted[n][kind][0], group_overhead_ms=fitted[n][kind][1]))
                for n in names]
            cells = []
            for label, c in cals:
                pr = predict_ms(part, c, tb)
                errs.setdefault(label, []).append(abs(pr - ms) / ms)
                cells.append(f"{pr:6.3f} ({(pr - ms) / ms:+6.1%})")
            print(f"{kind:>14} {name:>15} {impl:>20} {len(part):>4} {ms:8.3f} "
                  + " ".join(f"{c:>15}" for c in cells))
        print(f"{'mean |err|':>56} " + " ".join(
            f"{statistics.fmean(errs[label]):15.1%}" for label in ["logged"] + names))
    return 0


def load_sweep(path: str, commit: str) -> list:
    """(kind, shape name, impl, partition, median_ms) of bench_gemm_signal's fused variants with
    an explicit partition, graph replay, of one commit."""
    ops = {"gemm_allreduce_signal": "all_reduce", "gemm_reducescatter_signal": "reduce_scatter"}
    out = []
    with open(path) as f:
        for line in f:
            if '_signal"' not in line:
                continue
            r = json.loads(line)
            if (r.get("op") in ops and r.get("commit") == commit and r.get("graph")
                    and r.get("partition") and r.get("impl", "").startswith("fused[")):
                out.append((ops[r["op"]], shape_name(r["shape"]), r["impl"][6:-1],
                            tuple(r["partition"]), r["median_ms"]))
    return out


if __name__ == "__main__":
    sys.exit(main())
