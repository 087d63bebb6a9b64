"""Tuning decisions shared by the ranks: a cache per (op, shape, dtype, world size, ranks per
host, device, versions), rank 0 decides, every rank uses rank 0's choice, and ranks whose
caches disagree decide again.

Also the calibration the wave-group predictor needs: a collective's time against message size
(``measure_comm_curve``), timed the way the benchmarks time (slowest rank's median).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import statistics
import tempfile
import time
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .. import collectives
from ..envvars import env_file_path


def cache_key(op: str, shape: dict, dtype, world_size: int, device: str,
              hosts: Optional[Sequence[int]] = None) -> str:
    """What a decision depends on: the op, its shape, dtype, world size, how the world's ranks
    sit on hosts (``hosts``: ``World.host_layout()``, the ranks per host; None: one host), the
    device's name, and the versions of torch, Triton and this library. A process in two groups
    of one size (a tensor-parallel pair inside a host, a data-parallel pair across two) keeps a
    decision for each."""
    import triton

    from .. import __version__

    hosts = [world_size] if hosts is None else [int(n) for n in hosts]
    if sum(hosts) != world_size or min(hosts, default=0) < 1:
        raise ValueError(f"cache_key: hosts {hosts} must be positive counts of ranks adding up "
                         f"to the world size {world_size}")
    return json.dumps({"op": op, "shape": shape, "dtype": str(dtype), "world": world_size,
                       "hosts": hosts, "device": device, "torch": torch.__version__,
                       "triton": triton.__version__, "portable_overlap": __version__},
                      sort_keys=True)


CACHE_VAR = "PORTABLE_OVERLAP_TUNING_CACHE"


class MemoryCache:
    """Decisions kept in this process only (``entries``): ``decide``'s cache where no file is
    named."""

    path = None

    def __init__(self, entries: Optional[dict] = None):
        self.entries = {} if entries is None else entries

    def get(self, key: str) -> Any:
        return self.entries.get(key)

    def put(self, key: str, value: Any) -> None:
        self.entries[key] = value


#: the decisions of ``decide`` calls given no cache, where no file is named: the process's
_PROCESS_DECISIONS = MemoryCache()


def default_cache():
    """The cache ``decide`` uses when given none: the file ``$PORTABLE_OVERLAP_TUNING_CACHE``
    names (read when it is called), else this process's memory. Decisions go to disk only at a
    path the user set."""
    path = env_file_path(CACHE_VAR)
    return TuningCache(path) if path else _PROCESS_DECISIONS


class TuningCache:
    """A JSON file of decisions (``path``, or ``$PORTABLE_OVERLAP_TUNING_CACHE`` read when the
    cache is made; one of the two is needed), one per rank process.

    :meth:`put` replaces the file atomically: a new temporary file (O_EXCL, mode 0600) next to
    it, fsynced, renamed over it, so a reader sees the old file or the new one, never half of
    one, and no link planted at a temporary name is followed. A cache path that is itself a
    symbolic link is neither read nor written, with a warning (the decisions are still made and
    used in this process): writing there would put the file wherever the link points. A file
    that cannot be read or parsed is ignored with a warning and replaced at the next put. A put
    writes this cache's entries, the file's entries as it finds them then over those (another
    cache of the same file may have written since this one read it), and its decision over
    both; puts into one folder from several processes take turns (``_folder_lock``). A put
    that cannot write the file (a read-only folder, a full disk, a path under a regular file)
    warns and keeps the decision in this process: ``decide`` puts after every rank took the
    decision, and a rank that raised there would leave its peers waiting in the call."""

    def __init__(self, path: Optional[str] = None):
        self.path = path or env_file_path(CACHE_VAR)
        if not self.path:
            raise ValueError(f"TuningCache: give the file's path, or set {CACHE_VAR} (decisions "
                             f"kept in memory only: MemoryCache)")
        self.entries = _load(self.path)

    def get(self, key: str) -> Any:
        return self.entries.get(key)

    def put(self, key: str, value: Any) -> None:
        json.dumps({key: value})  # a value JSON cannot hold raises here and changes nothing
        self.entries = {**self.entries, key: value}
        if os.path.islink(self.path):
            _warn(f"tuning cache {self.path} is a symbolic link: the decision for {key} is not "
                  f"written (remove the link, or set {CACHE_VAR} to the path of a regular file)")
            return
        if os.path.exists(self.path) and not os.path.isfile(self.path):
            # a device node or a FIFO (/dev/null, set to turn the cache off): the atomic
            # write renames a file over the path, which would replace the node itself
            _warn(f"tuning cache {self.path} is not a regular file: the decision for {key} is "
                  f"kept in this process only (unset {CACHE_VAR} to keep decisions in memory, "
                  f"or set it to the path of a regular file)")
            return
        try:
            folder = os.path.dirname(self.path) or "."
            os.makedirs(folder, mode=0o700, exist_ok=True)
            with _folder_lock(folder):
                # the file's entries as they are now over this cache's (another cache of the
                # file, in this process or another, may have written since this one read it),
                # and this decision over both
                entries = {**self.entries, **_load(self.path, quiet=True), key: value}
                _replace_file(self.path, json.dumps(entries, indent=1, sort_keys=True))
            self.entries = entries
        except OSError as e:
            _warn(f"tuning cache {self.path} cannot be written ({e}): the decision for {key} is "
                  f"kept in this process only (set {CACHE_VAR} or cache_path to a writable "
                  f"file)")


#: how long a put waits for another process's put into the same folder (seconds) before it
#: writes without the lock: a put takes milliseconds, and a writer that holds the lock longer
#: (stopped in a debugger) must not stop every other rank's job
LOCK_WAIT_S = 10.0


@contextlib.contextmanager
def _folder_lock(folder: str):
    """An exclusive ``flock`` on ``folder`` around a put's read, merge and replacement of the
    file: without it, writers in several processes each replaced the file with what they had
    read before the others wrote (4 processes of 40 puts each kept 72 of the 160 entries).
    Waits at most :data:`LOCK_WAIT_S`; a folder that cannot be locked (a file system without
    ``flock``) is written without the lock."""
    import fcntl

    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.005)
            except OSError:
                break
        yield
    finally:
        os.close(fd)  # (releases the lock)


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _load(path: str, quiet: bool = False) -> dict:
    """The decisions in the file at ``path``; none (with a warning, unless ``quiet``) if it is
    a symbolic link, not a regular file, unreadable or not a JSON object; none (silently) if it
    does not exist."""
    try:
        # O_NONBLOCK: a FIFO planted at the path must not block the open
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}
    except OSError as e:
        return _ignored(path, "is a symbolic link" if e.errno == errno.ELOOP
                        else f"cannot be read ({e.strerror})", quiet)
    with os.fdopen(fd, "rb") as f:
        try:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return _ignored(path, "is not a regular file", quiet)
            text = f.read()
        except OSError as e:
            # a file that opens and then fails to read (EIO; ESTALE where another node renamed
            # a new version over a file shared on NFS): ignored like an unreadable one, not
            # raised on this rank alone while its peers wait in the call's next collective
            return _ignored(path, f"cannot be read ({e.strerror or e})", quiet)
        try:
            entries = json.loads(text.decode())
        except (ValueError, RecursionError) as e:  # bad UTF-8, nesting past the parser's depth
            return _ignored(path, f"is not valid JSON ({e})", quiet)
    if not isinstance(entries, dict):
        return _ignored(path, "does not hold a JSON object", quiet)
    return entries


def _ignored(path: str, why: str, quiet: bool = False) -> dict:
    if not quiet:
        _warn(f"tuning cache {path} {why}; ignored: its decisions are made again")
    return {}


def _replace_file(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically, through a fresh private file in its folder."""
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # renames over a link planted meanwhile, never through it
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def decide(world, key: str, compute: Callable[[], Any],
           cache: Optional[TuningCache] = None,
           valid: Optional[Callable[[Any], bool]] = None) -> Any:
    """Collective: the decision for ``key``. Where every rank's cache holds the same one, it is
    used as it is; otherwise every rank runs ``compute`` (measurements are collective) and every
    rank records and uses rank 0's result. An entry that ``valid`` refuses (a hand-edited file,
    one written for a transport this build lacks) counts as none, and ranks whose caches hold
    different entries (files of separate runs, a stale copy) decide again: both warn, and the
    new decision replaces the entries, so the ranks never run on different decisions and a bad
    file never stops the job."""
    try:
        # $PORTABLE_OVERLAP_TUNING_CACHE refused on this rank alone (a folder): told to the
        # peers in the collective below, where raised before it they waited there for ever
        cache = default_cache() if cache is None else cache
        refused = None
    except Exception as e:  # (any error of this rank alone: the peers hear of it below)
        refused = e
    mine = None
    if refused is None:
        where = getattr(cache, "path", None) or "in memory"
        mine = cache.get(key)
        if mine is not None and valid is not None and not _holds(valid, mine):
            _warn(f"tuning cache {where} holds {mine!r} for {key}, which is not a decision of "
                  f"this call; it is made again")
            mine = None
    posts = world.all_gather_object(("entry", mine) if refused is None else
                                    ("refused", f"{type(refused).__name__}: {refused}"))
    if refused is not None:
        raise refused
    failed = [f"rank {r}: {why}" for r, (kind, why) in enumerate(posts) if kind == "refused"]
    if failed:
        from ..errors import PeerSetupError

        raise PeerSetupError(f"the tuning decision for {key} was not made: the tuning cache "
                             f"was refused on " + "; ".join(failed))
    held = [v for _, v in posts]
    known = {json.dumps(v, sort_keys=True) for v in held if v is not None}
    if len(known) > 1:
        _warn(f"tuning caches disagree for {key}: " + ", ".join(
            f"rank {r}: {v}" for r, v in enumerate(held)) + "; it is made again, and every "
            f"rank's cache ({where} on this rank) gets rank 0's new decision")
    elif known and all(v is not None for v in held):
        return mine
    value = compute()  # collective if the measurement is: every rank takes part
    value = world.broadcast_object(value)
    cache.put(key, value)
    return value


