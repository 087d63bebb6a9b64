"""Faults a failing rank or a hostile caller causes, on CPU-emulated ranks: every wait bounded in
wall-clock time, a call refused on one rank failing on every rank without shifting later calls,
and the lifecycle guards of a context (closed, used from two threads, bad timeouts)."""
import threading
import time

import pytest
import torch

from portable_overlap import (ConcurrentUseError, ContextBrokenError, ContextClosedError,
                              GemvAllReduce, PeerTimeoutError, PortableOverlapError,
                              gemv_all_reduce_reference)
from portable_overlap.ops.context import get_context


def _inputs(world, M, N, K, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed * 1000 + world.rank)
    return torch.randn(M, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype)


def _close(y, ref):
    return bool(torch.allclose(y, ref, rtol=1e-4, atol=1e-4))


# -- wall-clock bounded waits -------------------------------------------------------------------
def _alone(world, timeout_s, n):
    """A call every rank makes, on a context with a long timeout (its time is what the
    interpreter needs for the work itself on this loaded machine; the ranks may reach it
    seconds apart), then one that rank 0 makes alone (N=n: a grid of several programs) on a
    context with ``timeout_s``."""
    x, w = _inputs(world, 1, n, 4, seed=1)
    warm = GemvAllReduce(world, max_n=n, timeout_s=120.0)
    t0 = time.monotonic()
    warm(x, w)
    work = time.monotonic() - t0
    warm.close()
    ctx = GemvAllReduce(world, max_n=n, timeout_s=timeout_s)
    out = None
    if world.rank == 0:
        t0 = time.monotonic()
        try:
            ctx(x, w)
            out = ("no error", 0.0, work)
        except PeerTimeoutError as e:
            out = (str(e), time.monotonic() - t0, work)
    ctx.close()
    return out


@pytest.mark.parametrize("timeout_s", [1.0, 2.0])
def test_missing_peer_times_out_within_twice_the_timeout(world, timeout_s):
    """One deadline per call shared by every program: the interpreter runs the programs one
    after another, and a per-program budget made a 0.5 s timeout take 30-40 s."""
    msg, took, work = world.run(_alone, timeout_s, 256, timeout=300)[0]
    assert "timed out waiting for rank" in msg, msg
    assert timeout_s * 0.9 <= took <= 2 * timeout_s + work, (took, work, msg)


def _bad(x, kind):
    if kind == "dtype":
        return x.to(torch.float16)
    if kind == "shape":
        return x[:, :-1].contiguous()
    if kind == "noncontig":
        return x.t().contiguous().t()
    return x.tolist()


def _refuse_on_rank(world, bad_rank, bad):
    """Three calls; in the second, ``bad_rank`` passes bad input (refused on the host before any
    launch). Returns per call: 'ok' (result right), 'wrong', or the error class name."""
    ctx = GemvAllReduce(world, max_n=64, timeout_s=5.0)
    outcomes = []
    for call in range(3):
        x, w = _inputs(world, 3, 40, 24, seed=call)
        ref = gemv_all_reduce_reference(x, w, world.group)
        if call == 1 and world.rank == bad_rank:
            x = _bad(x, bad)
        try:
            y = ctx(x, w, out=torch.full((3, 40), float("nan")))
            outcomes.append("ok" if _close(y, ref) else "wrong")
        except PortableOverlapError as e:
            outcomes.append(type(e).__name__)
        except (ValueError, TypeError) as e:
            outcomes.append("refused:" + type(e).__name__)
    ctx.close()
    return outcomes


@pytest.mark.parametrize("bad", ["dtype", "shape", "noncontig", "type"])
def test_call_refused_on_one_rank_fails_that_call_everywhere_and_no_later_one(world, bad):
    results = world.run(_refuse_on_rank, 1, bad, timeout=120)
    for rank, outcomes in enumerate(results):
        assert outcomes[0] == "ok" and outcomes[2] == "ok", (rank, outcomes)
        if rank == 1:
            assert outcomes[1].startswith("refused:"), outcomes
        else:  # the peer gave up on that call: raised, never a result
            assert outcomes[1] == "PeerTimeoutError", (rank, outcomes)


