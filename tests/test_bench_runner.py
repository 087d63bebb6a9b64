"""The benchmarks' shared command line, rows, figures and check-then-time loop (benchmarks/cli.py,
rows.py, metrics.py, runner.py), without a GPU: the timer is replaced by a fake one."""
import importlib
import json
import os
import re

import pytest

from benchmarks import cli, metrics, rows, runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "benchmarks"))
                 if f.startswith("bench_") and f.endswith(".py"))


# --- command line ---------------------------------------------------------------------------

def test_parse_shapes():
    assert cli.parse_shapes("8192x8192x4096,16384x7168x2048", ("M", "N", "K")) == [
        {"M": 8192, "N": 8192, "K": 4096}, {"M": 16384, "N": 7168, "K": 2048}]
    assert cli.parse_shapes(" 2×3X4 ,", "MNK") == [{"M": 2, "N": 3, "K": 4}]
    assert cli.parse_shapes("", "MNK") == []
    for bad, why in [("8x8", "expected 3 sizes MxNxK"), ("8x8xk", "integers"),
                     ("8x0x8", "positive")]:
        with pytest.raises(ValueError, match=why):
            cli.parse_shapes(bad, "MNK")


def test_format_shape():
    shape = {"S": 8192, "H": 2048, "k": 2, "routing": "zipf", "K_local": 7}
    assert cli.format_shape(shape, ("S", "H", "k", "routing")) == "8192x2048x2 zipf"
    assert cli.format_shape({"M": 1, "N": 2}) == "1x2"


def test_parse_lists():
    assert cli.parse_ints("2,4,,8") == [2, 4, 8]
    assert cli.parse_dtypes("bf16,fp16", ("bf16", "fp16")) == ["bf16", "fp16"]
    with pytest.raises(ValueError, match="takes bf16"):
        cli.parse_dtypes("fp32", ("bf16",))
    with pytest.raises(ValueError):
        cli.parse_dtypes("", ("bf16",))
    assert cli.parse_graph_modes("0,1") == (False, True)
    assert cli.parse_graph_modes("graph,plain,graph") == (True, False)
    assert cli.parse_graph_modes("both") == (False, True)
    with pytest.raises(ValueError, match="plain / graph"):
        cli.parse_graph_modes("replay")


def _parser(**kw):
    kw = {"dims": ("M", "N", "K"), "shapes": [(1, 2, 3), (4, 5, 6)], **kw}
    return cli.BenchParser("a benchmark", **kw)


def test_parser_defaults_and_overrides(tmp_path):
    ns = _parser(iters=60, warmup=5).parse_args(["--out", str(tmp_path / "r.jsonl")])
    assert ns.shapes == [{"M": 1, "N": 2, "K": 3}, {"M": 4, "N": 5, "K": 6}]
    assert (ns.dtypes, ns.graphs, ns.worlds, ns.check) == (["bf16"], (False, True), None, True)
    assert (ns.iters, ns.warmup, ns.out) == (60, 5, str(tmp_path / "r.jsonl"))
    ns = _parser(allowed_dtypes=("bf16", "fp16")).parse_args(
        ["--out", str(tmp_path) + "/", "--device-kind", "gpu-x2", "--shapes", "7x8x9",
         "--dtypes", "fp16", "--worlds", "2,4", "--no-plain", "--no-check", "--iters", "53"])
    assert ns.shapes == [{"M": 7, "N": 8, "K": 9}] and ns.dtypes == ["fp16"]
    assert ns.graphs == (True,) and ns.worlds == [2, 4] and not ns.check and ns.iters == 53
    assert ns.out == os.path.join(str(tmp_path), "gpu-x2.jsonl")
    # the forms the scripts took before they shared this parser still parse
    assert _parser().parse_args(["--out", "x", "--graph", "1"]).graphs == (True,)
    assert _parser().parse_args(["--out", "x", "--no-graph"]).graphs == (False,)
    assert _parser(graphs=(True,)).parse_args(["--out", "x"]).graphs == (True,)
    # --impls: names whose brackets hold commas stay whole
    ns = _parser().parse_args(["--out", "x", "--impls", "fused[stores,senders=16],auto,,seq"])
    assert ns.impls == ("fused[stores,senders=16]", "auto", "seq")


def test_parser_errors(tmp_path, capsys):
    for argv in (["--shapes", "1x2"], ["--dtypes", "fp32"], ["--no-graph", "--no-plain"],
                 ["--graph", "x"], []):
        with pytest.raises(SystemExit) as e:
            _parser().parse_args(["--out", "x", *argv] if argv else argv)
        assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "MxNxK,... (default: 1x2x3,4x5x6)" in out and "--worlds" in out


@pytest.mark.parametrize("argv, why", [
    (["--iters", "0"], "--iters 0: must be at least 50"),
    (["--iters", "-3"], "--iters -3: must be at least 50"),
    # the protocol's median is of at least 50 runs: a row of 10 looked like any other
    (["--iters", "49"], "--iters 49: must be at least 50"),
    (["--warmup", "-1"], "--warmup -1: must be at least 0"),
    (["--rounds", "0"], "--rounds 0: must be at least 1"),
    (["--worlds", "2,x"], "--worlds '2,x': a comma list of integers >= 1"),
    (["--worlds", "0"], "--worlds '0': a comma list of integers >= 1"),
    (["--shapes", "8192x"], "shape '8192x': expected 3 sizes"),
    (["--shapes", "0x5x5"], "sizes must be positive"),
    (["--shapes=-8x5x5"], "sizes must be positive"),
    (["--out", ""], "--out '': give a results file or a folder"),
    (["--device-kind", ""], "--device-kind '': a non-empty name"),
    (["--device-kind", "../x"], "--device-kind '../x': a non-empty name without '/'"),
])
def test_parser_refuses_counts_and_lists_out_of_range(argv, why, capsys):
    """--iters 0 timed no run: every impl's median raised, no row was written, exit 0."""
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["--out", "x", *argv])  # (a later --out overrides this one)
    assert e.value.code == 2
    assert why in capsys.readouterr().err


