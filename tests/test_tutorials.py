"""Every tutorial in docs/tutorials runs on CPU-emulated ranks (as a user would start it: a
plain ``python`` command) and reports that its result matched torch on every rank."""
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUTORIALS = sorted(glob.glob(os.path.join(ROOT, "docs", "tutorials", "[0-9]*.py")))
# the first two (no GEMM) are cheap enough to run on 4 ranks too
FOUR_RANKS = [t for t in TUTORIALS if os.path.basename(t)[:2] in ("01", "02")]


def _run(path, ranks):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PORTABLE_OVERLAP_EMULATED_RANKS=str(ranks))
    env.pop("RANK", None)
    out = subprocess.run([sys.executable, path], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "right on every rank: True" in out.stdout, out.stdout[-3000:]
    assert f"over {ranks} ranks" in out.stdout or f"{ranks} ranks" in out.stdout, out.stdout
    return out.stdout


def test_there_are_tutorials():
    names = [os.path.basename(t) for t in TUTORIALS]
    assert names[:2] == ["01_ping_pong.py", "02_all_gather.py"], names


@pytest.mark.emulated(ranks=2)
@pytest.mark.parametrize("path", TUTORIALS, ids=os.path.basename)
def test_tutorial_on_two_ranks(path):
    _run(path, 2)


@pytest.mark.emulated(ranks=4)
@pytest.mark.parametrize("path", FOUR_RANKS, ids=os.path.basename)
def test_tutorial_on_four_ranks(path):
    _run(path, 4)


def test_tutorials_stay_short():
    for path in TUTORIALS:
        with open(path) as f:
            lines = len(f.read().splitlines())
        assert lines <= 150, f"{os.path.basename(path)} has {lines} lines (a tutorial stays "\
                             f"under 150)"


def test_emulated_ranks_override_is_range_checked(monkeypatch):
    from portable_overlap.testing import run_on_ranks

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("PORTABLE_OVERLAP_EMULATED_RANKS", "0")
    with pytest.raises(ValueError, match="PORTABLE_OVERLAP_EMULATED_RANKS='0'"):
        run_on_ranks(print)
