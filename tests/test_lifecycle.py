"""Lifecycle faults of the CPU-emulated backend and the symmetric heap: segments are anonymous
(nothing is ever left in /dev/shm or /tmp, even when a rank is killed), the backend opens only
segments it made, a heap whose set-up fails on one rank frees everything and raises on every
rank."""
import gc
import os
import signal
import subprocess
import tempfile
import time

import pytest
import torch

from portable_overlap.backends import backend_classes
from portable_overlap.shmem import SymmetricHeap
from portable_overlap.testing import EmulatedWorld, WorkerHang

CPU = torch.device("cpu")
PREFIX = "portable_overlap_"


def _files_left(pids) -> list:
    """Files named like the segments of processes ``pids`` in the places a shared-memory file
    could be left behind (segment names carry the creator's pid; other processes on this
    machine may be using the library meanwhile)."""
    names = tuple(f"{PREFIX}{pid}_" for pid in pids)
    dirs = {"/dev/shm", tempfile.gettempdir()}
    return [os.path.join(d, n) for d in dirs if os.path.isdir(d)
            for n in os.listdir(d) if n.startswith(names)]


def _resources() -> dict:
    """This process's open fds (fd -> what it links to) and its count of mappings of our
    segments, to compare with :func:`_leaked`. Garbage is collected first: a segment stays
    mapped while a view of it lives (``HostSegment``), and views an earlier call of this rank
    process left in reference cycles would otherwise be unmapped between the two readings."""
    gc.collect()
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the fd listdir itself used
            pass
    with open("/proc/self/maps") as f:
        maps = sum(PREFIX in line for line in f)
    return {"fds": fds, "segment_maps": maps}


def _leaked(before: dict, after: dict) -> dict:
    """The fds opened and the segment mappings made between two :func:`_resources` (fds that
    closed meanwhile, a garbage-collected file or a dead peer's socket, do not count)."""
    new = {fd: link for fd, link in after["fds"].items() if before["fds"].get(fd) != link}
    maps = max(0, after["segment_maps"] - before["segment_maps"])  # (fewer: none made)
    return {k: v for k, v in (("fds", new), ("segment_maps", maps)) if v}


@pytest.fixture
def cpu_backend():
    return backend_classes()["cpu"]()


# -- segments are anonymous --------------------------------------------------------------------

def test_segments_are_anonymous_from_birth(cpu_backend):
    me = [os.getpid()]
    a = cpu_backend.alloc_exportable(4096, CPU)
    try:
        assert not _files_left(me), "an exportable allocation made a file"
        peer = cpu_backend.open_handle(cpu_backend.export_handle(a), 4096, CPU)
        assert not _files_left(me)
        cpu_backend.close_handle(peer)
    finally:
        cpu_backend.free(a)
    assert not _files_left(me)


def test_free_closes_the_segment(cpu_backend):
    before = _resources()
    a = cpu_backend.alloc_exportable(4096, CPU)
    peer = cpu_backend.open_handle(cpu_backend.export_handle(a), 4096, CPU)
    cpu_backend.close_handle(peer)
    cpu_backend.free(a)
    del a, peer
    gc.collect()
    assert not _leaked(before, _resources())


# -- the backend opens only segments it made ---------------------------------------------------

def _other_memfd_handle():
    fd = os.memfd_create("someone_else")
    os.ftruncate(fd, 4096)
    return (os.getpid(), fd, "someone_else"), [fd]


def _passwd_under_our_name():
    fd = os.open("/etc/passwd", os.O_RDONLY)
    return (os.getpid(), fd, PREFIX + "1_000000000000"), [fd]


def _another_process_fd():
    p = subprocess.Popen(["sleep", "30"], stdin=subprocess.PIPE)
    return (p.pid, 0, PREFIX + f"{p.pid}_000000000000"), [p]


def _our_segment_under_another_name(be):
    a = be.alloc_exportable(4096, CPU)
    pid, fd, _ = be.export_handle(a)
    return (pid, fd, PREFIX + f"{pid}_0123456789ab"), [a]


