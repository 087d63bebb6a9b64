"""Shared fixtures: CPU-emulated worlds of 2, 4 and 8 ranks, started once per test session.

A test hands a module-level function to ``world.run(fn, *args)``; it runs as ``fn(world, *args)``
on every rank (spawned processes, gloo, the CPU backend, the Triton interpreter)."""
import pytest

# The pytest process itself keeps compiled-mode Triton (the compile matrix needs real
# JITFunctions); the emulated ranks set TRITON_INTERPRET=1 before importing any kernel.
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
def world4():
    return _world(4)


@pytest.fixture
def world8():
    return _world(8)


@pytest.fixture(params=[2, 4], ids=["2ranks", "4ranks"])
def world(request):
    return _world(request.param)


def pytest_sessionfinish(session, exitstatus):
    for ew in _pools.values():
        ew.close()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The fault campaign's seeds and counts (tests/test_fault_campaign.py), at the end."""
    for line in getattr(config, "po_campaign", []):
        terminalreporter.write_line(f"fault campaign: {line}")
