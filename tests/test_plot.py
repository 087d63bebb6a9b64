"""benchmarks/plot.py: the reduction of result rows to speedups (latest row per impl, groups,
figures per op and per world) on synthetic rows, the tables, and the PNGs where matplotlib is
importable."""
import ast
import json
import os

import pytest

from benchmarks import plot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _row(op, impl, ms, world=2, graph=True, date="2026-01-02", dtype="bf16", device=None,
         **shape):
    shape = shape or {"M": 64, "N": 32, "K": 16, "K_local": 16 // world}
    return {"op": op, "shape": shape, "dtype": dtype, "world": world,
            "device": device or f"gpu-x{world}", "impl": impl, "graph": graph, "median_ms": ms,
            "p10_ms": ms, "p90_ms": ms, "date": date, "commit": "c"}


def _write(path, rows, extra_lines=()):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return str(path)


@pytest.fixture
def files(tmp_path):
    """Two files: world 2 (with an older and a newer date, a tie settled by position, rows that
    are not timings) and world 4 (another per-rank K_local, one shape only, no torch_fused)."""
    x2 = [
        _row("gemm", "fused", 3.0, date="2026-01-01"),       # older: replaced
        _row("gemm", "fused", 1.6, date="2026-01-03"),       # the newest date wins
        _row("gemm", "sequential", 2.0),
        _row("gemm", "compute", 1.2),
        _row("gemm", "comm", 0.8),
        _row("gemm", "torch_fused", 2.4),
        _row("gemm", "fused[p=8]", 1.5),
        _row("gemm", "sequential", 2.0, graph=False),
        _row("gemm", "fused", 2.5, graph=False),
        _row("gemm", "fused", 1.0, M=128, N=32, K=16, K_local=8),
        _row("gemm", "sequential", 1.5, M=128, N=32, K=16, K_local=8),
        _row("gemm", "sequential", 1.4, M=128, N=32, K=16, K_local=8),  # same date: later line
        _row("solo", "fused", 1.0),                           # nothing to compare with: left out
        _row("emb", "fused", 1.0, dtype="fp16", B=8, routing="zipf"),
        _row("emb", "sequential", 2.0, dtype="fp16", B=8, routing="zipf"),
        _row("emb", "fused", 1.0, dtype="fp32", B=8, routing="zipf"),
        _row("emb", "torch_fused", 1.5, dtype="fp32", B=8, routing="zipf"),
        {"op": "gemm_summary", "shape": {"M": 64}, "graph": True, "impl": "fused", "world": 2,
         "speedup": 9.0},
        {"op": "hbm_read", "shape": {}, "world": 2, "read_bandwidth_gbs": 4000.0},
    ]
    x4 = [
        _row("gemm", "fused", 1.0, world=4),
        _row("gemm", "sequential", 1.5, world=4),
        _row("gemm", "compute", 0.5, world=4),
        _row("gemm", "comm", 1.0, world=4),
        _row("gemm", "fused", 0.9, world=4, date="2026-01-03"),   # the newer date
        _row("gemm", "compute", 1.1),  # world 2, the same date as its row in x2: a later file
    ]
    a = _write(tmp_path / "x2.jsonl", x2, ["", "{not json"])
    b = _write(tmp_path / "x4.jsonl", x4)
    return [a, b]


def test_read_rows_and_shapes(files):
    rows = plot.read_rows(files)
    assert len(rows) == 25 and rows[0]["_pos"] == (0, 0) and rows[-1]["_pos"] == (1, 5)
    assert plot.layer_shape({"M": 1, "K_local": 2, "tables_per_rank": 3}) == {"M": 1}
    assert plot.shape_label({"S": 8, "H": 4, "routing": "zipf", "flag": True}) == \
        "8x4 zipf True"


def test_latest(files):
    groups = plot.latest(plot.read_rows(files))
    key2 = ("gemm", json.dumps({"K": 16, "M": 64, "N": 32}), "bf16", 2, "gpu-x2", True)
    assert groups[key2]["fused"]["median_ms"] == 1.6
    assert groups[key2]["compute"]["median_ms"] == 1.1
    key = ("gemm", json.dumps({"K": 16, "M": 128, "N": 32}), "bf16", 2, "gpu-x2", True)
    assert groups[key]["sequential"]["median_ms"] == 1.4
    key4 = ("gemm", json.dumps({"K": 16, "M": 64, "N": 32}), "bf16", 4, "gpu-x4", True)
    assert groups[key4]["fused"]["median_ms"] == 0.9
    assert not any(k[0].endswith("_summary") or k[0] == "hbm_read" for k in groups)


def test_reduce_rows(files):
    entries = plot.reduce_rows(plot.read_rows(files))
    got = {(e["op"], e["label"], e["dtype"], e["world"], e["graph"]): e for e in entries}
    assert set(got) == {("gemm", "64x32x16", "bf16", 2, True),
                        ("gemm", "64x32x16", "bf16", 2, False),
                        ("gemm", "128x32x16", "bf16", 2, True),
                        ("gemm", "64x32x16", "bf16", 4, True),
                        ("emb", "8 zipf", "fp16", 2, True), ("emb", "8 zipf", "fp32", 2, True)}
    e = got[("gemm", "64x32x16", "bf16", 2, True)]
    assert e["speedup"] == pytest.approx(2.0 / 1.6)
    assert e["speedup_vs_torch"] == pytest.approx(1.5)
    assert e["fraction_of_ideal"] == pytest.approx((2.0 - 1.6) / (2.0 - 1.1))
    assert e["times"]["fused[p=8]"] == 1.5 and e["date"] == "2026-01-03"
    assert e["shape"] == {"M": 64, "N": 32, "K": 16}  # the per-rank K_local left out
    plain = got[("gemm", "64x32x16", "bf16", 2, False)]
    assert plain["speedup"] == pytest.approx(0.8) and plain["fraction_of_ideal"] is None
    e4 = got[("gemm", "64x32x16", "bf16", 4, True)]
    assert e4["speedup"] == pytest.approx(1.5 / 0.9) and e4["speedup_vs_torch"] is None
    assert e4["fraction_of_ideal"] == pytest.approx((1.5 - 0.9) / (1.5 - 1.0))
    only_torch = got[("emb", "8 zipf", "fp32", 2, True)]
    assert only_torch["speedup"] is None and only_torch["speedup_vs_torch"] == 1.5
    # entries per op in the order their shapes first appear, worlds ascending
    gemm = [(e["label"], e["world"]) for e in entries if e["op"] == "gemm" and e["graph"]]
    assert gemm == [("64x32x16", 2), ("64x32x16", 4), ("128x32x16", 2)]


def test_figure_data(files):
    entries = plot.reduce_rows(plot.read_rows(files))
    d = plot.figure_data(entries, "gemm")
    assert d["categories"] == ["64x32x16", "128x32x16"]
    assert d["series"] == [(2, "gpu-x2"), (4, "gpu-x4")]
    assert d["values"]["speedup"][(4, "gpu-x4")][0] == pytest.approx(1.5 / 0.9)
    assert d["values"]["speedup"][(4, "gpu-x4")][1] is None  # world 4 did not run that shape
    assert d["values"]["speedup_vs_torch"][(2, "gpu-x2")] == [pytest.approx(1.5), None]
    assert d["panels"] == ["speedup", "speedup_vs_torch", "fraction_of_ideal"]
    emb = plot.figure_data(entries, "emb")  # two dtypes: the dtype names the category
    assert emb["categories"] == ["8 zipf fp16", "8 zipf fp32"]
    assert emb["panels"] == ["speedup", "speedup_vs_torch"]
    assert plot.figure_data(entries, "gemm", graph=False)["panels"] == ["speedup"]


def test_scaling_data(files, tmp_path):
    entries = plot.reduce_rows(plot.read_rows(files))
    s = plot.scaling_data(entries)
    # gemm: worlds 2 and 4 share one shape; emb: one series, one case with a speedup
    assert s["ops"] == ["emb", "gemm"] and s["cases"] == [1, 1]
    assert s["series"] == [(2, "gpu-x2"), (4, "gpu-x4")]
    assert s["values"][(2, "gpu-x2")] == [2.0, pytest.approx(2.0 / 1.6)]
    assert s["values"][(4, "gpu-x4")] == [None, pytest.approx(1.5 / 0.9)]
    # a series that shares no case with the others is dropped, not the op
    lone = _write(tmp_path / "x8.jsonl", [_row("gemm", "fused", 1.0, world=8, M=4096),
                                          _row("gemm", "sequential", 1.1, world=8, M=4096)])
    s = plot.scaling_data(plot.reduce_rows(plot.read_rows(files + [lone])))
    assert s["series"] == [(2, "gpu-x2"), (4, "gpu-x4")] and s["ops"] == ["emb", "gemm"]
    assert plot.geomean([1.0, 4.0, None]) == pytest.approx(2.0) and plot.geomean([]) is None


def test_tables_and_main(files, tmp_path, capsys):
    out = tmp_path / "plots"
    assert plot.main([*files, "--out", str(out), "--tables-only"]) == 0
    assert "6 groups" in capsys.readouterr().out
    lines = (out / "speedups.csv").read_text().splitlines()
    assert lines[0].split(",") == list(plot.TABLE_KEYS) and len(lines) == 7
    assert lines[1].startswith("emb,8 zipf,fp16,2,gpu-x2,graph,1.000,2.000,,,,2.000,,,")
    md = (out / "speedups.md").read_text()
    assert md.count("\n| gemm |") == 4 and "| 64x32x16 | bf16 | 4 | gpu-x4 | graph |" in md
    assert not list(out.glob("*.png"))


def test_reduction_needs_no_matplotlib():
    tree = ast.parse(open(os.path.join(ROOT, "benchmarks", "plot.py")).read())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top for a in n.names] + [n.module or "" for n in top
                                                      if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.startswith("matplotlib")]


def test_main_without_matplotlib_says_what_to_do(files, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises
    out = tmp_path / "plots"
    assert plot.main([*files, "--out", str(out)]) == 1
    assert "--tables-only" in capsys.readouterr().err
    assert (out / "speedups.md").exists() and not list(out.glob("*.png"))


def test_render(files, tmp_path):
    pytest.importorskip("matplotlib")
    entries = plot.reduce_rows(plot.read_rows(files))
    paths = plot.render(entries, str(tmp_path), dpi=40)
    assert sorted(os.path.basename(p) for p in paths) == ["emb.png", "gemm.png", "scaling.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert [os.path.basename(p) for p in plot.render(entries, str(tmp_path / "p"), graph=False,
                                                     dpi=40)] == ["gemm.png", "scaling.png"]