def _holds(valid: Callable[[Any], bool], value: Any) -> bool:
    """``valid(value)``, False where it raises (an entry of a shape the check did not expect)."""
    try:
        return bool(valid(value))
    except Exception:
        return False


def _now(device) -> Callable[[], float]:
    if device.type == "cpu":
        return time.perf_counter
    mod = torch.get_device_module(device)

    def now():
        mod.synchronize(device)
        return time.perf_counter()

    return now


#: timed runs queued behind one hold of the stream (``queue_ahead``)
AHEAD = 10
#: the hold: 4e6 GPU clock cycles, 2 ms or more at up to 2 GHz, while the host queues AHEAD
#: runs (a barrier, two events and a graph replay each: tens of microseconds of host time)
HOLD_CYCLES = 4_000_000


def queue_ahead(dev) -> None:
    """Hold ``dev``'s current stream for about 2 ms (a spinning kernel), so that the host queues
    the next :data:`AHEAD` timed runs before the GPU reaches them, as a model's host runs ahead
    of its GPU. Without it each run starts when its own host gets there: a stream barrier
    before each run (``World.stream_barrier``) then releases the ranks at the moment the last
    host launched, and a run that waits for its peers counts that host's delay. On 4 H200s a
    16 KiB GEMV + AllReduce timed in 0.047 or in 0.077 ms from one round to the next, torch's
    path alike, without the hold."""
    torch.get_device_module(dev)._sleep(HOLD_CYCLES)


