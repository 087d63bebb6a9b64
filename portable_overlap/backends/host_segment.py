"""Host memory shared by the processes of one machine: an anonymous memory file (a memfd)
mapped into every process that opens it.

The CPU-emulated backend's "device memory" is made of these, and so is the planner's call board
(``ops/call_board.py``), on any backend, where every rank runs on one host.

A segment has no name in any file system: its owner keeps the memfd open while the segment
lives and the other processes open it through ``/proc/<owner pid>/fd/<fd>``. The memory goes
away with the last fd or mapping, so a process killed at any moment (SIGKILL included) leaves
nothing in /dev/shm or /tmp. Openers must run as the same user as the owner (the kernel checks
that on the /proc open). A handle comes from another process, so :meth:`HostSegment.open`
checks that it names a live segment of this module before it opens anything.
"""
from __future__ import annotations

import mmap
import os
import re
import secrets
import stat

import torch

PREFIX = "portable_overlap_"
#: the names :meth:`HostSegment.create` gives: prefix, owner pid, 12 random hex digits
_NAME = re.compile(re.escape(PREFIX) + r"[0-9]+_[0-9a-f]{12}")


class HostSegment:
    """One memfd mapped into this process; ``tensor`` is a uint8 view whose data_ptr is the
    mapping's address. ``fd`` is the memfd the owner keeps open so that others can open it,
    and an opener's own descriptor where it asked to keep one (``keep_fd``: POSIX record locks
    on the segment need an open descriptor), else None (the mapping alone keeps the memory
    alive)."""

    def __init__(self, fd: int, name: str, nbytes: int, keep: bool):
        self.mm = mmap.mmap(fd, nbytes)
        self.fd = fd if keep else None
        self.name = name
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.address = self.tensor.data_ptr()

    @classmethod
    def create(cls, nbytes: int) -> "HostSegment":
        name = f"{PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
        fd = os.memfd_create(name, os.MFD_CLOEXEC)  # CLOEXEC: a child must not pin the memory
        try:
            os.ftruncate(fd, nbytes)
            return cls(fd, name, nbytes, keep=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def open(cls, handle, nbytes: int, label: str = "host segment",
             keep_fd: bool = False) -> "HostSegment":
        """Map the segment ``handle`` names, after checking that it is one (``label`` names
        the segment's user in the errors): a handle comes from another process and must
        never make this one open an arbitrary file."""
        pid, fd, name = _parse_handle(handle, label)
        path = f"/proc/{pid}/fd/{fd}"
        # checked before the open, so that a forged handle never opens a FIFO or a device
        _check_target(handle, path, name, label)
        try:
            mine = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
        except OSError as e:
            raise _not_ours(handle, f"{path} cannot be opened ({e.strerror})", label) from None
        kept = False
        try:
            # checked again on what was opened: the owner may have closed and reused the fd since
            _check_target(handle, f"/proc/self/fd/{mine}", name, label)
            st = os.fstat(mine)
            if not stat.S_ISREG(st.st_mode):
                raise _not_ours(handle, f"{path} is not a memory segment", label)
            if st.st_size < nbytes:
                raise ValueError(f"{label}: segment {name} holds {st.st_size} bytes, fewer than "
                                 f"the {nbytes} bytes asked for; the processes disagree on its "
                                 f"size")
            seg = cls(mine, name, nbytes, keep=keep_fd)
            kept = keep_fd
            return seg
        finally:
            if not kept:
                os.close(mine)  # the mapping keeps the memory

    def handle(self) -> tuple:
        return (os.getpid(), self.fd, self.name)

    def close(self) -> None:
        self.tensor = None
        try:
            self.mm.close()
        except BufferError:  # a view is still alive: the mapping goes when the last view does
            pass
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _not_ours(handle, why: str, label: str) -> ValueError:
    return ValueError(f"{label}: handle {handle!r} is not a segment of the {label}: {why}. "
                      f"Handles come from HostSegment.handle in a live process of the same "
                      f"user on this machine")


def _parse_handle(handle, label: str) -> tuple:
    """``(pid, fd, name)`` of a handle made by :meth:`HostSegment.handle`, checked field by
    field."""
    if not (isinstance(handle, tuple) and len(handle) == 3):
        raise _not_ours(handle, "expected a tuple (pid, fd, name)", label)
    pid, fd, name = handle
    if type(pid) is not int or pid <= 0 or type(fd) is not int or fd < 0:
        raise _not_ours(handle, "pid must be an int > 0 and fd an int >= 0", label)
    if not (isinstance(name, str) and _NAME.fullmatch(name)):
        raise _not_ours(handle, f"the name must look like {PREFIX}<pid>_<12 hex digits>", label)
    return pid, fd, name


def _check_target(handle, path: str, name: str, label: str) -> None:
    """Refuse unless ``path`` (a /proc fd link) is the memfd called ``name``."""
    try:
        target = os.readlink(path)
    except OSError as e:
        raise _not_ours(handle, f"{path} cannot be read ({e.strerror}: the process exited, "
                                f"freed the segment, or belongs to another user)",
                        label) from None
    if target != f"/memfd:{name} (deleted)":
        raise _not_ours(handle, f"{path} is {target!r}, not the memfd {name!r}", label)