def _skip_then_differ(world):
    """Rank 1 skips a call and makes the next one with other shapes: the peers' waiting call is
    caught by the shape tag (or the timeout), never returned as a result."""
    ctx = GemvAllReduce(world, max_n=64, timeout_s=2.0)
    outcomes = []
    for call, n in enumerate((32, 32, 48)):
        if world.rank == 1 and call == 1:
            outcomes.append("skipped")
            continue
        x, w = _inputs(world, 2, n, 16, seed=call)
        try:
            ctx(x, w)
            outcomes.append("returned")
        except PortableOverlapError as e:
            outcomes.append(type(e).__name__)
    ctx.close()
    return outcomes


def test_skipped_call_with_other_shapes_next_is_caught(world):
    for rank, outcomes in enumerate(world.run(_skip_then_differ, timeout=120)):
        assert outcomes[0] == "returned"
        assert "returned" not in outcomes[1:], (rank, outcomes)


# -- lifecycle guards ---------------------------------------------------------------------------
def _lifecycle(world):
    ctx = GemvAllReduce(world, max_n=32, timeout_s=2.0)
    x, w = _inputs(world, 1, 32, 8, seed=3)
    ref = gemv_all_reduce_reference(x, w, world.group)
    found = {}
    ctx.impl._guard.acquire()  # another thread's call is under way (on its workspace)
    try:
        ctx(x, w)
        found["thread"] = "no error"
    except ConcurrentUseError as e:
        found["thread"] = str(e)
    finally:
        ctx.impl._guard.release()
    found["after_thread"] = _close(ctx(x, w), ref)  # the refused thread's call never counted
    handle = ctx.handle
    ctx.close()
    ctx.close()  # twice is fine
    for name, fn in (("call", lambda: ctx(x, w)), ("sync", ctx.synchronize),
                     ("handle", lambda: get_context(handle))):
        try:
            fn()
            found[name] = "no error"
        except ContextClosedError as e:
            found[name] = str(e)
    ctx2 = GemvAllReduce(world, max_n=32, timeout_s=2.0)
    found["new_handle"] = ctx2.handle != handle
    ctx2.close()
    bad = {}
    for t in (0, -1, float("nan"), float("inf"), 1e9, "soon"):  # None: the default
        try:
            GemvAllReduce(world, max_n=8, timeout_s=t).close()
            bad[repr(t)] = "no error"
        except ValueError as e:
            bad[repr(t)] = str(e)
    found["bad_timeouts"] = bad
    return found


def test_lifecycle_guards(world2):
    for found in world2.run(_lifecycle, timeout=120):
        assert "another thread" in found["thread"], found
        assert found["after_thread"] is True
        for k in ("call", "sync", "handle"):
            assert "closed" in found[k], (k, found[k])
        assert found["new_handle"]
        for t, msg in found["bad_timeouts"].items():
            assert "timeout_s" in msg, (t, msg)


