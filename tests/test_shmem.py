"""The symmetric heap and the device helpers (peer pointers, remote stores, release/acquire
signals, bounded waits) exercised directly by a small ring kernel on emulated ranks."""
import torch
import triton
import triton.language as tl

from portable_overlap.errors import RankMismatchError
from portable_overlap.shmem import StatusBoard, SymmetricHeap
from portable_overlap.shmem.device import (FAILED_TAG, STATUS_TIMEOUT, await_flags, flag_value,
                                           peer_ptr, report, signal_peer, wait_flag)
from portable_overlap.shmem.status import STATUS_MISMATCH, STATUS_PEER_FAILED


@triton.jit
def _ring_kernel(data_ptr, inbox_ptr, flags_ptr, clock_ptr, bases_ptr, status_addr, rank, world,
                 epoch, timeout_us, BLOCK: tl.constexpr):
    """Store my data into the next rank's inbox, signal it, wait for the previous rank's."""
    nxt = (rank + 1) % world
    offs = tl.arange(0, BLOCK)
    v = tl.load(data_ptr + offs)
    tl.store(peer_ptr(inbox_ptr, bases_ptr, rank, nxt) + offs, v)
    tl.debug_barrier()
    signal_peer(flags_ptr, flag_value(epoch, rank), bases_ptr, rank, nxt)
    prev = (rank + world - 1) % world
    word, ok = wait_flag(flags_ptr, epoch, epoch, clock_ptr, timeout_us)
    if not ok:
        report(status_addr, 0, STATUS_TIMEOUT, prev, 0, epoch)


def _ring(world, skip_rank=-1, rounds=3):
    heap = SymmetricHeap(world, 4096)
    data = heap.alloc((64,), torch.float32)
    inbox = heap.alloc((64,), torch.float32)
    flags = heap.alloc((1,), torch.int64)
    clock = heap.alloc((2,), torch.int64)  # the call clock of shmem.device.call_deadline
    board = StatusBoard(world.backend, 1)
    same_offsets = world.all_gather_object((heap.offset_of(data), heap.offset_of(inbox)))
    got, tags = [], []
    for epoch in range(1, rounds + 1):
        data.copy_(torch.full((64,), float(world.rank * 100 + epoch)))
        if world.rank != skip_rank:
            _ring_kernel[(1,)](data, inbox, flags, clock, heap.bases, board.address, world.rank,
                               world.world_size, epoch, 1_000_000, BLOCK=64)
            got.append(inbox.clone())
            tags.append(int(flags[0]) >> 32)
        world.barrier()  # one inbox: the next round's store must wait until it was read
    failed = board.failed()
    heap.close()
    return same_offsets, got, tags, failed


def test_ring_of_remote_stores_and_signals(world):
    results = world.run(_ring)
    size = len(results)
    for rank, (offsets, got, tags, failed) in enumerate(results):
        assert len(set(offsets)) == 1  # same offsets on every rank
        prev = (rank - 1) % size
        for epoch, inbox in enumerate(got, start=1):
            assert torch.equal(inbox, torch.full((64,), float(prev * 100 + epoch)))
        assert tags == [prev] * 3  # the flag carries the sender's tag
        assert not failed


def test_wait_gives_up_when_the_peer_never_signals(world2):
    results = world2.run(_ring, 0, 1)  # rank 0 sits the round out
    assert results[1][3]  # rank 1 waited for rank 0, gave up and reported


def _heap_size_mismatch(world):
    try:
        SymmetricHeap(world, 4096 + 1024 * world.rank)
        return "no error"
    except RankMismatchError as e:
        return str(e)


def test_ranks_asking_for_different_heap_sizes(world2):
    for msg in world2.run(_heap_size_mismatch):
        assert "different sizes" in msg


def _workspaces_in_other_orders(world):
    """Workspaces "A" and "B" of one size made in other orders on the two ranks (heaps pair by
    the order they are made in: A paired with B, and stores into a peer's A landed in its B with
    no error), then the same in the same order."""
    from portable_overlap import Workspace

    errors = []
    for name in ("A", "B") if world.rank == 0 else ("B", "A"):
        try:
            Workspace(world, 4096, name=name).close()
            errors.append("no error")
        except RankMismatchError as e:
            errors.append(str(e))
    made = [Workspace(world, 4096, name=name) for name in ("A", "B")]
    for ws in made:
        ws.close()
    return errors


def test_workspaces_made_in_other_orders_raise_on_every_rank(world2):
    for errors in world2.run(_workspaces_in_other_orders):
        assert len(errors) == 2 and all("other orders" in e for e in errors), errors
        assert "'A workspace'" in errors[0] and "'B workspace'" in errors[0], errors


def _heap_full(world):
    heap = SymmetricHeap(world, 1024)
    heap.alloc((100,), torch.float32)
    try:
        heap.alloc((1000,), torch.float32)
        return "no error"
    except MemoryError as e:
        return str(e)
    finally:
        heap.close()


def test_heap_full(world2):
    assert all("full" in m for m in world2.run(_heap_full))


def _heap_close_times(world):
    import time

    be, times = world.backend, []
    close_handle, free = be.close_handle, be.free

    def timed(what, fn):
        def call(*args):
            fn(*args)
            times.append((what, time.monotonic_ns()))
        return call

    be.close_handle, be.free = timed("close", close_handle), timed("free", free)
    try:
        SymmetricHeap(world, 1024).close()
    finally:
        be.close_handle, be.free = close_handle, free
    return times


