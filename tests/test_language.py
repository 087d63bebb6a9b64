"""The public device API (portable_overlap.language) and its host side (Workspace) on emulated
ranks: every primitive against a torch reference over several calls, and the failure paths (a
flag nobody sets, a peer that gives up, a kernel that skips end_call, bad host input). The calls
live in portable_overlap.testing.language_calls, shared with tests/gpu/check_language.py."""
import pytest
import torch
import triton
import triton.language as tl

import portable_overlap.language as pol
from portable_overlap import Workspace
from portable_overlap.errors import ContextClosedError, RankMismatchError
from portable_overlap.shmem.providers import ShmemUnavailable
from portable_overlap.testing import language_calls as calls


def test_ping_ring_over_calls(world):
    assert not calls.check_ping(world.run(calls.ping, 37, 3), 3)


@pytest.mark.parametrize("n", [1, 63])
def test_ping_odd_sizes(world2, n):
    assert not calls.check_ping(world2.run(calls.ping, n, 2), 2)


def test_all_gather_by_puts(world):
    assert not calls.check_gather(world.run(calls.gather, 45, 2))


def test_bool_tensors_travel_through_the_heap(world2):
    """A bool buffer (a 1-bit element type to Triton, stored one byte each) is reached through
    remote_ptr like any other: its 16-byte step was divided by zero bytes per element."""
    assert not calls.check_mask_ring(world2.run(calls.mask_ring, 37, 2))


def test_counters_barrier_and_remote_loads(world):
    assert not calls.check_count(world.run(calls.count, 2))


def test_program_numbering_over_a_3d_grid(world2):
    assert not calls.check_grid(world2.run(calls.grid))


def test_a_flag_nobody_sets_raises_on_every_rank_naming_it(world):
    assert not calls.check_lonely(world.run(calls.lonely))


def test_a_peer_that_gives_up_is_reported_and_the_workspace_goes_on(world):
    assert not calls.check_quitter(world.run(calls.quitter))


def test_wait_peers_reports_the_peer_that_gave_up_not_the_late_one(world4):
    assert not calls.check_quitter_among_late(world4.run(calls.quitter_among_late))


@pytest.mark.parametrize("programs", [2, 3])
def test_wait_program_peers_waits_for_a_group_and_tells_other_grids(world, programs):
    """Groups of 2 or 3 programs (lanes of a block padded to a power of two), every rank's
    words of a group polled at once, this rank's included; ranks whose grids differ raise a
    mismatch at once and the workspace goes on."""
    assert not calls.check_program_groups(world.run(calls.program_groups, programs))


def test_flags_of_another_tag_raise_a_mismatch(world):
    assert not calls.check_tagged(world.run(calls.tagged))


def test_a_kernel_that_skips_end_call_is_caught(world2):
    assert not calls.check_no_end(world2.run(calls.no_end))


def test_a_kernel_that_counts_a_program_out_twice_is_caught(world2):
    """The launch still counts one call in the counter's call bits, but leaves a program's
    count below them: every later launch's programs would read different call numbers."""
    assert not calls.check_double_end(world2.run(calls.double_end))


def test_a_grid_the_call_counter_cannot_count_out_is_refused(world2):
    """pol.end_call counts programs below bit 20 of the call counter: a launch of 2**20
    programs or more would move the call number in the middle of the call."""
    assert not calls.check_oversized_grid(world2.run(calls.oversized_grid, timeout=60))


def test_an_empty_grid_is_refused_and_the_workspace_goes_on(world2):
    """A grid with a size of 0 launches no program, so none counts the call out: refused
    before the launch, given as sizes or as a callable, and the next launch runs."""
    assert not calls.check_empty_grid(world2.run(calls.empty_grid, timeout=60))


def test_a_branch_on_end_call_is_refused_and_end_call_last_tells_the_last(world2):
    """pol.end_call returns nothing (no program waits to learn whether it was the last): a
    kernel that branches on it would skip the branch without an error."""
    assert not calls.check_end_call_value(world2.run(calls.end_call_value, timeout=60))


_NO_SOURCE = """
import triton
import portable_overlap.language as pol
from portable_overlap.workspace import _value_used

@triton.jit
def branches(ctx):
    call = pol.begin_call(ctx)
    if pol.end_call(ctx, call):
        pass

print("checked:", _value_used(branches, pol.end_call))
"""