def _close_beside_a_call(world, transport):
    """close() while another thread's call is under way: held for 1 s by a thread that takes
    the call guard (of the workspace, or ``"auto"``'s planner), then a real race, a worker
    thread calling in a loop while the main thread closes. What close waited, what came after."""
    found = {}
    ctx = GemvAllReduce(world, max_n=32, transport=transport, timeout_s=2.0)
    guard = ctx.planner._lock if ctx.planner is not None else ctx.impl._guard
    guard.acquire()
    holder = threading.Timer(1.0, guard.release)
    holder.start()
    t0 = time.monotonic()
    ctx.close()
    found["waited"] = time.monotonic() - t0
    holder.join()
    x, w = _inputs(world, 1, 32, 8, seed=4)
    try:
        ctx(x, w)
        found["after"] = "no error"
    except ContextClosedError as e:
        found["after"] = str(e)
    ctx = GemvAllReduce(world, max_n=32, transport=transport, timeout_s=2.0)
    ref = gemv_all_reduce_reference(x, w, world.group)
    results = []

    def worker():
        for _ in range(40):
            try:
                results.append(_close(ctx(x, w), ref))
            except PortableOverlapError as e:  # closed, or a peer closed first
                results.append(type(e).__name__)
                return

    thread = threading.Thread(target=worker)
    thread.start()
    time.sleep(0.5)
    ctx.close()  # (every rank crashed: the worker's kernel ran on the freed heap)
    thread.join()
    found["race"] = results
    ctx = GemvAllReduce(world, max_n=32, transport=transport, timeout_s=2.0)
    found["fresh"] = _close(ctx(x, w), ref)
    ctx.close()
    return found


@pytest.mark.parametrize("transport", ["stores", "auto"])
def test_close_waits_for_another_threads_call(world2, transport):
    for found in world2.run(_close_beside_a_call, transport, timeout=200):
        assert found["waited"] > 0.9 and "closed" in found["after"], found
        assert found["fresh"] is True, found
        race = found["race"]
        assert all(r is True for r in race[:-1]), race
        assert race[-1] in (True, "ContextClosedError", "PeerTimeoutError",
                            "ContextBrokenError"), race


def _two_threads_two_contexts(world):
    """Under the interpreter, one thread's calls at a time per process: a call of another
    context made while another thread's call is under way raises a clear ConcurrentUseError
    before it starts (on every rank alike here), and both contexts serve calls after it."""
    from portable_overlap.ops.context import end_interpreter_turn, take_interpreter_turn

    a = GemvAllReduce(world, max_n=32, timeout_s=2.0)
    b = GemvAllReduce(world, max_n=32, timeout_s=2.0)
    x, w = _inputs(world, 1, 32, 8, seed=5)
    ref = gemv_all_reduce_reference(x, w, world.group)
    held, release = threading.Event(), threading.Event()

    def other_thread():  # a call of context a, under way in another thread
        take_interpreter_turn("test", world.rank)
        held.set()
        release.wait(30)
        end_interpreter_turn()

    thread = threading.Thread(target=other_thread)
    thread.start()
    held.wait(30)
    try:
        b(x, w)
        refused = "no error"
    except ConcurrentUseError as e:
        refused = str(e)
    release.set()
    thread.join()
    after = [_close(a(x, w), ref), _close(b(x, w), ref)]
    a.close()
    b.close()
    return refused, after


def test_a_second_threads_call_under_the_interpreter_is_refused_before_it_starts(world2):
    """Triton's interpreter is not thread-safe: two threads' launches at once failed with an
    InterpreterError that broke the context and left its peer waiting."""
    for refused, after in world2.run(_two_threads_two_contexts, timeout=120):
        assert "another thread" in refused and "interpreter" in refused, refused
        assert after == [True, True], after


def _signal_lifecycle(world):
    """The tile-group-signal transport has the same call guards as every other context."""
    from portable_overlap import MatmulAllReduce, matmul_all_reduce, matmul_all_reduce_reference

    ctx = MatmulAllReduce(world, 32, 24, transport="signal_collective", timeout_s=20.0)
    g = torch.Generator().manual_seed(7 + world.rank)
    a, b = torch.randn(32, 16, generator=g), torch.randn(16, 24, generator=g)
    ref = matmul_all_reduce_reference(a, b, world.group)
    found = {}
    ctx.impl._guard.acquire()  # another thread's call is under way
    try:
        matmul_all_reduce(a, b, ctx)
        found["thread"] = "no error"
    except ConcurrentUseError as e:
        found["thread"] = str(e)
    finally:
        ctx.impl._guard.release()
    found["after_thread"] = _close(matmul_all_reduce(a, b, ctx), ref)
    ctx.close()
    ctx.close()  # twice is fine
    for name, fn in (("call", lambda: matmul_all_reduce(a, b, ctx)),
                     ("sync", ctx.synchronize)):
        try:
            fn()
            found[name] = "no error"
        except ContextClosedError as e:
            found[name] = str(e)
    return found