# (script, its comma-list option of names): a name outside the list ran as the script's last
# case (a routing not "zipf" is balanced, a dist not "uniform" is Zipf) under the name given
CHOICE_FLAGS = [("bench_moe_combine", "--routings"), ("bench_moe_dispatch", "--routings"),
                ("bench_moe_layer", "--routings"), ("bench_embedding_alltoall", "--dists"),
                ("bench_matmul_reduce", "--modes"), ("bench_gemm_signal", "--ops"),
                ("bench_wave_predictor", "--ops")]


@pytest.mark.parametrize("name, flag", CHOICE_FLAGS)
def test_script_lists_refuse_unknown_names(name, flag, capsys):
    ap = importlib.import_module(f"benchmarks.{name}").parser()
    ap.parse_args(["--out", "x"])  # the defaults pass
    with pytest.raises(SystemExit) as e:
        ap.parse_args(["--out", "x", flag, "zipf,uniform,balanced,all_reduce,bogus"])
    assert e.value.code == 2
    assert f"{flag} ['" in capsys.readouterr().err


@pytest.mark.parametrize("name, argv", [
    ("bench_matmul_reduce", ["--pieces", ""]),  # (its body indexes the first of each)
    ("bench_matmul_reduce", ["--put-lanes", "0,x"]),
    ("bench_matmul_reduce", ["--pieces", "0"]),
    ("bench_gemm_alltoall", ["--pieces", "4,x"]),
    ("bench_gemm_alltoall", ["--pieces", "-2"]),
    ("bench_gemm_signal", ["--reserves", "8,x"]),
    ("bench_gemm_signal", ["--comm-ctas", "0"]),
    ("bench_gemm_signal", ["--sweep-shape", ""]),
    ("bench_gemm_signal", ["--sweep-shape", "8x8"]),
    ("bench_gemm_signal", ["--sweep-shape", "8x8x8,16x16x16"]),
    ("bench_moe_layer", ["--senders", "16,sixty-four"]),
])
def test_script_numbers_are_checked_at_parse_time(name, argv, capsys):
    """These lists were split once the world was up: an IndexError or int()'s ValueError after
    the launch."""
    ap = importlib.import_module(f"benchmarks.{name}").parser()
    with pytest.raises(SystemExit) as e:
        ap.parse_args(["--out", "x", *argv])
    assert e.value.code == 2
    assert f"argument {argv[0]}:" in capsys.readouterr().err


def test_device_kind_default(monkeypatch):
    monkeypatch.setenv("PO_DEVICE_KIND", "nvidia-h200-x4")
    assert _parser().parse_args(["--out", "r.jsonl"]).device_kind == "nvidia-h200-x4"


def test_worlds_and_launch():
    assert cli.launched_world_size({}) is None
    assert cli.launched_world_size({"WORLD_SIZE": "4", "RANK": "1"}) == 4
    assert cli.launched_world_size({"OMPI_COMM_WORLD_SIZE": "8"}) == 8
    assert cli.launch_plan([2, 4, 8], 4) == ([2, 4], [8])
    cmd = cli.torchrun_command("benchmarks/b.py", ["--out", "r"], 4, 29517)
    assert cmd[1:] == ["-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
                       "29517", "benchmarks/b.py", "--out", "r"]
    # a benchmark started as a module (``python -m benchmarks.b``) starts its ranks as one
    cmd = cli.torchrun_command(["-m", "benchmarks.b"], ["--out", "r"], 2, 29517)
    assert cmd[7:] == ["-m", "benchmarks.b", "--out", "r"]


# --- rows -----------------------------------------------------------------------------------

def test_rows(tmp_path, monkeypatch):
    row = rows.make_row("op", world=2, device="d", date="2026-01-02", commit="c",
                        shape={"M": 1}, dtype="bf16", impl="fused", graph=True, median_ms=1.0)
    assert list(row) == ["op", "shape", "dtype", "world", "device", "impl", "graph",
                         "median_ms", "date", "commit"]
    hbm = rows.make_row("hbm", world=1, device="d", date="x", commit="c")
    assert hbm["shape"] == {} and hbm["dtype"] is None
    assert rows.git_commit({"PO_COMMIT": "abc1234"}) == "abc1234"
    assert rows.git_commit({}, cwd=str(tmp_path)) == "unknown"  # not a git work tree
    assert rows.results_path(str(tmp_path), "k") == os.path.join(str(tmp_path), "k.jsonl")
    assert rows.results_path("a/b.jsonl", "k") == "a/b.jsonl"
    monkeypatch.setenv("PO_COMMIT", "feed123")
    w = rows.ResultWriter(str(tmp_path / "sub") + "/", "kind", 4)
    w.write(op="x", shape={"M": 2}, dtype="fp16", impl="fused", median_ms=0.5)
    (got,) = [json.loads(ln) for ln in open(tmp_path / "sub" / "kind.jsonl")]
    assert got["world"] == 4 and got["device"] == "kind" and got["commit"] == "feed123"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", got["date"])
    assert w.row(op="y", date="2020-01-01")["date"] == "2020-01-01"


# --- figures and the table ------------------------------------------------------------------

def test_metrics():
    assert metrics.speedup(2.0, 1.0) == 2.0
    assert metrics.speedup(None, 1.0) is None and metrics.speedup(1.0, 0.0) is None
    assert metrics.speedup(float("nan"), 1.0) is None
    assert metrics.ideal(1.0, 3.0) == 3.0 and metrics.ideal(1.0, None) is None
    # seq 5, ideal max(3, 2) = 3: fused 4 hides half of what can be hidden
    assert metrics.fraction_of_ideal(5.0, 4.0, 3.0, 2.0) == pytest.approx(0.5)
    assert metrics.fraction_of_ideal(5.0, 6.0, 3.0, 2.0) == pytest.approx(-0.5)
    assert metrics.fraction_of_ideal(3.0, 2.0, 3.0, 2.0) is None  # nothing to hide
    assert metrics.fraction_of_ideal(5.0, 4.0, None, 2.0) is None
    s = metrics.summarize({"fused": 4.0, "sequential": 5.0, "compute": 3.0, "comm": 2.0,
                           "torch_fused": 6.0, "fused[x]": 2.5})
    assert s == {"fused_ms": 4.0, "sequential_ms": 5.0, "compute_ms": 3.0, "comm_ms": 2.0,
                 "torch_fused_ms": 6.0, "ideal_ms": 3.0, "speedup": 1.25,
                 "speedup_vs_torch": 1.5, "fraction_of_ideal": 0.5}
    assert metrics.summarize({"fused[x]": 2.5, "sequential": 5.0}, "fused[x]")["speedup"] == 2.0
    assert metrics.summarize({"fused": 1.0})["speedup"] is None
    assert metrics.rounded({"a": 1.234567, "b": "x", "c": None, "d": float("inf")}, 2) == {
        "a": 1.23, "b": "x", "c": None, "d": float("inf")}


