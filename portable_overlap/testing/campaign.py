"""A seeded fault campaign: valid calls of every fused op mixed with faults, on every rank of a
world, checking what the library promises when things go wrong.

Every rank draws the same sequence from the seed (no communication is needed to agree on it):
an op, and with probability ``fault_rate`` one fault on one rank. What each fault may cause:

====================  =========================================================================
fault                 what the faulty rank does; what every rank must see
====================  =========================================================================
``bad_input``         passes an operand of another dtype: it raises ValueError/TypeError, every
                      other rank raises PortableOverlapError for that call; the next call works
``bad_out``           passes an ``out`` of the wrong shape: the same
``skip``              never makes the call (it then waits ``timeout_s``): the peers raise
                      PeerTimeoutError within 2x ``timeout_s``; the contexts are remade
``other_shape``       calls with another N: every rank raises (mismatch, or a timeout); remade
``bad_routing``       (MoE) a duplicated routing slot: the slot's owner raises InvalidInputError
``bad_index``         (embedding, ``validate=False``) an index past its table: that rank raises
                      InvalidInputError
``threads``           a second thread holds the context: that rank's extra call raises
                      ConcurrentUseError and counts for nothing; then every rank calls normally
``raise_after``       the caller's own code raises right after the call: results stay right
``closed``            (every rank) closes the context, then calls it: ContextClosedError
====================  =========================================================================

Checked on every rank and call: no call returns a result that differs from the torch reference
(outputs are poisoned with NaN first), no error arrives later than twice the timeout (beyond
the time the call's own work takes, measured on its last valid call), and the library's
segments and file descriptors are all gone once the contexts are closed. Kills (a rank that
dies mid-call or during set-up) end a world, so they are separate tests (tests/test_lifecycle.py,
tests/test_fault_campaign.py).
"""
from __future__ import annotations

import dataclasses
import gc
import os
import random
import time
from typing import Callable, Optional

import torch

from ..errors import PortableOverlapError

#: faults that leave the ranks out of step (a timeout somewhere): the op's contexts are remade
_REMAKE = ("skip", "other_shape", "closed")
#: faults that only mean something with a peer to disagree with (left out on one rank)
_NEED_PEERS = ("other_shape",)
#: the faults every op is put through; each adds its own (another shape, routing, indices)
_COMMON = ("bad_input", "bad_out", "skip", "threads", "raise_after", "closed")


@dataclasses.dataclass
class Op:
    """One fused op under test: ``make(world, timeout_s)`` a context; ``inputs(world, ctx,
    gen, variant)`` this rank's operands (a dict; variant "other_shape" changes a size the
    ranks must agree on);
    ``call(ctx, inp, out)``; ``reference(world, ctx, inp)`` the expected output (a collective:
    every rank calls it); ``out_shape(ctx, inp)``; ``faults`` those that apply; ``corrupt``
    (fault, inp) -> inp for the op-specific faults."""
    name: str
    make: Callable
    inputs: Callable
    call: Callable
    reference: Callable
    out_shape: Callable
    faults: tuple
    corrupt: Optional[Callable] = None
    tol: float = 1e-4


def _on(world, **tensors) -> dict:
    """The operands on the rank's device (drawn on the CPU, so every backend sees the same)."""
    return {k: v.to(world.device) for k, v in tensors.items()}


def _gen(seed: int, step: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 100003 + step) * 64 + rank)


def _small_tiles():
    """16x16x16 tiles, one warp: the interpreter's programs stay short."""
    from ..ops.matmul import MatmulConfig

    return MatmulConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1,
                        num_stages=1)


# -- the ops --------------------------------------------------------------------------------
def _gemv() -> Op:
    from ..ops.gemv_allreduce import GemvAllReduce, gemv_all_reduce_reference

    def inputs(world, ctx, g, variant):
        n = 24 if variant == "other_shape" else 40
        return _on(world, x=torch.randn(2, 12, generator=g), w=torch.randn(n, 12, generator=g))

    return Op("gemv_all_reduce",
              make=lambda world, t: GemvAllReduce(world, max_n=40, transport="stores",
                                                  timeout_s=t),
              inputs=inputs,
              call=lambda ctx, i, out: ctx(i["x"], i["w"], out=out),
              reference=lambda world, ctx, i: gemv_all_reduce_reference(i["x"], i["w"],
                                                                         world.group),
              out_shape=lambda ctx, i: (i["x"].shape[0], i["w"].shape[0]),
              faults=_COMMON + ("other_shape",))