def test_an_autotuned_kernel_is_refused_and_heuristics_are_seen_through(world2):
    """ws.launch refuses an autotuner (its timing runs would be calls of the workspace; under
    the interpreter it failed with "0 active drivers") and checks the kernel behind
    triton.heuristics as it checks a plain one; the workspace goes on."""
    for r, (errors, done) in enumerate(world2.run(calls.wrapped_kernels)):
        tuned, picked = errors
        assert tuned is not None and tuned[0] == "TypeError" and "autotune" in tuned[1], (r, tuned)
        assert picked is not None and picked[0] == "TypeError" and "end_call" in picked[1], \
            (r, picked)
        assert done == 1, (r, done)


def test_the_end_call_check_passes_over_a_kernel_without_source():
    """Under the interpreter a kernel defined in ``python -c`` has no source Python can find:
    the launch's check of ``pol.end_call``'s value passes it over instead of failing."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _NO_SOURCE], capture_output=True, text=True,
                         env=dict(os.environ, TRITON_INTERPRET="1"), timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("checked: None"), out.stderr


def test_every_call_on_eight_ranks(world8):
    assert not calls.check_every_call(world8.run(calls.every_call, timeout=540))


def test_every_peer_and_consumed_buffers_over_back_to_back_calls(world):
    assert not calls.check_sum(world.run(calls.sum_by_pushes, 11, 3), 3)


def test_a_consumed_flag_nobody_sets_raises_naming_it(world2):
    assert not calls.check_unread(world2.run(calls.unread))


def test_shmem_workspace_without_a_library_raises_on_every_rank_and_leaves_nothing(world2):
    """Emulated ranks have no SHMEM library: every rank raises the provider layer's reason,
    and a zero-copy workspace made after it works."""
    assert not calls.check_shmem_refused(world2.run(calls.shmem_refused))


def test_ring_by_puts_with_the_shmem_branch_off(world):
    """The shmem-or-zero-copy kernel on a zero-copy workspace (VIA_SHMEM=ws.shmem, False):
    the branch that calls pol.shmem_put is not run, the puts and flags are."""
    assert not calls.check_ping(world.run(calls.ring, 1500, 3, False), 3)


def test_ring_by_gets_with_the_shmem_branch_off(world):
    """The pull ring: each rank stages its data in its own buffer and the next rank reads it
    with pol.get (the shmem_get branch is not run on a zero-copy workspace)."""
    assert not calls.check_ping(world.run(calls.ring, 1500, 3, False, True), 3)


@pytest.mark.parametrize("get", [False, True], ids=["shmem_put", "shmem_get"])
def test_shmem_call_without_a_library_says_so(world2, get):
    name = "shmem_get" if get else "shmem_put"
    for err in world2.run(calls.shmem_call_without_library, get):
        assert err and f"pol.{name}: this process has no SHMEM library" in err[1], err


def test_the_provider_bindings_are_none_without_a_provider():
    from portable_overlap.shmem.providers import device

    assert device.LIBRARY is None  # this process runs the CPU backend
    for name in ("put_rows", "put_strided", "put", "get", "flush"):
        assert hasattr(device, name) and getattr(device, name) is None, name


class _StandInProvider:
    """A SHMEM provider's host side on the CPU: plain memory for the symmetric allocation, a
    launcher that runs the kernel as it is; it records what the workspace asked of it."""

    def __init__(self, world):
        self.world, self.allocs, self.wrapped = world, [], []

    def symmetric_empty(self, nbytes):
        self.allocs.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.world.device)

    def wrap(self, kernel):
        self.wrapped.append(kernel.fn.__name__)
        return kernel


def _with_provider(world, get_provider, fn):
    """``fn()`` on this rank with the provider lookup (``shmem.providers.get_provider``, which
    the workspace asks through ``provider_or_reason``) replaced by ``get_provider``."""
    import portable_overlap.shmem.providers as module

    real, module.get_provider = module.get_provider, get_provider
    try:
        return fn()
    finally:
        module.get_provider = real


def _stand_in_workspace(world):
    """A shmem workspace over the stand-in provider: where its tensors and flags live, a kernel
    without library calls launched twice, which kernels went to the provider's launcher, and
    what it allocated."""
    W = world.world_size
    p = _StandInProvider(world)

    def make():
        with Workspace(world, Workspace.bytes_for(((64,), torch.float32), ((W,), torch.int64)),
                       name="stand_in", shmem=True) as ws:
            inbox = ws.tensor((64,), torch.float32)
            ready = ws.flags((W,), "ready")
            out = torch.full((24,), -1, dtype=torch.int64)
            ws.launch(calls._grid_kernel, (2, 3, 4), out)
            ws.launch(calls._grid_kernel, (4, 3, 2), out)
            ws.synchronize()
            # a kernel that calls the library goes through the launcher (once per kernel); the
            # stand-ins of pol.shmem_put / pol.shmem_get cannot run here, so it is only looked up
            ring = [ws._linked_kernel(calls._ring_kernel) for _ in range(2)]
            ring += [ws._linked_kernel(calls._pull_ring_kernel) for _ in range(2)]
            inbox_in_heap = calls.error_of_one_call(lambda: ws.heap.offset_of(inbox)) is None
            return (ws.shmem, inbox_in_heap, ws.heap.offset_of(ready) >= 0,
                    bool((inbox == 0).all()), out, ring[0] is ring[1], ring[2] is ring[3])

    return _with_provider(world, lambda w: p, make) + (p.allocs, p.wrapped)


def _one_rank_without_a_library(world):
    """Rank 1 has no library (its provider lookup raises), rank 0 has the stand-in: what each
    raised and what rank 0 allocated; then rank 0 asks for shmem and rank 1 does not."""
    p = _StandInProvider(world)

    def lookup(w):
        if w.rank == 1:
            raise ShmemUnavailable("NVSHMEM unavailable: a stand-in reason")
        return p

    def make(shmem):
        return lambda: calls.error_of_one_call(
            lambda: Workspace(world, 1024, name="half", shmem=shmem))

    missing = _with_provider(world, lookup, make(True))
    disagree = _with_provider(world, lookup, make(world.rank == 0))
    return missing, disagree, p.allocs


def test_a_shmem_workspace_puts_tensors_in_the_library_and_flags_in_the_heap(world2):
    for shmem, inbox_in_heap, ready_in_heap, zeroed, out, reused, reused_pull, allocs, \
            wrapped in world2.run(_stand_in_workspace):
        assert shmem and not inbox_in_heap and ready_in_heap and zeroed
        assert torch.equal(out, torch.full((24,), 24 * 1000 + 2))  # launched as usual
        # one allocation of nbytes, rounded up to the 256-byte alignment
        nbytes = Workspace.bytes_for(((64,), torch.float32), ((2,), torch.int64))
        assert allocs == [-(-nbytes // 256) * 256]
        # the kernels that reach the library (a put, a get) go to its launcher, once each
        assert wrapped == ["_ring_kernel", "_pull_ring_kernel"] and reused and reused_pull


def test_a_rank_without_the_library_fails_every_rank_before_any_allocation(world2):
    for missing, disagree, allocs in world2.run(_one_rank_without_a_library):
        assert missing[0] == "ShmemUnavailable", missing
        assert "rank 1: NVSHMEM unavailable: a stand-in reason" in missing[1]
        assert "rank 0" not in missing[1]
        assert disagree[0] == RankMismatchError.__name__ and "shmem" in disagree[1], disagree
        assert allocs == []  # rank 0 allocated nothing: no rank waits in the library


def test_bad_host_input_is_refused(world2):
    for errors in world2.run(calls.bad_host):
        assert errors["nbytes"][0] == "ValueError" and "nbytes" in errors["nbytes"][1]
        assert errors["name"][0] == "ValueError"
        assert errors["timeout"][0] == "ValueError" and "timeout_s" in errors["timeout"][1]
        assert errors["shape"][0] == "ValueError" and errors["dtype"][0] == "ValueError"
        assert errors["flag name"][0] == "ValueError" and "name" in errors["flag name"][1]
        assert errors["full"][0] == "MemoryError" and "larger nbytes" in errors["full"][1]
        assert errors["disagree"][0] == RankMismatchError.__name__
        assert errors["closed"][0] == ContextClosedError.__name__
        assert errors["closed launch"][0] == ContextClosedError.__name__
        assert errors["shmem"][0] == "ValueError" and "shmem" in errors["shmem"][1]


def test_a_buffer_refused_on_one_rank_raises_on_every_rank(world2):
    """A buffer one rank refuses is refused on every rank in the same call (its peers were
    left in the ranks' comparison of the buffer), a size that is no integer is refused (2.5
    made a buffer of 2), and the workspace goes on."""
    for r, (errors, got) in enumerate(world2.run(calls.bad_buffer_on_one_rank)):
        for case in ("negative", "fraction", "flag name"):
            assert errors[case] is not None and errors[case][0] in (
                "ValueError", RankMismatchError.__name__), (r, case, errors[case])
        said = errors["fraction everywhere"]
        assert said is not None and said[0] == "ValueError" and "2.5" in said[1], (r, said)
        # every program of the workspace's first launch wrote 24 programs * 1000 + call 1
        assert torch.equal(got, torch.full((24,), 24001)), (r, got)


def test_public_names():
    assert set(pol.__all__) <= set(dir(pol))
    for name in pol.__all__:
        assert isinstance(getattr(pol, name), triton.JITFunction), name


def test_the_checks_can_fail():
    """The verdicts reject wrong results (so the GPU check cannot pass by accident)."""
    import torch

    x = torch.ones(3)
    assert calls.check_ping([([(x, x + 1, 1)], 1), ([(x, x, 1)], 1)], 1)
    assert calls.check_grid([torch.zeros(24, dtype=torch.int64)])
    assert calls.check_lonely([(None, None)])
    assert calls.check_no_end([(None, None)])
    assert calls.check_tagged([(None, None)])
    assert calls.check_unread([(1, None, None)])
    assert calls.check_sum([([(x, x, [1])], 1), ([(x, x, [1])], 1)], 1)


def _shmem_on_one_rank(world):
    """A shmem workspace on a world of one, the library usable (the stand-in): what it raised,
    and what was allocated."""
    p = _StandInProvider(world)
    err = _with_provider(world, lambda w: p, lambda: calls.error_of_one_call(
        lambda: Workspace(world, 1024, name="alone", shmem=True)))
    return err, p.allocs


@pytest.mark.emulated(ranks=1)
def test_a_shmem_workspace_on_one_rank_says_why(monkeypatch):
    """torch's rendezvous of the library's memory refuses a world of one (found on one H100):
    the workspace says so before allocating, instead of torch's internal check failing."""
    from portable_overlap.testing import run_on_ranks

    monkeypatch.delenv("RANK", raising=False)
    [(err, allocs)] = run_on_ranks(_shmem_on_one_rank, ranks=1)
    assert err and err[0] == "ShmemUnavailable" and "a world of one rank" in err[1], err
    assert allocs == []