def test_format_table():
    lines = metrics.format_table([
        {"label": "8192x8192x8192", "graph": True, "ok": True, "notes": {"pick": "1d", "f": 0.5},
         "times": {"fused": 4.0, "sequential": 5.0, "compute": 3.0, "comm": 2.0,
                   "fused[p=8]": 2.5}},
        {"label": "1x2x3", "graph": False, "ok": False, "times": {"fused": 1.0}}])
    assert lines[1].split() == ["case", "g", "fused", "seq", "compute", "comm", "torch",
                                "speedup", "frac", "vs", "torch", "ok"]
    assert lines[2].split() == ["8192x8192x8192", "G", "4.000", "5.000", "3.000", "2.000", "-",
                                "1.25", "0.50", "-", "yes", "pick", "1d", "f", "0.5"]
    assert lines[3].split() == ["G", "fused[p=8]:", "2.500", "ms,", "speedup", "2.00"]
    assert lines[4].split()[:3] == ["1x2x3", "P", "1.000"] and lines[4].split()[-1] == "NO"


# --- the loop, with a fake world and timer --------------------------------------------------

class FakeWorld:
    rank, world_size, device = 0, 1, "cpu"

    def all_gather_object(self, x):
        return [x]

    def broadcast_object(self, x):
        return x


@pytest.fixture
def timed(monkeypatch):
    """``time_op`` replaced: impl callables return their 'median' in ms (or raise)."""
    import benchmarks.harness as harness

    calls = []

    def fake_time_op(fn, world, *, graph, iters, warmup, barrier):
        calls.append((graph, iters, warmup, barrier))
        t = fn() * (0.5 if graph else 1.0)
        return {"median_ms": t, "p10_ms": t * 0.9, "p90_ms": t * 1.1}

    monkeypatch.setattr(harness, "time_op", fake_time_op)
    return calls


def _bench(tmp_path, *argv):
    args = _parser().parse_args(["--out", str(tmp_path / "r.jsonl"), "--device-kind", "k",
                                 *argv])
    return runner.Bench(args, FakeWorld())


def _rows(tmp_path):
    return [json.loads(ln) for ln in open(tmp_path / "r.jsonl")]


def test_run_checks_times_writes(tmp_path, timed, capsys, monkeypatch):
    monkeypatch.setenv("PO_COMMIT", "c0ffee1")
    bench = _bench(tmp_path, "--iters", "57", "--warmup", "2")
    checked = []

    def check(name):
        checked.append(name)
        if name == "fused[broken]":
            raise RuntimeError("boom")
        return {"fused": 1e-3, "fused[wrong]": 0.5, "fused[ok]": 0.0}[name]

    def fail():
        raise RuntimeError("no graph here")

    impls = {"fused": lambda: 4.0, "fused[wrong]": lambda: 1.0, "fused[broken]": lambda: 1.0,
             "fused[ok]": lambda: 3.0, "sequential": lambda: 5.0, "compute": lambda: 3.0,
             "comm": lambda: 2.0, "torch_fused": fail}
    times = bench.run(runner.Case(
        op="op", shape={"M": 1, "N": 2, "K": 3}, dtype="bf16", impls=impls, check=check,
        fields=lambda name: {"extra": name}, notes={"pick": "x"},
        derive=lambda t: {"fused_over_comm": t["fused"] / t["comm"]}))
    assert checked == ["fused", "fused[wrong]", "fused[broken]", "fused[ok]"]
    # wrong and failing impls are not timed; the one that fails to time is left out
    assert set(times) == {(n, g) for n in ("fused", "fused[ok]", "sequential", "compute", "comm")
                          for g in (False, True)}
    assert times[("fused", True)] == 2.0 and times[("fused", False)] == 4.0
    assert timed[0] == (False, 57, 2, "device")
    got = _rows(tmp_path)
    timed_rows = [r for r in got if r["op"] == "op"]
    assert len(timed_rows) == 10
    r = timed_rows[0]
    assert list(r)[:7] == ["op", "shape", "dtype", "world", "device", "impl", "graph"]
    assert (r["impl"], r["graph"], r["correct"], r["rel_err"], r["extra"]) == \
        ("fused", False, True, 1e-3, "fused")
    assert (r["median_ms"], r["commit"], r["device"], r["world"]) == (4.0, "c0ffee1", "k", 1)
    assert r["barrier"] == "device"
    assert {"p10_ms", "p90_ms", "date"} <= set(r)
    seq = next(x for x in timed_rows if x["impl"] == "sequential")
    assert seq["correct"] is None and seq["rel_err"] is None
    summary = [r for r in got if r["op"] == "op_summary"]
    assert [s["graph"] for s in summary] == [False, True]
    assert summary[1]["speedup"] == 1.25 and summary[1]["fraction_of_ideal"] == 0.5
    assert summary[1]["pick"] == "x" and summary[1]["fused_over_comm"] == 2.0
    assert summary[1]["impl"] == "fused" and "median_ms" not in summary[1]
    out = capsys.readouterr().out
    assert "fused[wrong] 5.0e-01 WRONG: not timed" in out and "fused[broken] inf" in out
    assert "torch_fused graph=False failed: RuntimeError: no graph here" in out
    bench.print_table()
    assert "speedup = seq / fused" in capsys.readouterr().out


def test_run_without_checks_and_one_mode(tmp_path, timed):
    bench = _bench(tmp_path, "--no-check", "--graph", "graph", "--barrier", "host")
    bench.run(runner.Case(op="op", shape={"M": 1, "N": 1, "K": 1}, dtype="bf16",
                          impls={"fused": lambda: 1.0, "fused[v]": lambda: 2.0,
                                 "sequential": lambda: 3.0},
                          check=lambda name: float("inf"), summarize=("fused", "fused[v]")))
    got = _rows(tmp_path)
    assert [(r["impl"], r["graph"]) for r in got if r["op"] == "op"] == [
        ("fused", True), ("fused[v]", True), ("sequential", True)]
    # the host barrier reaches the timer and the rows
    assert {c[3] for c in timed} == {"host"}
    assert {r["barrier"] for r in got if r["op"] == "op"} == {"host"}
    assert [(r["impl"], r["speedup"]) for r in got if r["op"] == "op_summary"] == [
        ("fused", 3.0), ("fused[v]", 1.5)]
    assert bench.records[0]["ok"] is None


