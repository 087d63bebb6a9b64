"""The call board (ops/call_board.py): the shared host memory through which the ranks of one
machine agree on a call of ``transport="auto"``. Its slots in one process (first record wins,
two slots per rank, a torn record is not read, a large record goes through the store), a race
of processes posting to one slot, and the planner on emulated ranks: it agrees on the board,
falls back to the store on every rank where one rank cannot map the board, and in both media a
rank that comes late to an agreement its peer gave up on raises, as does the peer."""
import multiprocessing as mp
import time

import pytest
import torch

import portable_overlap as po
from portable_overlap.backends.host_segment import HostSegment
from portable_overlap.ops import call_board, planner
from portable_overlap.ops.call_board import RECORD_BYTES, CallBoard
from portable_overlap.testing.compare import rel_err


class _DictStore:
    """The two store calls the board makes, on a dict."""

    def __init__(self):
        self.d = {}

    def set(self, key, value):
        self.d[key] = value

    def get(self, key):
        return self.d[key]


def _board(world_size=2):
    seg = HostSegment.create(2 * world_size * (RECORD_BYTES + 24))
    return CallBoard(seg, lambda n, q: f"rec/{n}/{q}")


def test_a_slot_keeps_the_first_record_of_an_agreement():
    b = _board()
    try:
        assert b.get(1, 0) == ("none", None)  # nothing posted: an empty slot is no record
        assert b.compare_set(1, 4, b"first") == ("here", b"first")
        assert b.compare_set(1, 4, b"second") == ("here", b"first")  # a claim finds it
        assert b.get(1, 4) == ("here", b"first")
        assert b.get(0, 4) == ("none", None)  # another rank's slot
        assert b.get(1, 6) == ("none", None)  # the same slot, a later agreement
        assert b.get(1, 2) == ("past", b"first")  # an earlier one: the rank went past it
        assert b.compare_set(1, 2, b"late") == ("past", b"first")  # never written back
    finally:
        b.close()


def test_two_slots_per_rank():
    b = _board(3)
    try:
        for n in range(6):
            for q in range(3):
                b.compare_set(q, n, f"{q}:{n}".encode())
            for q in range(3):  # this agreement's and the one before are both readable
                assert b.get(q, n) == ("here", f"{q}:{n}".encode())
                if n:
                    assert b.get(q, n - 1) == ("here", f"{q}:{n - 1}".encode())
    finally:
        b.close()


def test_a_torn_record_is_not_read():
    """A record whose bytes do not match its checksum (read while written, or its words seen
    out of order) reads as not posted yet."""
    b = _board()
    try:
        b.compare_set(0, 3, b"a whole record")
        off = b._offset(0, 3) + 24
        b._mm[off] ^= 0xFF
        assert b.get(0, 3) == ("none", None)
        b._mm[off] ^= 0xFF
        assert b.get(0, 3) == ("here", b"a whole record")
    finally:
        b.close()


