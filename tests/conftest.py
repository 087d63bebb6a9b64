"""Shared fixtures and the backend groups of the CPU suite.

Fixtures: CPU-emulated worlds of 2, 3, 4 and 8 ranks, started once per test session, and the
vendor binding modules (cuda-python's driver, hip-python's runtime) for the marshalling tests.

A test hands a module-level function to ``world.run(fn, *args)``; it runs as ``fn(world, *args)``
on every rank (spawned processes, gloo, the CPU backend, the Triton interpreter).

Every collected test gets the markers of its backend group (declared in pyproject.toml), derived
from what it uses, so ``pytest -m compile_gfx942`` runs one group:

- ``emulated(ranks=N)``: it uses ``world``, ``world2``, ``world3``, ``world4`` or ``world8`` (a
  test that starts its own :class:`EmulatedWorld` carries the marker itself);
- ``marshalling_cuda`` / ``marshalling_hip``: it uses ``cuda_driver`` / ``hip_runtime``;
- ``compile_sm90`` / ``compile_gfx942``: one of its parameters is a target of
  ``kernel_registry.TARGETS``;
- ``gpu``: marked by hand, skipped without a GPU;
- ``host``: none of the above (pure Python, one process).

The terminal summary ends with one line per group: collected, passed, failed, skipped."""
from collections import Counter

import pytest

# The pytest process itself keeps compiled-mode Triton (the compile matrix needs real
# JITFunctions); the emulated ranks set TRITON_INTERPRET=1 before importing any kernel.
from portable_overlap.kernel_registry import TARGETS
from portable_overlap.testing import EmulatedWorld

_pools: dict = {}


def _world(size: int) -> EmulatedWorld:
    ew = _pools.get(size)
    if ew is None or not ew.alive:  # a hang kills a pool; the next test gets a fresh one
        ew = _pools[size] = EmulatedWorld(size)
    return ew


@pytest.fixture
def world2():
    return _world(2)


@pytest.fixture
def world3():
    return _world(3)


@pytest.fixture
def world4():
    return _world(4)


@pytest.fixture
def world8():
    return _world(8)


@pytest.fixture(params=[2, 4], ids=["2ranks", "4ranks"])
def world(request):
    return _world(request.param)


@pytest.fixture
def cuda_driver():
    """cuda-python's driver module; it imports without a GPU (only its calls need a driver).
    Skips where cuda-python is not installed."""
    pytest.importorskip("cuda.bindings")
    from portable_overlap.backends.cuda import _import_driver

    return _import_driver()


@pytest.fixture
def hip_runtime():
    """hip-python's ``hip`` module; it imports without ROCm (only its calls need libamdhip64).
    Skips where hip-python is not installed."""
    from portable_overlap.backends.rocm import _import_hip

    try:
        return _import_hip()
    except ImportError:
        pytest.skip("hip-python not installed")


# --- backend groups ---------------------------------------------------------------------------

#: fixture -> ranks of the emulated world it hands out ("world" is parametrized: its parameter)
WORLD_FIXTURES = {"world2": 2, "world3": 3, "world4": 4, "world8": 8, "world": None}
#: fixture -> group of the tests that use it
BINDING_FIXTURES = {"cuda_driver": "marshalling_cuda", "hip_runtime": "marshalling_hip"}
#: summary order; "emulated" gets one line per rank count
GROUPS = ("host", "emulated", "marshalling_cuda", "marshalling_hip", "compile_sm90",
          "compile_gfx942", "compile_gfx950", "gpu")
_SELECTED = pytest.StashKey[list]()
# test outcomes by node id: pytest_runtest_logreport gets no config, and one suite runs per process
_outcomes: dict = {}


def compile_group(target) -> str:
    """The marker of a compile target: ``("cuda", 90, 32)`` -> ``compile_sm90``,
    ``("hip", "gfx942", 64)`` -> ``compile_gfx942``."""
    backend, arch = target[0], target[1]
    return f"compile_sm{arch}" if backend == "cuda" else f"compile_{arch}"


