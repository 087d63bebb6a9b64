"""The CPU-emulated world harness: remote errors carry the rank's traceback, a crashed rank is
reported at once instead of after the timeout, with what the surviving ranks answered."""
import os
import time

import pytest

from portable_overlap.testing import EmulatedWorld, RemoteError, WorkerHang


def _fail_on_rank_1(world):
    if world.rank == 1:
        raise KeyError("boom")
    return world.rank


def _die_on_rank_1(world):
    if world.rank == 1:
        os._exit(3)
    time.sleep(0.2)
    return world.rank


@pytest.mark.emulated(ranks=2)  # its own world, not a fixture: conftest cannot see it
def test_errors_and_crashes_are_reported():
    ew = EmulatedWorld(2)
    try:
        assert ew.run(lambda_free_rank) == [0, 1]
        with pytest.raises(RemoteError, match="rank 1 raised KeyError"):
            ew.run(_fail_on_rank_1)
        assert ew.run(lambda_free_rank) == [0, 1]  # still serving after an error
        t = time.monotonic()
        with pytest.raises(WorkerHang, match=r"ranks \[1\] died \(exit codes \[3\]\)") as info:
            ew.run(_die_on_rank_1, timeout=120)
        assert time.monotonic() - t < 30
        assert info.value.answers == {0: ("ok", 0)}  # the survivor's answer is kept
        assert "rank 0 returned" in str(info.value)
    finally:
        ew.close(force=True)


@pytest.mark.emulated(ranks=2)
def test_a_task_the_ranks_cannot_receive_fails_at_once():
    """A lambda cannot be pickled to the ranks: a clear error at once, not a wait for the
    timeout (the queue's feeder thread would only print the pickling error), and the world
    still serves the next task."""
    with EmulatedWorld(2) as ew:
        t = time.monotonic()
        with pytest.raises(TypeError, match="cannot receive .*lambda.*module-level function"):
            ew.run(lambda world: world.rank, timeout=120)
        assert time.monotonic() - t < 5
        assert ew.run(lambda_free_rank) == [0, 1]


def lambda_free_rank(world):
    return world.rank
