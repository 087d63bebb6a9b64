"""The call board: host memory through which the ranks of one machine post their records of a
call's agreement (``planner.TransportPlanner._agree``) and read their peers'.

An eager call of a decided ``"sequential"`` or ``"torch_fused"`` key agrees with its peers
before it runs (their waits have no deadline). Through the process group's store that takes
four round trips to the store's server: 0.275 ms on 4 H200s against a 0.081 ms GEMV +
AllReduce call, 0.4 ms on two emulated ranks of a 2-core host. Where every rank runs on one
machine, the ranks post to and read one shared memory segment instead
(``backends.host_segment``), made with the planner.

Layout: two slots per rank (agreement ``n`` uses slot ``n % 2`` of each rank), each a header
of three int64 words (the agreement's tag ``n + 1``, the record's length, a checksum of ``n``
and the record) and up to :data:`RECORD_BYTES` of record. Two slots are enough: a rank posts
agreement ``n + 2`` only after every peer posted ``n + 1``, which a peer does only after it has
read every record of ``n``.

- **Posting** (:meth:`CallBoard.compare_set`): a record is written into a slot for agreement
  ``n`` only where that slot holds nothing of ``n`` yet, under a POSIX record lock on the slot
  (``fcntl.lockf``), so a rank's own post and a peer's claim of that slot (the peer stopped
  waiting, ``_agree``) never both land: the one that comes second reads the first. The record
  is written first and the tag last.
- **Reading** (:meth:`CallBoard.get`) takes no lock: the checksum rejects a record read while
  it was being written (or whose words became visible out of order), and the reader reads again.
  A record of agreement ``n`` is never written again in that agreement.
- **A record larger than a slot** goes to the process group's store under its agreement's key,
  and the slot holds a note saying so; its poster deletes it at its next agreement
  (:meth:`CallBoard.release`), by when every rank has read it.
"""
from __future__ import annotations

import fcntl
import pickle
import struct
import zlib
from typing import Optional

from ..backends.host_segment import HostSegment

#: the largest record a slot holds (a pickled dict: the call's inputs in words, a few hundred
#: bytes for most calls); a larger one goes through the store. A board takes 8 KiB per rank,
#: 64 KiB on 8 ranks, for each context of ``transport="auto"``
RECORD_BYTES = 4096 - 24
_HEADER = struct.Struct("<qqq")  # tag (agreement + 1), record length, checksum
_TAG = struct.Struct("<q")
_BODY = struct.Struct("<qq")
_SLOT = _HEADER.size + RECORD_BYTES
#: the note a slot holds for a record that went to the store
IN_STORE = pickle.dumps({"kind": "in store"})


def _checksum(n: int, record: bytes) -> int:
    return zlib.crc32(record, zlib.crc32(n.to_bytes(8, "little"))) | (len(record) << 32)


