"""Lifecycle faults of the CPU-emulated backend: segments are anonymous (nothing is ever left in
/dev/shm or /tmp) and the backend opens only segments it made."""
import gc
import os
import subprocess
import tempfile

import pytest
import torch

from portable_overlap.backends import backend_classes

CPU = torch.device("cpu")
PREFIX = "portable_overlap_"


def _files_left() -> set:
    """Our segment names in the places a shared-memory file could be left behind."""
    dirs = {"/dev/shm", tempfile.gettempdir()}
    return {os.path.join(d, n) for d in dirs if os.path.isdir(d)
            for n in os.listdir(d) if n.startswith(PREFIX)}


def _resources() -> dict:
    """This process's open fds and mappings of our segments (to compare before and after)."""
    fds = set(os.listdir("/proc/self/fd"))
    with open("/proc/self/maps") as f:
        maps = sum(PREFIX in line for line in f)
    return {"fds": len(fds), "segment_maps": maps}


@pytest.fixture
def cpu_backend():
    return backend_classes()["cpu"]()


# -- segments are anonymous --------------------------------------------------------------------

def test_segments_are_anonymous_from_birth(cpu_backend):
    before = _files_left()
    a = cpu_backend.alloc_exportable(4096, CPU)
    try:
        assert _files_left() == before, "an exportable allocation made a file"
        peer = cpu_backend.open_handle(cpu_backend.export_handle(a), 4096, CPU)
        assert _files_left() == before
        cpu_backend.close_handle(peer)
    finally:
        cpu_backend.free(a)
    assert _files_left() == before


def test_free_closes_the_segment(cpu_backend):
    before = _resources()
    a = cpu_backend.alloc_exportable(4096, CPU)
    peer = cpu_backend.open_handle(cpu_backend.export_handle(a), 4096, CPU)
    cpu_backend.close_handle(peer)
    cpu_backend.free(a)
    del a, peer
    gc.collect()
    assert _resources() == before


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
        assert _resources() == before, "a refused handle left an fd or a mapping"
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
