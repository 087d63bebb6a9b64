"""The world: who this process is among the ranks, its device, its process group and its backend.

Built from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...), from mpirun
through mpi4py, or from a process group the caller already made (the CPU-emulated test harness).
On GPUs the process group uses NCCL (RCCL on ROCm builds of torch); on the CPU, gloo.
"""
from __future__ import annotations

import collections
import dataclasses
import datetime
import functools
import os
import socket
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .backends import Backend, DeviceFacts, get_backend
from .envvars import check_names
from .kept import kept_zeros


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
    #: host collectives this rank has entered (``collective_setup`` compares it)
    collectives: int = dataclasses.field(default=0, repr=False, compare=False)
    #: symmetric heaps made on this world (``SymmetricHeap.serial``: close compares it)
    heaps_made: int = dataclasses.field(default=0, repr=False, compare=False)

    def __deepcopy__(self, memo) -> "World":
        """The world itself: it names this process's place among its peers (its process group,
        backend, the groups and buffers it makes for the ops), which a copy of a module that
        holds it shares, as a copied module shares its process group (a process group cannot
        be copied: a deep copy of a layer on the torch path raised once an op had made the
        world's signal group)."""
        return self

    # -- constructors ------------------------------------------------------------------------
    @classmethod
    def from_env(cls, backend: Optional[str] = None, timeout_s: float = 300) -> "World":
        """torchrun if its variables are set, else mpirun (Open MPI / MPICH / PMI variables),
        else a world of one process."""
        if dist.is_initialized():
            return cls.from_process_group(backend=backend)
        if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
            # one without the other is a launcher's mistake, not a world of one: running as
            # rank 0 of 1 would make each process compute alone, with no error
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
        if not dist.is_initialized():
            pair = ("a torchrun-style launch sets RANK and WORLD_SIZE together (unset both "
                    "for a world of one process)")
            rank, size = _env_count("RANK", None, pair), _env_count("WORLD_SIZE", None, pair)
            if not 0 <= rank < size:
                # torch's rendezvous would wait for a rank that cannot come until the timeout
                raise ValueError(f"RANK={rank} with WORLD_SIZE={size}: the rank must lie in "
                                 f"0 .. WORLD_SIZE-1 (and WORLD_SIZE be at least 1)")
            local_rank, _ = _local_env(rank, size, size)
        else:
            local_rank, _ = _local_env(dist.get_rank(), dist.get_world_size())
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
        """The world of ``group`` (None: the default process group), made on its members only.
        ``rank`` and ``world_size`` are the group's; ``local_rank`` and ``local_world_size``
        are the job's (``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``: this process's index among the
        processes of its host, and their count), since the local rank picks the device: on a
        subgroup the local world can be larger than the world. Without those variables the
        job is taken to run on one host and the local rank is the job's rank, not the
        group's (which on a subgroup names another process's device)."""
        check_names()  # (every constructor comes here: a misspelt override is reported once)
        be = get_backend(backend)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("World.from_process_group: this process is not a member of the "
                             "group; make the world on the group's ranks only")
        size = dist.get_world_size(group)
        local_rank, local_size = _local_env(dist.get_rank(), dist.get_world_size())
        device = device or _device_for(be, local_rank)
        return cls(rank, size, local_rank, local_size, device, be, group)

    # -- facts and host-side collectives (set-up time only, never inside an op call) ---------
    @property
    def facts(self) -> DeviceFacts:
        if not hasattr(self, "_facts"):
            self._facts = self.backend.device_facts(self.device)
        return self._facts

    def host_layout(self) -> tuple:
        """How this world's ranks sit on hosts: the number of its ranks on each host, hosts in
        the order of their lowest rank (``(8,)``: one host of eight; ``(4, 4)``: two). Two
        groups of one size can move bytes at very different rates (NVLink inside a host, the
        network across hosts), so the tuning decisions are keyed by it. A host collective the
        first time (every rank asks at the same point: set-up, or a call every rank plans)."""
        return host_layout([host for host, _ in self.placement()])

    def placement(self) -> list:
        """Every rank's (host name, device uid), in rank order: the device uid is the backend's
        name for the physical device (``DeviceFacts.uid``, a GPU's UUID), so two ranks that
        name one share that device. A host collective the first time (every rank asks at the
        same point: set-up, or a call every rank plans), kept for the world's life."""
        if getattr(self, "_placement", None) is None:
            uid = self.facts.uid or f"{self.device}"  # unknown: the device as this rank names it
            self._placement = self.all_gather_object((socket.gethostname(), uid))
        return self._placement

    def shares_devices(self) -> bool:
        """Whether two ranks of this world run on one device (two processes on one GPU: a test
        set-up, or MPS). Transports that take one device per rank (torch's symmetric memory,
        NVSHMEM) cannot run there. A host collective the first time (``placement``)."""
        return len(set(self.placement())) < self.world_size

    def all_gather_object(self, obj: Any) -> list:
        """Every rank's ``obj``. Where a peer sent a :class:`SetupRefusal` in place of its value
        (its part of a set-up raised before it reached this collective: ``collective_setup``),
        raises :class:`~portable_overlap.errors.PeerSetupError` naming it, on every rank that
        did not refuse."""
        self.collectives += 1
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        refusals = [o for o in out if isinstance(o, SetupRefusal)]
        if refusals and not isinstance(obj, SetupRefusal):
            from .errors import PeerSetupError

            raise PeerSetupError("; ".join(f"rank {o.rank} refused to make {o.what} ({o.error})"
                                           for o in refusals)
                                 + f"; rank {self.rank} stopped making its own as well")
        return out

    def refuse_setup(self, what: str, error: BaseException) -> None:
        """Tell the peers, in the collective they wait in, that this rank's part of the set-up
        ``what`` raised ``error`` before it reached that collective."""
        self.all_gather_object(SetupRefusal(self.rank, what, f"{type(error).__name__}: {error}"))

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank. ``src`` is a rank of this world (of its
        process group), as :attr:`rank` is: torch reads a plain ``src`` as a rank of the whole
        job, which on a subgroup world names another process (or one outside the group)."""
        self.collectives += 1
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=src)
        return box[0]

    def barrier(self) -> None:
        """Every rank's host waits until every rank got here (on a GPU, after the work queued
        on its stream before the barrier ran)."""
        self.collectives += 1
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
            word = self._barrier_word = kept_zeros(1, torch.int32, self.device)
        dist.all_reduce(word, group=self.group)

    def check_same(self, what: str, value: Any, gather: Optional[Callable] = None) -> None:
        """Raise on every rank if the ranks disagree on ``value`` (host sync; set-up time).
        ``what`` travels with it: ranks that meet here while setting up different things (one
        op's context on one rank, another's on the other: contexts made in other orders) are
        told what each rank was making, where naming this rank's ``what`` alone would call the
        peer's arguments another value of it. ``gather`` gathers one object from every rank
        (default: ``all_gather_object`` on the world's group, under the process group's own
        timeout)."""
        from .errors import RankMismatchError

        pairs = (gather or self.all_gather_object)((what, value))
        if any(w != what for w, _ in pairs):
            raise RankMismatchError(
                "ranks are setting up different things at once (contexts made in other orders, "
                "or other ops on some ranks; every rank must make the same contexts in the same "
                "order): " + "; ".join(f"rank {r}: {w} {v}" for r, (w, v) in enumerate(pairs)))
        values = [v for _, v in pairs]
        if any(v != values[0] for v in values):
            raise RankMismatchError(f"ranks disagree on {what}: " + ", ".join(
                f"rank {r}: {v}" for r, v in enumerate(values)))

    def check_same_or_raise(self, what: str, value: Any, refusal: Optional[BaseException],
                            gather: Optional[Callable] = None) -> None:
        """``check_same`` of ``value``, or of ``refusal`` where this rank refused the step (its
        own check failed): every rank then raises, the refusing ones their error, the others a
        ``RankMismatchError`` naming it. Raised before the comparison, a refusal on some ranks
        only left the others waiting in it."""
        from .errors import RankMismatchError

        try:
            self.check_same(what, value if refusal is None else
                            f"refused ({type(refusal).__name__}: {refusal})", gather=gather)
        except RankMismatchError:
            if refusal is None:
                raise
        if refusal is not None:
            raise refusal

    def __repr__(self) -> str:
        return (f"World(rank={self.rank}/{self.world_size}, local={self.local_rank}/"
                f"{self.local_world_size}, device={self.device}, backend={self.backend.name}, "
                f"launcher={self.launcher})")


def host_layout(hosts: list) -> tuple:
    """The ranks per host of ``hosts`` (each rank's host name, in rank order), hosts in the
    order of their lowest rank: ``["a", "b", "a", "b"]`` gives ``(2, 2)``."""
    return tuple(collections.Counter(hosts).values())  # (a Counter keeps first-seen order)


@dataclasses.dataclass(frozen=True)
class SetupRefusal:
    """What a rank sends its peers in place of its value when its part of a collective set-up
    raised before the set-up's first host collective (``collective_setup``)."""
    rank: int
    what: str
    error: str


def collective_setup(init):
    """Decorate the ``__init__`` of a class whose construction is collective (it takes a
    :class:`World` among its arguments, and its ranks meet in host collectives: its argument
    agreement, the heap's allocation). An exception the constructor raises on this rank before
    it entered any host collective (a check of its own arguments, which a peer may pass) is
    told to the peers through the first collective they wait in, where they raise
    :class:`~portable_overlap.errors.PeerSetupError`, instead of waiting there until the process
    group's timeout; this rank raises its own exception. Constructors met within one another
    tell it once: an outer one sees the inner one's collective."""
    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        world = next((a for a in (*args, *kwargs.values()) if isinstance(a, World)), None)
        before = None if world is None else world.collectives
        try:
            if world is not None:
                # the device's facts read the library's overrides (PORTABLE_OVERLAP_CPU_SLOTS,
                # ...): one refused on this rank alone raises here, before any collective, so
                # the peers are told, where read later (a transport's plan) it left them waiting
                world.facts
            init(self, *args, **kwargs)
        except Exception as e:
            if world is not None and world.world_size > 1 and world.collectives == before:
                world.refuse_setup(type(self).__name__, e)
            raise

    wrapper.collective_setup = True
    return wrapper


def _env_count(name: str, default: Optional[int], needed: str = "") -> int:
    """``$name`` as an integer (a launcher's count or index); ``default`` when unset or empty,
    else an error naming the variable and why it is ``needed``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        if default is None:
            raise ValueError(f"{name} is not set: {needed}")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def _local_env(rank: int, size: int, most: Optional[int] = None) -> tuple:
    """``(LOCAL_RANK, LOCAL_WORLD_SIZE)``, by default ``rank`` and ``size`` (one host),
    checked (``most``: the world's size, where the ranks of this host are among its): the
    local rank picks the device, so one out of range would put this rank on another rank's
    device with no error."""
    local_size = _env_count("LOCAL_WORLD_SIZE", size)
    if local_size < 1 or (most is not None and local_size > most):
        bound = "at least 1" if most is None else f"in 1 .. WORLD_SIZE={most}"
        raise ValueError(f"LOCAL_WORLD_SIZE={local_size}: it must be {bound}")
    local_rank = _env_count("LOCAL_RANK", rank if local_size == size else None,
                            f"LOCAL_WORLD_SIZE={local_size} says the ranks span hosts, so the "
                            f"rank's index on its host must be given")
    if not 0 <= local_rank < local_size:
        raise ValueError(f"LOCAL_RANK={local_rank} with LOCAL_WORLD_SIZE={local_size}: the "
                         f"local rank must lie in 0 .. LOCAL_WORLD_SIZE-1")
    return local_rank, local_size


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