def _moe() -> Op:
    from ..ops.moe_combine import MoeGemmCombine, moe_gemm_combine_reference
    from ..ops.moe_dispatch import moe_dispatch_reference

    S, H, I, E, k = 6, 16, 8, 2, 2

    def inputs(world, ctx, g, variant):
        t = _on(world, tokens=torch.randn(S, I, generator=g),
                ids=torch.rand(S, E * world.world_size, generator=g).topk(k, dim=1).indices,
                topk=torch.softmax(torch.randn(S, k, generator=g), dim=1),
                w=torch.randn(E, I, H, generator=g) / I ** 0.5)
        x, counts, slots = moe_dispatch_reference(t["tokens"], t["ids"], E, world.group)
        return {"x": x, "w": t["w"], "counts": counts, "slots": slots, "topk": t["topk"]}

    def corrupt(fault, i):
        slots = i["slots"].clone()
        if slots.numel() >= 2:  # two rows to one slot: some slot of the owner gets no row
            slots[1] = slots[0]
        return dict(i, slots=slots)

    return Op("moe_gemm_combine",
              make=lambda world, t: MoeGemmCombine(world, max_tokens=S, top_k=k, hidden=H,
                                                   experts_per_rank=E, timeout_s=t,
                                                   transport="stores",
                                                   config=_small_tiles()),
              inputs=inputs,
              call=lambda ctx, i, out: ctx(i["x"], i["w"], i["counts"], i["slots"], i["topk"],
                                           out=out),
              reference=lambda world, ctx, i: moe_gemm_combine_reference(
                  i["x"], i["w"], i["counts"], i["slots"], i["topk"], world.group),
              out_shape=lambda ctx, i: (i["topk"].shape[0], H),
              faults=_COMMON + ("bad_routing",),
              corrupt=corrupt)


def _embedding() -> Op:
    from ..ops.embedding_alltoall import EmbeddingAllToAll, embedding_all_to_all_reference

    rows = [7, 5, 9, 4]

    def make(world, t):
        ctx = EmbeddingAllToAll(world, rows, 8, max_local_batch=4, block_b=2, timeout_s=t,
                                transport="stores")
        ctx.validate = False  # the device check is what is under test
        return ctx

    def inputs(world, ctx, g, variant):
        B = 3 * world.world_size
        weight = torch.randn(ctx.weight_rows, ctx.dim, generator=g)
        lengths = torch.randint(0, 3, (ctx.n_loc * B,), generator=g)
        idx = [torch.randint(0, ctx.plan.table_rows[t], (int(lengths[j * B:(j + 1) * B].sum()),),
                             generator=g) for j, t in enumerate(ctx.local_tables)]
        indices = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64)
        return _on(world, weight=weight, lengths=lengths, indices=indices)

    def corrupt(fault, i):
        indices = i["indices"].clone()
        if indices.numel():
            indices[-1] = 1 << 20  # past every table
        return dict(i, indices=indices)

    return Op("embedding_all_to_all",
              make=make,
              inputs=inputs,
              call=lambda ctx, i, out: ctx(i["weight"], i["lengths"], i["indices"], out=out),
              reference=lambda world, ctx, i: embedding_all_to_all_reference(
                  i["weight"], i["lengths"], i["indices"], None, ctx.plan, world.rank,
                  ctx.resolve_splits(i["lengths"], None), "sum", world.group),
              out_shape=lambda ctx, i: ctx.output_shape(ctx.resolve_splits(i["lengths"], None)),
              faults=_COMMON + ("bad_index",),
              corrupt=corrupt)


def _gemm_all_to_all(transport: str) -> Op:
    from ..ops.gemm_alltoall import MatmulAllToAll, matmul_all_to_all, matmul_all_to_all_reference


    def inputs(world, ctx, g, variant):
        M = 4 * world.world_size
        n = 8 if variant == "other_shape" else 12
        return _on(world, a=torch.randn(M, 8, generator=g), b=torch.randn(8, n, generator=g))

    options = {"config": _small_tiles()} if transport == "stores" else {}
    return Op(f"matmul_all_to_all[{transport}]",
              make=lambda world, t: MatmulAllToAll(world, 4 * world.world_size, 12,
                                                   transport=transport, timeout_s=t, **options),
              inputs=inputs,
              call=lambda ctx, i, out: matmul_all_to_all(i["a"], i["b"], ctx, out),
              reference=lambda world, ctx, i: matmul_all_to_all_reference(i["a"], i["b"],
                                                                           world.group),
              out_shape=lambda ctx, i: (i["a"].shape[0], i["b"].shape[1]),
              faults=_COMMON + ("other_shape",))


