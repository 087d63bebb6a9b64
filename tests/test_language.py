"""The public device API (portable_overlap.language) and its host side (Workspace) on emulated
ranks: every primitive against a torch reference over several calls, and the failure paths (a
flag nobody sets, a peer that gives up, a kernel that skips end_call, bad host input)."""
import pytest
import torch
import triton
import triton.language as tl

import portable_overlap.language as pol
from portable_overlap import Workspace
from portable_overlap.errors import (ContextBrokenError, ContextClosedError, PeerTimeoutError,
                                     RankMismatchError)


def error_of_one_call(fn):
    """(exception type name, message) of what ``fn()`` raised, or None."""
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e)
    return None


@triton.jit
def _ping_kernel(ctx, x_ptr, inbox_ptr, ready_ptr, free_ptr, ok_ptr, n, BLOCK: tl.constexpr):
    """Rank r pushes x (n elements) into rank r+1's inbox and signals it; reads its own inbox
    (from r-1) into x_ptr's second half after the wait; frees the inbox for the next call."""
    call = pol.begin_call(ctx)
    me = pol.rank(ctx)
    world = pol.num_ranks(ctx)
    nxt = pol.peer_at(1, me, world)
    prev = pol.peer_at(world - 1, me, world)
    ok = pol.wait(ctx, free_ptr + nxt, call - 1, nxt)  # nxt read what I sent last call
    offs = tl.arange(0, BLOCK)
    m = offs < n
    pol.put_signal(ctx, inbox_ptr + offs, tl.load(x_ptr + offs, mask=m), nxt, ready_ptr + me,
                   call, m)
    ok = ok & pol.wait(ctx, ready_ptr + prev, call, prev)
    tl.store(x_ptr + n + offs, tl.load(inbox_ptr + offs, mask=m), mask=m)
    pol.signal(ctx, free_ptr + me, prev, call)
    tl.store(ok_ptr, ok.to(tl.int32))
    pol.end_call(ctx, call)


def _ping(world, n, calls):
    W, r = world.world_size, world.rank
    with Workspace(world, 1 << 14, timeout_s=20.0, name="ping") as ws:
        inbox = ws.tensor((n,), torch.float32)
        ready = ws.flags((W,), "ready")
        free = ws.flags((W,), "free")
        got = []
        for c in range(calls):
            g = torch.Generator().manual_seed(1000 * c + r)
            x = torch.cat([torch.randn(n, generator=g), torch.full((n,), float("nan"))])
            ok = torch.zeros(1, dtype=torch.int32)
            ws.launch(_ping_kernel, (1,), x, inbox, ready, free, ok, n, BLOCK=64)
            got.append((x[:n].clone(), x[n:].clone(), int(ok)))
        ws.synchronize()
        return got, int(ws.ctx[0])


def test_ping_ring_over_calls(world):
    out = world.run(_ping, 37, 3)
    W = len(out)
    for r, (got, done) in enumerate(out):
        assert done == 3  # the device counted three calls
        prev = (r - 1) % W
        for c in range(3):
            mine, recv, ok = got[c]
            assert ok == 1
            assert torch.equal(recv, out[prev][0][c][0])  # exactly what the previous rank sent


@triton.jit
def _gather_kernel(ctx, x_ptr, out_ptr, ready_ptr, n, BLOCK: tl.constexpr):
    """All-gather by bulk puts: program p sends x to the peer at step p+1 of the rotation,
    then signals; program 0 also copies its own rows. Every program then waits for the peer it
    reads from and copies that peer's rows from the heap to out."""
    call = pol.begin_call(ctx)
    me = pol.rank(ctx)
    world = pol.num_ranks(ctx)
    p = pol.program()
    q = pol.peer_at(p + 1, me, world)
    pol.put(ctx, out_ptr + me * n, x_ptr, n, q, BLOCK)
    pol.signal(ctx, ready_ptr + me, q, call)
    if p == 0:
        pol.put(ctx, out_ptr + me * n, x_ptr, n, me, BLOCK)
    src = pol.peer_at(world - 1 - p, me, world)
    pol.wait(ctx, ready_ptr + src, call, src)
    pol.end_call(ctx, call)


def _gather(world, n, calls):
    W, r = world.world_size, world.rank
    ws = Workspace(world, 1 << 16, timeout_s=20.0, name="gather")
    out = ws.tensor((W, n), torch.float16)
    ready = ws.flags((W,), "ready")
    results = []
    for c in range(calls):
        x = torch.randn(n, generator=torch.Generator().manual_seed(50 * c + r)).half()
        out.fill_(float("nan"))
        world.barrier()  # one receive buffer: nobody stores before everyone poisoned it
        ws.launch(_gather_kernel, (W - 1,), x, out, ready, n, BLOCK=32)
        results.append((x, out.clone()))
        world.barrier()  # ...and nobody overwrites it before everyone read it
    ws.close()
    return results


