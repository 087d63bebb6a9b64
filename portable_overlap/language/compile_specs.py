"""A kernel that uses every primitive of :mod:`portable_overlap.language`, for the compile matrix
(sm_90, gfx942, gfx950 on a CPU-only machine) and the signal/wait code checks."""
import triton
import triton.language as tl

from . import (announce_call, barrier, begin_call, end_call_consumed, fence_bulk_reads, get,
               load_remote, notify, num_ranks, peer_at, put, put_signal, rank, signal, signal_all,
               store_remote, wait, wait_consumed, wait_consumed_once, wait_count, wait_free,
               wait_peers)


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
