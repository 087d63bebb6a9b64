"""The result tools (compare_results, compare_worlds, ops_table, plot) refuse a results file
they cannot read with one line naming it and exit code 2, as compare_results did alone: the
others ended in a traceback (exit code 1), and plot took a file with no JSON line for one
without rows ("0 groups", empty tables, exit code 0)."""
import json
import os
import subprocess
import sys

import pytest

from benchmarks import compare_results, compare_worlds, ops_table, plot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW = {"op": "gemv_allreduce", "shape": {"M": 1, "N": 8, "K": 8}, "dtype": "bf16", "world": 2,
       "impl": "fused", "graph": True, "median_ms": 0.5, "commit": "abc"}


def _main(tool, files, monkeypatch, tmp_path):
    """The tool's ``main`` on ``files``; its exit code."""
    if tool is compare_results:
        return compare_results.main(files)
    if tool is plot:
        return plot.main([*files, "--out", str(tmp_path / "plots"), "--tables-only"])
    monkeypatch.setattr(sys, "argv", [tool.__name__, *files])  # (they parse sys.argv)
    return tool.main()


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.jsonl"
    path.write_text(json.dumps(ROW) + "\n")
    return str(path)


@pytest.mark.parametrize("tool", [compare_results, compare_worlds, ops_table, plot],
                         ids=lambda t: t.__name__.split(".")[-1])
@pytest.mark.parametrize("content, says", [
    (None, "FileNotFoundError: No such file or directory"),
    ("not json\n", "not JSON"),  # (plot: no line is one: "no line is a JSON object")
    ("[1, 2]\n", "a JSON list, not an object"),
])
def test_a_tool_refuses_an_unreadable_file_naming_it(tool, content, says, good, tmp_path,
                                                     monkeypatch, capsys):
    bad = tmp_path / "bad.jsonl"
    if content is not None:
        bad.write_text(content)
    if tool is plot and content is not None:
        says = "no line is a JSON object"
    assert _main(tool, [good, str(bad)], monkeypatch, tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    name = tool.__name__.split(".")[-1]
    assert len(err) == 1 and err[0].startswith(f"{name}: cannot read the results in {bad}: ")
    assert says in err[0], err
    if tool is plot:
        assert not (tmp_path / "plots").exists()  # no empty tables written


def test_a_row_without_a_field_the_tool_reads_is_named(good, tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({k: v for k, v in ROW.items() if k != "world"}) + "\n")
    assert _main(compare_worlds, [good, str(bad)], monkeypatch, tmp_path) == 2
    assert "a row has no field 'world'" in capsys.readouterr().err


def test_plot_still_skips_a_torn_line_of_a_results_file(good, tmp_path, capsys):
    with open(good, "a") as f:
        f.write('{"op": "gemv_all')
    assert plot.main([good, "--out", str(tmp_path / "plots"), "--tables-only"]) == 0


@pytest.mark.parametrize("tool", ["compare_worlds", "ops_table"])
def test_the_exit_code_reaches_the_shell(tool, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    missing = str(tmp_path / "missing.jsonl")
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{tool}", missing, missing],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert missing in done.stderr and "Traceback" not in done.stderr