def test_all_gather_by_puts(world):
    out = world.run(_gather, 45, 2)
    for r, results in enumerate(out):
        for c, (_, gathered) in enumerate(results):
            want = torch.stack([out[q][c][0] for q in range(len(out))])
            assert torch.equal(gathered, want)


@triton.jit
def _count_kernel(ctx, counter_ptr, bar_ptr, x_ptr, out_ptr, ok_ptr, BLOCK: tl.constexpr):
    """Every rank adds 1 to every rank's counter (itself included) and waits for world per
    call; then a barrier; then reads every peer's x by remote loads and sums them."""
    call = pol.begin_call(ctx)
    me = pol.rank(ctx)
    world = pol.num_ranks(ctx)
    for step in range(0, world):
        pol.notify(ctx, counter_ptr, pol.peer_at(step, me, world))
    ok = pol.wait_count(ctx, counter_ptr, call * world, call, -1)
    ok = ok & pol.barrier(ctx, bar_ptr, call)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    for q in range(0, world):
        acc += pol.load_remote(ctx, x_ptr + offs, q)
    tl.store(out_ptr + offs, acc)
    tl.store(ok_ptr, ok.to(tl.int32))
    pol.end_call(ctx, call)


def _count(world, calls):
    W, r = world.world_size, world.rank
    ws = Workspace(world, 4096, timeout_s=20.0)
    counter = ws.flags((1,), "arrivals")
    bars = ws.flags((calls, W), "barrier")
    x = ws.tensor((16,), torch.float32)
    got = []
    for c in range(calls):
        x.copy_(torch.randn(16, generator=torch.Generator().manual_seed(7 * c + r)))
        world.barrier()
        out = torch.full((16,), float("nan"))
        ok = torch.zeros(1, dtype=torch.int32)
        ws.launch(_count_kernel, (1,), counter, bars[c], x, out, ok, BLOCK=16)
        got.append((x.clone(), out, int(ok), int(counter[0])))
        world.barrier()
    ws.close()
    return got


def test_counters_barrier_and_remote_loads(world):
    out = world.run(_count, 2)
    W = len(out)
    for r, got in enumerate(out):
        for c, (_, total, ok, count) in enumerate(got):
            assert ok == 1 and count == (c + 1) * W  # counters accumulate over calls
            want = sum(out[q][c][0] for q in range(W))
            torch.testing.assert_close(total, want)


@triton.jit
def _grid_kernel(ctx, out_ptr):
    call = pol.begin_call(ctx)
    tl.store(out_ptr + pol.program(), pol.num_programs() * 1000 + call)
    pol.end_call(ctx, call)


def _grid(world):
    with Workspace(world, 256) as ws:
        out = torch.full((24,), -1, dtype=torch.int64)
        ws.launch(_grid_kernel, (2, 3, 4), out)
        ws.launch(_grid_kernel, (4, 3, 2), out)
        ws.synchronize()
        return out


def test_program_numbering_over_a_3d_grid(world2):
    for out in world2.run(_grid):
        assert torch.equal(out, torch.full((24,), 24 * 1000 + 2))  # every slot, second call


@triton.jit
def _lonely_kernel(ctx, flags_ptr):
    """Waits for a flag that no rank ever sets."""
    call = pol.begin_call(ctx)
    pol.wait(ctx, flags_ptr + 2, call, pol.peer_at(1, pol.rank(ctx), pol.num_ranks(ctx)))
    pol.end_call(ctx, call)


def _lonely(world):
    ws = Workspace(world, 1024, timeout_s=0.5, name="lonely")
    ws.tensor((5,), torch.float32)
    flags = ws.flags((2, 3), "never_set")
    first = error_of_one_call(lambda: ws.launch(_lonely_kernel, (2,), flags))
    second = error_of_one_call(lambda: ws.launch(_lonely_kernel, (2,), flags))
    ws.close()
    return first, second


def test_a_flag_nobody_sets_raises_on_every_rank_naming_it(world):
    W = 0
    for r, (first, second) in enumerate(world.run(_lonely)):
        W += 1
        kind, msg = first
        assert kind == "PeerTimeoutError"
        assert "lonely" in msg and f"rank {r}" in msg and "call #1" in msg
        assert "'never_set' (shape [2, 3], flat index) flag [2]" in msg
        assert second[0] == "ContextBrokenError"  # out of step: the workspace is done


@triton.jit
def _quit_kernel(ctx, flags_ptr, out_ptr, QUITTER: tl.constexpr):
    """Rank QUITTER gives up on the call; the others wait for its flag."""
    call = pol.begin_call(ctx)
    me = pol.rank(ctx)
    world = pol.num_ranks(ctx)
    for step in range(1, world):
        pol.signal(ctx, flags_ptr + me, pol.peer_at(step, me, world), call, me != QUITTER)
    ok = me >= 0
    for step in range(1, world):
        q = pol.peer_at(step, me, world)
        ok = ok & pol.wait(ctx, flags_ptr + q, call, q)
    tl.store(out_ptr, ok.to(tl.int32))
    pol.end_call(ctx, call)


