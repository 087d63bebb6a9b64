"""The world: who this process is among the ranks, its device, its process group and its backend.

Built from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...), from mpirun
through mpi4py, or from a process group the caller already made (the CPU-emulated test harness).
On GPUs the process group uses NCCL (RCCL on ROCm builds of torch); on the CPU, gloo.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import socket
from typing import Any, Optional

import torch
import torch.distributed as dist

from .backends import Backend, DeviceFacts, get_backend


@dataclasses.dataclass
class World:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: Backend
    group: Optional[dist.ProcessGroup] = None
    launcher: str = "external"

    # -- constructors ------------------------------------------------------------------------
    @classmethod
    def from_env(cls, backend: Optional[str] = None, timeout_s: float = 300) -> "World":
        """torchrun if its variables are set, else mpirun (Open MPI / MPICH / PMI variables),
        else a world of one process."""
        if dist.is_initialized():
            return cls.from_process_group(backend=backend)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            return cls.from_torchrun(backend=backend, timeout_s=timeout_s)
        if any(v in os.environ for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")):
            return cls.from_mpi(backend=backend, timeout_s=timeout_s)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        return cls.from_torchrun(backend=backend, timeout_s=timeout_s)

    @classmethod
    def from_torchrun(cls, backend: Optional[str] = None, timeout_s: float = 300) -> "World":
        be = get_backend(backend)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = _device_for(be, local_rank)
        if not dist.is_initialized():
            dist.init_process_group(
                backend=be.process_group_backend, timeout=datetime.timedelta(seconds=timeout_s),
                device_id=device if device.type != "cpu" else None)
        w = cls.from_process_group(backend=be.name, device=device)
        w.launcher = "torchrun"
        return w

    @classmethod
    def from_mpi(cls, backend: Optional[str] = None, timeout_s: float = 300) -> "World":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        addr = comm.bcast(
            (socket.gethostbyname(socket.gethostname()), _free_port()) if comm.rank == 0 else None)
        os.environ.update(
            MASTER_ADDR=str(addr[0]), MASTER_PORT=str(addr[1]), RANK=str(comm.rank),
            WORLD_SIZE=str(comm.size), LOCAL_RANK=str(local.rank),
            LOCAL_WORLD_SIZE=str(local.size))
        w = cls.from_torchrun(backend=backend, timeout_s=timeout_s)
        w.launcher = "mpirun"
        return w

    @classmethod
    def from_process_group(cls, group: Optional[dist.ProcessGroup] = None,
                           backend: Optional[str] = None,
                           device: Optional[torch.device] = None) -> "World":
        be = get_backend(backend)
        rank = dist.get_rank(group)
        size = dist.get_world_size(group)
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
        device = device or _device_for(be, local_rank)
        return cls(rank, size, local_rank, local_size, device, be, group)

    # -- facts and host-side collectives (set-up time only, never inside an op call) ---------
    @property
    def facts(self) -> DeviceFacts:
        if not hasattr(self, "_facts"):
            self._facts = self.backend.device_facts(self.device)
        return self._facts

    def all_gather_object(self, obj: Any) -> list:
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def barrier(self) -> None:
        """Every rank's host waits until every rank got here (on a GPU, after the work queued
        on its stream before the barrier ran)."""
        if self.world_size > 1:
            if self.device.type == "cuda":
                dist.barrier(group=self.group, device_ids=[self.device.index])
            else:
                dist.barrier(group=self.group)

    def stream_barrier(self) -> None:
        """A barrier on this rank's current stream that the host does not wait for: the work
        queued after it starts when every rank's stream has reached it. On a GPU an all-reduce
        of one word by the process group's library (NCCL / RCCL), so the ranks leave it within
        about a hop of the links, where a host barrier lets each rank's next launch wait for
        its own host to wake up (tens of microseconds apart, which a timed call that waits for
        its peers then counts: ``benchmarks/harness.py``); on the CPU, :meth:`barrier`."""
        if self.world_size == 1:
            return
        if self.device.type == "cpu":
            self.barrier()
            return
        word = getattr(self, "_barrier_word", None)
        if word is None:
            word = self._barrier_word = torch.zeros(1, dtype=torch.int32, device=self.device)
        dist.all_reduce(word, group=self.group)

    def check_same(self, what: str, value: Any) -> None:
        """Raise on every rank if the ranks disagree on ``value`` (host sync; set-up time)."""
        from .errors import RankMismatchError

        values = self.all_gather_object(value)
        if any(v != values[0] for v in values):
            raise RankMismatchError(f"ranks disagree on {what}: " + ", ".join(
                f"rank {r}: {v}" for r, v in enumerate(values)))

    def __repr__(self) -> str:
        return (f"World(rank={self.rank}/{self.world_size}, local={self.local_rank}/"
                f"{self.local_world_size}, device={self.device}, backend={self.backend.name}, "
                f"launcher={self.launcher})")


def _device_for(be: Backend, local_rank: int) -> torch.device:
    if be.name == "cpu":
        return torch.device("cpu")
    n = torch.cuda.device_count()
    dev = torch.device("cuda", local_rank % n)
    torch.cuda.set_device(dev)
    return dev


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