@triton.jit
def _to_peer_kernel(ctx, x_ptr, box_ptr, flag_ptr, peer, n, HOW: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Reach ``peer`` with one primitive: store_remote, put, signal or load_remote (HOW)."""
    call = pol.begin_call(ctx)
    offs = tl.arange(0, BLOCK)
    m = offs < n
    if HOW == 0:
        pol.store_remote(ctx, box_ptr + offs, tl.load(x_ptr + offs, mask=m), peer, m)
    elif HOW == 1:
        pol.put(ctx, box_ptr, x_ptr, n, peer, BLOCK)
    elif HOW == 2:
        pol.signal(ctx, flag_ptr, peer, call)
    else:
        tl.store(x_ptr + offs, pol.load_remote(ctx, box_ptr + offs, peer, m, 0.0), mask=m)
    pol.end_call(ctx, call)


def _out_of_world_peers(world):
    """Every primitive that reaches a peer, at a rank the world does not have (its size, -1,
    a large one): what each launch raised; then whether a launch to the next rank lands."""
    W = world.world_size
    with Workspace(world, 4096, name="far") as ws:
        box = ws.tensor((5,), torch.float32)
        flag = ws.flags((1,), "ready")
        x = torch.arange(5, dtype=torch.float32) + 1
        errors = {}
        for peer in (W, -1, 1000):
            for how in range(4):
                errors[peer, how] = calls.error_of_one_call(lambda: (ws.launch(
                    _to_peer_kernel, (1,), x, box, flag, peer, 5, HOW=how, BLOCK=8),
                    ws.synchronize()))
        world.barrier()
        box.zero_()
        world.barrier()
        ws.launch(_to_peer_kernel, (1,), x * (world.rank + 1), box, flag,
                  (world.rank + 1) % W, 5, HOW=0, BLOCK=8)
        ws.synchronize()
        world.barrier()
        return errors, box.clone()


def test_a_peer_outside_the_world_is_reported_not_dereferenced(world2):
    """A peer rank of W or more, or negative, read a word past the descriptor's heap bases as
    a base: the access went to an arbitrary address (the ranks died of SIGSEGV). It raises
    InvalidInputError naming the rank, and the workspace goes on."""
    for r, (errors, box) in enumerate(world2.run(_out_of_world_peers, timeout=300)):
        for (peer, how), err in errors.items():
            assert err is not None and err[0] == "InvalidInputError", (r, peer, how, err)
            assert "peer rank" in err[1] and f"got {peer}" in err[1], (r, peer, how, err)
        sender = (r - 1) % 2
        assert torch.equal(box, (torch.arange(5.0) + 1) * (sender + 1)), (r, box)


@triton.jit
def _signal_all_kernel(ctx, flag_ptr):
    call = pol.begin_call(ctx)
    pol.signal_all(ctx, flag_ptr, call)
    pol.end_call(ctx, call)


def _pointers_outside_the_heap(world):
    """Every primitive that reaches a peer, and ``signal_all``, given pointers outside this
    workspace's heap (a plain tensor, another workspace's buffer): what each launch raised
    (the access goes to this rank's own address instead); then a right launch lands."""
    W, r = world.world_size, world.rank
    with Workspace(world, 4096, name="near") as ws, Workspace(world, 4096, name="other") as other:
        box, flag = ws.tensor((5,), torch.float32), ws.flags((1,), "ready")
        other_box, other_flag = other.tensor((5,), torch.float32), other.flags((1,), "ready")
        plain, plain_flag = torch.zeros(5), torch.zeros(1, dtype=torch.int64)
        x = torch.arange(5, dtype=torch.float32) + 1
        peer = (r + 1) % W
        errors = {}
        for name, b, f in (("plain", plain, plain_flag), ("other", other_box, other_flag)):
            for how in range(4):
                errors[name, how] = calls.error_of_one_call(lambda: (ws.launch(
                    _to_peer_kernel, (1,), x, b, f, peer, 5, HOW=how, BLOCK=8),
                    ws.synchronize()))
            errors[name, "signal_all"] = calls.error_of_one_call(lambda: (ws.launch(
                _signal_all_kernel, (1,), f), ws.synchronize()))
        world.barrier()
        box.zero_()
        world.barrier()
        ws.launch(_to_peer_kernel, (1,), x * (r + 1), box, flag, peer, 5, HOW=0, BLOCK=8)
        ws.synchronize()
        world.barrier()
        return errors, box.clone()


def test_a_pointer_outside_the_heap_is_reported_not_dereferenced(world2):
    """A pointer outside the workspace's heap (a copy of a heap tensor, another workspace's
    buffer) was moved by the distance between two ranks' heaps: a store landed in the
    process's own memory with no error, or a rank died of SIGSEGV. It raises
    InvalidInputError naming the pointer, on emulated ranks, and the workspace goes on."""
    for r, (errors, box) in enumerate(world2.run(_pointers_outside_the_heap, timeout=300)):
        for key, err in errors.items():
            assert err is not None and err[0] == "InvalidInputError", (r, key, err)
            assert "outside this rank's heap" in err[1], (r, key, err)
        sender = (r - 1) % 2
        assert torch.equal(box, (torch.arange(5.0) + 1) * (sender + 1)), (r, box)


@triton.jit
def _raising_kernel(ctx, box_ptr, flag_ptr, word_ptr, RAISE: tl.constexpr):
    """Signal the next rank, then (RAISE) fail before end_call: the interpreter refuses an
    int32 out of range."""
    call = pol.begin_call(ctx)
    me, world = pol.rank(ctx), pol.num_ranks(ctx)
    pol.put_signal(ctx, box_ptr, call.to(tl.float32), pol.peer_at(1, me, world),
                   flag_ptr + me, call)
    if RAISE:
        tl.store(word_ptr, tl.load(word_ptr) & 0xFFFFFFFF)
    pol.wait(ctx, flag_ptr + pol.peer_at(world - 1, me, world), call,
             pol.peer_at(world - 1, me, world))
    pol.end_call(ctx, call)


def _a_launch_that_raises(world):
    """Rank 0's second launch raises after it signalled its peer: what each rank's next
    launches raise."""
    with Workspace(world, 1024, timeout_s=1.0, name="raises") as ws:
        box, flag = ws.tensor((1,), torch.float32), ws.flags((world.world_size,), "ready")
        word = torch.zeros(1, dtype=torch.int32)
        out = []
        for i in range(3):
            out.append(calls.error_of_one_call(lambda: (ws.launch(
                _raising_kernel, (1,), box, flag, word,
                RAISE=(i == 1 and world.rank == 0)), ws.synchronize())))
        return out


def test_a_launch_that_raises_breaks_the_workspace(world2):
    """Under the interpreter a launch that raised had run its programs up to the error (its
    peer held its signal), while this rank's call counter stayed: its next launch paired with
    the peer's next call and returned the previous call's data with no error."""
    rank0, rank1 = world2.run(_a_launch_that_raises, timeout=120)
    assert rank0[0] is None and rank0[1] is not None, rank0
    assert rank0[2] is not None and rank0[2][0] == "ContextBrokenError", rank0
    # (rank 1's second call had rank 0's signal; its third waits for a launch that never comes)
    assert rank1[0] is None and rank1[2] is not None, rank1


@triton.jit
def _short_count_kernel(ctx, counter_ptr, per_call):
    """Every rank adds 1 to its next peer's counter and waits for ``per_call`` per call."""
    call = pol.begin_call(ctx)
    me, world = pol.rank(ctx), pol.num_ranks(ctx)
    pol.notify(ctx, counter_ptr, pol.peer_at(1, me, world))
    pol.wait_count(ctx, counter_ptr, call * per_call, call, pol.peer_at(world - 1, me, world))
    pol.end_call(ctx, call)


def _short_count(world):
    """A counter that falls short: two calls that wait for 1 per call, then one that waits for
    2 per call (6 in call 3, with the counter at 3): the error."""
    with Workspace(world, 1024, timeout_s=0.5, name="short") as ws:
        counter = ws.flags((1,), "arrived")
        for _ in range(2):
            ws.launch(_short_count_kernel, (1,), counter, 1)
        return calls.error_of_one_call(lambda: (
            ws.launch(_short_count_kernel, (1,), counter, 2), ws.synchronize()))


def test_a_counter_that_falls_short_is_named_with_its_target_count(world2):
    """wait_count's timeout named the target count as a call number ("call #6" for a count
    of 6 at call 3)."""
    for r, err in enumerate(world2.run(_short_count, timeout=300)):
        assert err is not None and err[0] == "PeerTimeoutError", (r, err)
        assert "'arrived' counter [0] to reach 6 (counted by rank" in err[1], (r, err)
        assert "call #6" not in err[1], (r, err)


@triton.jit
def _own_words_kernel(ctx, flags_ptr, S: tl.constexpr):
    """Every program sets its word on every rank, then waits for its group's words, this
    rank's too (OWN: a wait on the other programs of this launch)."""
    call = pol.begin_call(ctx)
    me = pol.rank(ctx)
    p = pol.program()
    pol.signal_all(ctx, flags_ptr + me * S + p, call, True, 5)
    pol.signal(ctx, flags_ptr + me * S + p, me, call, True, 5)
    pol.wait_program_peers(ctx, flags_ptr, 0, S, call, 5, PROGRAMS=2, OWN=True)
    pol.end_call(ctx, call)


def _own_words_in_order(world):
    with Workspace(world, 4096, timeout_s=0.5, name="own") as ws:
        flags = ws.flags((world.world_size, 4), "word")
        return calls.error_of_one_call(lambda: (
            ws.launch(_own_words_kernel, (2,), flags, S=4), ws.synchronize()))


def test_a_wait_on_the_same_launch_under_the_interpreter_says_why(world2):
    """Program 0 waits for program 1's word of this rank, which the interpreter runs after it:
    the timeout said "rank r never arrived" of the rank that raised it."""
    for r, err in enumerate(world2.run(_own_words_in_order, timeout=300)):
        assert err is not None and err[0] == "PeerTimeoutError", (r, err)
        assert f"waiting for rank {r}'s 'word'" in err[1], (r, err)
        assert "never arrived" not in err[1] and "resident" in err[1], (r, err)


@triton.jit
def _wait_with_peer_kernel(ctx, flags_ptr, counter_ptr, peer, HOW: tl.constexpr):
    """Tell every peer this rank's call (``flags[rank]``, and one count), then wait for the
    previous rank's with ``peer`` as the rank named in the wait's report: ``wait``,
    ``wait_reached`` or ``wait_count`` (HOW)."""
    call = pol.begin_call(ctx)
    me, world = pol.rank(ctx), pol.num_ranks(ctx)
    pol.signal_all(ctx, flags_ptr + me, call)
    pol.notify(ctx, counter_ptr, pol.peer_at(1, me, world))
    prev = pol.peer_at(world - 1, me, world)
    if HOW == 0:
        pol.wait(ctx, flags_ptr + prev, call, peer)
    elif HOW == 1:
        pol.wait_reached(ctx, flags_ptr + prev, call, call, peer)
    else:
        pol.wait_count(ctx, counter_ptr, call, call, peer)
    pol.end_call(ctx, call)


def _waits_naming_peers(world):
    """What each wait raised with a peer rank outside the world (and with -1, which
    ``wait_count`` takes as "nobody in particular"); then what a launch with int32 words as
    flags raised, in a workspace of its own."""
    W = world.world_size
    errors = {}
    with Workspace(world, 4096, timeout_s=5.0, name="named") as ws:
        flags, counter = ws.flags((W,), "ready"), ws.flags((1,), "count")
        for peer in (W, -1, (world.rank + W - 1) % W):
            for how in range(3):
                errors[peer, how] = calls.error_of_one_call(lambda: (ws.launch(
                    _wait_with_peer_kernel, (1,), flags, counter, peer, HOW=how),
                    ws.synchronize()))
    with Workspace(world, 4096, timeout_s=1.0, name="narrow") as ws:
        words, counter = ws.tensor((W,), torch.int32), ws.flags((1,), "count")
        errors["int32"] = calls.error_of_one_call(lambda: (ws.launch(
            _wait_with_peer_kernel, (1,), words, counter, 0, HOW=0), ws.synchronize()))
        world.barrier()
    return errors


def test_a_wait_naming_a_peer_outside_the_world_or_a_flag_of_int32_says_so(world2):
    """A wait's ``peer`` is only who its report names: a rank past the world passed unseen
    where the flag came, or read as "rank 2 never arrived" at the timeout. It raises
    InvalidInputError naming the rank (-1 is refused but by ``wait_count``), and the
    workspace goes on. A flag array of int32 (``Workspace.tensor``, not ``flags``) failed
    inside the wait with the interpreter's int32 error; it is refused as not int64 words."""
    for r, errors in enumerate(world2.run(_waits_naming_peers, timeout=300)):
        for how in range(3):
            err = errors[2, how]
            assert err and err[0] == "InvalidInputError" and "got 2" in err[1], (r, how, err)
            assert errors[1 - r, how] is None, (r, how, errors[1 - r, how])
        for how in range(2):
            err = errors[-1, how]
            assert err and err[0] == "InvalidInputError" and "got -1" in err[1], (r, how, err)
        assert errors[-1, 2] is None, (r, errors[-1, 2])
        err = errors["int32"]
        assert err and "int64 words" in err[1], (r, err)


def _flags_carved_late(world):
    """A flag array carved after one launch, after the counter moved to 2**31 - 1 calls, and
    at 2**31: what each raised; then a wait on the flags carved in time, at call 2**31 + 1."""
    from portable_overlap.testing.call_numbers import move_to
    from portable_overlap.workspace import FLAG_CARVE_CALLS

    W = world.world_size
    with Workspace(world, 4096, timeout_s=5.0, name="late") as ws:
        flags, counter = ws.flags((W,), "ready"), ws.flags((1,), "count")
        ws.launch(_wait_with_peer_kernel, (1,), flags, counter, 0, HOW=1)
        ws.synchronize()
        world.barrier()
        errors = [calls.error_of_one_call(lambda: ws.flags((2,), "early"))]
        world.barrier()
        move_to(ws.ctx, FLAG_CARVE_CALLS, [flags])  # next call: 2**31 (2**31 - 1 done)
        ws._calls = FLAG_CARVE_CALLS - 1  # (the host's count of launches, which it checks)
        world.barrier()
        errors.append(calls.error_of_one_call(lambda: ws.flags((2,), "in time")))
        fresh = ws.flags((W,), "fresh")
        ws.launch(_wait_with_peer_kernel, (1,), flags, counter, 0, HOW=1)  # call 2**31
        ws.synchronize()
        world.barrier()
        errors.append(calls.error_of_one_call(lambda: ws.flags((2,), "late")))
        # the flags carved at 2**31 - 1 calls serve the calls past 2**31
        errors.append(calls.error_of_one_call(lambda: (ws.launch(
            _wait_with_peer_kernel, (1,), fresh, counter, 0, HOW=0), ws.synchronize())))
        return errors


def test_a_flag_array_carved_after_2_31_launches_is_refused(world2):
    """A flag word compares call numbers mod 2**32: a zeroed word carved after 2**31 launches
    read as set for the next call, so a wait on it passed at once. ``ws.flags`` refuses it
    then, on every rank, naming the launches; arrays carved before serve later calls."""
    for r, errors in enumerate(world2.run(_flags_carved_late, timeout=300)):
        early, in_time, late, fresh_wait = errors
        assert early is None and in_time is None and fresh_wait is None, (r, errors)
        assert late and late[0] == "ValueError" and "2147483648 launches" in late[1], (r, late)


@triton.jit
def _give_up_then_wait_kernel(ctx, a_ptr, b_ptr):
    """Rank 1 gives up on flag ``a`` (says so there) and never sets ``b``; rank 0 waits on
    both: its wait on ``a`` reports the peer that gave up, its wait on ``b`` times out."""
    call = pol.begin_call(ctx)
    me, world = pol.rank(ctx), pol.num_ranks(ctx)
    other = pol.peer_at(1, me, world)
    pol.signal(ctx, a_ptr + me, other, call, me != 1)
    if me != 1:
        pol.signal(ctx, b_ptr + me, other, call)
    ok = pol.wait(ctx, a_ptr + other, call, other)
    ok = ok & pol.wait(ctx, b_ptr + other, call, other)
    pol.end_call(ctx, call)


@triton.jit
def _ping_kernel(ctx, x_ptr, inbox_ptr, ready_ptr, out_ptr, n, BLOCK: tl.constexpr):
    call = pol.begin_call(ctx)
    me, world = pol.rank(ctx), pol.num_ranks(ctx)
    nxt, prev = pol.peer_at(1, me, world), pol.peer_at(world - 1, me, world)
    offs = tl.arange(0, BLOCK)
    m = offs < n
    pol.put_signal(ctx, inbox_ptr + offs, tl.load(x_ptr + offs, mask=m), nxt, ready_ptr + me,
                   call, m)
    pol.wait(ctx, ready_ptr + prev, call, prev)
    tl.store(out_ptr + offs, tl.load(inbox_ptr + offs, mask=m), mask=m)
    pol.end_call(ctx, call)


def _timeout_behind_a_report(world):
    """A wait that timed out after its program had reported a peer that gave up (a program
    keeps its first report): the workspace went on as after the peer's report alone, its
    device no longer live, so every later wait gave up at once with no report and the next
    calls returned the previous call's data. (what each step raised, the values received)."""
    import time

    ws = Workspace(world, 8192, timeout_s=0.5, name="hidden")
    a, b, ready = ws.flags((2,), "a"), ws.flags((2,), "b"), ws.flags((2,), "ready")
    inbox = ws.tensor((4,), torch.float32)
    found = []
    try:
        try:
            ws.launch(_give_up_then_wait_kernel, (1,), a, b)
            ws.synchronize()
            found.append(("first", "ok"))
        except Exception as e:
            found.append(("first", type(e).__name__))
        world.barrier()
        for i in range(2):
            x = torch.full((4,), float(100 * (i + 1) + world.rank))
            got = torch.full((4,), -7.0)
            if world.rank == 1:
                time.sleep(1.0)  # past rank 0's deadline, were its waits still live
            try:
                ws.launch(_ping_kernel, (1,), x, inbox, ready, got, 4, BLOCK=4)
                ws.synchronize()
                found.append((f"ping{i}", got.tolist()))
            except Exception as e:
                found.append((f"ping{i}", type(e).__name__))
            world.barrier()
    finally:
        ws.close()
    return found


def test_a_timeout_behind_an_earlier_report_breaks_the_workspace(world2):
    mine = dict(world2.run(_timeout_behind_a_report, timeout=120)[0])
    assert mine["first"] == "PeerTimeoutError", mine
    # broken, not answering with the previous call's rows (201 and 202 were sent)
    assert mine["ping0"] == mine["ping1"] == "ContextBrokenError", mine


@triton.jit
def _copy_kernel(ctx, box_ptr, local_ptr, n, GET: tl.constexpr, BLOCK: tl.constexpr):
    call = pol.begin_call(ctx)
    nxt = pol.peer_at(1, pol.rank(ctx), pol.num_ranks(ctx))
    if GET:
        pol.get(ctx, local_ptr, box_ptr, n, nxt, BLOCK)
    else:
        pol.put(ctx, box_ptr, local_ptr, n, nxt, BLOCK)
    pol.end_call(ctx, call)


def _copies_past_the_heap(world):
    """``pol.put`` / ``pol.get`` of n elements from a heap tensor that run past the heap's end
    on the peer: ``remote_ptr`` checked the first address only, and the copy wrote past the
    peer's heap (both ranks crashed) or read another buffer's bytes (returned with no error).
    (what each launch raised, the box's first words, the local buffer's first words)."""
    from portable_overlap.errors import InvalidInputError

    found = {}
    with Workspace(world, 4096, timeout_s=2.0, name="past") as ws:
        box = ws.tensor((16,), torch.float32)
        for get in (False, True):
            for n in (16, 4096):
                box.fill_(-1.0)
                local = torch.full((n,), float(world.rank + 1))
                world.barrier()
                try:
                    ws.launch(_copy_kernel, (1,), box, local, n, GET=get, BLOCK=16)
                    ws.synchronize()
                    what = "ok"
                except InvalidInputError as e:
                    what = "outside" if "outside this rank's heap" in str(e) else str(e)
                world.barrier()
                found[("get" if get else "put", n)] = (what, box[:2].tolist(),
                                                       local[:2].tolist())
    return found


def test_a_copy_past_the_heap_end_is_reported_and_copies_nothing(world2):
    for r, found in enumerate(world2.run(_copies_past_the_heap, timeout=120)):
        peer = 2 - r  # the other rank's value (rank + 1)
        assert found[("put", 16)] == ("ok", [float(peer)] * 2, [float(r + 1)] * 2), found
        assert found[("get", 16)] == ("ok", [-1.0] * 2, [-1.0] * 2), found
        assert found[("put", 4096)] == ("outside", [-1.0] * 2, [float(r + 1)] * 2), found
        assert found[("get", 4096)] == ("outside", [-1.0] * 2, [float(r + 1)] * 2), found