def test_signal_transport_has_the_lifecycle_guards(world2):
    for found in world2.run(_signal_lifecycle, timeout=180):
        assert "another thread" in found["thread"], found
        assert found["after_thread"] is True, found
        for k in ("call", "sync"):
            assert "closed" in found[k], (k, found[k])


def _broken_after_timeout(world):
    """After a timeout the context is out of step: every later call raises at once."""
    ctx = GemvAllReduce(world, max_n=32, timeout_s=0.5)
    x, w = _inputs(world, 1, 32, 8, seed=4)
    first = second = "no error"
    if world.rank == 0:
        try:
            ctx(x, w)
        except PeerTimeoutError:
            first = "timeout"
        t0 = time.monotonic()
        try:
            ctx(x, w)
        except ContextBrokenError:
            second = f"broken after {time.monotonic() - t0:.3f} s"
    ctx.close()
    return first, second


def test_context_broken_after_a_timeout(world2):
    first, second = world2.run(_broken_after_timeout, timeout=120)[0]
    assert first == "timeout"
    assert second.startswith("broken") and float(second.split()[2]) < 0.1, second


# -- the host-collective transport (GEMM with tile-group signals) ------------------------------
def _signal_fault(world, fault, timeout_s):
    """A warm GEMM + AllReduce (plans agreed at the first call); then rank 1 skips a call, or
    calls with another N. The others' collectives must give up within 2x the timeout."""
    from portable_overlap.ops.gemm_signal import GemmSignal, SignalConfig
    from portable_overlap.ops.matmul import MatmulConfig

    cfg = SignalConfig(matmul=MatmulConfig(block_m=16, block_n=16, block_k=16, group_m=2,
                                           num_warps=1, num_stages=1))
    ctx = GemmSignal(world, config=cfg, timeout_s=timeout_s)
    a, b = torch.randn(8, 8), torch.randn(8, 32)
    ctx.all_reduce(a, b)
    ctx.all_reduce(a, b[:, :16])
    out = "skipped"
    if not (fault == "skip" and world.rank == 1):
        bb = b[:, :16] if (fault == "other_n" and world.rank == 1) else b
        t0 = time.monotonic()
        try:
            ctx.all_reduce(a, bb)
            out = "no error"
        except PortableOverlapError as e:
            out = (type(e).__name__, str(e), time.monotonic() - t0)
    else:
        time.sleep(3 * timeout_s)  # still there (not closed) while the peer waits
    ctx.close()
    return out


@pytest.mark.parametrize("fault", ["skip", "other_n"])
def test_signal_collectives_are_bounded(world2, fault):
    """A skipped call times out within 2x the context's timeout; a call with other shapes is
    caught on every rank before any data moves (under gloo, whose ranks abort on a collective of
    another size)."""
    for rank, out in enumerate(world2.run(_signal_fault, fault, 1.0, timeout=120)):
        if out == "skipped":
            continue
        assert out != "no error", (rank, out)
        kind, msg, took = out
        if fault == "skip":
            assert kind == "PeerTimeoutError" and "timeout_s=1.0" in msg, (rank, msg)
            assert took <= 2.0 + 0.5, (rank, took, msg)
        else:
            assert kind == "RankMismatchError" and "different shapes" in msg, (rank, msg)
            # which ranks, what each passed, once
            assert "ranks 0 and 1" in msg and msg.count("rank 1:") == 1, (rank, msg)
            assert "N=32" in msg and "N=16" in msg and "they differ in: N" in msg, (rank, msg)


