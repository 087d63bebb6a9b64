"""Exceptions raised by portable_overlap. Every message names the op, rank and what to do."""
from __future__ import annotations


class PortableOverlapError(RuntimeError):
    """Base class of the library's errors."""


class BackendUnavailable(PortableOverlapError):
    """The backend named (by ``PORTABLE_OVERLAP_BACKEND`` or by argument) cannot be used here."""


class BackendEntryMissing(PortableOverlapError, NotImplementedError):
    """A backend does not implement one entry of the interface."""

    def __init__(self, backend: str, entry: str):
        super().__init__(f"backend {backend!r} does not implement {entry!r}")
        self.backend = backend
        self.entry = entry


class PeerTimeoutError(PortableOverlapError):
    """A bounded wait inside a kernel gave up: a peer never signalled.

    The kernel recorded which op, which rank waited, for which peer and which flag; the context
    that raised it is out of step with its peers and must be closed.
    """


class RankMismatchError(PortableOverlapError):
    """The ranks called a collective op with different shapes or arguments. The message names
    the ranks that disagree and what each passed (shapes, dtype, settings), and the fields that
    differ."""


class PeerSetupError(PortableOverlapError):
    """A collective set-up (the symmetric heap's allocation or mapping) failed on some rank.

    Every rank raises it in the same call, naming the ranks that failed and why, after freeing
    what it had set up; nothing is left to close."""


class ContextBrokenError(PortableOverlapError):
    """The context already raised a peer error; its peers are out of step, create a new one."""


class ContextClosedError(PortableOverlapError, ValueError):
    """The context was closed (or its handle belongs to no open context)."""


class ConcurrentUseError(PortableOverlapError):
    """A second thread called a context while another thread's call was running."""


class InvalidInputError(PortableOverlapError, ValueError):
    """A kernel found data-dependent input invalid (a routing slot out of range, row counts that
    do not add up). Checks that need no device data raise ValueError before any launch; these
    are found on the device and raised at the context's next check."""