def _quit(world):
    W = world.world_size
    ws = Workspace(world, 1024, timeout_s=20.0, name="quitter")
    flags = ws.flags((W,), "ready")
    out = torch.full((1,), -1, dtype=torch.int32)
    first = error_of_one_call(lambda: ws.launch(_quit_kernel, (1,), flags, out, QUITTER=1))
    ok1 = int(out)
    # the next call's flags would stand for this one's (a later call counts as arrived) if a
    # rank signalled them before a peer read this call's: a kernel that runs calls back to
    # back protects its flags with a "free" flag, as _ping_kernel does; here the host waits
    world.barrier()
    ws.launch(_quit_kernel, (1,), flags, out, QUITTER=W)  # nobody quits: usable again
    ok2 = int(out)
    ws.close()
    return first, ok1, ok2


def test_a_peer_that_gives_up_is_reported_and_the_workspace_goes_on(world):
    for r, (first, ok1, ok2) in enumerate(world.run(_quit)):
        if r == 1:
            assert first is None and ok1 == 1  # the quitter itself waited for the others
        else:
            assert first[0] == "PeerTimeoutError" and "rank 1 gave up" in first[1]
            assert "'ready'" in first[1] and ok1 == 0
        assert ok2 == 1


@triton.jit
def _no_end_kernel(ctx, out_ptr):
    call = pol.begin_call(ctx)
    tl.store(out_ptr, call)


def _no_end(world):
    ws = Workspace(world, 256)
    out = torch.zeros(1, dtype=torch.int64)
    err = error_of_one_call(lambda: ws.launch(_no_end_kernel, (1,), out))
    again = error_of_one_call(lambda: ws.launch(_no_end_kernel, (1,), out))
    ws.close()
    return err, again


def test_a_kernel_that_skips_end_call_is_caught(world2):
    for err, again in world2.run(_no_end):
        assert err[0] == "ContextBrokenError" and "pol.end_call" in err[1]
        assert again[0] == "ContextBrokenError"


def _bad_host(world):
    errors = {}
    for what, fn in {
        "nbytes": lambda: Workspace(world, -1),
        "name": lambda: Workspace(world, 64, name=""),
        "timeout": lambda: Workspace(world, 64, timeout_s=0),
    }.items():
        errors[what] = error_of_one_call(fn)
    ws = Workspace(world, 1024, name="host")
    errors["shape"] = error_of_one_call(lambda: ws.tensor(("a",), torch.float32))
    errors["dtype"] = error_of_one_call(lambda: ws.tensor((4,), "float32"))
    errors["flag name"] = error_of_one_call(lambda: ws.flags((4,), ""))
    errors["full"] = error_of_one_call(lambda: ws.tensor((4096,), torch.float32))
    errors["disagree"] = error_of_one_call(
        lambda: ws.tensor((4 + world.rank,), torch.float32))
    ws.close()
    errors["closed"] = error_of_one_call(lambda: ws.tensor((4,), torch.float32))
    errors["closed launch"] = error_of_one_call(lambda: ws.launch(_grid_kernel, (1,), None))
    return errors


def test_bad_host_input_is_refused(world2):
    for errors in world2.run(_bad_host):
        assert errors["nbytes"][0] == "ValueError" and "nbytes" in errors["nbytes"][1]
        assert errors["name"][0] == "ValueError"
        assert errors["timeout"][0] == "ValueError" and "timeout_s" in errors["timeout"][1]
        assert errors["shape"][0] == "ValueError" and errors["dtype"][0] == "ValueError"
        assert errors["flag name"][0] == "ValueError" and "name" in errors["flag name"][1]
        assert errors["full"][0] == "MemoryError" and "larger nbytes" in errors["full"][1]
        assert errors["disagree"][0] == RankMismatchError.__name__
        assert errors["closed"][0] == ContextClosedError.__name__
        assert errors["closed launch"][0] == ContextClosedError.__name__


def test_public_names():
    assert set(pol.__all__) <= set(dir(pol))
    for name in pol.__all__:
        assert isinstance(getattr(pol, name), triton.JITFunction), name
    assert issubclass(PeerTimeoutError, RuntimeError) and issubclass(ContextBrokenError,
                                                                      RuntimeError)


@pytest.mark.parametrize("n", [1, 63])
def test_ping_odd_sizes(world2, n):
    for r, (got, done) in enumerate(out := world2.run(_ping, n, 2)):
        assert done == 2
        for c in range(2):
            assert torch.equal(got[c][1], out[1 - r][0][c][0])
