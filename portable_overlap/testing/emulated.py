"""CPU-emulated ranks: one spawned process per rank, a gloo process group, the CPU backend (a
shared-memory heap) and the Triton interpreter, kept alive so many test cases share one start-up.

    with EmulatedWorld(2) as ew:
        results = ew.run(some_module_level_function, arg)  # fn(world, arg) on every rank

A rank that raises makes ``run`` raise :class:`RemoteError` with the rank's traceback; ranks that
do not answer within ``timeout`` are killed and ``run`` raises :class:`WorkerHang` (the pool is
then dead; make a new one). When a rank dies the others get ``DEAD_RANK_GRACE_S`` to answer
first; the :class:`WorkerHang` carries their answers, so a test can check that a crash made them
raise instead of hang. When a rank raises, the others get ``ERROR_GRACE_S``: a rank that raised
before a collective leaves its peers waiting in it (gloo's own timeout is half an hour), so
past that grace the pool is killed and the first error is raised, naming the ranks that hung.

Whatever ends a run early (a hang, a peer's error, pytest-timeout's or a user's interrupt
while ``run`` waits) kills the pool, so no later task queues behind a rank that is still
running this one. Before killing them the harness asks the ranks that did not answer for
their Python stacks (``faulthandler`` on ``SIGUSR1``): the error says where each one waited.
"""
from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Optional

from .environment import environ


class RemoteError(RuntimeError):
    """Rank ``rank`` raised ``exc_type(message)``; ``tb`` is its traceback. ``after`` says what
    became of the ranks that had not answered by then, where they were killed."""

    def __init__(self, rank: int, exc_type: str, message: str, tb: str, after: str = ""):
        super().__init__(f"rank {rank} raised {exc_type}: {message}\n"
                         f"--- remote traceback ---\n{tb}" + (f"\n{after}" if after else ""))
        self.rank, self.exc_type, self.message = rank, exc_type, message


class WorkerHang(RuntimeError):
    """Ranks died or did not answer. ``answers`` holds what the other ranks answered, rank ->
    ``("ok", return value)`` or ``("err", (type name, message, traceback))``: whether the
    survivors of a crash raised (and what) or hung."""

    def __init__(self, why: str, answers: Optional[dict] = None):
        self.answers = dict(answers or {})
        told = "; ".join(f"rank {r} " + (f"raised {p[0]}: {p[1]}" if st == "err" else "returned")
                         for r, (st, p) in sorted(self.answers.items()))
        super().__init__(why + (f" (the others: {told})" if told else ""))


def _task_stacks(dump: str) -> str:
    """The threads of a ``faulthandler`` dump that run the task, the queues' feeder threads
    (always parked in ``_feed``) left out. Of each thread: its innermost ``_STACK_LINES``
    frames (where it waits), then only the test's and this library's frames (the calls that
    led there, below the many frames of the Triton interpreter and of Python's library)."""
    blocks, cur = [], []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")) and cur:
            blocks.append(cur)
            cur = []
        if line.strip():
            cur.append(line)
    blocks.append(cur)
    kept = []
    for b in blocks:
        if not b or any("in _feed" in ln for ln in b):
            continue
        head, rest = b[:_STACK_LINES + 1], b[_STACK_LINES + 1:]
        outer = [ln for ln in rest if "portable_overlap" in ln
                 or ("site-packages" not in ln and "/lib/python" not in ln)]
        skipped = len(rest) - len(outer)
        kept.append("\n".join(head + ([f"  ... ({skipped} library frames)"] if skipped else [])
                              + outer))
    return "\n".join(kept)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: SIGUSR1 where the platform has it: the signal that makes a rank write its stacks
_DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)
#: innermost frames of each thread kept whole in an error message
_STACK_LINES = 12


