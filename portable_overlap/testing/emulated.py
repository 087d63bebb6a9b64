"""CPU-emulated ranks: one spawned process per rank, a gloo process group, the CPU backend (a
shared-memory heap) and the Triton interpreter, kept alive so many test cases share one start-up.

    with EmulatedWorld(2) as ew:
        results = ew.run(some_module_level_function, arg)  # fn(world, arg) on every rank

A rank that raises makes ``run`` raise :class:`RemoteError` with the rank's traceback; ranks that
do not answer within ``timeout`` are killed and ``run`` raises :class:`WorkerHang` (the pool is
then dead; make a new one). When a rank dies the others get ``DEAD_RANK_GRACE_S`` to answer
first; the :class:`WorkerHang` carries their answers, so a test can check that a crash made them
raise instead of hang.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Optional


class RemoteError(RuntimeError):
    def __init__(self, rank: int, exc_type: str, message: str, tb: str):
        super().__init__(f"rank {rank} raised {exc_type}: {message}\n"
                         f"--- remote traceback ---\n{tb}")
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, size: int, port: int, inbox, outbox, env: dict) -> None:
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
            outbox.put((rank, "ok", fn(world, *args, **kwargs)))
        except BaseException as e:  # report everything, keep serving
            outbox.put((rank, "err", (type(e).__name__, str(e), traceback.format_exc())))
    dist.destroy_process_group()


class EmulatedWorld:
    #: after a rank died, how long the others may take to answer (they should raise, not hang)
    DEAD_RANK_GRACE_S = 10.0

    def __init__(self, size: int, start_timeout: float = 180.0):
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
        self._procs = [ctx.Process(target=_worker,
                                   args=(r, size, port, self._in[r], self._out[r], env),
                                   daemon=True) for r in range(size)]
        # The children import Triton kernels while unpickling their target, before _worker runs:
        # the interpreter switch must already be in the environment they inherit.
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            for p in self._procs:
                p.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.alive = True
        self._collect(start_timeout, expect="ready")

    def run(self, fn: Callable, *args, timeout: float = 300.0, **kwargs) -> list:
        """``fn(world, *args, **kwargs)`` on every rank; the ranks' return values in rank order."""
        if not self.alive:
            raise WorkerHang("this emulated world was shut down after a hang; make a new one")
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
        return self._collect(timeout)

    def _collect(self, timeout: float, expect: Optional[str] = None) -> list:
        answers: dict = {}  # rank -> (status, payload)
        deadline = time.monotonic() + timeout
        grace_from = None
        while len(answers) < self.size:
            pending = [r for r in range(self.size) if r not in answers]
            dead = {r: self._procs[r].exitcode for r in pending if not self._procs[r].is_alive()}
            if dead and grace_from is None:  # the live ranks get a moment to report how they fared
                grace_from = time.monotonic()
                deadline = min(deadline, grace_from + self.DEAD_RANK_GRACE_S)
            if len(dead) == len(pending) or time.monotonic() > deadline:
                self.close(force=True)
                hung = [r for r in pending if r not in dead]
                waited = timeout if grace_from is None else self.DEAD_RANK_GRACE_S
                why = "; ".join(filter(None, [
                    dead and f"ranks {sorted(dead)} died (exit codes {list(dead.values())})",
                    hung and f"ranks {hung} did not answer within {waited:g} s"]))
                raise WorkerHang(why, answers)
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

    @property
    def pids(self) -> list:
        """The ranks' process ids, in rank order."""
        return [p.pid for p in self._procs]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
