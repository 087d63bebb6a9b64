"""The README, the package and docs/ describe the library as it is (DESIGN.md): no numbered work
periods or runs ("session 5", "run 3", "(runs 6-7)") and no commit hashes in them. Provenance lives
in the result rows (each carries its commit) and in the logs' own READMEs under
benchmarks/results/, history in CHANGELOG.md; none of those is scanned here.

Paths are scanned like prose: log folders and files are named by date and what they hold
(``benchmarks/results/logs/2026-11-22-gemm-signal-tma/no-sm-reserve/bench_gemm_signal.log``), so
a figure's source can be cited without a work-period or run number."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT_SUFFIXES = (".py", ".md", ".txt", ".rst", ".toml", ".cfg", ".json", ".yaml", ".yml")


# "session 5", "Session 3", "session5", "2026-11-22-session5", "sessions 2-4"; "this session",
# "the previous session".
SESSION = re.compile(r"(?<![A-Za-z])sessions?\s*#?\s*\d+"
                     r"|\b(?:this|that|next|previous|last|earlier|later|same)\s+session\b",
                     re.IGNORECASE)
# "run 3", "runs 6-7", "runs 8 and 12", "(run 1)", "run #4", "Run 9": a run number. Not when the
# numbers count something ("runs 2 and 4 ranks", "run 8 programs"): see UNITS.
RUN = re.compile(r"\bruns?(?:\s+#?\s*|\s*#\s*)(\d+)"
                 r"((?:\s*(?:,|and|or|to|-|–|—|→|&)\s*\d+)*)(?!\.\d)"
                 r"(?:[\s-]+(\w+))?", re.IGNORECASE)
UNITS = {"rank", "ranks", "gpu", "gpus", "process", "processes", "step", "steps", "iteration",
         "iterations", "time", "times", "call", "calls", "layer", "layers", "program", "programs",
         "warp", "warps", "tile", "tiles", "shape", "shapes", "thread", "threads", "worker",
         "workers", "stream", "streams", "lane", "lanes", "piece", "pieces", "copy", "copies",
         "kernel", "kernels", "launch", "launches", "token", "tokens", "row", "rows", "group",
         "groups", "block", "blocks", "sm", "sms", "ms", "s", "us", "µs", "x", "×"}
# A run number glued to its word, as in a log name: "run3-checks.log", "run6/", "run{1,2,11}".
RUN_GLUED = re.compile(r"(?<![A-Za-z])runs?(?:\d+|\{\d)", re.IGNORECASE)
# A commit-like token: 7-40 lowercase hex characters with at least one digit and one letter, not
# part of a longer word or a hex literal (0x...), not a number like 1e5 (too short anyway).
HEX = re.compile(r"(?<![\w.])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w])")


def _files():
    out = [os.path.join(ROOT, "README.md")]
    for top in ("portable_overlap", "docs"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            out += [os.path.join(dirpath, f) for f in sorted(filenames)
                    if f.endswith(TEXT_SUFFIXES)]
    return out


def findings(text: str) -> list:
    """``(line number, what, line)`` for every diary mark in ``text``."""
    found = []
    for no, line in enumerate(text.splitlines(), 1):
        hits = [m.group(0) for m in SESSION.finditer(line)]
        hits += [m.group(0) for m in RUN.finditer(line)
                 if (m.group(3) or "").lower() not in UNITS]
        hits += [m.group(0) for m in RUN_GLUED.finditer(line)]
        hits += [m.group(0) for m in HEX.finditer(line)]
        found += [(no, h.strip(), line.strip()) for h in hits]
    return found


def test_patterns():
    diary = ["Status (2026-11-22, session 5): seven ops", "(5 shapes, session 5 run 1)",
             "measured 0.705 vs 0.764 ms (run 3)", "profiles of runs 8 and 12", "Run 9 (x8)",
             "session 3 runs 3–6, commits dea50e3, 94c50b8", "commit 8a3e5cf", "in this session",
             "(runs 6-7)", "run 4's sweep", "Session 3 changes", "in session5 the",
             "the folder 2026-11-22-session4 holds them", "`run3-*` logs",
             "logs in `logs/2026-11-22-session5/run1/bench_ag.log`",
             "`logs/2026-11-22-session2/run{1,2,11}-bench_a2a.log`",
             "`logs/2026-11-22-session3/`"]
    for s in diary:
        assert findings(s), s
    fine = ["runs 2 and 4 ranks", "runs on 2, 4 and 8 emulated ranks", "each run costs 0.5 s",
            "logs in `benchmarks/results/logs/2026-11-22-gemm-signal-tma/allgather-2d-ficco/bench_ag.log`",
            "`benchmarks/results/logs/2026-11-23-reliability/campaign-seed9/`", "v = 0x7fffffff12",
            "1000000", "run-to-run noise", "runs = [(0, W)]", "a run of 16 contiguous",
            "`benchmarks/runner.py`", "rerun 3 times", "prerun2",
            "the tests run 8 programs", "deadline: 1.7e-3", "sessionless",
            "CI runs 2-rank and 4-rank worlds", "each run takes 0.5 s"]
    for s in fine:
        assert not findings(s), (s, findings(s))


@pytest.mark.parametrize("path", _files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_no_diary(path):
    with open(path, encoding="utf-8") as f:
        found = findings(f.read())
    rel = os.path.relpath(path, ROOT)
    assert not found, "development history in %s (move it to CHANGELOG.md or the logs):\n%s" % (
        rel, "\n".join("  %s:%d: %r in: %s" % (rel, no, what, line) for no, what, line in found))
