"""Calls of the public device API (portable_overlap.language) that the CPU tests and the GPU
check share: each runs on every rank (``fn(world, ...)``) on the world's device and returns
host values; the ``check_*`` functions judge every rank's results and return what is wrong."""
import time

import torch
import triton
import triton.language as tl

import portable_overlap.language as pol
from ..language.host import calls_counted
from ..workspace import Workspace


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


def ping(world, n, calls):
    """Rank r sends fresh random data to r+1 in ``calls`` back-to-back calls (free flags);
    returns per call (sent, received, ok) and the device's call count."""
    W, r, dev = world.world_size, world.rank, world.device
    nbytes = Workspace.bytes_for(((n,), torch.float32), ((W,), torch.int64), ((W,), torch.int64))
    with Workspace(world, nbytes, timeout_s=20.0, name="ping") as ws:
        inbox = ws.tensor((n,), torch.float32)
        ready = ws.flags((W,), "ready")
        free = ws.flags((W,), "free")
        got = []
        for c in range(calls):
            g = torch.Generator(dev).manual_seed(1000 * c + r)
            x = torch.cat([torch.randn(n, generator=g, device=dev),
                           torch.full((n,), float("nan"), device=dev)])
            ok = torch.zeros(1, dtype=torch.int32, device=dev)
            ws.launch(_ping_kernel, (1,), x, inbox, ready, free, ok, n,
                      BLOCK=triton.next_power_of_2(n))  # one tile holds the message
            got.append((x[:n].to("cpu", copy=True), x[n:].to("cpu", copy=True), int(ok)))
        ws.synchronize()
        return got, calls_counted(ws.ctx)


@triton.jit
def _ring_kernel(ctx, x_ptr, inbox_ptr, out_ptr, ready_ptr, free_ptr, ok_ptr, n,
                 BLOCK: tl.constexpr, VIA_SHMEM: tl.constexpr):
    """Rank r puts x (n elements) into rank r+1's inbox, through the SHMEM library (VIA_SHMEM)
    or by zero-copy stores, and signals it; copies its own inbox (from r-1) to out after the
    wait; frees the inbox for the next call."""
    call = pol.begin_call(ctx)
    me = pol.rank(ctx)
    world = pol.num_ranks(ctx)
    nxt = pol.peer_at(1, me, world)
    prev = pol.peer_at(world - 1, me, world)
    ok = pol.wait(ctx, free_ptr + nxt, call - 1, nxt)  # nxt read what I sent last call
    if VIA_SHMEM:
        pol.shmem_put(inbox_ptr, x_ptr, n, nxt)
        pol.shmem_quiet()  # the data is at nxt before the flag says so
    else:
        pol.put(ctx, inbox_ptr, x_ptr, n, nxt, BLOCK)
    pol.signal(ctx, ready_ptr + me, nxt, call)
    ok = ok & pol.wait(ctx, ready_ptr + prev, call, prev)
    for i in range(0, n, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(inbox_ptr + offs, mask=offs < n), mask=offs < n)
    pol.signal(ctx, free_ptr + me, prev, call)
    tl.store(ok_ptr, ok.to(tl.int32))
    pol.end_call(ctx, call)