def _matmul_reduce() -> Op:
    from ..ops.matmul_reduce import (MatmulReduceScatter, matmul_reduce_scatter,
                                     matmul_reduce_scatter_reference)

    def inputs(world, ctx, g, variant):
        M = 2 * world.world_size
        n = 6 if variant == "other_shape" else 10
        return _on(world, a=torch.randn(M, 8, generator=g), b=torch.randn(8, n, generator=g))

    return Op("matmul_reduce_scatter",
              make=lambda world, t: MatmulReduceScatter(world, 2 * world.world_size, 10,
                                                        transport="copy_engine", timeout_s=t),
              inputs=inputs,
              call=lambda ctx, i, out: matmul_reduce_scatter(i["a"], i["b"], ctx, out),
              reference=lambda world, ctx, i: matmul_reduce_scatter_reference(i["a"], i["b"],
                                                                              world.group),
              out_shape=lambda ctx, i: (i["a"].shape[0] // ctx.world.world_size,
                                        i["b"].shape[1]),
              faults=_COMMON + ("other_shape",))


def _all_gather_matmul() -> Op:
    from ..ops.allgather_gemm import AllGatherMatmul, all_gather_matmul_reference

    def inputs(world, ctx, g, variant):  # (ranks may differ in N: other shards' rows differ)
        m = 2 if variant == "other_shape" else 3
        return _on(world, a=torch.randn(m, 8, generator=g), b=torch.randn(8, 10, generator=g))

    return Op("all_gather_matmul",
              make=lambda world, t: AllGatherMatmul(world, max_shard_elems=24,
                                                    transport="copy_engine", timeout_s=t),
              inputs=inputs,
              call=lambda ctx, i, out: ctx(i["a"], i["b"], out=out),
              reference=lambda world, ctx, i: all_gather_matmul_reference(i["a"], i["b"],
                                                                          world.group),
              out_shape=lambda ctx, i: (i["a"].shape[0] * ctx.world.world_size,
                                        i["b"].shape[1]),
              faults=_COMMON + ("other_shape",))


def all_ops() -> list:
    return [_gemv(), _moe(), _embedding(), _gemm_all_to_all("stores"),
            _gemm_all_to_all("copy_engine"), _matmul_reduce(), _all_gather_matmul()]


# -- the campaign ---------------------------------------------------------------------------
@dataclasses.dataclass
class Tally:
    calls: int = 0
    faulted: int = 0
    wrong: list = dataclasses.field(default_factory=list)  # silent wrong results
    late: list = dataclasses.field(default_factory=list)  # errors after 2x the timeout
    unexpected: list = dataclasses.field(default_factory=list)  # outcomes the table forbids
    by_fault: dict = dataclasses.field(default_factory=dict)
    outcomes: list = dataclasses.field(default_factory=list)  # (step, fault, bad_rank, kind)


def _allowed(fault: Optional[str], mine: bool) -> set:
    """What a rank's call may end in, by the module docstring's table (a returned result is
    also checked against the reference)."""
    if fault in (None, "raise_after", "threads"):
        return {"returned"}
    if fault == "closed":
        return {"ContextClosedError"}
    if fault in ("bad_input", "bad_out"):
        return {"refused"} if mine else {"PeerTimeoutError"}
    if fault == "skip":
        return {"skipped"} if mine else {"PeerTimeoutError"}
    if fault == "other_shape":
        return {"RankMismatchError", "PeerTimeoutError"}
    # bad_routing / bad_index: the rank that finds it raises; a rank whose result did not
    # depend on the bad data returns it (checked), the others hear that a peer gave up
    return {"InvalidInputError", "PeerTimeoutError", "returned"}


def _bad_operand(inp: dict) -> dict:
    """The first floating operand in another dtype (refused before any launch)."""
    for k, v in inp.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return dict(inp, **{k: v.to(torch.float16)})
    raise AssertionError("no floating operand")


def _checked(ctx, result):
    ctx.synchronize()
    return result


def _outcome(fn) -> tuple:
    t0 = time.monotonic()
    try:
        return "returned", fn(), time.monotonic() - t0
    except PortableOverlapError as e:
        return type(e).__name__, e, time.monotonic() - t0
    except (ValueError, TypeError) as e:
        return "refused", e, time.monotonic() - t0