def _with_blocks(world) -> dict:
    import portable_overlap as po

    made = {"embedding_all_to_all": lambda: po.EmbeddingAllToAll(world, [8, 8], 4, 2),
            "moe_dispatch": lambda: po.MoeDispatch(world, max_tokens=4, top_k=1, hidden=8,
                                                   experts_per_rank=1),
            "moe_gemm_combine": lambda: po.MoeGemmCombine(world, max_tokens=4, top_k=1,
                                                          hidden=8, experts_per_rank=1)}
    found = {}
    for name, make in made.items():
        with make() as ctx:
            pass
        try:
            ctx.synchronize()
            found[name] = "still open"
        except ContextClosedError:
            found[name] = "closed"
    return found


def test_every_context_closes_at_the_end_of_a_with_block(world2):
    """README: a context is closed by ``ctx.close()`` or a ``with`` block, for every op."""
    for found in world2.run(_with_blocks):
        assert set(found.values()) == {"closed"}, found


@pytest.mark.parametrize("timeout_s", [0.0, 0.005, -1.0, float("nan"), float("inf"), 1801.0,
                                       "ten", None])
def test_timeouts_outside_the_deadlines_range_are_refused(timeout_s):
    """A call's deadline is kept in units of 2**20 ns and may come up to 1.05 ms early: a timeout of
    a few milliseconds or less gave up at once."""
    from portable_overlap.ops.context import check_timeout

    with pytest.raises(ValueError, match=r"op: timeout_s must be"):
        check_timeout("op", timeout_s)
    assert check_timeout("op", 0.01) == 0.01 and check_timeout("op", 1800) == 1800.0


class _Stream:
    """A stand-in for a device stream: what waited for what, and whether it is capturing."""

    def __init__(self, name, log, capturing=False):
        self.name, self.log, self.capturing = name, log, capturing

    def wait_stream(self, other):
        self.log.append((self.name, other.name))


class _StreamModule:
    """The parts of ``torch.get_device_module`` that ``_follow_stream`` uses."""

    def __init__(self):
        self.current = None

    def current_stream(self, device):
        return self.current

    def is_current_stream_capturing(self):
        return self.current.capturing

    def stream(self, s):
        module = self

        class _With:
            def __enter__(self):
                self.saved, module.current = module.current, s

            def __exit__(self, *exc):
                module.current = self.saved
        return _With()


def test_calls_on_another_stream_wait_for_the_last_call(monkeypatch):
    """Calls of one context share its workspace and call counter: where the caller's stream
    changes, the new stream waits for the old one, once, and not where either is captured."""
    from types import SimpleNamespace

    from portable_overlap.ops.context import ContextBase

    log, module = [], _StreamModule()
    handles = {}
    backend = SimpleNamespace(current_stream=lambda d: handles[module.current.name])
    ctx = SimpleNamespace(world=SimpleNamespace(device=torch.device("cpu"), backend=backend),
                          _stream=None)
    monkeypatch.setattr(torch, "get_device_module", lambda d: module)
    a, b = _Stream("a", log), _Stream("b", log)
    cap, c = _Stream("capture", log, capturing=True), _Stream("c", log)
    handles.update(a=1, b=2, capture=3, c=4)

    def call_on(s):
        module.current = s
        ContextBase._follow_stream(ctx)

    call_on(a)
    call_on(a)
    assert log == []  # the first call and one on the same stream wait for nothing
    call_on(b)
    call_on(b)
    assert log == [("b", "a")]
    call_on(cap)  # a captured stream cannot wait for work outside its graph
    assert log == [("b", "a")]
    call_on(c)  # nor is a wait queued behind a capture still running
    assert log == [("b", "a")]
    call_on(cap)
    cap.capturing = False  # the capture ended: its stream holds nothing of the graph
    call_on(a)
    assert log == [("b", "a"), ("a", "capture")]