def time_call(fn: Callable[[], Any], world, *, iters: int = 20, warmup: int = 3,
              graph: bool = False, host_bound: bool = False) -> float:
    """Collective: the slowest rank's median milliseconds of ``fn`` over ``iters`` runs, a
    barrier before each (the benchmark protocol, in the library so tuners time alike). Device
    events around each run; with ``graph``, ``fn`` is captured once into a device graph (after
    ``warmup`` plain runs on a side stream, which also load its kernels) and each run replays
    it. On a GPU the barrier is on the stream (``World.stream_barrier``), the stream held while
    the host queues the next runs (:func:`queue_ahead`): with a host barrier
    every candidate that waits for its peers counts the gap between the ranks' hosts, tens of
    microseconds, which would decide between candidates of a decode step. On the CPU the host
    clock times plain runs.

    ``host_bound`` (plain runs on a GPU): the larger of the device's median and the median
    host time to issue one run, what a caller that issues runs one after another gets. The hold
    hides up to 2 ms of host work per :data:`AHEAD` runs from the device's events: on 2 H200s a
    GEMV + AllReduce whose eager calls first agreed with their peers through the store (0.5 ms
    of host time) timed 0.072 ms by the events alone, as fast as the kernel that needs no
    agreement, and ran at 0.62 ms per call when picked."""
    dev = world.device
    if dev.type == "cpu":
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            world.barrier()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return max(world.all_gather_object(statistics.median(times)))
    device_ms, host_ms = timed_runs(fn, world, iters=iters, warmup=warmup, graph=graph)
    ms = statistics.median(device_ms)
    if host_bound and not graph:
        ms = max(ms, statistics.median(host_ms))
    return max(world.all_gather_object(ms))


#: device -> (warm-up stream, capture stream) of :func:`timed_runs`, one pair per device for
#: the process: BLAS libraries keep a workspace per stream that runs their products (cuBLAS:
#: 32 MiB on sm_90, kept until the process ends), so new streams at every timing lost 32 MiB
#: per stream to each timed candidate that multiplies with them (128 MiB per GEMV + AllReduce
#: context whose ``"auto"`` timed its first shape, on one H100:
#: ``benchmarks/probe_context_churn.py``)
_TIMING_STREAMS: dict = {}


def _timing_streams(dev: torch.device) -> tuple:
    pair = _TIMING_STREAMS.get(dev)
    if pair is None:
        mod = torch.get_device_module(dev)
        pair = _TIMING_STREAMS[dev] = (mod.Stream(device=dev), mod.Stream(device=dev))
    return pair