def _emulated_ranks(item) -> set:
    params = getattr(getattr(item, "callspec", None), "params", {})
    ranks = set()
    for name, size in WORLD_FIXTURES.items():
        if name in item.fixturenames:
            ranks.add(size if size is not None else params.get(name))
    ranks.discard(None)  # a "world" fixture overridden without parameters: size unknown
    return ranks


def _add_markers(item) -> None:
    have = {m.name for m in item.iter_markers()}
    if "emulated" not in have:
        for n in sorted(_emulated_ranks(item)):
            item.add_marker(pytest.mark.emulated(ranks=n))
    for fixture, group in BINDING_FIXTURES.items():
        if fixture in item.fixturenames and group not in have:
            item.add_marker(getattr(pytest.mark, group))
    params = getattr(getattr(item, "callspec", None), "params", {})
    for value in params.values():
        if isinstance(value, tuple) and value in TARGETS:
            item.add_marker(getattr(pytest.mark, compile_group(value)))
    if not {m.name for m in item.iter_markers()} & set(GROUPS):
        item.add_marker(pytest.mark.host)


def groups_of(item) -> list:
    """Summary labels of the groups ``item`` belongs to, e.g. ``["emulated, 2 ranks"]``."""
    out = []
    for m in item.iter_markers():
        if m.name == "emulated":
            label = f"emulated, {m.kwargs.get('ranks', '?')} ranks"
        elif m.name in GROUPS:
            label = m.name
        else:
            continue
        if label not in out:
            out.append(label)
    return out


# tryfirst: the markers must be on the items before pytest's own hook selects by -m
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    for item in items:
        _add_markers(item)
    if any(item.get_closest_marker("gpu") for item in items):
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="needs a GPU")
            for item in items:
                if item.get_closest_marker("gpu"):
                    item.add_marker(skip)


def pytest_collection_finish(session):
    session.config.stash[_SELECTED] = [(item.nodeid, groups_of(item)) for item in session.items]


def pytest_runtest_logreport(report):
    """Each test's outcome: a failed set-up or tear-down counts as an error, a skip in set-up
    or call (an xfail included) as skipped."""
    if report.when == "call":
        _outcomes[report.nodeid] = "skipped" if report.skipped else report.outcome
    elif report.failed:
        if _outcomes.get(report.nodeid) != "failed":
            _outcomes[report.nodeid] = "error"
    elif report.skipped and report.when == "setup":
        _outcomes[report.nodeid] = "skipped"


def group_summary(selected, outcomes) -> list:
    """One line per group: ``label  N collected, P passed, F failed, S skipped`` (the outcomes
    once tests have run and the group has any; errors added when there are some)."""
    collected, counts = Counter(), {}
    for nodeid, groups in selected:
        for g in groups:
            collected[g] += 1
            if nodeid in outcomes:
                counts.setdefault(g, Counter())[outcomes[nodeid]] += 1
    labels = [g for g in GROUPS if g != "emulated"]
    emulated = sorted((g for g in collected if g.startswith("emulated")),
                      key=lambda g: int(g.split()[1]) if g.split()[1].isdigit() else 0)
    labels[1:1] = emulated or ["emulated"]
    width = max(len(g) for g in labels)
    lines = []
    for g in labels:
        line = f"{g:<{width}}  {collected[g]:4d} collected"
        if outcomes and collected[g]:
            c = counts.get(g, Counter())
            line += f", {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
            if c["error"]:
                line += f", {c['error']} errors"
        lines.append(line)
    return lines


def pytest_sessionfinish(session, exitstatus):
    for ew in _pools.values():
        ew.close()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The fault campaign's seeds and counts (tests/test_fault_campaign.py), then the backend
    groups' counts, at the end."""
    for line in getattr(config, "po_campaign", []):
        terminalreporter.write_line(f"fault campaign: {line}")
    selected = config.stash.get(_SELECTED, None)
    if selected is None:  # collection failed before the items were known
        return
    terminalreporter.write_sep("-", "backend groups")
    for line in group_summary(selected, _outcomes):
        terminalreporter.write_line(line)
