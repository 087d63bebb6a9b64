"""A kernel that uses every primitive of :mod:`portable_overlap.language`, for the compile matrix
(sm_90, gfx942, gfx950 on a CPU-only machine) and the signal/wait code checks; and a kernel of
the shmem-or-zero-copy pattern, compiled with its shmem branch off (a branch on a constexpr
False is not compiled, so it needs no SHMEM device library: the one kernel source serves both
kinds of workspace)."""
import triton
import triton.language as tl

from . import (announce_call, barrier, begin_call, end_call, end_call_consumed, fence_bulk_reads,
               get, load_remote, notify, num_ranks, peer_at, put, put_signal, rank, shmem_put,
               shmem_quiet, signal, signal_all, store_remote, wait, wait_consumed,
               wait_consumed_once, wait_count, wait_free, wait_peers)


@triton.jit
def language_primitives_kernel(ctx, x_ptr, heap_ptr, flags_ptr, counter_ptr, bar_ptr, free_ptr,
                               consumed_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """One step of each primitive: a tile pushed with its signal, a bulk put and get, a counter
    notified and awaited, a barrier, remote loads and stores, every wait's outcome stored."""
    call = begin_call(ctx)
    me = rank(ctx)
    world = num_ranks(ctx)
    q = peer_at(1, me, world)
    announce_call(ctx, free_ptr, call)
    ok = wait_free(ctx, free_ptr, q, call)
    ok = ok & wait_consumed(ctx, consumed_ptr, q, call)
    ok, waited = wait_consumed_once(ctx, consumed_ptr, q, call, tl.zeros((), tl.int64), ok)
    offs = tl.arange(0, BLOCK)
    m = offs < n
    tile = tl.load(x_ptr + offs, mask=m)
    put_signal(ctx, heap_ptr + offs, tile, q, flags_ptr + me, call, m)
    put(ctx, heap_ptr + n, x_ptr, n, q, BLOCK)
    signal(ctx, flags_ptr + world + me, q, call)
    signal_all(ctx, flags_ptr + 2 * world + me, call, ok)
    notify(ctx, counter_ptr, q)
    src = peer_at(world - 1, me, world)
    ok = ok & wait(ctx, flags_ptr + src, call, src)
    fence_bulk_reads()
    ok = ok & wait(ctx, flags_ptr + world + src, call, src)
    ok = ok & wait_count(ctx, counter_ptr, call, call, src)
    ok = ok & barrier(ctx, bar_ptr, call)
    ok = ok & wait_peers(ctx, flags_ptr + 2 * world, 1, call)
    got = load_remote(ctx, heap_ptr + offs, src, m, 0.0)
    store_remote(ctx, heap_ptr + 2 * n + offs, got, me, m)
    get(ctx, out_ptr, heap_ptr + n, n, src, BLOCK)
    tl.store(out_ptr + n, (ok & (waited != 0)).to(out_ptr.dtype.element_ty))
    end_call_consumed(ctx, call, consumed_ptr)


@triton.jit
def language_shmem_branch_kernel(ctx, x_ptr, inbox_ptr, flags_ptr, out_ptr, n,
                                 BLOCK: tl.constexpr, VIA_SHMEM: tl.constexpr):
    """x to the next rank's inbox through the SHMEM library or by zero-copy stores (``VIA_SHMEM
    = ws.shmem``), then the signal; the previous rank's data after the wait."""
    call = begin_call(ctx)
    me = rank(ctx)
    world = num_ranks(ctx)
    q = peer_at(1, me, world)
    if VIA_SHMEM:
        shmem_put(inbox_ptr, x_ptr, n, q)
        shmem_quiet()
    else:
        put(ctx, inbox_ptr, x_ptr, n, q, BLOCK)
    signal(ctx, flags_ptr + me, q, call)
    src = peer_at(world - 1, me, world)
    ok = wait(ctx, flags_ptr + src, call, src)
    for i in range(0, n, BLOCK):  # plain loads: a shmem inbox is not in the heap
        offs = i + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(inbox_ptr + offs, mask=offs < n), mask=offs < n)
    tl.store(out_ptr + n, ok.to(out_ptr.dtype.element_ty))
    end_call(ctx, call)


def specs():
    for dt in ("bf16", "fp32"):
        sig = {"ctx": "*i64", "x_ptr": f"*{dt}", "heap_ptr": f"*{dt}", "flags_ptr": "*i64",
               "counter_ptr": "*i64", "bar_ptr": "*i64", "free_ptr": "*i64", "consumed_ptr": "*i64",
               "out_ptr": f"*{dt}",
               "n": "i32",
               "BLOCK": "constexpr"}
        yield (f"language_primitives[{dt}]", language_primitives_kernel, sig, dict(BLOCK=256),
               ["ctx", "x_ptr", "heap_ptr", "flags_ptr", "counter_ptr", "bar_ptr", "free_ptr",
                "consumed_ptr", "out_ptr"])
    yield ("language_shmem_branch[fp32,zero-copy]", language_shmem_branch_kernel,
           {"ctx": "*i64", "x_ptr": "*fp32", "inbox_ptr": "*fp32", "flags_ptr": "*i64",
            "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr", "VIA_SHMEM": "constexpr"},
           dict(BLOCK=256, VIA_SHMEM=False), ["ctx", "x_ptr", "inbox_ptr", "flags_ptr", "out_ptr"])