def timed_runs(fn: Callable[[], Any], world, *, iters: int, warmup: int, graph: bool,
               replay_warmup: int = 0, barrier: str = "device") -> tuple:
    """On a GPU: ``(device ms, host ms)`` of each of ``iters`` runs of ``fn`` on this rank, the
    protocol of :func:`time_call` and of the benchmarks (``benchmarks/harness.py``): ``warmup``
    plain runs (with ``graph`` on a side stream, then ``fn`` captured once and each run a
    replay, after ``replay_warmup`` untimed replays), then per run a barrier (``"device"``: on
    the stream, the stream held before every :data:`AHEAD` runs, :func:`queue_ahead`;
    ``"host"``: ``world.barrier``) and device events around it; the host ms is how long the
    host took to issue the run."""
    dev = world.device
    mod = torch.get_device_module(dev)
    run = fn
    if graph:
        side, capture = _timing_streams(dev)
        side.wait_stream(mod.current_stream(dev))
        with mod.stream(side):  # warm-up outside the capture: compiles, plans, comms
            for _ in range(warmup):
                fn()
        mod.current_stream(dev).wait_stream(side)
        mod.synchronize(dev)
        world.barrier()
        g = mod.CUDAGraph()  # torch's name on both vendors (HIP graphs on ROCm builds)
        with mod.graph(g, stream=capture):
            fn()
        run = g.replay
        for _ in range(replay_warmup):
            run()
    else:
        for _ in range(warmup):
            fn()
    mod.synchronize(dev)
    before = world.stream_barrier if barrier == "device" else world.barrier
    events = [(mod.Event(enable_timing=True), mod.Event(enable_timing=True))
              for _ in range(iters)]
    world.barrier()
    host = []
    for i, (start, end) in enumerate(events):
        if barrier == "device" and i % AHEAD == 0:
            queue_ahead(dev)
        before()
        start.record()
        t0 = time.perf_counter()
        run()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
    mod.synchronize(dev)
    return [s.elapsed_time(e) for s, e in events], host


def rotated_rounds(names: Sequence[str], rounds: int) -> list:
    """The order of ``names`` in each of ``rounds`` rounds, rotated by one each round, so that
    no name is always timed after the same others (``time_paths``)."""
    names = list(names)
    return [names[r % len(names):] + names[:r % len(names)] for r in range(rounds)] \
        if names else []


def time_paths(paths: dict, world, *, iters: int = 20, warmup: int = 3, graph: bool = False,
               rounds: int = 3) -> dict:
    """Collective: ``{name: ms}`` for the callables of ``paths``: ``time_call`` of each in
    ``rounds`` rounds of ``iters // rounds`` runs (at least one), the order rotated each round
    (``rotated_rounds``), each path's median over its rounds. A fixed order favours the first
    path, as a GPU's clock falls while it heats: on one H100 the same AllGather + GEMM kernel
    timed 9-13% slower after two other paths than before them
    (``benchmarks/probe_allgather_tutorial_gap.py``)."""
    rounds = max(1, min(rounds, iters))
    per: dict = {name: [] for name in paths}
    for order in rotated_rounds(paths, rounds):
        for name in order:
            per[name].append(time_call(paths[name], world, iters=max(1, iters // rounds),
                                       warmup=warmup, graph=graph))
    return {name: statistics.median(v) for name, v in per.items()}


def measure_comm_curve(world, collective: str, sizes: Sequence[int], dtype=torch.bfloat16,
                       iters: int = 20) -> tuple:
    """Collective: ``((bytes, ms), ...)`` of ``collective`` ("all_reduce", "reduce_scatter",
    "all_to_all") over the world's group for each message size in bytes (the bytes each rank
    contributes), slowest rank's median of ``iters`` after a barrier each."""
    dev, W = world.device, world.world_size
    elem = torch.empty((), dtype=dtype).element_size()
    now = _now(dev)
    curve = []
    for nbytes in sizes:
        n = max(W, nbytes // elem // W * W)
        x = torch.ones(n, dtype=dtype, device=dev)
        y = torch.empty(n // W if collective == "reduce_scatter" else n, dtype=dtype, device=dev)
        if collective == "all_reduce":
            run = lambda: dist.all_reduce(x, group=world.group)  # noqa: E731
        elif collective == "reduce_scatter":
            run = lambda: collectives.reduce_scatter(y, x, group=world.group)  # noqa: E731
        elif collective == "all_to_all":
            run = lambda: dist.all_to_all_single(y, x, group=world.group)  # noqa: E731
        else:
            raise ValueError(f"unknown collective {collective!r}")
        run()
        times = []
        for _ in range(iters):
            world.barrier()
            t0 = now()
            run()
            times.append((now() - t0) * 1e3)
        slowest = max(world.all_gather_object(statistics.median(times)))
        curve.append((n * elem, slowest))
    return tuple(curve)