def test_impls_that_no_case_has_are_named_and_fail_the_run(tmp_path, timed, capsys,
                                                           monkeypatch):
    """A typo in --impls filtered every impl out of every case: nothing timed, exit 0."""
    for var in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    import portable_overlap

    monkeypatch.setattr(portable_overlap.World, "from_env", staticmethod(lambda: FakeWorld()))

    def body(bench):
        bench.run(runner.Case(op="op", shape={"M": 1, "N": 1, "K": 1}, dtype="bf16",
                              impls={"fused": lambda: 1.0, "sequential": lambda: 2.0}))

    argv = ["--out", str(tmp_path / "r.jsonl"), "--no-check", "--impls", "fused,sequentail"]
    assert runner.run_main(_parser(), body, argv) == 2
    out = capsys.readouterr().out
    assert "--impls sequentail not among this case's impls (fused, sequential)" in out
    assert "--impls sequentail: no case has an impl of that name" in out
    assert [r["impl"] for r in _rows(tmp_path)] == ["fused", "fused"]  # what matched still ran
    argv[-1] = "fused,sequential"
    assert runner.run_main(_parser(), body, argv) == 0


def test_a_wrong_or_untimed_impl_fails_the_run(tmp_path, timed, capsys, monkeypatch):
    """An impl that failed its check, or whose timing raised, was printed and the run exited
    0: a benchmark in CI or a reviewer's script took a wrong result for a pass."""
    for var in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    import portable_overlap

    monkeypatch.setattr(portable_overlap.World, "from_env", staticmethod(lambda: FakeWorld()))

    def fail():
        raise RuntimeError("no event here")

    def body_of(check, timed_ok=True):
        def body(bench):
            bench.run(runner.Case(op="op", shape={"M": 1, "N": 1, "K": 1}, dtype="bf16",
                                  impls={"fused": lambda: 1.0,
                                         "sequential": (lambda: 2.0) if timed_ok else fail},
                                  check=check))
        return body

    argv = ["--out", str(tmp_path / "r.jsonl")]
    assert runner.run_main(_parser(), body_of(lambda n: 0.0), argv) == 0
    assert runner.run_main(_parser(), body_of(lambda n: 0.5), argv) == 1
    assert "FAILED: 1 impl(s)" in capsys.readouterr().out
    assert runner.run_main(_parser(), body_of(lambda n: float("nan")), argv) == 1
    assert runner.run_main(_parser(), body_of(lambda n: 0.0, timed_ok=False), argv) == 1
    out = capsys.readouterr().out
    assert "sequential graph=False not timed" in out and "sequential graph=True not timed" in out


def test_a_world_without_gpus_is_refused_up_front(tmp_path, monkeypatch, capsys):
    for var in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    import portable_overlap

    class CpuWorld(FakeWorld):
        class backend:
            name = "cpu"

    monkeypatch.setattr(portable_overlap.World, "from_env", staticmethod(lambda: CpuWorld()))
    ran = []
    assert runner.run_main(_parser(), ran.append, ["--out", str(tmp_path / "r.jsonl")]) == 2
    assert ran == [] and "run them on a GPU machine" in capsys.readouterr().out
    monkeypatch.setattr(cli, "launch_plan", lambda worlds, n: ([], list(worlds)))
    # (2, as without GPUs: `--worlds 2` on a machine without GPUs exited 1, a wrong result's
    # code)
    assert cli.launch("script.py", [], [2, 4]) == 2
    assert "nothing was run" in capsys.readouterr().out


def test_a_shape_the_world_does_not_divide_is_refused_naming_it(tmp_path, monkeypatch,
                                                                capsys):
    """A split size that the world does not divide ran another shape than asked (``M // W``)
    or failed deep inside, exit 0."""
    for var in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    import portable_overlap

    class TwoRanks(FakeWorld):
        world_size = 2

    monkeypatch.setattr(portable_overlap.World, "from_env", staticmethod(lambda: TwoRanks()))
    ran = []
    parser = _parser(split_dims=("M", "K"))
    assert "M, K must divide by the world size" in parser.format_help()
    argv = ["--out", str(tmp_path / "r.jsonl"), "--shapes", "4x5x6,3x4x4"]
    assert runner.run_main(parser, ran.append, argv) == 2
    out = capsys.readouterr().out
    assert ran == [] and "3x4x4: M=3" in out and "world size 2" in out
    argv[-1] = "4x5x6,2x3x2"
    assert runner.run_main(parser, ran.append, argv) == 0 and len(ran) == 1


def test_rel_err():
    torch = pytest.importorskip("torch")
    ref = torch.ones(4)
    assert runner.rel_err(ref * 1.5, ref) == pytest.approx(0.5)
    assert runner.rel_err(torch.full((4,), float("nan")), ref) == float("inf")
    assert runner.torch_dtype("bf16") == torch.bfloat16


def test_run_main_skips_or_launches(tmp_path, monkeypatch, capsys):
    ran = []
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    argv = ["--out", str(tmp_path / "r.jsonl"), "--worlds", "2,8"]
    assert runner.run_main(_parser(), ran.append, argv) == 0
    assert "skipping: world size 4 is not in --worlds 2,8" in capsys.readouterr().out
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    launched = []
    monkeypatch.setattr(cli, "launch", lambda script, a, worlds: launched.append((a, worlds)) or 3)
    assert runner.run_main(_parser(), ran.append, argv) == 3
    assert launched == [(argv, [2, 8])] and ran == []


# --- every benchmark script -----------------------------------------------------------------

