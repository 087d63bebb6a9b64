"""The figures a benchmark reports, from median times in milliseconds (pure Python):

    speedup            = t_sequential / t_fused
    speedup over torch = t_torch_fused / t_fused
    ideal              = max(t_compute, t_comm)
    fraction of ideal  = (t_sequential - t_fused) / (t_sequential - ideal)

and the short text table the benchmarks print at the end of a run.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

#: the impl names with a role in the protocol; every other name is a named variant
ROLES = ("fused", "sequential", "compute", "comm", "torch_fused")


def _ok(t) -> bool:
    return t is not None and isinstance(t, (int, float)) and math.isfinite(t) and t > 0


def speedup(t_base: Optional[float], t_fused: Optional[float]) -> Optional[float]:
    """``t_base / t_fused``; None when either time is missing or not a positive number."""
    if not (_ok(t_base) and _ok(t_fused)):
        return None
    return t_base / t_fused


def ideal(t_compute: Optional[float], t_comm: Optional[float]) -> Optional[float]:
    """``max(t_compute, t_comm)``: the time of a perfect overlap; None when either is missing."""
    if not (_ok(t_compute) and _ok(t_comm)):
        return None
    return max(t_compute, t_comm)


def fraction_of_ideal(t_seq, t_fused, t_compute, t_comm) -> Optional[float]:
    """``(t_seq - t_fused) / (t_seq - max(t_compute, t_comm))``: 1 when the fused op reaches the
    perfect overlap, 0 when it is no faster than the sequential path, negative when slower.
    None when a time is missing or when ``t_seq <= ideal`` (nothing to hide: undefined)."""
    best = ideal(t_compute, t_comm)
    if best is None or not (_ok(t_seq) and _ok(t_fused)) or t_seq <= best:
        return None
    return (t_seq - t_fused) / (t_seq - best)


def summarize(times: Mapping[str, float], impl: str = "fused") -> dict:
    """The figures of ``impl`` against the roles in ``times`` ({impl name: median ms}):
    ``{impl}_ms`` as ``fused_ms``, ``sequential_ms``, ``compute_ms``, ``comm_ms``,
    ``torch_fused_ms``, ``ideal_ms``, ``speedup``, ``speedup_vs_torch``, ``fraction_of_ideal``;
    a value is None where its inputs are missing."""
    t = {k: (v if _ok(v) else None) for k, v in times.items()}
    f, s, c, m, tf = (t.get(impl), t.get("sequential"), t.get("compute"), t.get("comm"),
                      t.get("torch_fused"))
    return {"fused_ms": f, "sequential_ms": s, "compute_ms": c, "comm_ms": m,
            "torch_fused_ms": tf, "ideal_ms": ideal(c, m), "speedup": speedup(s, f),
            "speedup_vs_torch": speedup(tf, f), "fraction_of_ideal": fraction_of_ideal(s, f, c, m)}


def rounded(d: Mapping, digits: int = 5) -> dict:
    """``d`` with its floats rounded to ``digits`` decimals (for result rows)."""
    return {k: round(v, digits) if isinstance(v, float) and math.isfinite(v) else v
            for k, v in d.items()}


def _cell(x, spec: str, width: int) -> str:
    if not isinstance(x, (int, float)) or not math.isfinite(x):
        return "-".rjust(width)
    return format(x, spec).rjust(width)


def format_table(records: Sequence[Mapping]) -> list:
    """Lines of the end-of-run table. Each record: ``label`` (the case), ``graph`` (bool),
    ``times`` ({impl: ms}), optional ``ok`` (True / False / None: not checked) and ``notes``
    ({name: number or text}, printed after the figures). One line per record with the roles,
    ``speedup``, ``frac`` (fraction of ideal) and ``vs torch``; then one indented line per
    named variant with its time and its speedup over the sequential path."""
    width = max([len(str(r["label"])) for r in records] + [4])
    head = (f"{'case':>{width}} g {'fused':>8} {'seq':>8} {'compute':>8} {'comm':>8} "
            f"{'torch':>8} {'speedup':>7} {'frac':>6} {'vs torch':>8} {'ok':>3}")
    lines = ["ms, slowest rank's median; g: P plain launches, G CUDA-graph replay; speedup = "
             "seq / fused; frac = (seq - fused) / (seq - max(compute, comm)); vs torch = "
             "torch_fused / fused", head]
    for r in records:
        t = r["times"]
        s = summarize(t)
        ok = {True: "yes", False: "NO"}.get(r.get("ok"), "-")
        line = (f"{r['label']:>{width}} {'G' if r['graph'] else 'P'} "
                + " ".join(_cell(t.get(n), ".3f", 8) for n in ROLES)
                + f" {_cell(s['speedup'], '.2f', 7)} {_cell(s['fraction_of_ideal'], '.2f', 6)}"
                f" {_cell(s['speedup_vs_torch'], '.2f', 8)} {ok:>3}")
        notes = r.get("notes") or {}
        if notes:
            line += "  " + " ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                    for k, v in notes.items())
        lines.append(line)
        for name in [n for n in t if n not in ROLES]:
            lines.append(f"{'':>{width}} {'G' if r['graph'] else 'P'}   {name}: "
                         f"{_cell(t[name], '.3f', 0).strip()} ms, speedup "
                         f"{_cell(speedup(t.get('sequential'), t[name]), '.2f', 0).strip()}")
    return lines