def _worker(rank: int, size: int, port: int, inbox, outbox, env: dict,
            stack_file: str) -> None:
    if _DUMP_SIGNAL is not None:  # the parent asks for the stacks of a rank that hangs
        dump = open(stack_file, "w")  # (kept open: faulthandler writes to its descriptor)
        faulthandler.register(_DUMP_SIGNAL, file=dump, all_threads=True)
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from portable_overlap.world import World

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    world = World.from_process_group(backend="cpu")
    world.launcher = "emulated"
    outbox.put((rank, "ready", None))
    while True:
        task = inbox.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            result = fn(world, *args, **kwargs)
            # pickled here, not by the queue's feeder thread, which only prints its error
            # and leaves the caller waiting for an answer that never comes
            ForkingPickler.dumps(result)
            outbox.put((rank, "ok", result))
        except BaseException as e:  # report everything, keep serving
            outbox.put((rank, "err", (type(e).__name__, str(e), traceback.format_exc())))
    dist.destroy_process_group()


#: the most CPU-emulated ranks one machine runs (each a process with its own interpreter): more
#: started thousands of processes for a typo and failed past the machine's open-file limit
MAX_RANKS = 64


class EmulatedWorld:
    #: after a rank died, how long the others may take to answer (they should raise, not hang)
    DEAD_RANK_GRACE_S = 10.0
    #: after a rank raised, how long the others may take to answer: a rank that raised
    #: before a collective or a wait leaves its peers there; waits give up after their
    #: context's ``timeout_s`` (seconds), a gloo collective only after half an hour
    ERROR_GRACE_S = 120.0

    def __init__(self, size: int, start_timeout: float = 180.0):
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_RANKS:
            raise ValueError(f"EmulatedWorld: size must be an int in 1 .. {MAX_RANKS}, got "
                             f"{size!r}")
        self.size = size
        ctx = mp.get_context("spawn")
        # one answer queue per rank: a queue's writers share a lock, and a rank that dies (a
        # crash, os._exit) just after an answer, before its queue's feeder thread released that
        # lock, would leave every other rank's answer blocked behind it
        self._out = [ctx.Queue() for _ in range(size)]
        self._in = [ctx.Queue() for _ in range(size)]
        env = {"TRITON_INTERPRET": "1", "PORTABLE_OVERLAP_BACKEND": "cpu",
               "OMP_NUM_THREADS": "1"}
        port = _free_port()
        self._stack_dir = tempfile.mkdtemp(prefix="po-emulated-")
        self._procs = [ctx.Process(target=_worker,
                                   args=(r, size, port, self._in[r], self._out[r], env,
                                         self._stack_file(r)),
                                   daemon=True) for r in range(size)]
        # The children import Triton kernels while unpickling their target, before _worker runs:
        # the interpreter switch must already be in the environment they inherit.
        with environ(**env):
            for p in self._procs:
                p.start()
        self.alive = True
        self._collect(start_timeout, expect="ready")

    def run(self, fn: Callable, *args, timeout: float = 300.0, **kwargs) -> list:
        """``fn(world, *args, **kwargs)`` on every rank; the ranks' return values in rank order."""
        if not self.alive:
            raise WorkerHang("this emulated world was shut down (ranks hung, died or were left "
                             "behind by a peer's error); make a new one")
        # Queue.put pickles in a feeder thread, which only prints a failure: the ranks would
        # wait for a task that never comes. Pickle here, so a lambda fails at once, by name.
        try:
            ForkingPickler.dumps((fn, args, kwargs))
        except Exception as e:
            raise TypeError(f"the emulated ranks cannot receive {fn!r} with its arguments: "
                            f"{type(e).__name__}: {e} (pass a module-level function and "
                            f"picklable arguments)") from e
        for q in self._in:
            q.put((fn, args, kwargs))
        try:
            return self._collect(timeout)
        except (RemoteError, WorkerHang):
            raise
        except BaseException:
            # an interrupt while waiting (pytest-timeout, Ctrl-C): the ranks may still run
            # this task, and a later one would queue behind it and reach them out of step
            print(self._kill([r for r in range(self.size) if self._procs[r].is_alive()],
                             "was running when the wait was interrupted"), file=sys.stderr)
            raise

    def _collect(self, timeout: float, expect: Optional[str] = None) -> list:
        answers: dict = {}  # rank -> (status, payload)
        deadline = time.monotonic() + timeout
        grace_from = error_from = None
        while len(answers) < self.size:
            pending = [r for r in range(self.size) if r not in answers]
            dead = {r: self._procs[r].exitcode for r in pending if not self._procs[r].is_alive()}
            if dead and grace_from is None:  # the live ranks get a moment to report how they fared
                grace_from = time.monotonic()
                deadline = min(deadline, grace_from + self.DEAD_RANK_GRACE_S)
            if error_from is None and any(st == "err" for st, _ in answers.values()):
                error_from = time.monotonic()
                deadline = min(deadline, error_from + self.ERROR_GRACE_S)
            if len(dead) == len(pending) or time.monotonic() > deadline:
                hung = [r for r in pending if r not in dead]
                stacks = self._kill(hung, "did not answer")
                if grace_from is None and error_from is not None:
                    # the peers of a rank that raised: its error is the cause
                    r, (_, payload) = next((r, a) for r, a in sorted(answers.items())
                                           if a[0] == "err")
                    raise RemoteError(r, *payload, after=(
                        f"--- ranks {hung} did not answer within {self.ERROR_GRACE_S:g} s after "
                        f"it (the pool was shut down) ---\n{stacks}"))
                waited = timeout if grace_from is None else self.DEAD_RANK_GRACE_S
                why = "; ".join(filter(None, [
                    dead and f"ranks {sorted(dead)} died (exit codes {list(dead.values())})",
                    hung and f"ranks {hung} did not answer within {waited:g} s"]))
                raise WorkerHang(why + (f"\n{stacks}" if stacks else ""), answers)
            for r in pending:  # short polls: a rank that died (a crash in a kernel) is seen at once
                try:
                    rank, status, payload = self._out[r].get(timeout=0.5 / len(pending))
                except queue.Empty:
                    continue
                answers[rank] = (status, payload)
        errors = [RemoteError(r, *payload) for r, (status, payload) in sorted(answers.items())
                  if status == "err"]
        if errors:
            raise errors[0]
        return [answers[r][1] for r in range(self.size)]

    def _stack_file(self, rank: int) -> str:
        return os.path.join(self._stack_dir, f"rank{rank}.stacks")

    def stacks(self, ranks, wait_s: float = 2.0) -> dict:
        """rank -> the Python stacks of its threads now (``faulthandler``'s text, innermost
        frame first), for the live ranks among ``ranks``; empty where the platform has no
        SIGUSR1. A rank busy in C code (a gloo wait) writes at once: the dump is made by the
        signal handler, not by the interpreter loop."""
        ranks = [r for r in ranks if self._procs[r].is_alive()]
        if _DUMP_SIGNAL is None or not ranks:
            return {}
        sizes = {}
        for r in ranks:
            path = self._stack_file(r)
            sizes[r] = os.path.getsize(path) if os.path.exists(path) else 0
            os.kill(self._procs[r].pid, _DUMP_SIGNAL)
        found: dict = {}
        end = time.monotonic() + wait_s
        while len(found) < len(ranks) and time.monotonic() < end:
            time.sleep(0.1)
            for r in ranks:
                path = self._stack_file(r)
                if r not in found and os.path.exists(path) and os.path.getsize(path) > sizes[r]:
                    time.sleep(0.1)  # (the handler writes frame by frame)
                    with open(path) as f:
                        f.seek(sizes[r])
                        found[r] = f.read()
        return found

    def _kill(self, ranks, what: str) -> str:
        """Shut the pool down after ``ranks`` ``what``: their stacks first, as text for an
        error message (``_task_stacks``)."""
        found = self.stacks(ranks) if self.alive else {}
        self.close(force=True)
        return "\n".join(f"--- rank {r} {what}; its stacks ---\n" + _task_stacks(text)
                         for r, text in sorted(found.items()))

    def close(self, force: bool = False) -> None:
        if not self.alive:
            return
        self.alive = False
        if not force:
            for q in self._in:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        shutil.rmtree(self._stack_dir, ignore_errors=True)

    @property
    def pids(self) -> list:
        """The ranks' process ids, in rank order."""
        return [p.pid for p in self._procs]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