@pytest.mark.parametrize("name", SCRIPTS)
def test_script_uses_the_shared_cli(name, tmp_path, capsys):
    """Each bench_*.py builds its parser from BenchParser (nothing re-declared), parses its
    defaults and prints --help without a GPU, and runs through run_main."""
    src = open(os.path.join(ROOT, "benchmarks", name + ".py")).read()
    for flag in ("--out", "--device-kind", "--shapes", "--iters", "--warmup", "--dtypes",
                 "--no-graph", "--no-plain", "--graph", "--worlds"):
        assert f'add_argument("{flag}"' not in src, (name, flag)
    assert "import argparse" not in src and "ResultWriter(" not in src
    assert "run_main(parser(), body)" in src
    mod = importlib.import_module(f"benchmarks.{name}")
    ap = mod.parser()
    assert isinstance(ap, cli.BenchParser)
    ns = ap.parse_args(["--out", str(tmp_path / "r.jsonl")])
    assert ns.shapes and all(set(s) == set(ap.dims) for s in ns.shapes)
    # (bench_allgather_gemm and bench_moe_layer took the median of 30 by default)
    assert ns.iters >= 50  # the protocol's median is of at least 50 runs
    with pytest.raises(SystemExit) as e:
        ap.parse_args(["--help"])
    assert e.value.code == 0 and "shared benchmark options" in capsys.readouterr().out


def test_ci_invocations_parse(tmp_path):
    """The flags ci/gpu.sh passes to each benchmark (and those of its bash arrays) are accepted
    by the benchmark's parser."""
    text = open(os.path.join(ROOT, "ci", "gpu.sh")).read().replace("\\\n", " ")
    arrays = {"bench_gemv_allreduce": ["--tune"], "bench_embedding_alltoall": ["--sweep"]}
    seen = set()
    for m in re.finditer(r"benchmarks/(bench_\w+)\.py (.*?)2>&1", text):
        name, tokens = m.group(1), m.group(2).split()
        argv, skip = [], False
        for t in tokens:
            if skip:
                skip = False
            elif t in ("--out", "--device-kind"):
                argv += [t, str(tmp_path / "r.jsonl") if t == "--out" else "kind"]
                skip = True
            elif not t.startswith(("$", '"$')):  # shell expansions: not known here
                argv.append(t)
        ns = importlib.import_module(f"benchmarks.{name}").parser().parse_args(
            argv + arrays.get(name, []))
        assert ns.out == str(tmp_path / "r.jsonl")
        seen.add(name)
    assert seen == set(SCRIPTS)


def test_scaleup_defaults_parse(tmp_path):
    """The benchmark arguments ci/scaleup.sh sets by default (through gpu.sh's PO_*_ARGS) are
    accepted by the benchmarks they reach, and it has a case for each of its parts."""
    text = open(os.path.join(ROOT, "ci", "scaleup.sh")).read()
    gpu = open(os.path.join(ROOT, "ci", "gpu.sh")).read().replace("\\\n", " ")
    defaults = re.findall(r"export (PO_\w+_ARGS)=\$\{\1:-(.*?)\}\n", text)
    assert defaults
    for var, argv in defaults:
        name = re.search(r"benchmarks/(bench_\w+)\.py [^\n]*\$\{" + var, gpu).group(1)
        importlib.import_module(f"benchmarks.{name}").parser().parse_args(
            ["--out", str(tmp_path / "r.jsonl")] + argv.split())
    for part in ("checks", "ops", "gemv", "moe", "moe-layer", "embedding", "rest"):
        assert re.search(rf"\n  {part}\)[ \n]", text), part


def test_scaleup_turns_off_every_section_of_gpu_sh():
    """ci/scaleup.sh turns every section of ci/gpu.sh off before a part turns its own on: a
    section missing from its list runs in every part (the 900 s layout checks did, after the
    sections of a part, until the device call's limit stopped it)."""
    text = open(os.path.join(ROOT, "ci", "scaleup.sh")).read()
    gpu = open(os.path.join(ROOT, "ci", "gpu.sh")).read()
    listed = set(re.search(r"skip_all=\((.*?)\)", text, re.S).group(1).split())
    # (the sections' own switches: those inside a section, e.g. PO_SKIP_SIG_BENCH, go with it)
    read = set(re.findall(r"^if \[ \"\$\{(PO_SKIP_\w+):-0\}\"", gpu, re.M))
    assert read and read <= listed, sorted(read - listed)
    assert "PO_PACK=" in text and "PO_PACK" in gpu


# what each part of ci/scaleup.sh runs: the scripts its torchrun sections start
SCALEUP_PARTS = {
    "checks": ["tests/gpu/gpu_checks.py"],
    "checks-ops": ["tests/gpu/gpu_checks.py"],
    "checks-moe": ["tests/gpu/gpu_checks.py"],
    "checks-rest": ["tests/gpu/gpu_checks.py"],
    "ops": ["tests/gpu/check_torch_fused.py", "benchmarks/bench_allgather_gemm.py",
            "benchmarks/bench_matmul_reduce.py"],
    "gemv": ["benchmarks/bench_gemv_allreduce.py", "tests/gpu/check_auto_transport.py"],
    "moe": ["benchmarks/bench_moe_combine.py", "benchmarks/bench_moe_dispatch.py",
            "examples/moe/moe_layer.py", "examples/transformer/prefill.py"],
    "moe-layer": ["benchmarks/bench_moe_layer.py"],
    "embedding": ["benchmarks/bench_gemm_alltoall.py", "tests/gpu/check_embedding_alltoall.py",
                  "benchmarks/bench_embedding_alltoall.py", "examples/dlrm/train.py"],
    "rest": ["tests/gpu/check_language.py", "benchmarks/bench_tutorials.py",
             "tests/gpu/check_campaign.py"],
}