@triton.jit
def _pull_ring_kernel(ctx, x_ptr, outbox_ptr, out_ptr, ready_ptr, free_ptr, ok_ptr, n,
                      BLOCK: tl.constexpr, VIA_SHMEM: tl.constexpr):
    """Rank r stages x (n elements) in its own outbox and tells r+1, which pulls it into out
    through the SHMEM library (VIA_SHMEM) or by zero-copy loads, then tells r that the outbox
    is read (r stages the next call's x only after that)."""
    call = pol.begin_call(ctx)
    me = pol.rank(ctx)
    world = pol.num_ranks(ctx)
    nxt = pol.peer_at(1, me, world)
    prev = pol.peer_at(world - 1, me, world)
    ok = pol.wait(ctx, free_ptr + nxt, call - 1, nxt)  # nxt pulled what I staged last call
    for i in range(0, n, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        tl.store(outbox_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)
    pol.signal(ctx, ready_ptr + me, nxt, call)  # the release covers the outbox's stores
    ok = ok & pol.wait(ctx, ready_ptr + prev, call, prev)
    if VIA_SHMEM:
        pol.shmem_get(out_ptr, outbox_ptr, n, prev)  # in out when it returns
    else:
        pol.get(ctx, out_ptr, outbox_ptr, n, prev, BLOCK)
    pol.signal(ctx, free_ptr + me, prev, call)  # after the reads: prev may stage again
    tl.store(ok_ptr, ok.to(tl.int32))
    pol.end_call(ctx, call)


def ring(world, n, calls, shmem, pull=False):
    """Rank r sends fresh random data to r+1 in ``calls`` back-to-back calls: pushed by r
    (puts), or with ``pull`` staged in r's own buffer and pulled by r+1 (gets); through the
    SHMEM library on a ``Workspace(shmem=True)``, by ``pol.put`` / ``pol.get`` otherwise (raises
    ShmemUnavailable on every rank where the library is not usable). Returns what
    :func:`ping` returns."""
    W, r, dev = world.world_size, world.rank, world.device
    nbytes = Workspace.bytes_for(((n,), torch.float32), ((W,), torch.int64), ((W,), torch.int64))
    kernel = _pull_ring_kernel if pull else _ring_kernel
    with Workspace(world, nbytes, timeout_s=20.0, name="ring", shmem=shmem) as ws:
        box = ws.tensor((n,), torch.float32)  # the inbox of puts, the outbox of gets
        ready = ws.flags((W,), "ready")
        free = ws.flags((W,), "free")
        got = []
        for c in range(calls):
            x = torch.randn(n, generator=torch.Generator(dev).manual_seed(1000 * c + r),
                            device=dev)
            out = torch.full((n,), float("nan"), device=dev)
            ok = torch.zeros(1, dtype=torch.int32, device=dev)
            ws.launch(kernel, (1,), x, box, out, ready, free, ok, n, BLOCK=1024,
                      VIA_SHMEM=ws.shmem)
            got.append((x.to("cpu", copy=True), out.to("cpu", copy=True), int(ok)))
        ws.synchronize()
        return got, calls_counted(ws.ctx)


def shmem_refused(world):
    """``Workspace(shmem=True)`` where no SHMEM library is usable: its error; then whether a
    ``Workspace(shmem=False)`` made after it works (a ring of two calls)."""
    err = error_of_one_call(lambda: Workspace(world, 4096, name="shm", shmem=True))
    return err, ring(world, 37, 2, shmem=False)


@triton.jit
def _shmem_put_kernel(ctx, x_ptr, inbox_ptr, n):
    call = pol.begin_call(ctx)
    pol.shmem_put(inbox_ptr, x_ptr, n, pol.rank(ctx))
    pol.end_call(ctx, call)


@triton.jit
def _shmem_get_kernel(ctx, x_ptr, inbox_ptr, n):
    call = pol.begin_call(ctx)
    pol.shmem_get(x_ptr, inbox_ptr, n, pol.rank(ctx))
    pol.end_call(ctx, call)


def shmem_call_without_library(world, get=False):
    """A kernel that calls ``pol.shmem_put`` (``pol.shmem_get`` with ``get``) with no
    constexpr guard where no SHMEM library is bound: the launch's error (no peer waits for
    it)."""
    kernel = _shmem_get_kernel if get else _shmem_put_kernel
    with Workspace(world, 1024, name="no_library") as ws:
        inbox = ws.tensor((16,), torch.float32)
        x = torch.ones(16, device=world.device)
        return error_of_one_call(lambda: ws.launch(kernel, (1,), x, inbox, 16))


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


def gather(world, n, calls):
    """All-gather by puts, ``calls`` times with fresh data; returns per call (x, gathered)."""
    W, r, dev = world.world_size, world.rank, world.device
    ws = Workspace(world, Workspace.bytes_for(((W, n), torch.float16), ((W,), torch.int64)),
                   timeout_s=20.0, name="gather")
    out = ws.tensor((W, n), torch.float16)
    ready = ws.flags((W,), "ready")
    results = []
    for c in range(calls):
        x = torch.randn(n, generator=torch.Generator(dev).manual_seed(50 * c + r),
                        device=dev).half()
        out.fill_(float("nan"))
        world.barrier()  # one receive buffer: nobody stores before everyone poisoned it
        ws.launch(_gather_kernel, (max(W - 1, 1),), x, out, ready, n, BLOCK=32)
        results.append((x.to("cpu", copy=True), out.to("cpu", copy=True)))
        world.barrier()  # ...and nobody overwrites it before everyone read it
    ws.close()
    return results


@triton.jit
def _mask_ring_kernel(ctx, x_ptr, inbox_ptr, ready_ptr, n, BLOCK: tl.constexpr):
    """Rank r pushes its mask x (n bools) into rank r+1's inbox and signals it."""
    call = pol.begin_call(ctx)
    me = pol.rank(ctx)
    world = pol.num_ranks(ctx)
    nxt = pol.peer_at(1, me, world)
    prev = pol.peer_at(world - 1, me, world)
    offs = tl.arange(0, BLOCK)
    m = offs < n
    pol.put_signal(ctx, inbox_ptr + offs, tl.load(x_ptr + offs, mask=m), nxt, ready_ptr + me,
                   call, m)
    pol.wait(ctx, ready_ptr + prev, call, prev)
    pol.end_call(ctx, call)


def mask_ring(world, n, calls):
    """A ring of bool tensors (one byte per element, a pointer type of 1 bit to Triton), with
    the receive buffer set to the opposite of what must arrive before each call; returns per
    call (sent, received)."""
    W, r, dev = world.world_size, world.rank, world.device
    ws = Workspace(world, Workspace.bytes_for(((n,), torch.bool), ((W,), torch.int64)),
                   timeout_s=20.0, name="mask_ring")
    inbox = ws.tensor((n,), torch.bool)
    ready = ws.flags((W,), "ready")
    got = []
    for c in range(calls):
        sent = [torch.rand(n, generator=torch.Generator(dev).manual_seed(90 * c + q),
                           device=dev) < 0.5 for q in range(W)]
        inbox.copy_(~sent[(r - 1) % W])
        world.barrier()  # every inbox poisoned before any rank stores into it
        ws.launch(_mask_ring_kernel, (1,), sent[r], inbox, ready, n,
                  BLOCK=triton.next_power_of_2(n))
        got.append((sent[r].to("cpu", copy=True), inbox.to("cpu", copy=True)))
        world.barrier()  # ...and read before the next call's poison
    ws.close()
    return got


def check_mask_ring(out):
    bad = []
    for r, calls in enumerate(out):
        for c, (_, received) in enumerate(calls):
            if not torch.equal(received, out[(r - 1) % len(out)][c][0]):
                bad.append(f"rank {r} call {c}: received another mask than its peer sent")
    return bad


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


def count(world, calls):
    """Counters, a barrier and remote loads; returns per call (x, sum over ranks, ok,
    counter)."""
    W, r, dev = world.world_size, world.rank, world.device
    ws = Workspace(world, 4096, timeout_s=20.0)
    counter = ws.flags((1,), "arrivals")
    bars = ws.flags((calls, W), "barrier")
    x = ws.tensor((16,), torch.float32)
    got = []
    for c in range(calls):
        x.copy_(torch.randn(16, generator=torch.Generator(dev).manual_seed(7 * c + r),
                            device=dev))
        ws.synchronize()
        world.barrier()
        out = torch.full((16,), float("nan"), device=dev)
        ok = torch.zeros(1, dtype=torch.int32, device=dev)
        ws.launch(_count_kernel, (1,), counter, bars[c], x, out, ok, BLOCK=16)
        got.append((x.to("cpu", copy=True), out.to("cpu", copy=True), int(ok), int(counter[0])))
        world.barrier()
    ws.close()
    return got


@triton.jit
def _grid_kernel(ctx, out_ptr):
    call = pol.begin_call(ctx)
    tl.store(out_ptr + pol.program(), pol.num_programs() * 1000 + call)
    pol.end_call(ctx, call)


def grid(world):
    """A 3-D grid's program numbering, over two calls; returns the slots written."""
    with Workspace(world, 256) as ws:
        out = torch.full((24,), -1, dtype=torch.int64, device=world.device)
        ws.launch(_grid_kernel, (2, 3, 4), out)
        ws.launch(_grid_kernel, (4, 3, 2), out)
        ws.synchronize()
        return out.to("cpu", copy=True)


@triton.jit
def _lonely_kernel(ctx, flags_ptr):
    """Waits for a flag that no rank ever sets."""
    call = pol.begin_call(ctx)
    pol.wait(ctx, flags_ptr + 2, call, pol.peer_at(1, pol.rank(ctx), pol.num_ranks(ctx)))
    pol.end_call(ctx, call)


def lonely(world):
    """Every rank waits for a flag nobody sets, then calls again: the two errors."""
    ws = Workspace(world, 1024, timeout_s=0.5, name="lonely")
    ws.tensor((5,), torch.float32)
    flags = ws.flags((2, 3), "never_set")
    first = error_of_one_call(lambda: (ws.launch(_lonely_kernel, (2,), flags),
                                       ws.synchronize()))
    second = error_of_one_call(lambda: ws.launch(_lonely_kernel, (2,), flags))
    ws.close()
    return first, second


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


def quitter(world):
    """Rank 1 gives up on a call; then a call where nobody does."""
    W = world.world_size
    ws = Workspace(world, 1024, timeout_s=20.0, name="quitter")
    flags = ws.flags((W,), "ready")
    out = torch.full((1,), -1, dtype=torch.int32, device=world.device)
    first = error_of_one_call(lambda: (ws.launch(_quit_kernel, (1,), flags, out, QUITTER=1),
                                       ws.synchronize()))
    ok1 = int(out)
    # the next call's flags would stand for this one's (a later call counts as arrived) if a
    # rank signalled them before a peer read this call's: a kernel that runs calls back to
    # back protects its flags with a "free" flag, as _ping_kernel does; here the host waits
    world.barrier()
    ws.launch(_quit_kernel, (1,), flags, out, QUITTER=W)  # nobody quits: usable again
    ok2 = int(out)
    ws.close()
    return first, ok1, ok2


@triton.jit
def _quit_all_kernel(ctx, flags_ptr, out_ptr, QUITTER: tl.constexpr):
    """Rank QUITTER gives up on the call; every rank waits for all of its peers at once."""
    call = pol.begin_call(ctx)
    me = pol.rank(ctx)
    pol.signal_all(ctx, flags_ptr + me, call, me != QUITTER)
    ok = pol.wait_peers(ctx, flags_ptr, 1, call)
    tl.store(out_ptr, ok.to(tl.int32))
    pol.end_call(ctx, call)


def quitter_among_late(world, delay_s: float = 1.0):
    """``pol.wait_peers`` where one peer gives up and another is late (3 ranks or more): rank
    W-1 gives up on a call that rank 1 launches ``delay_s`` late, so rank 0 (whose rotation
    meets rank 1 first) sees the failure while rank 1's flag is still missing. Every rank but
    the quitter must report the quitter, not a timeout (which would leave the workspace out of
    step), and a call where nobody gives up must then pass."""
    W = world.world_size
    ws = Workspace(world, 1024, timeout_s=20.0, name="quitter_among_late")
    flags = ws.flags((W,), "ready")
    out = torch.full((1,), -1, dtype=torch.int32, device=world.device)
    if world.rank == 1:
        time.sleep(delay_s)
    first = error_of_one_call(lambda: (ws.launch(_quit_all_kernel, (1,), flags, out,
                                                 QUITTER=W - 1), ws.synchronize()))
    ok1 = int(out)
    world.barrier()  # the next call's flags must not stand for this one's (see quitter)
    ws.launch(_quit_all_kernel, (1,), flags, out, QUITTER=W)  # nobody quits
    ok2 = int(out)
    ws.close()
    return first, ok1, ok2


def check_quitter_among_late(out):
    bad, W = [], len(out)
    for r, (first, ok1, ok2) in enumerate(out):
        if r == W - 1:
            good = first is None and ok1 == 1
        else:
            good = (first is not None and first[0] == "PeerTimeoutError"
                    and f"rank {W - 1} gave up" in first[1] and ok1 == 0)
        if not good or ok2 != 1:
            bad.append(f"rank {r}: {first}, ok {ok1} then {ok2}")
    return bad


@triton.jit
def _no_end_kernel(ctx, out_ptr):
    call = pol.begin_call(ctx)
    tl.store(out_ptr, call)


def no_end(world):
    """A kernel that never calls end_call, launched twice: the two errors."""
    ws = Workspace(world, 256)
    out = torch.zeros(1, dtype=torch.int64, device=world.device)
    err = error_of_one_call(lambda: (ws.launch(_no_end_kernel, (1,), out), ws.synchronize()))
    again = error_of_one_call(lambda: ws.launch(_no_end_kernel, (1,), out))
    ws.close()
    return err, again


@triton.jit
def _counted_kernel(ctx):
    call = pol.begin_call(ctx)
    pol.end_call(ctx, call)


def oversized_grid(world):
    """Launches of a kernel that ends with ``pol.end_call`` over grids of ``2**20`` programs
    and more (1-D, 3-D), whose programs the call counter cannot count out below its call
    bits, then one of 3 programs: the errors and the device's call count after them."""
    with Workspace(world, 256, name="grid") as ws:
        errors = [error_of_one_call(lambda g=g: ws.launch(_counted_kernel, g))
                  for g in ((1 << 20,), (64, 128, 128))]
        ws.launch(_counted_kernel, (3,))
        ws.synchronize()
        return errors, calls_counted(ws.ctx)


def check_oversized_grid(out):
    return [f"rank {r}: {errors}, {done} calls" for r, (errors, done) in enumerate(out)
            if done != 1 or not all(e and e[0] == "ValueError" and "2**20" in e[1]
                                    for e in errors)]


def empty_grid(world):
    """Launches over empty grids (``(0,)``, ``(3, 0)``: ``triton.cdiv(n, BLOCK)`` of an
    ``n`` of 0; the same given as callables, which Triton evaluates at the launch), then one
    of 3 programs: the errors and the device's call count after them. An empty launch counted
    as a call that no program counted out, and the call-count check broke the workspace,
    blaming the kernel for skipping ``pol.end_call``."""
    with Workspace(world, 256, name="grid") as ws:
        errors = [error_of_one_call(lambda g=g: ws.launch(_counted_kernel, g))
                  for g in ((0,), (3, 0), lambda meta: (triton.cdiv(0, 16),),
                            lambda meta: (3, 0))]
        ws.launch(_counted_kernel, (3,))
        ws.synchronize()
        return errors, calls_counted(ws.ctx)


def check_empty_grid(out):
    return [f"rank {r}: {errors}, {done} calls" for r, (errors, done) in enumerate(out)
            if done != 1 or not all(e and e[0] == "ValueError" and "empty grid" in e[1]
                                    for e in errors)]


@triton.jit
def _group_kernel(ctx, flags_ptr, out_ptr, P: tl.constexpr, STRIDE: tl.constexpr):
    """Groups of P programs (a grid of whole groups, its size in the tag): every program sets
    its word of a ``[num_ranks, STRIDE]`` flag array in every peer's heap, and in this rank's
    but for the group's last, which waits for every rank's words of its group at once
    (``pol.wait_program_peers`` with ``OWN``) and stores whether they came."""
    call = pol.begin_call(ctx)
    me = pol.rank(ctx)
    pid = tl.program_id(0)
    tag = tl.num_programs(0) * 2
    pol.signal_all(ctx, flags_ptr + me * STRIDE + pid, call, True, tag)
    first = pid // P * P
    if pid < first + P - 1:
        pol.signal(ctx, flags_ptr + me * STRIDE + pid, me, call, True, tag)
    else:
        ok = pol.wait_program_peers(ctx, flags_ptr, first, STRIDE, call, tag, PROGRAMS=P,
                                    OWN=True)
        tl.store(out_ptr + pid, ok.to(tl.int32))
    # the grid follows the call: the words past it, every 2**30 calls
    if (call & (pol.REFRESH_CALLS - 1)) == 0:
        pol.refresh_words(ctx, flags_ptr, tl.num_programs(0), STRIDE, call, tag, OWN=True)
    pol.end_call(ctx, call)


def program_groups(world, P: int):
    """``_group_kernel`` over 2 groups on every rank, then rank 0 over 3 groups against 1 on
    the others (the grids differ: rank 0's last group waits for words no peer sets), then 2
    groups again: each call's error, its time and the groups' verdicts."""
    stride = 16
    ws = Workspace(world, 4096, timeout_s=20.0, name="groups")
    flags = ws.flags((world.world_size, stride), "group")
    got = []
    for groups in (2, 3 if world.rank == 0 else 1, 2):
        out = torch.full((stride,), -1, dtype=torch.int32, device=world.device)
        t0 = time.monotonic()
        err = error_of_one_call(lambda: (ws.launch(_group_kernel, (groups * P,), flags, out,
                                                   P=P, STRIDE=stride), ws.synchronize()))
        got.append((err, time.monotonic() - t0, out[P - 1::P].tolist()[:groups]))
        world.barrier()  # (the next call's flags must not stand for this one's: see quitter)
    ws.close()
    return got


def check_program_groups(out):
    bad = []
    for r, ((e1, _, ok1), (e2, s2, ok2), (e3, _, ok3)) in enumerate(out):
        if e1 is not None or ok1 != [1, 1] or e3 is not None or ok3 != [1, 1]:
            bad.append(f"rank {r}: agreeing calls {e1} {ok1}, {e3} {ok3}")
        # the disagreeing grids: a mismatch on every rank, well before the 20 s deadline
        if e2 is None or e2[0] != "RankMismatchError" or s2 > 10 or 1 in ok2:
            bad.append(f"rank {r}: other grids {e2} after {s2:.1f} s, {ok2}")
    return bad


@triton.jit
def _double_end_kernel(ctx, out_ptr, TWICE: tl.constexpr):
    call = pol.begin_call(ctx)
    tl.store(out_ptr + pol.program(), call)
    pol.end_call(ctx, call)
    if TWICE:
        if pol.program() == 1:
            pol.end_call(ctx, call)


def double_end(world):
    """A kernel whose program 1 calls ``pol.end_call`` twice (its launch still counts one
    call in the counter's call bits), then a kernel that calls it once: the first launch's
    error, and the call numbers the second launch's programs read (None where it raised)."""
    with Workspace(world, 256, name="double_end") as ws:
        out = torch.zeros(2, dtype=torch.int64, device=world.device)
        err = error_of_one_call(lambda: ws.launch(_double_end_kernel, (2,), out, TWICE=True))
        numbers = None
        try:
            ws.launch(_double_end_kernel, (2,), out, TWICE=False)
            numbers = out.tolist()
        except Exception:
            pass
        return err, numbers


def check_double_end(out):
    return [f"rank {r}: {err}, then {numbers}" for r, (err, numbers) in enumerate(out)
            if not (err and err[0] == "ContextBrokenError" and "pol.end_call" in err[1])]


@triton.jit
def _last_counts(ctx, out_ptr, call):
    if pol.end_call(ctx, call):  # nothing to branch on: pol.end_call returns nothing
        tl.atomic_add(out_ptr, 1)


@triton.jit
def _branch_on_end_call_kernel(ctx, out_ptr):
    call = pol.begin_call(ctx)
    _last_counts(ctx, out_ptr, call)  # in a callee: the check follows the calls


@triton.jit
def _last_kernel(ctx, out_ptr):
    call = pol.begin_call(ctx)
    if pol.end_call_last(ctx, call):
        tl.atomic_add(out_ptr, 1)


def end_call_value(world):
    """A kernel that branches on ``pol.end_call`` (in a jit function it calls) and one that
    branches on ``pol.end_call_last``, each launched over 3 programs: the first's error, the
    second's count of last programs over two launches, and the device's call count."""
    with Workspace(world, 256, name="end_value") as ws:
        out = torch.zeros(1, dtype=torch.int64, device=world.device)
        err = error_of_one_call(lambda: ws.launch(_branch_on_end_call_kernel, (3,), out))
        for _ in range(2):
            ws.launch(_last_kernel, (3,), out)
        ws.synchronize()
        return err, int(out), calls_counted(ws.ctx)


def check_end_call_value(out):
    return [f"rank {r}: {err}, {lasts} last programs, {done} calls"
            for r, (err, lasts, done) in enumerate(out)
            if not (err and err[0] == "TypeError" and "_last_counts" in err[1]
                    and "pol.end_call_last" in err[1]) or lasts != 2 or done != 2]


@triton.autotune(configs=[triton.Config({"BLOCK": 8}), triton.Config({"BLOCK": 16})], key=[])
@triton.jit
def _tuned_kernel(ctx, out_ptr, BLOCK: tl.constexpr):
    call = pol.begin_call(ctx)
    tl.store(out_ptr + tl.arange(0, BLOCK), tl.full((BLOCK,), 0, tl.int64) + call)
    pol.end_call(ctx, call)


@triton.heuristics({"BLOCK": lambda args: 4})
@triton.jit
def _picked_branch_on_end_call_kernel(ctx, out_ptr, BLOCK: tl.constexpr):
    call = pol.begin_call(ctx)
    _last_counts(ctx, out_ptr, call)


def wrapped_kernels(world):
    """An autotuned kernel, then a kernel behind ``triton.heuristics`` that branches on
    ``pol.end_call``, then a plain one: the first two launches' errors and the device's call
    count after the third."""
    with Workspace(world, 256, name="wrapped") as ws:
        out = torch.zeros(16, dtype=torch.int64, device=world.device)
        errors = [error_of_one_call(lambda: ws.launch(_tuned_kernel, (1,), out)),
                  error_of_one_call(lambda: ws.launch(_picked_branch_on_end_call_kernel, (3,),
                                                      out))]
        ws.launch(_counted_kernel, (3,))
        ws.synchronize()
        return errors, calls_counted(ws.ctx)


def bad_host(world):
    """Host input a Workspace refuses: each case's error."""
    errors = {}
    for what, fn in {
        "nbytes": lambda: Workspace(world, -1),
        "name": lambda: Workspace(world, 64, name=""),
        "timeout": lambda: Workspace(world, 64, timeout_s=0),
        "shmem": lambda: Workspace(world, 64, shmem="yes"),
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


def bad_buffer_on_one_rank(world):
    """Buffers refused on some ranks only (a negative size, a size that is no integer, an
    empty flag name on the last rank), then on every rank (a fractional size, which must
    not be rounded down to a smaller buffer than asked); then a good buffer and a call that
    uses it. Returns each case's error and the good call's result."""
    last = world.rank == world.world_size - 1
    ws = Workspace(world, 4096, timeout_s=20.0, name="buffers")
    errors = {
        "negative": error_of_one_call(lambda: ws.tensor((-4 if last else 4,), torch.float32)),
        "fraction": error_of_one_call(lambda: ws.tensor((4.5 if last else 4,), torch.float32)),
        "flag name": error_of_one_call(lambda: ws.flags((4,), "" if last else "ready")),
        "fraction everywhere": error_of_one_call(lambda: ws.tensor((2.5,), torch.float32)),
    }
    out = ws.tensor((24,), torch.int64)
    out.fill_(-1)
    ws.launch(_grid_kernel, (2, 3, 4), out)
    ws.synchronize()
    got = out.to("cpu", copy=True)
    ws.close()
    return errors, got


@triton.jit
def _tagged_kernel(ctx, flags_ptr, tag):
    """Every rank signals its peers with ``tag`` and expects the same tag from them."""
    call = pol.begin_call(ctx)
    me = pol.rank(ctx)
    world = pol.num_ranks(ctx)
    for step in range(1, world):
        pol.signal(ctx, flags_ptr + me, pol.peer_at(step, me, world), call, True, tag)
    for step in range(1, world):
        q = pol.peer_at(step, me, world)
        pol.wait(ctx, flags_ptr + q, call, q, tag)
    pol.end_call(ctx, call)


def tagged(world):
    """Rank 0 calls with tag 7, the others with 9; then every rank with 9 (after a host
    barrier). Returns the two calls' errors."""
    ws = Workspace(world, 1024, timeout_s=20.0, name="tagged")
    flags = ws.flags((world.world_size,), "ready")
    first = error_of_one_call(lambda: (ws.launch(_tagged_kernel, (1,), flags,
                                                 7 if world.rank == 0 else 9), ws.synchronize()))
    world.barrier()
    second = error_of_one_call(lambda: (ws.launch(_tagged_kernel, (1,), flags, 9),
                                        ws.synchronize()))
    ws.close()
    return first, second


def check_tagged(out):
    bad = []
    for r, (first, second) in enumerate(out):
        if not (first and first[0] == "RankMismatchError" and "different shapes" in first[1]):
            bad.append(f"rank {r}: first call raised {first}")
        if second is not None:
            bad.append(f"rank {r}: second call raised {second}")
    return bad


def every_call(world):
    """Each call above once (for 8 ranks, where one pool serves them all)."""
    return dict(ping=ping(world, 33, 2), gather=gather(world, 21, 2), count=count(world, 2),
                lonely=lonely(world), quitter=quitter(world), tagged=tagged(world),
                sum=sum_by_pushes(world, 11, 2), push_ring=ring(world, 40, 2, False),
                pull_ring=ring(world, 40, 2, False, pull=True))


@triton.jit
def _sum_kernel(ctx, x_ptr, recv_ptr, sent_ptr, consumed_ptr, out_ptr, ok_ptr, n, tag,
                BLOCK: tl.constexpr):
    """out = the sum of every rank's x (n elements per program), by pushes: program p stores
    its slice of x into ``recv[me]`` of every peer in two halves (the second half's wait for
    the peer's "consumed" flag is skipped), signals ``sent[me][p]`` on every peer, waits for
    every peer's ``sent[q][p]`` and adds the received slices to its own. Calls run back to
    back: a peer's buffer is written only once it has read the previous call's data."""
    call = pol.begin_call(ctx)
    me = pol.rank(ctx)
    world = pol.num_ranks(ctx)
    p = pol.program()
    P = pol.num_programs()
    offs = p * n + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < (p + 1) * n)
    ok = pol.is_live(ctx)
    waited = tl.zeros((), tl.int64)
    for half in range(0, 2):
        lo = p * n + half * (n // 2)
        part = (offs >= lo) & (offs < lo + n // 2 + half * (n % 2))
        for step in range(1, world):
            q = pol.peer_at(step, me, world)
            ok, waited = pol.wait_consumed_once(ctx, consumed_ptr, q, call, waited, ok)
            pol.store_remote(ctx, recv_ptr + me * P * n + offs, x, q, part & ok)
    pol.signal_all(ctx, sent_ptr + me * P + p, call, ok, tag)
    if ok:
        ok = pol.wait_peers(ctx, sent_ptr + p, P, call, tag)
    acc = x.to(tl.float32)
    for q in range(0, world):
        if q != me:
            acc += tl.load(recv_ptr + q * P * n + offs, mask=offs < (p + 1) * n)
    tl.store(out_ptr + offs, acc, mask=(offs < (p + 1) * n) & ok)
    tl.store(ok_ptr + p, ok.to(tl.int32))
    pol.end_call_consumed(ctx, call, consumed_ptr)


def sum_by_pushes(world, n, calls, programs=2):
    """The sum of every rank's x over ``calls`` back-to-back calls (no host synchronization
    between them); returns per call (x, sum, ok per program) and the device's call count."""
    W, r, dev = world.world_size, world.rank, world.device
    nbytes = Workspace.bytes_for(((W, programs * n), torch.float32),
                                 ((W, programs), torch.int64), ((W,), torch.int64))
    with Workspace(world, nbytes, timeout_s=20.0, name="sum") as ws:
        recv = ws.tensor((W, programs * n), torch.float32)
        sent = ws.flags((W, programs), "sent")
        consumed = ws.flags((W,), "consumed")
        launched = []
        for c in range(calls):
            x = torch.randn(programs * n, generator=torch.Generator(dev).manual_seed(31 * c + r),
                            device=dev)
            out = torch.full_like(x, float("nan"))
            ok = torch.zeros(programs, dtype=torch.int32, device=dev)
            ws.launch(_sum_kernel, (programs,), x, recv, sent, consumed, out, ok, n, 5,
                      BLOCK=triton.next_power_of_2(n))
            launched.append((x, out, ok))
        ws.synchronize()
        got = [(x.to("cpu"), out.to("cpu"), ok.tolist()) for x, out, ok in launched]
        return got, calls_counted(ws.ctx)


@triton.jit
def _unread_kernel(ctx, consumed_ptr, ok_ptr):
    """Waits for the next peer's "consumed" flag of the previous call, which nobody sets
    (the kernel ends with ``end_call``, not ``end_call_consumed``)."""
    call = pol.begin_call(ctx)
    q = pol.peer_at(1, pol.rank(ctx), pol.num_ranks(ctx))
    tl.store(ok_ptr, pol.wait_consumed(ctx, consumed_ptr, q, call).to(tl.int32))
    pol.end_call(ctx, call)


def unread(world):
    """Three calls of ``_unread_kernel``: the first waits for nothing (call 0 counts as
    consumed), the second times out waiting for the flag of call 1 (the report names the
    call the flag should hold), the third finds the workspace broken. Returns (first ok,
    second's error, third's error)."""
    ws = Workspace(world, 1024, timeout_s=0.5, name="unread")
    consumed = ws.flags((world.world_size,), "consumed")
    ok = torch.zeros(1, dtype=torch.int32, device=world.device)
    ws.launch(_unread_kernel, (1,), consumed, ok)
    ws.synchronize()
    first = int(ok)
    second = error_of_one_call(lambda: (ws.launch(_unread_kernel, (1,), consumed, ok),
                                        ws.synchronize()))
    third = error_of_one_call(lambda: ws.launch(_unread_kernel, (1,), consumed, ok))
    ws.close()
    return first, second, third


# -- verdicts over every rank's results (rank order); each returns the list of what is wrong --
def _miscounted(out, calls):
    """Ranks whose device counted other than ``calls`` calls (out: per rank (results, count))."""
    return [f"rank {r}: the device counted {done} calls, not {calls}"
            for r, (_, done) in enumerate(out) if done != calls]


def check_ping(out, calls):
    bad, W = _miscounted(out, calls), len(out)
    for r, (got, _) in enumerate(out):
        for c in range(calls):
            mine, recv, ok = got[c]
            if ok != 1 or not torch.equal(recv, out[(r - 1) % W][0][c][0]):
                bad.append(f"rank {r} call {c}: ok={ok}, received data differs")
    return bad


def check_shmem_refused(out):
    bad = []
    for r, (err, _) in enumerate(out):
        kind, msg = err or (None, "")
        if not (kind == "ShmemUnavailable" and "shm: shmem=True" in msg
                and all(f"rank {q}: no device-initiated communication library on the 'cpu' "
                        f"backend" in msg for q in range(len(out)))):
            bad.append(f"rank {r}: Workspace(shmem=True) raised {err}")
    return bad + check_ping([ring for _, ring in out], 2)


def check_gather(out):
    bad = []
    for r, results in enumerate(out):
        for c, (_, gathered) in enumerate(results):
            want = torch.stack([out[q][c][0] for q in range(len(out))])
            if not torch.equal(gathered, want):
                bad.append(f"rank {r} call {c}: gathered rows differ")
    return bad


def check_count(out):
    bad, W = [], len(out)
    for r, got in enumerate(out):
        for c, (_, total, ok, count) in enumerate(got):
            want = sum(out[q][c][0] for q in range(W))
            if ok != 1 or count != (c + 1) * W or not torch.allclose(total, want):
                bad.append(f"rank {r} call {c}: ok={ok}, counter {count} (want {(c + 1) * W})"
                           f", sum off by {(total - want).abs().max():.3g}")
    return bad


def check_grid(out):
    want = torch.full((24,), 24 * 1000 + 2)
    return [f"rank {r}: {o.tolist()}" for r, o in enumerate(out) if not torch.equal(o, want)]


def check_lonely(out):
    bad = []
    for r, (first, second) in enumerate(out):
        kind, msg = first or (None, "")
        if not (kind == "PeerTimeoutError" and "lonely" in msg and f"rank {r}" in msg
                and "call #1" in msg and "'never_set' (shape [2, 3], flat index) flag [2]" in msg):
            bad.append(f"rank {r}: first call raised {first}")
        if (second or (None,))[0] != "ContextBrokenError":
            bad.append(f"rank {r}: second call raised {second}")
    return bad


def check_quitter(out):
    bad = []
    for r, (first, ok1, ok2) in enumerate(out):
        if r == 1:
            good = first is None and ok1 == 1  # the quitter itself waited for the others
        else:
            good = (first is not None and first[0] == "PeerTimeoutError"
                    and "rank 1 gave up" in first[1] and "'ready'" in first[1] and ok1 == 0)
        if not good or ok2 != 1:
            bad.append(f"rank {r}: {first}, ok {ok1} then {ok2}")
    return bad


def check_no_end(out):
    return [f"rank {r}: {err}, then {again}" for r, (err, again) in enumerate(out)
            if not (err and err[0] == "ContextBrokenError" and "pol.end_call" in err[1]
                    and again and again[0] == "ContextBrokenError")]


def check_every_call(out):
    """The verdicts of :func:`every_call`, each problem prefixed by its call."""
    pick = lambda name: [o[name] for o in out]  # noqa: E731
    return [f"{name}: {p}" for name, check in (
        ("ping", lambda o: check_ping(o, 2)), ("gather", check_gather), ("count", check_count),
        ("lonely", check_lonely), ("quitter", check_quitter), ("tagged", check_tagged),
        ("sum", lambda o: check_sum(o, 2)), ("push_ring", lambda o: check_ping(o, 2)),
        ("pull_ring", lambda o: check_ping(o, 2)))
        for p in check(pick(name))]


def check_sum(out, calls):
    bad, W = _miscounted(out, calls), len(out)
    for r, (got, _) in enumerate(out):
        for c in range(calls):
            _, total, ok = got[c]
            want = sum(out[q][0][c][0] for q in range(W))
            if set(ok) != {1} or not torch.allclose(total, want, rtol=1e-5, atol=1e-5):
                bad.append(f"rank {r} call {c}: ok={ok}, sum off by "
                           f"{(total - want).abs().max():.3g}")
    return bad


def check_unread(out):
    bad, W = [], len(out)
    for r, (first, second, third) in enumerate(out):
        kind, msg = second or (None, "")
        if not (first == 1 and kind == "PeerTimeoutError" and f"rank {r}" in msg
                and f"'consumed' flag [{(r + 1) % W}] of call #1" in msg):
            bad.append(f"rank {r}: first ok={first}, then {second}")
        if (third or (None,))[0] != "ContextBrokenError":
            bad.append(f"rank {r}: third call raised {third}")
    return bad