def run_campaign(world, seed: int, steps: int, *, fault_rate: float = 0.65,
                 timeout_s: float = 1.0, ops: Optional[list] = None,
                 verbose: bool = False) -> dict:
    """Collective: ``steps`` steps on every rank of ``world`` (see the module docstring).
    Returns this rank's tally as a dict."""
    rng = random.Random(seed)
    ops = ops or all_ops()
    ctxs = {op.name: op.make(world, timeout_s) for op in ops}
    work = {op.name: 0.0 for op in ops}  # this rank's time of the op's last valid call
    tally = Tally()
    rank, W = world.rank, world.world_size
    for step in range(steps):
        op = rng.choice(ops)
        # ranks that disagree need two: on one rank another shape is just a valid call
        faults = [f for f in op.faults if W > 1 or f not in _NEED_PEERS]
        fault = rng.choice(faults) if rng.random() < fault_rate else None
        bad_rank = rng.randrange(W)
        ctx = ctxs[op.name]
        g = _gen(seed, step, rank)
        variant = "other_shape" if fault == "other_shape" and rank == bad_rank else None
        inp = op.inputs(world, ctx, g, None)
        ref = op.reference(world, ctx, inp)  # every rank, valid operands: a collective in step
        call_inp = op.inputs(world, ctx, _gen(seed, step, rank), variant) if variant else inp
        mine = fault is not None and (rank == bad_rank or fault == "closed")
        if mine and fault == "bad_input":
            call_inp = _bad_operand(call_inp)
        elif mine and fault in ("bad_routing", "bad_index"):
            call_inp = op.corrupt(fault, call_inp)
        shape = op.out_shape(ctx, call_inp)
        if mine and fault == "bad_out":
            shape = (shape[0] + 1,) + tuple(shape[1:])
        out = torch.full(shape, float("nan"), dtype=ref.dtype, device=ref.device)
        if mine and fault == "closed":
            ctx.close()
        tally.calls += 1
        tally.faulted += fault is not None
        tally.by_fault[fault or "none"] = tally.by_fault.get(fault or "none", 0) + 1
        where = f"seed {seed} step {step} {op.name} fault={fault} bad_rank={bad_rank} rank {rank}"
        if verbose:
            print(where, flush=True)

        extra = None
        if mine and fault == "threads":
            guard = getattr(ctx, "impl", ctx)._guard  # a pattern context's transport's
            guard.acquire()  # as if another thread's call were running
            try:
                extra = _outcome(lambda: op.call(ctx, call_inp, out))
            finally:
                guard.release()
        if mine and fault == "skip":
            time.sleep(timeout_s)  # the peers wait for a call that never comes
            kind, value, took = "skipped", None, 0.0
        else:
            # synchronized: on GPUs a kernel's findings reach the host at the next check
            kind, value, took = _outcome(lambda: _checked(ctx, op.call(ctx, call_inp, out)))
            if mine and fault == "raise_after" and kind == "returned":
                try:
                    raise RuntimeError("the caller's own code failed after the call")
                except RuntimeError:
                    pass

        # -- judge -------------------------------------------------------------------------
        if kind == "returned":
            if value.shape != ref.shape or not torch.allclose(
                    value.float(), ref.float(), rtol=op.tol, atol=op.tol, equal_nan=False):
                tally.wrong.append(f"{where}: returned a wrong result")
            elif fault is None:
                work[op.name] = max(work[op.name], took)
        elif kind == "PeerTimeoutError" and took > 2 * timeout_s + 2 * work[op.name] + 0.5:
            tally.late.append(f"{where}: PeerTimeoutError after {took:.2f} s "
                              f"(timeout {timeout_s} s, work {work[op.name]:.2f} s)")
        allowed = _allowed(fault, mine)
        if kind not in allowed:
            tally.unexpected.append(f"{where}: {kind} ({str(value)[:300]}), expected one of "
                                    f"{sorted(allowed)}")
        if fault == "threads" and mine and (extra is None or extra[0] != "ConcurrentUseError"):
            tally.unexpected.append(f"{where}: a second thread's call gave {extra and extra[0]}")
        tally.outcomes.append((step, fault, bad_rank, kind))

        if fault in _REMAKE:
            if not (fault == "closed"):
                ctx.close()
            ctxs[op.name] = op.make(world, timeout_s)
    for ctx in ctxs.values():
        ctx.close()
    return dataclasses.asdict(tally)


def leftovers() -> list:
    """This process's file descriptors and /dev/shm entries of the library (none may remain
    once its contexts are closed). Garbage is collected first: a segment stays mapped, with
    its descriptor, while a view of it lives (``HostSegment.close``), and views in reference
    cycles (a traceback's frames) live until a collection."""
    gc.collect()
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "portable_overlap" in target:
            found.append(target)
    if os.path.isdir("/dev/shm"):
        found += [f for f in os.listdir("/dev/shm")
                  if f.startswith(f"portable_overlap_{os.getpid()}_")]
    return found