@pytest.mark.parametrize("part", sorted(SCALEUP_PARTS))
def test_scaleup_part_runs_its_sections_and_packs_them(part, tmp_path):
    """Each part of ci/scaleup.sh, with torchrun, nvidia-smi and python3 stood in for (they
    record their arguments): the part starts its own scripts, in order, and no other, and
    OUTDIR.tgz holds OUTDIR's logs."""
    import subprocess
    import tarfile
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    calls = tmp_path / "calls.txt"
    for tool in ("torchrun", "python3", "nvidia-smi"):
        (bin_ / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> "{calls}"\n')
        (bin_ / tool).chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "PO_DEVICE_KIND": "kind"}
    done = subprocess.run(["bash", os.path.join(ROOT, "ci", "scaleup.sh"), part, str(out), "8"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    started = [next(t for t in line.split() if t.endswith(".py"))
               for line in calls.read_text().splitlines() if line.startswith("torchrun")]
    assert started == SCALEUP_PARTS[part], started
    with tarfile.open(f"{out}.tgz") as tar:
        assert "out/timing.txt" in tar.getnames()


def test_rounds_rotate_the_order_and_keep_the_median_round(tmp_path, timed):
    """``--rounds 3``: every impl timed in each of three rounds, the order rotated each round
    (a fixed order favours the impls timed first on a GPU whose clock drifts), and each impl's
    row is its round with the median median."""
    order = []
    clock = iter([9.0, 1.0, 5.0, 2.0, 8.0, 3.0])  # what each timing returns, in call order

    def impl(name):
        def run():
            order.append(name)
            return next(clock)
        return run

    bench = _bench(tmp_path, "--no-check", "--graph", "graph", "--rounds", "3")
    times = bench.run(runner.Case(op="op", shape={"M": 1, "N": 1, "K": 1}, dtype="bf16",
                                  impls={"fused": impl("fused"), "sequential": impl("sequential")},
                                  check=None))
    assert order == ["fused", "sequential", "sequential", "fused", "fused", "sequential"]
    # fused got 9, 2, 8 (median 8); sequential 1, 5, 3 (median 3); graph halves them
    assert times == {("fused", True): 4.0, ("sequential", True): 1.5}
    assert [(r["impl"], r["median_ms"]) for r in _rows(tmp_path) if r["op"] == "op"] == [
        ("fused", 4.0), ("sequential", 1.5)]


def test_default_rounds_rotate_so_fused_is_not_always_timed_first(tmp_path, timed):
    """Without --rounds every case timed its impls once in their fixed order, ``fused`` first:
    the place a GPU's drifting clock favours. By default the order rotates, and each row says
    how many rounds it is the median round of."""
    order = []

    def impl(name):
        def run():
            order.append(name)
            return 1.0
        return run

    bench = _bench(tmp_path, "--no-check", "--graph", "graph")
    bench.run(runner.Case(op="op", shape={"M": 1, "N": 1, "K": 1}, dtype="bf16",
                          impls={n: impl(n) for n in ("fused", "sequential", "compute")}))
    assert order == ["fused", "sequential", "compute", "sequential", "compute", "fused",
                     "compute", "fused", "sequential"]
    assert {r["rounds"] for r in _rows(tmp_path) if r["op"] == "op"} == {3}


def test_compare_worlds_keeps_one_barrier(tmp_path):
    """benchmarks/compare_worlds.py compares rows of one barrier: rows without the key are
    host-barrier rows, and the newest row of the chosen barrier wins."""
    from benchmarks import compare_worlds

    path = tmp_path / "r.jsonl"
    base = {"op": "gemv_allreduce", "shape": {"M": 1}, "dtype": "bf16", "world": 2,
            "impl": "fused", "graph": True, "commit": "c"}
    rows = [dict(base, median_ms=3.0), dict(base, median_ms=2.0, barrier="device"),
            dict(base, median_ms=4.0, barrier="host")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def pick(barrier):
        return next(iter(compare_worlds.load(str(path), True, barrier)[0].values()))

    assert pick("host")["fused"][0] == 4.0
    assert pick("device")["fused"][0] == 2.0
    assert pick("any")["fused"][0] == 4.0


def test_ops_table_takes_the_fastest_of_ours_and_leaves_auto_out_of_the_fastest(tmp_path):
    """benchmarks/ops_table.py: "ours" is the fastest ``fused...`` row (not the GEMV kernel
    without its exchange), "fastest / auto" compares auto with every other candidate, and a
    problem without its baselines is left out."""
    from benchmarks import ops_table

    path = tmp_path / "r.jsonl"
    base = {"op": "gemv_allreduce", "shape": {"M": 1, "N": 8, "K": 16}, "dtype": "bf16",
            "world": 2, "graph": True, "commit": "c", "barrier": "device"}
    times = {"compute": 1.0, "comm": 0.5, "sequential": 1.6, "torch_fused": 1.2, "fused": 1.3,
             "fused_one_shot": 1.1, "fused_nocomm": 0.9, "auto": 1.25}
    rows = [dict(base, impl=i, median_ms=t) for i, t in times.items()]
    rows[-1]["pick"] = {"plain": "one_shot", "captured": "torch_fused"}
    rows.append(dict(base, op="allgather_gemm", impl="fused", median_ms=1.0))  # no baselines
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table, world = ops_table.load(str(path), True, "device")
    assert world == 2 and len(table) == 2
    key = next(k for k in table if k[0] == "gemv_allreduce")
    s = ops_table.summarize("gemv_allreduce", table[key])
    assert (s["ours"], s["which"], s["pick"]) == (1.1, "one-shot", "torch_fused")
    assert abs(s["fastest_over_auto"] - 1.1 / 1.25) < 1e-12
    assert abs(s["vs"] - 1.2 / 1.1) < 1e-12
    lines = ops_table.world_table(table)
    assert len(lines) == 3 and "1.100 (one-shot)" in lines[2] and "1.250 (torch_fused)" in lines[2]
    assert ops_table.load(str(path), True, "host")[0] == {}


class _FakeDevice:
    """Stands in for a GPU's torch device module: each kernel-like call is logged, events time
    1.5 ms apart, and a stream is a context manager."""

    def __init__(self):
        self.log, self.clock = [], 0.0

    class _Ctx:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def Stream(self, device=None):  # noqa: N802  (torch's names)
        fake = self

        class S:
            def wait_stream(self, other):
                fake.log.append("wait_stream")
        return S()

    def current_stream(self, device=None):
        return self.Stream()

    def stream(self, s):
        self.log.append("side stream")
        return self._Ctx()

    def synchronize(self, device=None):
        self.log.append("sync")

    def _sleep(self, cycles):
        self.log.append("hold")

    def CUDAGraph(self):  # noqa: N802
        fake = self

        class G:
            def replay(self):
                fake.log.append("replay")
        return G()

    def graph(self, g, stream=None):
        self.log.append("capture")
        return self._Ctx()

    def Event(self, enable_timing=False):  # noqa: N802
        fake = self

        class E:
            def record(self):
                fake.clock += 1.5
                self.t = fake.clock

            def elapsed_time(self, end):
                return end.t - self.t
        return E()


def test_timed_runs_holds_the_stream_every_ahead_runs_and_warms_replays(monkeypatch):
    """``schedule.tuning.timed_runs`` (the protocol of the planner and of ``harness.time_op``):
    a hold before every AHEAD runs and a stream barrier before each with ``barrier="device"``,
    host barriers and no hold with ``"host"``; with a graph, ``warmup`` runs on a side stream,
    one capture, ``replay_warmup`` untimed replays, then one replay per timed run."""
    import torch

    from portable_overlap.schedule import tuning

    fake = _FakeDevice()
    monkeypatch.setattr(torch, "get_device_module", lambda dev: fake)

    class World:
        device = torch.device("cpu")

        def barrier(self):
            fake.log.append("host barrier")

        def stream_barrier(self):
            fake.log.append("stream barrier")

    calls = []
    ms, host = tuning.timed_runs(lambda: calls.append(1), World(), iters=12, warmup=2,
                                 graph=False)
    assert len(calls) == 14 and len(ms) == len(host) == 12 and ms == [1.5] * 12
    assert fake.log.count("hold") == 2 and fake.log.count("stream barrier") == 12
    fake.log.clear()
    calls.clear()
    ms, _ = tuning.timed_runs(lambda: calls.append(1), World(), iters=5, warmup=3, graph=True,
                              replay_warmup=4, barrier="host")
    assert len(calls) == 4 and len(ms) == 5  # 3 side-stream runs and the captured one
    assert fake.log.count("capture") == 1 and fake.log.count("replay") == 9
    assert "hold" not in fake.log and fake.log.count("host barrier") == 7  # capture, start, 5


# --- the committed results ------------------------------------------------------------------

RESULTS = os.path.join(ROOT, "benchmarks", "results")
#: the protocol's keys and their types; ``dtype`` None where a row has no element type (hbm_read)
ROW_TYPES = {"op": str, "shape": dict, "dtype": (str, type(None)), "world": int, "device": str,
             "date": str, "commit": str}
TIMING = ("median_ms", "p10_ms", "p90_ms")


def _strict_json(line):
    """json.loads refusing NaN and Infinity, which no JSON reader but Python's takes."""
    def bad(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(line, parse_constant=bad)


def row_problems(row) -> list:
    """What keeps ``row`` from the protocol's form: a missing key, a wrong type, a timed row
    (one with ``median_ms``) without its impl, graph and p10 / p90 as finite positive numbers in
    order. Summaries and calibrations time nothing and leave the timing keys out
    (benchmarks/rows.py)."""
    out = [f"missing {k}" for k in ROW_TYPES if k not in row]
    out += [f"{k} is {type(row[k]).__name__}" for k, t in ROW_TYPES.items()
            if k in row and (not isinstance(row[k], t) or isinstance(row[k], bool))]
    if isinstance(row.get("date"), str) and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]):
        out.append("date not YYYY-MM-DD")
    if str(row.get("op", "")).endswith("_summary") or "median_ms" in row:
        out += [f"missing {k}" for k in ("impl", "graph") if k not in row]
        if "impl" in row and not isinstance(row["impl"], str):
            out.append("impl is not a str")
        if "graph" in row and not isinstance(row["graph"], bool):
            out.append("graph is not a bool")
    if "median_ms" in row:
        nums = [row.get(k) for k in TIMING]
        for k, v in zip(TIMING, nums):
            if k not in row:
                out.append(f"missing {k}")
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                out.append(f"{k} is {v!r}")
        if all(isinstance(v, (int, float)) and 0 < v < float("inf") for v in nums) \
                and not nums[1] <= nums[0] <= nums[2]:
            out.append("not p10 <= median <= p90")
    return out


def committed_problems() -> dict:
    """{(results file, op, problem): rows} over every row of every committed results file."""
    found = {}
    for name in sorted(f for f in os.listdir(RESULTS) if f.endswith(".jsonl")):
        for line in open(os.path.join(RESULTS, name)):
            if not line.strip():
                probs, op = ["blank line"], None
            else:
                try:
                    row = _strict_json(line)
                except ValueError as e:
                    row = json.loads(line)  # (Python's reader takes NaN / Infinity)
                    probs, op = [f"not JSON: {str(e)[:40]}"], row.get("op")
                else:
                    probs, op = row_problems(row), row.get("op")
                if not probs:
                    continue
            for p in probs:
                found[(name, op, p)] = found.get((name, op, p), 0) + 1
    return found


#: rows of the committed files that lack part of the protocol's form, by (file, op, problem):
#: measurements, kept as they were recorded (probes and tuners that time without p10 / p90,
#: summaries written without their impl, a NaN rel_err and a failed variant's Infinity). A row
#: not counted here fails the test below.
COMMITTED_EXCEPTIONS = {
    ("nvidia-h100-x1.jsonl", "gemv_allreduce_summary", "missing impl"): 18,
    ("nvidia-h200-x2.jsonl", "embedding_alltoall", "not JSON: NaN is not JSON"): 4,
    ("nvidia-h200-x2.jsonl", "embedding_alltoall_residency", "missing p10_ms"): 34,
    ("nvidia-h200-x2.jsonl", "embedding_alltoall_residency", "missing p90_ms"): 34,
    ("nvidia-h200-x2.jsonl", "embedding_alltoall_summary", "missing impl"): 264,
    ("nvidia-h200-x2.jsonl", "embedding_alltoall_tuning", "missing p10_ms"): 80,
    ("nvidia-h200-x2.jsonl", "embedding_alltoall_tuning", "missing p90_ms"): 80,
    ("nvidia-h200-x2.jsonl", "embedding_alltoall_tuning", "not JSON: Infinity is not JSON"): 2,
    ("nvidia-h200-x2.jsonl", "gemm_allreduce_signal_summary", "missing impl"): 42,
    ("nvidia-h200-x2.jsonl", "gemm_reducescatter_signal_summary", "missing impl"): 42,
    ("nvidia-h200-x2.jsonl", "gemv_allreduce_summary", "missing impl"): 20,
    ("nvidia-h200-x2.jsonl", "moe_dispatch_stages", "p10_ms is None"): 228,
    ("nvidia-h200-x2.jsonl", "moe_dispatch_stages", "p90_ms is None"): 228,
    ("nvidia-h200-x2.jsonl", "wave_predictor_summary", "missing impl"): 24,
    ("nvidia-h200-x4.jsonl", "embedding_alltoall_summary", "missing impl"): 24,
    ("nvidia-h200-x4.jsonl", "embedding_alltoall_tuning", "missing p10_ms"): 27,
    ("nvidia-h200-x4.jsonl", "embedding_alltoall_tuning", "missing p90_ms"): 27,
    ("nvidia-h200-x4.jsonl", "gemm_allreduce_signal_summary", "missing impl"): 6,
    ("nvidia-h200-x4.jsonl", "gemm_reducescatter_signal_summary", "missing impl"): 6,
    ("nvidia-h200-x4.jsonl", "gemv_allreduce_summary", "missing impl"): 10,
    ("nvidia-h200-x4.jsonl", "wave_predictor_summary", "missing impl"): 4,
    ("nvidia-h200.jsonl", "auto_agreement", "missing p10_ms"): 18,
    ("nvidia-h200.jsonl", "auto_agreement", "missing p90_ms"): 18,
    ("nvidia-h200.jsonl", "gemm_core_shapes", "missing p10_ms"): 363,
    ("nvidia-h200.jsonl", "gemm_core_shapes", "missing p90_ms"): 363,
    ("nvidia-h200.jsonl", "rs_kernel_pieces", "missing p10_ms"): 60,
    ("nvidia-h200.jsonl", "rs_kernel_pieces", "missing p90_ms"): 60,
}


def test_every_committed_row_has_the_protocols_keys_and_types():
    """Every row of every committed results file: the protocol's keys and types (``row_problems``),
    as strict JSON; the measurements that lack part of it are the counted exceptions."""
    found = committed_problems()
    new = {k: n for k, n in found.items() if n > COMMITTED_EXCEPTIONS.get(k, 0)}
    assert not new, new


def test_row_problems_finds_each_fault():
    good = {"op": "x", "shape": {"M": 1}, "dtype": "bf16", "world": 2, "device": "d",
            "impl": "fused", "graph": True, "median_ms": 1.0, "p10_ms": 0.9, "p90_ms": 1.1,
            "date": "2026-01-02", "commit": "c"}
    assert row_problems(good) == []
    assert row_problems({k: v for k, v in good.items() if k not in TIMING}) == []
    for change, why in [({"shape": [1]}, "shape is list"), ({"graph": 1}, "graph is not a bool"),
                        ({"world": True}, "world is bool"), ({"p10_ms": None}, "p10_ms is None"),
                        ({"median_ms": 2.0}, "not p10 <= median <= p90"),
                        ({"date": "today"}, "date not YYYY-MM-DD")]:
        assert why in row_problems({**good, **change}), change
    assert row_problems({k: v for k, v in good.items() if k != "p90_ms"}) == ["missing p90_ms"]
    assert row_problems({"op": "x_summary", **{k: good[k] for k in ROW_TYPES if k != "op"}}) \
        == ["missing impl", "missing graph"]


def test_writer_writes_strict_json(tmp_path):
    """A NaN rel_err or a failed variant's infinite median was written as NaN / Infinity, which
    no JSON reader but Python's takes: the row is null there."""
    w = rows.ResultWriter(str(tmp_path / "r.jsonl"), "k", 2, commit="c")
    w.write(op="x", shape={"M": 1}, dtype="bf16", impl="sequential", graph=True, median_ms=1.0,
            p10_ms=1.0, p90_ms=1.0, rel_err=float("nan"),
            sweep=[{"median_ms": float("inf")}, (1.0, float("-inf"))])
    (line,) = open(tmp_path / "r.jsonl").read().splitlines()
    got = _strict_json(line)
    assert got["rel_err"] is None and got["sweep"] == [{"median_ms": None}, [1.0, None]]
    assert row_problems(got) == []


def test_compare_results_leaves_out_untimed_rows_and_refuses_bad_files(tmp_path, capsys):
    """A failed timing is written with a null median (``rows.finite``): comparing such a file
    raised a TypeError, and an old median of 0 a ZeroDivisionError."""
    from benchmarks import compare_results

    rows = [{"op": "a", "impl": "fused", "median_ms": None}, {"op": "b", "median_ms": 0.0},
            {"op": "c", "impl": "fused", "median_ms": 2.0}]
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps(r) + "\n" for r in rows))
    new = tmp_path / "new.jsonl"
    new.write_text(json.dumps({"op": "c", "impl": "fused", "median_ms": 1.0}) + "\n")
    assert compare_results.main([str(old), str(new)]) == 0
    assert "1 rows matched" in capsys.readouterr().out
    assert compare_results.main([str(tmp_path / "missing.jsonl"), str(new)]) == 2
    assert "cannot read" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare_results.main([str(old), str(new), "--tol", "-1"])