def test_a_record_larger_than_a_slot_goes_through_the_store():
    b, store = _board(), _DictStore()
    big = bytes(range(256)) * (RECORD_BYTES // 256 + 3)
    try:
        assert b.compare_set(1, 7, big, store) == ("here", big)
        assert store.d == {"rec/7/1": big}
        assert b.get(1, 7, store) == ("here", big)
        assert b.compare_set(1, 7, b"claim", store) == ("here", big)
    finally:
        b.close()


_RACE_SLOTS = 1000


def _race(handle, me, start, out):
    seg = HostSegment.open(handle, 2 * _RACE_SLOTS * (RECORD_BYTES + 24), "call board",
                           keep_fd=True)
    b = CallBoard(seg, lambda n, q: f"rec/{n}/{q}")
    start.wait()
    # each process tries to post its record into every slot (agreement 0 of "rank" q), as
    # ranks claiming a slot at once with its owner posting there, all in the same order (the
    # test fails every time without the slot's lock: processes read different records)
    out.put((me, [b.compare_set(q, 0, f"p{me}".encode())[1] for q in range(_RACE_SLOTS)]))
    b.close()


def test_processes_racing_for_one_slot_see_one_winner():
    seg = HostSegment.create(2 * _RACE_SLOTS * (RECORD_BYTES + 24))
    b = CallBoard(seg, lambda n, q: f"rec/{n}/{q}")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start = ctx.Barrier(3)
    procs = [ctx.Process(target=_race, args=(seg.handle(), i, start, out)) for i in range(3)]
    try:
        for p in procs:
            p.start()
        got = dict(out.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(30)
        for q in range(_RACE_SLOTS):  # every process read the record the slot holds
            held = b.get(q, 0)
            assert held[0] == "here" and all(got[i][q] == held[1] for i in got), (q, got)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        b.close()


# -- the planner on emulated ranks ---------------------------------------------------------------

def _decided_calls(world, block):
    """A context of ``transport="auto"`` (only ``"sequential"``: every decided call agrees
    first). ``block``: rank 1 cannot map the board (``"map"``) or lock its slots
    (``"lock"``), or every record is larger than a slot (``"large"``). Returns whether the
    agreements went on the board alone, which of this rank's agreements the store still holds
    a record of, and the error of four decided calls."""
    real_open, real_lock = HostSegment.open, call_board.fcntl.lockf
    real_bytes = call_board.RECORD_BYTES

    def refuse(*args, **kwargs):
        raise OSError(f"injected: cannot {block}")
    if block == "large":
        call_board.RECORD_BYTES = 16
    if world.rank == 1 and block == "map":
        HostSegment.open = refuse
    if world.rank == 1 and block == "lock":
        call_board.fcntl.lockf = refuse
    try:
        try:
            ctx = po.GemvAllReduce(world, 16, transport="auto", candidates=("sequential",),
                                   iters=1, warmup=0)
        finally:
            HostSegment.open, call_board.fcntl.lockf = real_open, real_lock
        try:
            g = torch.Generator().manual_seed(world.rank)
            err = 0.0
            for _ in range(4):
                x, w = torch.randn(3, 7, generator=g), torch.randn(16, 7, generator=g)
                y = ctx(x, w)
                ref = x @ w.t()
                torch.distributed.all_reduce(ref, group=world.group)
                err = max(err, rel_err(y, ref))
            store = torch.distributed.distributed_c10d._get_default_store()
            p = ctx.planner
            in_store = [store.check([p._store_key(n, world.rank)]) for n in range(p._begun)]
            board_only = p._board is not None and block != "large"
            return board_only, block != "large" or p._board is not None, in_store, err
        finally:
            ctx.close()
    finally:
        call_board.RECORD_BYTES = real_bytes


@pytest.mark.parametrize("block", [None, "map", "lock", "large"],
                         ids=["board", "one-rank-cannot-map", "one-rank-cannot-lock",
                              "records-larger-than-a-slot"])
def test_the_planner_agrees_on_the_board_or_on_every_rank_through_the_store(world4, block):
    for on_board, has_board, in_store, err in world4.run(_decided_calls, block):
        assert on_board == (block is None) and has_board
        if block is None:
            assert not any(in_store)
        else:  # only the last agreement's record is left in the store
            assert in_store == [False] * (len(in_store) - 1) + [True], in_store
        assert err < 1e-5


def _late_rank(world, medium):
    """Rank 1 comes to a decided call's agreement after rank 0 gave up waiting: rank 0 raises
    PeerTimeoutError naming rank 1, rank 1 finds rank 0's claim and raises naming rank 0, and
    both contexts refuse the next call."""
    make = CallBoard.__dict__["make"]
    if medium == "store":  # as where the ranks run on several machines
        CallBoard.make = classmethod(lambda cls, *a: None)
    saved = planner.EXCHANGE_MIN_S
    planner.EXCHANGE_MIN_S = 1.0
    try:
        ctx = po.GemvAllReduce(world, 8, transport="auto", candidates=("sequential",),
                               timeout_s=1.0, iters=1, warmup=0)
    finally:
        CallBoard.make = make
    found = {"board": ctx.planner._board is not None}
    x, w = torch.randn(2, 5), torch.randn(8, 5)
    try:
        ctx(x, w)
        world.barrier()
        if world.rank == 1:
            time.sleep(2.5)
        for what in ("late", "next"):
            try:
                ctx(x, w)
                found[what] = ("no error", "")
            except Exception as e:
                found[what] = (type(e).__name__, str(e))
    finally:
        planner.EXCHANGE_MIN_S = saved
        ctx.close()
    return found


@pytest.mark.parametrize("medium", ["board", "store"])
def test_a_rank_late_to_an_agreement_its_peer_gave_up_raises_too(world2, medium):
    r0, r1 = world2.run(_late_rank, medium, timeout=120)
    assert r0["board"] == r1["board"] == (medium == "board")
    assert r0["late"][0] == "PeerTimeoutError" and "rank(s) [1] did not join" in r0["late"][1]
    assert r1["late"][0] == "PeerTimeoutError" and "rank 0 stopped waiting" in r1["late"][1]
    assert r0["next"][0] == r1["next"][0] == "ContextBrokenError", (r0, r1)