def test_heap_close_unmaps_on_every_rank_before_any_rank_frees(world3):
    """HIP leaves freeing an exported allocation that another process still has open
    undefined (hipIpcOpenMemHandle's contract): close unmaps the peers' heaps on every rank,
    then frees, with a barrier between (the clock is the machine's, shared by the ranks)."""
    times = world3.run(_heap_close_times)
    closes = [t for rank in times for what, t in rank if what == "close"]
    frees = [t for rank in times for what, t in rank if what == "free"]
    assert len(closes) == 3 * 2 and len(frees) == 3
    assert max(closes) < min(frees)


def _close_in_other_orders(world):
    from portable_overlap.errors import RankMismatchError

    heaps = [SymmetricHeap(world, 1024), SymmetricHeap(world, 2048)]
    outcomes = []
    for h in (heaps if world.rank == 0 else heaps[::-1]):
        try:
            h.close()
            outcomes.append("closed")
        except RankMismatchError as e:
            outcomes.append(str(e))
    same = [SymmetricHeap(world, 512) for _ in range(2)]
    for h in same:  # the world is still usable: heaps closed in order close
        h.close()
    return outcomes, [h.serial for h in heaps]


def test_heaps_closed_in_other_orders_raise_on_every_rank(world2):
    """Rank 0 closes heap 0 then 1, rank 1 heap 1 then 0: both closes raise on both ranks,
    naming what each rank closed, instead of one rank freeing a heap its peer still maps
    (undefined on HIP); heaps made and closed in order afterwards close."""
    found = world2.run(_close_in_other_orders)
    a, b = found[0][1]  # (the world's earlier heaps number them; the same on both ranks)
    assert found[1][1] == [a, b] and b == a + 1
    for outcomes, _ in found:
        assert len(outcomes) == 2, outcomes
        for msg in outcomes:
            assert "closed different symmetric heaps" in msg, msg
        assert f"rank 0: heap {a} of 1024 bytes; rank 1: heap {b} of 2048 bytes" in outcomes[0]
        assert f"rank 0: heap {b} of 2048 bytes; rank 1: heap {a} of 1024 bytes" in outcomes[1]


def _heap_past_memory(world):
    import os

    from portable_overlap.errors import PeerSetupError

    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        SymmetricHeap(world, total + (1 << 20)).close()
        return "no error"
    except PeerSetupError as e:
        return str(e)


def test_a_heap_past_the_machines_memory_is_refused_on_every_rank(world2):
    """On the CPU backend a heap larger than the machine's memory fails at its allocation on
    every rank: a memfd and its mapping take no memory until touched, so the allocation
    passed and the heap's zeroing then ran the machine out of memory."""
    for msg in world2.run(_heap_past_memory):
        assert "MemoryError" in msg and "more than this machine's memory" in msg, msg


def test_a_segment_past_the_machines_memory_is_refused():
    """The same at the backend, without zeroing anything (so it is safe to run without the
    check: the allocation then returns, and is freed untouched)."""
    import os

    from portable_overlap.backends.cpu import CpuBackend

    be = CpuBackend()
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        alloc = be.alloc_exportable(total + 4096, torch.device("cpu"))
    except MemoryError as e:
        assert "more than this machine's memory" in str(e)
    else:
        be.free(alloc)
        raise AssertionError("a segment larger than the machine's memory was made")


@triton.jit
def _await_all_kernel(flags_ptr, n, epoch, tag, clock_ptr, timeout_us, status_addr, ok_ptr,
                      BLOCK: tl.constexpr):
    ok = await_flags(flags_ptr, n, epoch, tag, clock_ptr, timeout_us, status_addr, 0, 1,
                     tl.cast(1000, tl.int64), True, BLOCK)
    tl.store(ok_ptr, ok.to(tl.int32))


def _await_all(world):
    """await_flags over 200 flags, 64 per poll, in each way a peer's flags can stand; the words
    past n hold a failure tag that must be ignored. Returns (ok, board slot, out-of-step word)."""
    epoch, tag, n = 5, 9, 200
    word = (tag << 32) | epoch
    cases = {"all there": {}, "later epoch": {7: (tag << 32) | (epoch + 1)},
             "one late": {150: (tag << 32) | (epoch - 1)},
             "one gave up": {37: (int(FAILED_TAG.value) << 32) | epoch,
                             100: (tag << 32) | (epoch - 1)},
             "other shapes": {130: (8 << 32) | epoch}}
    out = {}
    for name, changes in cases.items():
        flags = torch.full((256,), word, dtype=torch.int64)
        flags[n:] = (int(FAILED_TAG.value) << 32) | epoch
        for i, v in changes.items():
            flags[i] = v
        clock = torch.zeros(2, dtype=torch.int64)
        board = StatusBoard(world.backend, 1)
        ok = torch.full((1,), -1, dtype=torch.int32)
        _await_all_kernel[(1,)](flags, n, epoch, tag, clock, 20_000, board.address, ok,
                                BLOCK=64)
        out[name] = (int(ok), board.words[0].tolist(), int(clock[1]))
    return out


def test_await_flags_judges_every_flag_and_names_the_first_bad_one(world2):
    for got in world2.run(_await_all):  # each rank alone, in its interpreter process
        assert got["all there"] == (1, [0, 0, 0, 0], 0)
        assert got["later epoch"] == (1, [0, 0, 0, 0], 0)
        assert got["one late"] == (0, [STATUS_TIMEOUT, 1, 1150, 5], 5)
        assert got["one gave up"] == (0, [STATUS_PEER_FAILED, 1, 1037, (9 << 32) | 5], 0)
        assert got["other shapes"] == (0, [STATUS_MISMATCH, 1, 1130, (8 << 32) | 9], 0)