# a child that answers ``--help`` with every module that runs as a script, one import of torch
# for all; a module that makes a world instead (the work's first step) ends that module's turn
_HELP_ALL = r"""
import contextlib, io, runpy, sys
from portable_overlap import World
from portable_overlap.testing import EmulatedWorld

class Started(Exception):
    pass

def refuse(*a, **k):
    raise Started()

World.from_env = World.from_torchrun = World.from_mpi = classmethod(refuse)
EmulatedWorld.__init__ = refuse
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        result = "returned"
    except SystemExit as e:
        result = f"exit {e.code}" if out.getvalue().startswith("usage:") else "exit, no usage"
    except Started:
        result = "started work"
    except BaseException as e:
        result = f"raised {type(e).__name__}: {e}"
    print(name, result, flush=True)
"""


def test_every_benchmark_script_answers_help_without_starting_work():
    """``--help`` of probe_embedding_residency raised argparse's conflicting-option error
    (it added BenchParser's --rounds again), and probe_packed_experts took no arguments and
    started its probe."""
    import subprocess
    import sys

    names = sorted(f"benchmarks.{f[:-3]}" for f in os.listdir(os.path.join(ROOT, "benchmarks"))
                   if f.endswith(".py") and "if __name__ == \"__main__\":" in open(
                       os.path.join(ROOT, "benchmarks", f), encoding="utf-8").read())
    assert len(names) > 30
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("RANK", "WORLD_SIZE"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", _HELP_ALL, *names], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert sorted(results) == names, done.stdout + done.stderr[-3000:]
    bad = {n: r for n, r in results.items() if r != "exit 0"}
    assert not bad, bad
