"""The backend groups of tests/conftest.py: every test gets the markers of what it uses
(emulated ranks, cuda-python / hip-python bindings, a compile target), ``-m`` selects on them, and
the summary counts each group's outcomes. Runs the real conftest and pyproject.toml on a small
made-up suite whose fixtures stand in for the expensive ones."""
import os
import re
import subprocess
import sys

import pytest
import torch

pytest_plugins = ["pytester"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SUITE = '''
import pytest
from portable_overlap.kernel_registry import TARGETS

# stand-ins: the classification looks at the fixture names, not at what they hand out
@pytest.fixture
def world2():
    return 2

@pytest.fixture
def world8():
    return 8

@pytest.fixture(params=[2, 4], ids=["2ranks", "4ranks"])
def world(request):
    return request.param

@pytest.fixture
def heap(world8):
    return world8

@pytest.fixture
def cuda_driver():
    return "driver"

@pytest.fixture
def hip_runtime():
    return "hip"

@pytest.fixture
def broken():
    raise RuntimeError("set-up fails")

def test_plain():
    pass

def test_skipped():
    pytest.skip("nothing to do")

def test_setup_error(broken):
    pass

def test_on_world(world):
    assert world in (2, 4)

def test_on_two(world2):
    pass

def test_through_a_fixture(heap):
    assert heap == 8

@pytest.mark.emulated(ranks=2)
def test_own_world():
    pass

def test_cuda(cuda_driver):
    pass

def test_hip(hip_runtime):
    pass

@pytest.mark.parametrize("target", TARGETS, ids=lambda t: str(t[1]))
def test_compile(target):
    assert target[0] == "cuda"  # the other target fails: counted as failed in its group

@pytest.mark.gpu
def test_on_gpu():
    pass
'''


@pytest.fixture
def suite(pytester):
    with open(os.path.join(ROOT, "tests", "conftest.py"), encoding="utf-8") as f:
        pytester.makeconftest(f.read())
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        pytester.makepyprojecttoml(f.read())
    pytester.makepyfile(test_suite=SUITE)
    return pytester


def _run(pytester, *args):
    # a marker the conftest adds without a declaration in pyproject.toml fails the run
    return pytester.runpytest_inprocess("-p", "no:cacheprovider",
                                        "-W", "error::pytest.PytestUnknownMarkWarning",
                                        "test_suite.py", *args)


def _group_lines(result) -> dict:
    lines = result.stdout.lines
    start = next(i for i, line in enumerate(lines) if "backend groups" in line)
    out = {}
    for line in lines[start + 1:]:
        label, sep, counts = line.partition("  ")
        if not sep or "collected" not in counts:
            break
        out[label.strip()] = counts.strip()
    return out


def test_groups_and_their_counts(suite):
    result = _run(suite, "-q")
    groups = _group_lines(result)
    gpu = "0 passed, 0 failed, 1 skipped" if not torch.cuda.is_available() else \
        "1 passed, 0 failed, 0 skipped"
    assert groups == {
        "host": "3 collected, 1 passed, 0 failed, 1 skipped, 1 errors",
        "emulated, 2 ranks": "3 collected, 3 passed, 0 failed, 0 skipped",
        "emulated, 4 ranks": "1 collected, 1 passed, 0 failed, 0 skipped",
        "emulated, 8 ranks": "1 collected, 1 passed, 0 failed, 0 skipped",
        "marshalling_cuda": "1 collected, 1 passed, 0 failed, 0 skipped",
        "marshalling_hip": "1 collected, 1 passed, 0 failed, 0 skipped",
        "compile_sm90": "1 collected, 1 passed, 0 failed, 0 skipped",
        "compile_gfx942": "1 collected, 0 passed, 1 failed, 0 skipped",
        "compile_gfx950": "1 collected, 0 passed, 1 failed, 0 skipped",
        "gpu": "1 collected, " + gpu,
    }, result.stdout.str()


@pytest.mark.parametrize("expr,selected", [
    ("compile_gfx942", ["test_compile[gfx942]"]),
    ("emulated(ranks=4)", ["test_on_world[4ranks]"]),
    ("emulated and not emulated(ranks=2)", ["test_on_world[4ranks]", "test_through_a_fixture"]),
    ("marshalling_cuda or marshalling_hip", ["test_cuda", "test_hip"]),
    ("host", ["test_plain", "test_skipped", "test_setup_error"]),
])
def test_markers_select(suite, expr, selected):
    result = _run(suite, "--collect-only", "-q", "-m", expr)
    got = [line.split("::", 1)[1] for line in result.stdout.lines if "::" in line]
    assert got == selected, result.stdout.str()



def test_the_suite_selects_by_group():
    """On the real files: ``-m`` picks the hip-python tests of test_backends.py and the gfx942
    half of the compile matrix, and nothing else."""
    files = ["tests/test_backends.py", "tests/test_compile_matrix.py"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                          "no:cacheprovider", "-m", "marshalling_hip or compile_gfx942", *files],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    hip = [i for i in ids if i.startswith("tests/test_backends.py::")]
    compiled = [i for i in ids if i.startswith("tests/test_compile_matrix.py::")]
    assert hip and all("::test_hip_" in i for i in hip), hip
    assert len(hip) == sum("def test_hip_" in line for line in open(
        os.path.join(ROOT, files[0]), encoding="utf-8")), hip
    assert compiled and all(i.endswith("-hip-gfx942]") for i in compiled), compiled
    assert len(ids) == len(hip) + len(compiled)
    assert re.search(rf"^compile_gfx942\s+{len(compiled)} collected$", out.stdout, re.M), out.stdout
    assert re.search(r"^compile_sm90\s+0 collected$", out.stdout, re.M), out.stdout
