"""The CPU-emulated world harness: remote errors carry the rank's traceback, a crashed rank is
reported at once instead of after the timeout, with what the surviving ranks answered; a rank
that raised before a collective does not leave its peers hanging there, and a hang says where
each rank waited."""
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


def _raise_before_barrier(world):
    """Rank 1 raises where rank 0 enters a collective: rank 0 would wait in gloo's barrier for
    half an hour."""
    import torch.distributed as dist

    if world.rank == 1:
        raise ValueError("refused before the barrier")
    dist.barrier(group=world.group)
    return world.rank


def _sleep_in_rank_0(world):
    if world.rank == 0:
        _wait_here_forever()
    return world.rank


def _wait_here_forever():
    while True:
        time.sleep(0.05)


@pytest.mark.emulated(ranks=2)
def test_a_rank_left_in_a_collective_by_a_peers_error():
    """The error of the rank that raised comes back after ``ERROR_GRACE_S``, naming the rank
    left behind and where it waited; the pool is shut down (a task sent to it now would reach
    rank 0 while it still waits in the barrier)."""
    ew = EmulatedWorld(2)
    ew.ERROR_GRACE_S = 3.0
    try:
        t = time.monotonic()
        with pytest.raises(RemoteError, match="rank 1 raised ValueError: refused before") as info:
            ew.run(_raise_before_barrier, timeout=120)
        assert time.monotonic() - t < 60
        text = str(info.value)
        assert "ranks [0] did not answer within 3 s after it" in text
        assert "_raise_before_barrier" in text  # rank 0's stack: where it waited
        assert not ew.alive
        with pytest.raises(WorkerHang, match="shut down"):
            ew.run(lambda_free_rank)
    finally:
        ew.close(force=True)


@pytest.mark.emulated(ranks=2)
def test_a_hang_says_where_each_rank_waited():
    ew = EmulatedWorld(2)
    try:
        with pytest.raises(WorkerHang, match=r"ranks \[0\] did not answer within 4 s") as info:
            ew.run(_sleep_in_rank_0, timeout=4)
        text = str(info.value)
        assert "--- rank 0 did not answer; its stacks ---" in text
        assert "_wait_here_forever" in text and "_sleep_in_rank_0" in text
        assert "_feed" not in text  # the queues' feeder threads are left out
        assert info.value.answers == {1: ("ok", 1)}
    finally:
        ew.close(force=True)


class _Interrupted(BaseException):  # (as pytest-timeout's and Ctrl-C's are: not an Exception)
    pass


def _interrupt(signum, frame):
    raise _Interrupted()


@pytest.mark.emulated(ranks=2)
def test_an_interrupted_wait_shuts_the_pool_down(capsys):
    """pytest-timeout firing while ``run`` waits: the pool is killed (rank 0 still runs the task;
    the next one would queue behind it), and the ranks' stacks are printed."""
    import signal

    ew = EmulatedWorld(2)
    old = signal.signal(signal.SIGALRM, _interrupt)
    try:
        signal.alarm(3)
        with pytest.raises(_Interrupted):
            ew.run(_sleep_in_rank_0, timeout=120)
        assert not ew.alive
        assert "_wait_here_forever" in capsys.readouterr().err
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        ew.close(force=True)


def test_stacks_keep_where_a_rank_waits_and_how_it_got_there():
    """A rank waiting deep in the Triton interpreter: its innermost frames, then the test's and
    the library's frames below the interpreter's; the queues' feeder threads left out."""
    from portable_overlap.testing.emulated import _STACK_LINES, _task_stacks

    lib = "/venv/lib/python3.11/site-packages"
    dump = ("Thread 0x1 (most recent call first):\n"
            "  File \"/usr/lib/python3.11/multiprocessing/queues.py\", line 231 in _feed\n\n"
            "Current thread 0x2 (most recent call first):\n"
            + "".join(f"  File \"{lib}/triton/interpreter.py\", line {i} in step{i}\n"
                      for i in range(40))
            + f"  File \"{lib}/portable_overlap/ops/moe_dispatch/swiglu.py\", line 9 in run\n"
            "  File \"/src/tests/test_moe.py\", line 5 in _layer\n"
            "  File \"/usr/lib/python3.11/multiprocessing/process.py\", line 108 in run\n")
    text = _task_stacks(dump)
    lines = text.splitlines()
    assert lines[0].startswith("Current thread 0x2")
    assert [f"step{i}" in ln for i, ln in enumerate(lines[1:_STACK_LINES + 1])] == \
        [True] * _STACK_LINES
    # the rest of the interpreter's frames and Python's process.py
    assert f"... ({40 - _STACK_LINES + 1} library frames)" in text
    assert lines[-2:] == [f"  File \"{lib}/portable_overlap/ops/moe_dispatch/swiglu.py\", "
                          "line 9 in run", "  File \"/src/tests/test_moe.py\", line 5 in _layer"]
    assert "_feed" not in text


def _unpicklable_answer(world):
    import threading

    return threading.Lock() if world.rank == 1 else "fine"


@pytest.mark.emulated(ranks=2)
def test_an_answer_the_caller_cannot_receive_fails_at_once():
    """A rank's result that cannot be pickled: the queue's feeder thread printed the error and
    the caller waited for the answer until its timeout (a WorkerHang naming idle ranks)."""
    t0 = time.monotonic()
    with EmulatedWorld(2) as ew:
        with pytest.raises(RemoteError, match="rank 1 raised TypeError.*pickle"):
            ew.run(_unpicklable_answer, timeout=60)
        assert ew.run(lambda_free_rank) == [0, 1]  # the pool still serves
    assert time.monotonic() - t0 < 30
