"""The call protocol over many calls and many contexts, on CPU-emulated ranks: call numbers
far from 0 (a context that ran for hours), the deadline's stamp of an earlier call, contexts
called in other orders on other ranks."""
import contextlib
import dataclasses
import time

import pytest
import torch
import torch.distributed as dist

import portable_overlap as po
from portable_overlap import (GemvAllReduce, PortableOverlapError, all_gather_matmul_reference,
                              gemv_all_reduce_reference)
from portable_overlap.language.host import CTX_CLOCK
from portable_overlap.ops.embedding_alltoall import embedding_all_to_all_reference
from portable_overlap.ops.gemm_alltoall import GemmAllToAll, gemm_all_to_all_reference
from portable_overlap.ops.matmul import MatmulConfig
from portable_overlap.ops.moe_combine import MoeGemmCombine, moe_gemm_combine_reference
from portable_overlap.ops.moe_dispatch import (MoeDispatch, moe_dispatch, moe_dispatch_reference,
                                               moe_dispatch_swiglu, moe_dispatch_swiglu_reference)
from portable_overlap.ops.moe_layer import moe_layer, moe_layer_reference
from portable_overlap.testing.call_numbers import calls_at_numbers, move_on, move_to
from portable_overlap.testing.routing import route

#: GEMM tilings of the grid tests: 128 x 128 tiles are not split (``matmul_reduce.stores``)
WHOLE_TILES = MatmulConfig(block_m=128, block_n=128, block_k=16, group_m=1, num_warps=4,
                           num_stages=1)
SMALL_TILES = MatmulConfig(block_m=16, block_n=16, block_k=16, group_m=1, num_warps=1,
                           num_stages=1)


def _inputs(world, M, N, K, seed):
    g = torch.Generator().manual_seed(seed * 1000 + world.rank)
    return torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)