FORGED = {
    "old-style path": lambda be: (b"/etc/passwd", []),
    "a path string": lambda be: ("/etc/passwd", []),
    "not a tuple": lambda be: (None, []),
    "two fields": lambda be: ((os.getpid(), 3), []),
    "strings for ints": lambda be: (("1", "2", PREFIX + "1_000000000000"), []),
    "bool pid": lambda be: ((True, 3, PREFIX + "1_000000000000"), []),
    "negative fd": lambda be: ((os.getpid(), -1, PREFIX + "1_000000000000"), []),
    "no such process": lambda be: ((2 ** 22 + 17, 3, PREFIX + "1_000000000000"), []),
    "a name with a slash": lambda be: ((os.getpid(), 0, PREFIX + "../../etc/passwd"), []),
    "a memfd not ours": lambda be: _other_memfd_handle(),
    "a file under our name": lambda be: _passwd_under_our_name(),
    "another process's fd": lambda be: _another_process_fd(),
    "our segment, other name": _our_segment_under_another_name,
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_open_handle_refuses_handles_not_ours(cpu_backend, case):
    handle, keep = FORGED[case](cpu_backend)
    before = _resources()
    try:
        with pytest.raises(ValueError, match="not a segment of the cpu backend"):
            cpu_backend.open_handle(handle, 16, CPU)
        assert not _leaked(before, _resources()), "a refused handle left an fd or a mapping"
    finally:
        for k in keep:
            if isinstance(k, int):
                os.close(k)
            elif isinstance(k, subprocess.Popen):
                k.kill()
                k.wait()
            else:
                cpu_backend.free(k)


def test_open_handle_refuses_a_size_beyond_the_segment(cpu_backend):
    a = cpu_backend.alloc_exportable(4096, CPU)
    try:
        with pytest.raises(ValueError, match="4096 bytes.*8192"):
            cpu_backend.open_handle(cpu_backend.export_handle(a), 8192, CPU)
    finally:
        cpu_backend.free(a)


# -- heap set-up that fails half-way -----------------------------------------------------------

def _heap_with_a_failing_step(world, failing_rank, step):
    """Make a heap while ``step`` (a backend entry) raises on ``failing_rank``; then make a good
    one, which needs the ranks still in step. Returns how the first ended and this process's
    resources before and after it."""
    be = world.backend
    before = _resources()

    def refuse(*args, **kwargs):
        raise OSError(f"injected: {step} failed")

    if world.rank == failing_rank:
        setattr(be, step, refuse)
    try:
        SymmetricHeap(world, 4096)
        outcome = "no error"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    finally:
        be.__dict__.pop(step, None)
    gc.collect()
    after = _resources()
    SymmetricHeap(world, 4096).close()
    return outcome, before, after


@pytest.mark.parametrize("step", ["alloc_exportable", "open_handle"])
def test_heap_setup_failing_on_one_rank_frees_everything_everywhere(world2, step):
    for rank, (outcome, res_before, res_after) in enumerate(
            world2.run(_heap_with_a_failing_step, 1, step, timeout=60)):
        assert outcome.startswith("PeerSetupError: "), (rank, outcome)
        assert "rank 1 could not" in outcome and f"injected: {step} failed" in outcome, outcome
        assert not _leaked(res_before, res_after), (rank, _leaked(res_before, res_after))
    assert not _files_left(world2.pids)


def _context_with_a_failing_status_board(world, kind):
    """Make a context (``kind``: an op's, or a device-API ``Workspace``) while the backend's
    host-mapped allocation (its status board, made after the heap) fails on rank 1; then make
    a good one and call it, which needs the ranks still in step. Returns how the first ended
    and this process's resources before and after it."""
    import portable_overlap as po

    def make():
        if kind == "workspace":
            return po.Workspace(world, 1024, timeout_s=10.0)
        return po.GemvAllReduce(world, max_n=32, transport="stores", timeout_s=10.0)

    be = world.backend
    before = _resources()

    def refuse(*args, **kwargs):
        raise OSError("injected: no host-mapped memory")

    if world.rank == 1:
        be.alloc_host_mapped = refuse
    try:
        make().close()
        outcome = "no error"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    finally:
        be.__dict__.pop("alloc_host_mapped", None)
    gc.collect()
    after = _resources()
    with make() as ctx:
        if kind == "workspace":
            ok = ctx.world_size == world.world_size
        else:
            x, w = torch.randn(2, 16), torch.randn(8, 16)
            ref = x @ w.T
            torch.distributed.all_reduce(ref, group=world.group)
            ok = torch.allclose(ctx(x, w), ref, rtol=1e-4, atol=1e-4)
    return outcome, before, after, ok


@pytest.mark.parametrize("kind", ["op_context", "workspace"])
def test_context_setup_failing_after_its_heap_on_one_rank_raises_on_every_rank(world2, kind):
    """A context's set-up on its heap (the status board in host memory the device writes)
    that fails on one rank raises PeerSetupError on every rank, which all free the heap
    together; before, the failing rank left alone (the op's context, with its heap never
    freed) or closed its heap into whatever collective its peers met next (``Workspace``).
    A context made after it works."""
    for rank, (outcome, res_before, res_after, ok) in enumerate(
            world2.run(_context_with_a_failing_status_board, kind, timeout=120)):
        assert outcome.startswith("PeerSetupError: "), (rank, outcome)
        assert "rank 1 could not set it up: OSError: injected" in outcome, outcome
        assert not _leaked(res_before, res_after), (rank, _leaked(res_before, res_after))
        assert ok, rank


def _context_with_bad_arguments_on_one_rank(world, case, bad_rank):
    """Makes the context of ``case`` with a bad argument on ``bad_rank`` only (or on every rank
    where ``bad_rank`` is None); returns how it ended and how long it took, then makes a good
    one (the ranks must still be in step)."""
    from portable_overlap import (GemvAllReduce, MatmulAllReduce, MoeDispatch, Workspace)

    def make(bad):
        if case == "gemv":
            return GemvAllReduce(world, max_n=0 if bad else 64, transport="stores")
        if case == "gemv_kernel_timeout":  # past the pattern's agreement, in the workspace's
            return GemvAllReduce(world, max_n=64, transport="stores",
                                 timeout_s=-1.0 if bad else 5.0)
        if case == "matmul":
            return MatmulAllReduce(world, 64, 64, transport="copy_engine",
                                   pieces=0 if bad else 2)
        if case == "moe_dispatch":
            return MoeDispatch(world, max_tokens=8, top_k=2, hidden=16, experts_per_rank=2,
                               transport="stores", capacity=-3 if bad else None)
        if case == "workspace":
            return Workspace(world, -1 if bad else 256)
        raise AssertionError(case)

    bad = bad_rank is None or world.rank == bad_rank
    t0 = time.monotonic()
    try:
        make(bad).close()
        outcome = "no error"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    took = time.monotonic() - t0
    make(False).close()
    return outcome, took


@pytest.mark.parametrize("case", ["gemv", "gemv_kernel_timeout", "matmul", "moe_dispatch",
                                  "workspace"])
def test_bad_context_arguments_on_one_rank_raise_on_every_rank(world2, case):
    """A context's check of its own arguments that fails on one rank: that rank raised, and
    its peers waited in the argument agreement until the process group's timeout (300 s).
    Now the peers raise PeerSetupError naming the rank, at once, and the next contexts are
    made in step."""
    for bad_rank in (1, 0, None):
        got = world2.run(_context_with_bad_arguments_on_one_rank, case, bad_rank, timeout=120)
        for rank, (outcome, took) in enumerate(got):
            assert took < 30, (case, rank, took, outcome)
            if bad_rank is None or rank == bad_rank:
                assert outcome.startswith("ValueError: "), (case, rank, outcome)
            else:
                assert outcome.startswith("PeerSetupError: "), (case, rank, outcome)
                assert f"rank {bad_rank} refused to make" in outcome, outcome
                assert "ValueError" in outcome, outcome


def _die_while_making_heap(world, victim, moment):
    """``victim`` kills itself (SIGKILL) right after the backend entry ``moment`` in the heap's
    set-up; the others report how the set-up ended, how long it took, and their resources
    before and after."""
    be = world.backend
    if world.rank == victim:
        real = getattr(be, moment)

        def then_die(*args, **kwargs):
            real(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)

        setattr(be, moment, then_die)
    before = _resources()
    t0 = time.monotonic()
    try:
        SymmetricHeap(world, 4096)
        outcome = "no error"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - t0
    gc.collect()
    return outcome, seconds, before, _resources()


@pytest.mark.emulated(ranks=2)  # its own world, not a fixture: conftest cannot see it
@pytest.mark.parametrize("moment", ["alloc_exportable", "open_handle"])
def test_rank_killed_while_making_a_heap(moment):
    ew = EmulatedWorld(2)
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerHang, match=r"ranks \[1\] died") as info:
            ew.run(_die_while_making_heap, 1, moment, timeout=60)
        assert time.monotonic() - t0 < 30
        status, answer = info.value.answers[0]  # the survivor answered: it did not hang
        assert status == "ok", answer
        outcome, seconds, res_before, res_after = answer
        assert outcome != "no error" and seconds < 20, answer
        # the survivor freed its heap: no fd or mapping of a segment is left
        assert not _leaked(res_before, res_after), _leaked(res_before, res_after)
    finally:
        ew.close(force=True)
    assert not _files_left(ew.pids)