class CallBoard:
    """Two slots per rank in a :class:`HostSegment` every rank maps (module docstring).
    ``store_key(n, q)`` names the store key of rank ``q``'s record of agreement ``n`` where it
    is larger than a slot."""

    def __init__(self, segment: HostSegment, store_key):
        self.segment = segment
        self.store_key = store_key
        self._mm = segment.mm
        self._stored = []  # (n, q) of the records this process posted through the store

    # -- set-up ---------------------------------------------------------------------------------
    @classmethod
    def make(cls, world, store_key) -> Optional["CallBoard"]:
        """Collective: the board of ``world`` (rank 0 makes the segment, the others map it), or
        None on every rank where a rank could not map it or lock its slots (their agreements
        then go through the store). Ranks on another machine than rank 0 cannot: they find no
        such segment at the handle's ``/proc`` path (``HostSegment.open`` checks the random
        name it carries), so no count of the ranks per machine is needed, which a world made
        of a process group's subset does not know."""
        if world.world_size == 1:
            return None
        nbytes = 2 * world.world_size * _SLOT
        segment, handle = None, None
        if world.rank == 0:
            try:
                segment = HostSegment.create(nbytes)
                handle = segment.handle()
            except OSError:
                segment = None
        handle = world.broadcast_object(handle)
        if handle is not None and world.rank != 0:
            try:
                # the lock needs an open descriptor of the segment in this process
                segment = HostSegment.open(handle, nbytes, "call board", keep_fd=True)
            except (OSError, ValueError):  # another user, /proc hidden, another machine
                segment = None
        if segment is not None:
            try:  # the slots' record locks, tried once here rather than met at a call
                fcntl.lockf(segment.fd, fcntl.LOCK_EX, _SLOT, 2 * world.rank * _SLOT)
                fcntl.lockf(segment.fd, fcntl.LOCK_UN, _SLOT, 2 * world.rank * _SLOT)
            except OSError:
                segment.close()
                segment = None
        if not all(world.all_gather_object(segment is not None)):
            if segment is not None:
                segment.close()
            return None
        return cls(segment, store_key)

    def close(self) -> None:
        self._mm = None
        self.segment.close()

    # -- slots ----------------------------------------------------------------------------------
    def _offset(self, q: int, n: int) -> int:
        return (2 * q + n % 2) * _SLOT

    def _read(self, q: int, n: int):
        """``(tag, record)`` of rank ``q``'s slot for agreement ``n`` as it reads now; the record
        is None where the slot holds no record of ``n`` or later, or one not (yet) whole."""
        off = self._offset(q, n)
        tag = _TAG.unpack_from(self._mm, off)[0]
        if tag <= n:
            return tag, None
        length, check = _BODY.unpack_from(self._mm, off + _TAG.size)
        if not 0 <= length <= _SLOT - _HEADER.size:
            return tag, None
        record = bytes(self._mm[off + _HEADER.size:off + _HEADER.size + length])
        if _TAG.unpack_from(self._mm, off)[0] != tag or _checksum(tag - 1, record) != check:
            return tag, None
        return tag, record

    def get(self, q: int, n: int, store=None):
        """Rank ``q``'s record of agreement ``n``: ``("here", record)`` once it is posted,
        ``("past", record)`` where the slot holds a later agreement's record (the rank went on
        without this one: it is out of step), else ``("none", None)``. ``store``: where a record
        larger than a slot is (needed only once one is posted)."""
        for _ in range(64):  # a read that met a write in progress reads again
            tag, record = self._read(q, n)
            if tag <= n:
                return "none", None
            if record is not None:
                if record == IN_STORE:
                    record = store.get(self.store_key(tag - 1, q))
                return ("here" if tag == n + 1 else "past"), record
        return "none", None

    def compare_set(self, q: int, n: int, record: bytes, store=None) -> tuple:
        """Post ``record`` as rank ``q``'s record of agreement ``n`` unless that slot holds one
        of ``n`` (or later) already. Returns what :meth:`get` returns afterwards: ``("here",
        record)`` where it was posted. Atomic across ranks (a record lock on the slot)."""
        off = self._offset(q, n)
        fd = self.segment.fd
        fcntl.lockf(fd, fcntl.LOCK_EX, _SLOT, off)
        try:
            held = self.get(q, n, store)
            if held[0] != "none":
                return held
            body = record
            if len(record) > RECORD_BYTES:
                store.set(self.store_key(n, q), record)
                self._stored.append((n, q))
                body = IN_STORE
            # the record first, the tag last: a reader that sees the tag reads a whole record
            # (and the checksum catches one whose words it saw out of order)
            self._mm[off + _HEADER.size:off + _HEADER.size + len(body)] = body
            _BODY.pack_into(self._mm, off + _TAG.size, len(body), _checksum(n, body))
            _TAG.pack_into(self._mm, off, n + 1)
            return "here", record
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN, _SLOT, off)

    def release(self, n: int, store) -> None:
        """Delete from the store the records this process posted there for agreements before
        ``n``: once every rank posted ``n``, every rank has read them."""
        keep = []
        for m, q in self._stored:
            if m < n:
                store.delete_key(self.store_key(m, q))
            else:
                keep.append((m, q))
        self._stored = keep
