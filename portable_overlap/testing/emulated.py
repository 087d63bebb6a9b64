"""CPU-emulated ranks: one spawned process per rank, a gloo process group, the CPU backend (a
shared-memory heap) and the Triton interpreter, kept alive so many test cases share one start-up.

    with EmulatedWorld(2) as ew:
        results = ew.run(some_module_level_function, arg)  # fn(world, arg) on every rank

A rank that raises makes ``run`` raise :class:`RemoteError` with the rank's traceback; ranks that
do not answer within ``timeout`` are killed and ``run`` raises :class:`WorkerHang` (the pool is
then dead; make a new one).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable, Optional


class RemoteError(RuntimeError):
    def __init__(self, rank: int, exc_type: str, message: str, tb: str):
        super().__init__(f"rank {rank} raised {exc_type}: {message}\n--- remote traceback ---\n{tb}")
        self.rank, self.exc_type, self.message = rank, exc_type, message


class WorkerHang(RuntimeError):
    pass


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
    def __init__(self, size: int, start_timeout: float = 180.0):
        self.size = size
        ctx = mp.get_context("spawn")
        self._out = ctx.Queue()
        self._in = [ctx.Queue() for _ in range(size)]
        env = {"TRITON_INTERPRET": "1", "PORTABLE_OVERLAP_BACKEND": "cpu",
               "OMP_NUM_THREADS": "1"}
        port = _free_port()
        self._procs = [ctx.Process(target=_worker, args=(r, size, port, self._in[r], self._out, env),
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
        for q in self._in:
            q.put((fn, args, kwargs))
        return self._collect(timeout)

    def _collect(self, timeout: float, expect: Optional[str] = None) -> list:
        results: list[Any] = [None] * self.size
        errors = []
        deadline = time.monotonic() + timeout
        pending = set(range(self.size))
        while pending:
            try:  # short polls: a rank that died (a crash in a kernel) is reported at once
                rank, status, payload = self._out.get(timeout=0.5)
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(self._procs) if not p.is_alive()}
                if not dead and time.monotonic() < deadline:
                    continue
                self.close(force=True)
                why = (f"ranks {sorted(dead)} died (exit codes {list(dead.values())})" if dead
                       else f"ranks {sorted(pending)} did not answer within {timeout} s")
                raise WorkerHang(why) from None
            pending.discard(rank)
            if status == "err":
                errors.append(RemoteError(rank, *payload))
            else:
                results[rank] = payload
        if errors:
            raise errors[0]
        return results

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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