def _unreferenced_context(world):
    """A context nothing refers to any more, before and after its ``close()``: whether it is
    still alive after a garbage collection, and whether its handle still names it."""
    import weakref

    from portable_overlap import GemvAllReduce
    from portable_overlap.ops.context import get_context

    ctx = GemvAllReduce(world, 16, transport="stores")
    handle, ref = ctx.handle, weakref.ref(ctx)
    del ctx
    gc.collect()
    kept = ref() is not None and get_context(handle) is ref()
    gen = torch.Generator().manual_seed(world.rank)
    x, w = torch.randn(2, 8, generator=gen), torch.randn(16, 8, generator=gen)
    works = bool(torch.allclose(ref()(x, w), _all_reduced(world, x, w), atol=1e-5))
    ref().close()
    try:
        get_context(handle)
        named = True
    except Exception:
        named = False
    return kept, works, named


def _all_reduced(world, x, w):
    import torch.distributed as dist

    y = x @ w.T
    dist.all_reduce(y, group=world.group)
    return y


def test_a_context_never_closed_is_kept_until_closed(world2):
    """Garbage collection runs on each rank at its own moment, so it never frees a context
    (README, "Threads and closed contexts"): the handle table keeps it, usable, until its
    collective ``close()``, which lets the handle go."""
    for kept, works, named in world2.run(_unreferenced_context, timeout=120):
        assert kept and works and not named