def _burn_cpu(seconds: float) -> None:
    """Spend ``seconds`` of this process's CPU time: the interpreter's clock
    (``backends.device_clock``) is CPU time."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def _stamp_of_an_earlier_call(world, transport, skip):
    """Call 2 spins on rank 0 (rank 1 comes late) and stamps the deadline clock; the context
    then moves ``skip`` calls on (its counter and flags), rank 0 spends more than the timeout
    of CPU time, and rank 1 comes late to the next call again."""
    ctx = GemvAllReduce(world, max_n=64, timeout_s=2.0, transport=transport)
    outcomes = []
    for call in range(3):
        x, w = _inputs(world, 2, 40, 16, call)
        ref = gemv_all_reduce_reference(x, w, world.group)
        if call == 2:
            move_on(ctx.impl.ctx, skip, (ctx.impl.ready, ctx.impl.bcast))
            if world.rank == 0:
                _burn_cpu(2.5)
        world.barrier()
        if world.rank == 1 and call >= 1:
            time.sleep(0.5)  # rank 0's first wait of the call spins
        try:
            y = ctx(x, w, out=torch.full((2, 40), float("nan")))
            outcomes.append("ok" if torch.allclose(y, ref, rtol=1e-4, atol=1e-4) else "wrong")
        except PortableOverlapError as e:
            outcomes.append(f"{type(e).__name__}: {e}")
    stamp = int(ctx.impl.ctx[CTX_CLOCK]) & 0xFFFFFFFF
    ctx.close()
    return outcomes, stamp


def test_the_deadline_of_a_call_many_calls_on_is_its_own(world2):
    """The deadline clock stamps the call whose wait spun first. A stamp of the call 65536
    calls back (a rank whose flags were there at every call in between, the last rank to
    arrive) read as this call's gave rank 0's first wait the old start: a timeout at once,
    the context broken for good."""
    skip = 65535  # the call after it is call 2 + 65536
    for rank, (outcomes, stamp) in enumerate(world2.run(_stamp_of_an_earlier_call, "stores",
                                                        skip, timeout=300)):
        assert outcomes == ["ok"] * 3, (rank, outcomes)
        if rank == 0:
            assert stamp == 3 + skip, stamp


def _grid_back_after_many_calls(world, transport):
    """A shape of 4 programs (call 1), then 2**31 + 10 calls of a shape of 1 program, then the
    first shape again, rank 1 slower (a K 32 times rank 0's): rank 0's waits for rank 1's
    programs 1-3 find words no call of the small grid wrote."""
    ctx = GemvAllReduce(world, max_n=256, timeout_s=5.0, transport=transport)
    ws = ctx.impl
    written = [f[:, :1] for f in ((ws.ready,) if transport == "one_shot"
                                  else (ws.ready, ws.bcast))]
    shapes = [(256, 16), (16, 16), (16, 16), (256, 16 if world.rank == 0 else 512)]
    outcomes = []
    for i, (N, K) in enumerate(shapes):
        if i == 2:  # on to the call before the 2**30-th
            move_to(ws.ctx, 1 << 30, written)
        if i == 3:  # on to call 2**31 + 12
            move_to(ws.ctx, (1 << 31) + 12, written)
        x, w = _inputs(world, 2, N, K, i)
        ref = gemv_all_reduce_reference(x, w, world.group)
        try:
            y = ctx(x, w, out=torch.full((2, N), float("nan")))
            outcomes.append("ok" if torch.allclose(y, ref, rtol=1e-4, atol=1e-4) else "wrong")
        except PortableOverlapError as e:
            outcomes.append(f"{type(e).__name__}: {e}")
    ctx.close()
    return outcomes


@pytest.mark.parametrize("transport", ["stores", "one_shot"])
def test_flag_words_a_small_grid_leaves_are_not_taken_for_a_later_call(world2, transport):
    """Flags carry 32 bits of the call number: a word no launch wrote for 2**31 calls read as
    a later call's, and rank 0 summed partials rank 1 had not stored yet (a wrong result, no
    error). Each 2**30-th call writes the words its grid does not."""
    for rank, outcomes in enumerate(world2.run(_grid_back_after_many_calls, transport,
                                               timeout=300)):
        assert outcomes == ["ok"] * 4, (rank, outcomes)


def _gemm_grid_back_after_many_calls(world, op):
    """A GEMM op over stores, a product of 4 tiles (4 programs, call 1), then 2**31 + 10 calls
    of one of 1 or 2 tiles (as many programs), then the first shape again, one rank slower (a
    K 32 or 64 times the other's): the peer's waits of programs past the small grid find words
    no call of it wrote. GEMM + AllReduce (128 x 128 tiles, whole): rank 1 is the slow one
    (rank 0's programs 2-3 copy the tiles rank 1's reduced); GEMM + ReduceScatter: rank 0
    (rank 1's programs 2-3 add the partials rank 0's stored); GEMM + All-to-All (16 x 16
    tiles): rank 1 (rank 0's programs 1-3 copy the rows rank 1's stored)."""
    if op == "gemm_all_to_all":
        ws = ctx = GemmAllToAll(world, 32 * 32, timeout_s=5.0, config=SMALL_TILES)
        counter, flags, M_big, small, slow, K_slow = ws.ctl, (ws.sent,), 32, 1, 1, 1024
    else:
        make = po.MatmulAllReduce if op == "all_reduce" else po.MatmulReduceScatter
        ctx = make(world, 256, 256, transport="stores", timeout_s=5.0, config=WHOLE_TILES)
        ws = ctx.impl
        counter, M_big, small = ws.ctx, 256, 2
        flags = (ws.sent, ws.reduced) if op == "all_reduce" else (ws.sent,)
        slow, K_slow = (1, 512) if op == "all_reduce" else (0, 512)
    written = [f[:, :small] for f in flags] + [ws.consumed]
    K_big = K_slow if world.rank == slow else 16
    shapes = [(M_big, M_big, 16), (2, 16, 16), (2, 16, 16), (M_big, M_big, K_big)]
    outcomes = []
    for i, (M, N, K) in enumerate(shapes):
        if i >= 2:  # (the peer's last writes here, its "consumed" words, have landed)
            world.barrier()
        if i == 2:  # on to the call before the 2**30-th
            move_to(counter, 1 << 30, written)
        if i == 3:  # on to call 2**31 + 12
            move_to(counter, (1 << 31) + 12, written)
        g = torch.Generator().manual_seed(i * 1000 + world.rank)
        a, b = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g)
        if op == "gemm_all_to_all":
            ref = gemm_all_to_all_reference(a, b, world.group)
        else:
            ref = a @ b
            dist.all_reduce(ref, group=world.group)
            if op == "reduce_scatter":
                ref = ref[M // 2 * world.rank: M // 2 * (world.rank + 1)]
        try:
            y = ctx(a, b, out=torch.full(ref.shape, float("nan")))
            outcomes.append("ok" if torch.allclose(y, ref, rtol=1e-4, atol=1e-3) else "wrong")
        except PortableOverlapError as e:
            outcomes.append(f"{type(e).__name__}: {e}")
    ctx.close()
    return outcomes


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "gemm_all_to_all"])
def test_gemm_flag_words_a_small_grid_leaves_are_not_taken_for_a_later_call(world2, op):
    """The GEMM ops' grids follow the product's tiles: their per-program flag words past a
    small grid, left for 2**31 calls, read as a later call's, and the larger grid read data
    its peer had not stored yet (a wrong result, no error). Each 2**30-th call writes the words
    its grid does not (``pol.refresh_words``)."""
    found = world2.run(_gemm_grid_back_after_many_calls, op, timeout=300)
    assert found == [["ok"] * 4] * 2, found


@contextlib.contextmanager
def _emulated_sms(world, n):
    """Plans made inside see a device of ``n`` SMs (None: the backend's own). The MoE
    combine's GEMM and the one-launch layer run as many programs as are resident at once; on
    a GPU that number follows the call's tiles (decode sizes or not), on the interpreter's
    emulated device it is one number: a plan made here gets its own."""
    facts = world.facts
    if n is not None:
        world._facts = dataclasses.replace(facts, sm_count=n)
    try:
        yield
    finally:
        world._facts = facts


#: the calls of a refresh test that the test moves to a refreshing number: by their place
REFRESHING = {1: 1 << 30, 3: 1 << 31}


def _outcome(call) -> str:
    """``"ok"`` where ``call()`` returns True (its result matched the reference), ``"wrong"``
    where False, else the error it raised."""
    try:
        return "ok" if call() else "wrong"
    except PortableOverlapError as e:
        return f"{type(e).__name__}: {e}"


def _run_refreshing(world, moves, checked, calls) -> list:
    """Run ``calls`` in order, calls 1 and 3 as numbers 2**30 and 2**31 (``REFRESHING``, the
    calls that refresh the flag words; ``call_numbers.calls_at_numbers``): after each of them,
    every word of each ``checked`` row (``(name, row)``: a rank's words in this rank's heap,
    written by that call or by its refresh) must hold its number. Returns an outcome per call
    (``_outcome``), with the words not refreshed named."""
    outcomes = []
    for _, outcome, stale in calls_at_numbers(world, REFRESHING, moves, checked,
                                              [lambda c=c: _outcome(c) for c in calls]):
        outcomes.append(outcome + "".join(f", not refreshed: {s}" for s in stale or ()))
    return outcomes


def _refresh_calls(world, op):
    """Calls at numbers 2**30 and 2**31 (the calls that refresh the flag words), between calls
    of other shapes: GEMM + AllReduce with split tiles (a product of 2 tiles) and whole ones
    (of 4 programs); AllGather + GEMM with a shard of 2 rows (its own rows copied to its
    buffer) and of 32 (not); GEMM + All-to-All with 1 tile (1 program) and 4; embedding +
    All-to-All with 1 and 8 samples a rank (the first number of ``shapes``). After each, the
    peer's words of the checked flag arrays (and AllGather + GEMM's own) must all hold it:
    written by the call, or by its refresh.

    ``"all_reduce_split_rows"``: GEMM + AllReduce on 8 emulated SMs with 16 x 16 tiles, the
    refreshing calls of split tiles (M 33, N 16: 2 row tiles of a 17-row block, each cut into
    2 K ranges) whose last row tile is partial, and on rank 0, whose block has 16 rows, starts
    past the rows: no part closes that tile, so its ``reduced`` word is the refresh's to write
    (``matmul_reduce.kernel._refresh_words``), between calls of whole tiles (M 64, N 32)."""
    with _emulated_sms(world, 8 if op == "all_reduce_split_rows" else None):
        return _refresh_calls_of(world, op)


def _refresh_calls_of(world, op):
    peer = 1 - world.rank
    if op == "all_reduce_split_rows":
        ctx = po.MatmulAllReduce(world, 64, 64, transport="stores", timeout_s=10.0,
                                 config=SMALL_TILES)
        ws = ctx.impl
        words = [ws.sent, ws.reduced, ws.consumed]
        checked = [("sent", ws.sent[peer]), ("reduced", ws.reduced[peer])]
        shapes = [(64, 32, 16), (33, 16, 32), (64, 32, 16), (33, 16, 32)]
    elif op == "all_reduce":
        ctx = po.MatmulAllReduce(world, 64, 64, transport="stores", timeout_s=10.0)
        ws = ctx.impl
        words = [ws.sent, ws.reduced, ws.consumed]
        checked = [("sent", ws.sent[peer]), ("reduced", ws.reduced[peer])]
        shapes = [(2, 16, 16), (2, 16, 16), (64, 64, 16), (2, 16, 16)]
    elif op == "all_gather_matmul":
        ctx = po.AllGatherMatmul(world, 32 * 16, transport="stores", timeout_s=10.0)
        ws = ctx.impl
        words = [ws.ready, ws.consumed]
        checked = [("ready", ws.ready[peer]), ("own ready", ws.ready[world.rank])]
        shapes = [(2, 16, 16), (32, 16, 16), (2, 16, 16), (2, 16, 16)]
    elif op == "gemm_all_to_all":  # 16 x 16 tiles: a grid of one program per tile, up to 4
        ctx = ws = GemmAllToAll(world, 32 * 32, timeout_s=10.0, config=SMALL_TILES)
        words = [ws.sent, ws.consumed]
        checked = [("sent", ws.sent[peer])]
        shapes = [(2, 16, 16), (2, 16, 16), (32, 32, 16), (2, 16, 16)]
    else:  # batch splits of 1 sample a rank (2 programs: 2 tables a rank) and of 8 (4)
        ctx = po.EmbeddingAllToAll(world, [7, 5, 9, 4], 8, max_local_batch=8, block_b=4,
                                   transport="stores", timeout_s=10.0)
        ws = ctx.impl
        words = [ws.sent, ws.consumed]
        checked = [("sent", ws.sent[peer])]
        shapes = [(1, 0, 0), (1, 0, 0), (8, 0, 0), (1, 0, 0)]
    counter = ws.ctl if op in ("embedding", "gemm_all_to_all") else ws.ctx
    calls = []
    for i, (M, N, K) in enumerate(shapes):
        g = torch.Generator().manual_seed(i * 1000 + world.rank)
        if op == "embedding":
            calls.append(lambda M=M, g=g: _embedding_call(world, ctx, [M] * 2, g))
        else:
            calls.append(lambda M=M, N=N, K=K, g=g, i=i: _gemm_call(world, ctx, op, M, N, K, g, i))
    try:
        return _run_refreshing(world, [(counter, words)], checked, calls)
    finally:
        ctx.close()


def _embedding_call(world, ctx, splits, g) -> bool:
    """One call of an embedding + All-to-All context on random bags of up to 3 rows: whether
    it matches the reference."""
    B = sum(splits)
    weight = torch.randn(ctx.weight_rows, ctx.dim, generator=g)
    lengths = torch.randint(0, 4, (ctx.n_loc * B,), generator=g)
    indices = torch.cat([torch.randint(0, ctx.plan.table_rows[t],
                                       (int(lengths[j * B:(j + 1) * B].sum()),), generator=g)
                         for j, t in enumerate(ctx.local_tables)])
    ref = embedding_all_to_all_reference(weight, lengths, indices, None, ctx.plan, world.rank,
                                         splits, "sum", world.group)
    y = ctx(weight, lengths, indices, batch_splits=splits,
            out=torch.full(ctx.output_shape(splits), float("nan")))
    return torch.allclose(y, ref, rtol=1e-5, atol=1e-5)


def _gemm_call(world, ctx, op, M, N, K, g, i, late: float = 0.0, took=None) -> bool:
    """One call of a GEMM + AllReduce, AllGather + GEMM or GEMM + All-to-All context on random
    operands: whether it matches the reference. ``late``: seconds this rank sleeps before the
    op (after the reference's collectives, so that its peer waits inside the op); ``took``: a
    list that gets the op's wall time."""
    a = torch.randn(M, K, generator=g)
    if op.startswith("all_reduce"):
        b = torch.randn(K, N, generator=g)
        ref = a @ b
        dist.all_reduce(ref, group=world.group)
    elif op == "gemm_all_to_all":
        b = torch.randn(K, N, generator=g)
        ref = gemm_all_to_all_reference(a, b, world.group)
    else:  # (b is the same on every rank)
        b = torch.randn(K, N, generator=torch.Generator().manual_seed(i))
        ref = all_gather_matmul_reference(a, b, world.group)
    out = torch.full(ref.shape, float("nan"))
    time.sleep(late)
    start = time.perf_counter()
    y = ctx(a, b, out=out)
    if took is not None:
        took.append(time.perf_counter() - start)
    return torch.allclose(y, ref, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("op", ["all_reduce", "all_reduce_split_rows", "all_gather_matmul",
                                "gemm_all_to_all", "embedding"])
def test_the_calls_that_refresh_flag_words_and_the_next_ones_are_right(world2, op):
    """The refreshing calls' kernels run their refresh (the branch of every 2**30-th call,
    which no other test reaches), write every word their grid does not, and give the right
    result, and so do the calls after them, of other grids."""
    found = world2.run(_refresh_calls, op, timeout=300)
    assert found == [["ok"] * 4] * 2, found


#: how late rank 1 comes to the late-peer refresh test's calls (s): well under its timeout
LATE_S = 1.0


def _refresh_calls_with_a_late_peer(world):
    """AllGather + GEMM's calls of ``_refresh_calls`` with a shard of 2 rows, the refreshing
    ones (2**30, 2**31) and, between them, one of 32 rows (more chunks, so more ``ready``
    words), rank 1 ``LATE_S`` late to each call from the first refreshing one on: rank 0's
    tiles wait for rank 1's words, in the call after the refresh for words that the refresh
    wrote with the call before's number. Returns the outcomes and rank 0's op times."""
    ctx = po.AllGatherMatmul(world, 32 * 16, transport="stores", timeout_s=10.0)
    ws, peer, took = ctx.impl, 1 - world.rank, []
    calls = []
    for i, M in enumerate([2, 2, 32, 2]):
        g = torch.Generator().manual_seed(i * 1000 + world.rank)
        late = LATE_S if world.rank == 1 and i >= 1 else 0.0
        calls.append(lambda M=M, g=g, i=i, late=late: _gemm_call(
            world, ctx, "all_gather_matmul", M, 16, 16, g, i, late, took))
    try:
        outcomes = _run_refreshing(world, [(ws.ctx, [ws.ready, ws.consumed])],
                                   [("ready", ws.ready[peer])], calls)
    finally:
        ctx.close()
    return outcomes, took


def test_the_calls_after_a_refresh_wait_for_a_late_peer(world2):
    """A rank's waits in the calls from a refreshing one on find its late peer's words not
    yet written for the call (the refresh wrote the words past the small shard's chunks with
    its own number, an earlier call's for the next call) and wait: every result is right, and
    rank 0's calls 1-3 each took about as long as rank 1 came late."""
    (outcomes0, took0), (outcomes1, _) = world2.run(_refresh_calls_with_a_late_peer, timeout=300)
    assert [outcomes0, outcomes1] == [["ok"] * 4] * 2, (outcomes0, outcomes1)
    assert all(t > 0.8 * LATE_S for t in took0[1:]), took0


#: the MoE refresh tests' sizes: hidden, intermediate, experts a rank, choices a token ...
MOE_H, MOE_I, MOE_E, MOE_K = 16, 16, 1, 2
#: ... and the tokens of a call past decode sizes there (``moe_combine.api.decode_walk``: more
#: than 64 rows a (source, expert) segment on average, 2 ranks of one expert each)
S_MANY = 65


def _moe_inputs(world, S, g):
    """Tokens [S, H], top-k ids (uniform) and weights [S, k] of one call on this rank."""
    tokens = torch.randn(S, MOE_H, generator=g)
    ids = route("uniform", S, MOE_E * world.world_size, MOE_K, world.world_size, g)
    return tokens, ids, torch.rand(S, MOE_K, generator=g)


def _moe_call(world, d, c, weights, form, S, senders, g) -> bool:
    """One call of ``form`` on random inputs of S tokens: the MoE dispatch (``"dispatch"``),
    the fused dispatch + gated GEMM (``"swiglu"``, ``senders`` programs sending), the combine
    (``"combine"``, on rows the torch dispatch delivered) or the one-launch layer
    (``"layer"``); whether it matches the reference (poisoned outputs and receive rows)."""
    wg, wu, wd = weights
    tokens, ids, tw = _moe_inputs(world, S, g)
    if form == "combine":
        rows = torch.randn(S, MOE_I, generator=g)  # (the combine's rows are of width I)
        x, counts, slots = moe_dispatch_reference(rows, ids, MOE_E, world.group)
        ref = moe_gemm_combine_reference(x, wd, counts, slots, tw, world.group)
        out = c(x, wd, counts, slots, tw, out=torch.full((S, MOE_H), float("nan")))
        c.synchronize()
        return torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    d.recv.fill_(float("nan"))
    if form == "layer":
        ref = moe_layer_reference(tokens, ids, tw, wg, wu, wd, MOE_E, world.group)
        out = moe_layer(tokens, ids, tw, wg, wu, wd, d, c,
                        torch.full((S, MOE_H), float("nan")), senders=senders)
        d.synchronize()
        c.synchronize()
        return torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    if form == "dispatch":
        ref, c_ref, s_ref = moe_dispatch_reference(tokens, ids, MOE_E, world.group)
        x, counts, slots = moe_dispatch(tokens, ids, d)
        same = torch.equal(x[:ref.shape[0]], ref)
    else:
        ref, c_ref, s_ref = moe_dispatch_swiglu_reference(tokens, ids, wg, wu, MOE_E,
                                                          world.group)
        h = torch.full((d.capacity, MOE_I), float("nan"))
        _, counts, slots = moe_dispatch_swiglu(tokens, ids, wg, wu, d, h, senders=senders)
        same = torch.allclose(h[:ref.shape[0]], ref, rtol=1e-5, atol=1e-5)
    d.synchronize()
    return same and torch.equal(counts, c_ref) and torch.equal(slots[:ref.shape[0]], s_ref)


#: per MoE op, its calls (form, tokens, senders, SMs of the plan): the calls at 2**30 and
#: 2**31 (places 1 and 3) between calls that write more of the same words: the scatter's
#: grid (4 programs, none of this rank's own words) against a fused launch of 2 senders (2
#: words in every heap); 1 sender against 2; the combine's GEMM and the layer planned for
#: decode sizes on 2 SMs against 4 SMs past them
MOE_CALLS = {
    "moe_dispatch": [("dispatch", 1, None, None), ("dispatch", 1, None, None),
                     ("swiglu", S_MANY, 2, None), ("dispatch", 1, None, None)],
    "moe_dispatch_swiglu": [("swiglu", S_MANY, 2, None), ("swiglu", 1, 1, None),
                            ("swiglu", S_MANY, 2, None), ("swiglu", 1, 1, None)],
    "moe_gemm_combine": [("combine", S_MANY, None, 4), ("combine", 1, None, 2),
                         ("combine", S_MANY, None, 4), ("combine", 1, None, 2)],
    "moe_layer": [("layer", S_MANY, 2, 4), ("layer", 1, 1, 2), ("layer", S_MANY, 2, 4),
                  ("layer", 1, 1, 2)],
}


def _moe_refresh_calls(world, op):
    """``_refresh_calls`` for the MoE ops on the ``"stores"`` workspaces (``MOE_CALLS``): the
    dispatch's counter and flags move on for the dispatch, the fused dispatch + gated GEMM and
    the layer, the combine's (both its launches' counters) for the combine and the layer. After
    a refreshing call the dispatch's ``sent`` words must all hold it, the peer's and this
    rank's own (which the fused launches' tiles wait for), and so must the peer's ``sent``
    words of the combine."""
    peer, r = 1 - world.rank, world.rank
    g = torch.Generator().manual_seed(700 + r)
    weights = ((torch.randn(MOE_E, MOE_H, MOE_I, generator=g) / MOE_H ** 0.5),
               (torch.randn(MOE_E, MOE_H, MOE_I, generator=g) / MOE_H ** 0.5),
               (torch.randn(MOE_E, MOE_I, MOE_H, generator=g) / MOE_I ** 0.5))
    sizes = dict(max_tokens=S_MANY, top_k=MOE_K, hidden=MOE_H, experts_per_rank=MOE_E,
                 transport="stores", timeout_s=10.0)
    d = c = None
    moves, checked = [], []
    if op != "moe_gemm_combine":
        d = MoeDispatch(world, dtype=torch.float32, **sizes)
        wd = d.kernel()
        moves.append((wd.ctl, [wd.count_flag, wd.sent, wd.consumed]))
        checked += [("dispatch sent", wd.sent[peer]), ("own dispatch sent", wd.sent[r])]
    if op in ("moe_gemm_combine", "moe_layer"):
        c = MoeGemmCombine(world, **sizes)
        wc = c.kernel()
        moves.append(((wc.ctl, wc.ctl[2:]), [wc.sent, wc.consumed]))
        checked += [("combine sent", wc.sent[peer])]
    calls = []
    for i, (form, S, senders, sms) in enumerate(MOE_CALLS[op]):
        def call(form=form, S=S, senders=senders, sms=sms, i=i):
            with _emulated_sms(world, sms):
                g = torch.Generator().manual_seed(1000 * i + r)
                return _moe_call(world, d, c, weights, form, S, senders, g)
        calls.append(call)
    try:
        return _run_refreshing(world, moves, checked, calls)
    finally:
        for ctx in (d, c):
            if ctx is not None:
                ctx.close()


@pytest.mark.parametrize("op", ["moe_dispatch", "moe_dispatch_swiglu", "moe_gemm_combine",
                                "moe_layer"])
def test_the_moe_calls_that_refresh_flag_words_and_the_next_ones_are_right(world2, op):
    """The MoE kernels' refreshing calls (the scatter's, the fused dispatch + gated GEMM's,
    the combine GEMM's and the one-launch layer's) write every ``sent`` word their launch does
    not and give the right result, and so do the calls after them, whose launches write more
    of those words."""
    found = world2.run(_moe_refresh_calls, op, timeout=300)
    assert found == [["ok"] * 4] * 2, found


def _other_contexts_then_one_call(world):
    """Rank 0 makes a GEMV + AllReduce context, rank 1 a GEMM + AllReduce one; then both make
    the same context and call it."""
    outcomes = []
    try:
        if world.rank == 0:
            po.GemvAllReduce(world, max_n=32, transport="stores").close()
        else:
            po.MatmulAllReduce(world, 16, 16, transport="stores").close()
        outcomes.append("made")
    except po.RankMismatchError as e:
        outcomes.append(str(e))
    ctx = GemvAllReduce(world, max_n=32, timeout_s=10.0)
    x, w = _inputs(world, 2, 16, 8, 3)
    y = ctx(x, w)
    outcomes.append(bool(torch.allclose(y, gemv_all_reduce_reference(x, w, world.group),
                                        rtol=1e-4, atol=1e-4)))
    ctx.close()
    return outcomes


def test_contexts_of_other_ops_made_at_once_name_both(world2):
    """Each rank's error named its own op only ("ranks disagree on gemv_all_reduce transport:
    rank 0: stores, rank 1: ..." on rank 0, "matmul_all_reduce" on rank 1): each rank read its
    peer's arguments as another value of its own. Both ranks now say what each was making, and
    the next context is made in step."""
    for rank, (msg, ok) in enumerate(world2.run(_other_contexts_then_one_call, timeout=120)):
        assert msg.startswith("ranks are setting up different things at once"), (rank, msg)
        assert "rank 0: gemv_all_reduce" in msg and "rank 1: matmul_all_reduce" in msg, msg
        assert ok, rank
