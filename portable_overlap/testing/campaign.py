"""A seeded fault campaign: valid calls of every public op through every transport that runs
here, mixed with faults, on every rank of a world, checking what the library promises when
things go wrong.

Every rank draws the same sequence from the seed (no communication is needed to agree on it):
an op of ``po.OPS``, one of its transports (``"auto"`` among them), a valid call from the op's
entry in ``op_cases.py`` (the shape sweep's table: drawn dims, dtypes, layouts, optional
operands), and with probability ``fault_rate`` one fault on one rank. What each fault may cause:

====================  =========================================================================
fault                 what the faulty rank does; what every rank must see
====================  =========================================================================
``bad_input``         passes its first floating operand in another dtype: it raises
                      ValueError/TypeError (or hears that its call differs from its peers'),
                      every other rank raises PortableOverlapError for that call; the next
                      call works
``bad_out``           passes an ``out`` with a row too many: the same
``skip``              never makes the call (it then waits ``timeout_s``): the peers raise
                      PeerTimeoutError (or RankMismatchError where the call agrees first)
                      within 2x ``timeout_s``; the contexts are remade
``other_shape``       calls with a size its peers' calls must share changed (N, the gathered
                      shards' rows, the embedding's batch split): every rank raises; remade
``bad_routing``       (MoE) an expert id no rank holds, or a duplicated routing slot: the rank
                      that finds it raises InvalidInputError (or refuses the call), a rank whose
                      result did not depend on the bad data returns it (checked), the others
                      hear that a peer gave up
``bad_index``         (embedding, ``validate=False``) an index past its table: the same
``threads``           a second thread holds the context: that rank's extra call raises
                      ConcurrentUseError and counts for nothing; then every rank calls normally
``raise_after``       the caller's own code raises right after the call: results stay right
``closed``            (every rank) closes the context, then calls it: ContextClosedError
====================  =========================================================================

Checked on every rank and call: no call returns a result that differs from the torch reference
(outputs are poisoned with NaN first), no error arrives later than twice the timeout (beyond
the time the call's own work takes, measured on the valid calls of the same op over the run;
both on the clock the waits are bounded by: the rank's CPU time under the interpreter),
and the library's segments and file descriptors are all gone once the contexts are closed.
Kills (a rank that dies mid-call or during set-up) end a world, so they are separate tests
(tests/test_lifecycle.py, tests/test_fault_campaign.py). A problem names its seed, step, op,
transport, fault and case, and ``run_campaign(world, seed, step + 1)`` with the same bounds
replays it.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import random
import time
from typing import Optional

import torch

from ..errors import PortableOverlapError
from ..ops import planner
from .op_cases import DTYPES, all_cases, draw_context, step_generator

#: faults that leave the ranks out of step (a timeout somewhere): the op's context is remade
_REMAKE = ("skip", "other_shape", "closed")
#: faults that only mean something with a peer to disagree with (left out on one rank)
_NEED_PEERS = ("other_shape",)
#: the faults every op is put through; each entry adds its own (``Case.faults``)
_COMMON = ("bad_input", "bad_out", "skip", "threads", "raise_after", "closed")
#: what a rank whose peer gave up on a call may raise: the peer's refusal heard on the device
#: (PeerTimeoutError "gave up"), in the agreement that calls of ``"auto"`` and the unbounded
#: transports make first (RankMismatchError), or at ``"auto"``'s first call of a shape, where
#: every candidate failed on the peer (PortableOverlapError naming each one's error)
_PEER_FAILED = {"PeerTimeoutError", "RankMismatchError", "PortableOverlapError"}
#: the faults that keep the ranks in step: the only ones drawn for a transport whose calls
#: wait without a deadline and agree with no peer first (``_unbounded``)
_IN_STEP = ("threads", "raise_after", "closed")
#: draws of a valid call per step before the step is left out (on every rank alike)
_DRAWS = 10


@dataclasses.dataclass
class Tally:
    calls: int = 0
    faulted: int = 0
    wrong: list = dataclasses.field(default_factory=list)  # silent wrong results
    late: list = dataclasses.field(default_factory=list)  # errors after 2x the timeout
    unexpected: list = dataclasses.field(default_factory=list)  # outcomes the table forbids
    by_fault: dict = dataclasses.field(default_factory=dict)
    by_transport: dict = dataclasses.field(default_factory=dict)  # "op[transport]" -> calls
    unavailable: dict = dataclasses.field(default_factory=dict)  # op -> {transport: why}
    outcomes: list = dataclasses.field(default_factory=list)  # (step, fault, bad_rank, kind)


def _allowed(fault: Optional[str], mine: bool) -> set:
    """What a rank's call may end in, by the module docstring's table (a returned result is
    also checked against the reference)."""
    if fault in (None, "raise_after", "threads"):
        return {"returned"}
    if fault == "closed":
        return {"ContextClosedError"}
    if fault in ("bad_input", "bad_out"):
        return {"refused"} | _PEER_FAILED if mine else _PEER_FAILED
    if fault == "skip":
        return {"skipped"} if mine else _PEER_FAILED
    if fault == "other_shape":
        return _PEER_FAILED | ({"refused"} if mine else set())
    # bad_routing / bad_index: the rank that finds it raises; a rank whose result did not
    # depend on the bad data returns it (checked), the others hear that a peer gave up
    return {"InvalidInputError", "returned"} | _PEER_FAILED | ({"refused"} if mine else set())


def _bad_operand(t: dict) -> dict:
    """The first floating operand in another dtype (refused before any launch)."""
    for k, v in t.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            other = torch.float32 if v.dtype != torch.float32 else torch.float16
            return dict(t, **{k: v.to(other)})
    raise AssertionError("no floating operand")


def _call_guard(ctx):
    """The lock a second thread's call of ``ctx`` would hold: the planner's where the context
    has one (``"auto"``, the named transports whose calls agree first), else its transport's."""
    planner = getattr(ctx, "planner", None)
    if planner is not None:
        return planner._lock
    impl = getattr(ctx, "impl", None)
    return (impl if impl is not None else ctx)._guard


def _unbounded(ctx, transport: str) -> bool:
    """Whether a named ``transport``'s calls wait in the collective library or torch's barriers
    with no agreement first: named ``"torch_fused"``, and ``"sequential"`` outside the GEMM
    patterns. A rank that refuses or skips such a call leaves its peers waiting there, as a
    rank that skips an NCCL call does (``docs/reliability.md``, "What is not caught")."""
    from ..ops.planner import UNBOUNDED

    return transport in UNBOUNDED and transport not in getattr(ctx, "AGREED_TRANSPORTS", ())


def _outcome(fn) -> tuple:
    t0 = time.monotonic()
    try:
        return "returned", fn(), time.monotonic() - t0
    except PortableOverlapError as e:
        return type(e).__name__, e, time.monotonic() - t0
    except (ValueError, TypeError) as e:
        return "refused", e, time.monotonic() - t0
    except Exception as e:  # reported as an outcome the table forbids, the world goes on
        return type(e).__name__, e, time.monotonic() - t0


def late_errors(timeouts: list, work: dict, clock: str = "wall") -> list:
    """The PeerTimeoutErrors of ``timeouts`` ((where, (op, transport), seconds taken, the
    wait's bound, message) each) that came later than twice the bound plus twice the call's
    own work, taken as the longest valid call of its op over the whole run (shapes are drawn
    at every step; an op's first call has none before it), and a second for the
    interpreter's start-up of a new shape. ``work``: (op, transport) and op -> seconds.
    ``clock``: the clock both were measured on, named in the message (``call_clock``)."""
    late = []
    for where, key, took, wait_s, message in timeouts:
        busy = max(work.get(key, 0.0), work.get(key[0], 0.0))
        if took > 2 * wait_s + 2 * busy + 1.0:
            late.append(f"{where}: PeerTimeoutError after {took:.2f} s of {clock} time (wait "
                        f"{wait_s} s, work {busy:.2f} s): {message}")
    return late


def call_clock(world) -> tuple:
    """(name, clock) of the clock a call's time is judged on: the one the library's waits are
    bounded by. On GPUs the device's wall clock; under the interpreter the rank's CPU time
    (``backends.device_clock``): with more emulated ranks than cores, the ranks that spin for
    a missing peer share the cores and their wall time stretches (8 ranks on 2 busy cores:
    75-140 s of wall time for a 15 s bound, each within it in CPU time)."""
    if world.device.type == "cpu":
        return "CPU", time.process_time
    return "wall", time.monotonic


def run_campaign(world, seed: int, steps: int, *, fault_rate: float = 0.65,
                 timeout_s: float = 1.0, ops: Optional[list] = None, max_dim: int = 12,
                 leave_out: tuple = (), agreement_s: Optional[float] = None,
                 verbose: bool = False) -> dict:
    """Collective: ``steps`` steps on every rank of ``world`` (see the module docstring).
    ``ops``: names of ``po.OPS`` to draw from (default all); ``max_dim``: the largest dim
    drawn; ``leave_out``: transports never drawn (``"shmem"`` where ranks share a GPU);
    ``agreement_s``: the least time a call's agreement waits for its peers during the run
    (``planner.EXCHANGE_MIN_S``, 60 s, which leaves time for peers that still compile a new
    shape's kernels; the interpreter compiles none, so the CPU tests set the timeout here).
    Returns this rank's tally as a dict."""
    rng = random.Random(seed)
    cases = all_cases()
    names = list(ops) if ops else list(cases)
    unknown = sorted(set(names) - set(cases))
    if unknown:
        raise ValueError(f"run_campaign: no op named {unknown}; the ops are {sorted(cases)}")
    ctxs: dict = {}  # (op, transport) -> (context, its sizes)
    work: dict = {}  # (op, transport) and op -> this rank's longest valid call
    timeouts: list = []  # this rank's PeerTimeoutErrors, for late_errors
    clock_name, clock = call_clock(world)
    tally = Tally()
    rank, W = world.rank, world.world_size

    def make(entry, transport, sizes):
        ctx = entry.make(world, transport, sizes, timeout_s)
        if hasattr(ctx, "validate"):
            ctx.validate = False  # the embedding's device check is what bad_index is for
        return ctx

    floor = planner.EXCHANGE_MIN_S
    if agreement_s is not None:
        planner.EXCHANGE_MIN_S = agreement_s
    try:
        for step in range(steps):
            name = rng.choice(names)
            entry = cases[name]
            key = draw_context(rng, entry, W, max_dim, ctxs, tally.unavailable, make,
                               leave_out=leave_out)
            transport = key[1]
            ctx, sizes = ctxs[key]
            case = None
            for _ in range(_DRAWS):
                c = entry.draw(rng, W, sizes, max_dim, False)
                c.setdefault("dtype", rng.choice(DTYPES))
                c.update(op=name, transport=transport, sizes=sizes)
                if entry.refusal(c, W) is None:
                    case = c
                    break
            faults = [f for f in _COMMON + tuple(entry.faults)
                      if (W > 1 or f not in _NEED_PEERS)
                      and (f != "bad_out" or entry.takes_out)
                      and (f in _IN_STEP or not _unbounded(ctx, transport))]
            fault = rng.choice(faults) if rng.random() < fault_rate else None
            bad_rank = rng.randrange(W)
            if case is None:
                continue
            other = entry.disagree(case) if fault == "other_shape" else None
            if fault == "other_shape" and other is None:
                fault = None  # no size left to change at this call: a valid one
            mine = fault is not None and (rank == bad_rank or fault == "closed")
            g = step_generator(seed, step, rank)
            t = entry.operands(world, ctx, case, g)
            ref = entry.reference(world, ctx, case, t)  # every rank: a collective in step
            call_case, call_t = case, t
            if mine and fault == "other_shape":
                call_case = other
                call_t = entry.operands(world, ctx, other, step_generator(seed, step, rank))
            elif mine and fault == "bad_input":
                call_t = _bad_operand(t)
            elif mine and fault in ("bad_routing", "bad_index"):
                call_t = entry.corrupt(fault, t)
            out = None
            shape = entry.out_shape(world, ctx, call_case, call_t)
            if shape is not None:
                if mine and fault == "bad_out":
                    shape = (shape[0] + 1,) + tuple(shape[1:])
                out = torch.full(shape, float("nan"), dtype=ref.dtype, device=world.device)
            if mine and fault == "closed":
                ctx.close()
            tally.calls += 1
            tally.faulted += fault is not None
            tally.by_fault[fault or "none"] = tally.by_fault.get(fault or "none", 0) + 1
            op_t = f"{name}[{transport}]"
            tally.by_transport[op_t] = tally.by_transport.get(op_t, 0) + 1
            where = (f"seed {seed} step {step} {op_t} fault={fault} bad_rank={bad_rank} "
                     f"rank {rank} of {W}")
            if verbose:
                print(where, flush=True)

            def run():
                got = entry.call(ctx, call_case, call_t, out)
                ctx.synchronize()  # on GPUs a kernel's findings reach the host at a check
                return got

            extra = None
            if mine and fault == "threads":
                guard = _call_guard(ctx)
                guard.acquire()  # as if another thread's call were running
                try:
                    extra = _outcome(run)
                finally:
                    guard.release()
            if mine and fault == "skip":
                time.sleep(timeout_s)  # the peers wait for a call that never comes
                kind, value, took = "skipped", None, 0.0
            else:
                c0 = clock()
                kind, value, took = _outcome(run)
                took = clock() - c0  # on the clock the waits are bounded by (call_clock)
                if mine and fault == "raise_after" and kind == "returned":
                    try:
                        raise RuntimeError("the caller's own code failed after the call")
                    except RuntimeError:
                        pass

            # -- judge -----------------------------------------------------------------------
            if kind == "returned":
                err, why = entry.judge(value, ref, case)
                if why is None and out is not None and value is not out:
                    err, why = entry.judge(out, ref, case)
                    why = why and f"out= holds another result: {why}"
                if why is not None:
                    tally.wrong.append(f"{where}: returned a wrong result: {why} | case "
                                       f"{_words(case)}")
                elif fault is None:
                    for k in (key, name):
                        work[k] = max(work.get(k, 0.0), took)
            elif kind == "PeerTimeoutError":
                # a call's agreement waits at least planner.EXCHANGE_MIN_S
                wait_s = (max(planner.EXCHANGE_MIN_S, timeout_s) if "agreement" in str(value)
                          else timeout_s)
                # judged once the run is over (late_errors): an op's first call has no
                # valid call of its own to measure the work by
                timeouts.append((where, key, took, wait_s, str(value)[:300]))
            allowed = _allowed(fault, mine)
            if kind not in allowed:
                tally.unexpected.append(f"{where}: {kind} ({str(value)[:300]}), expected one "
                                        f"of {sorted(allowed)} | case {_words(case)}")
            if fault == "threads" and mine and (extra is None or
                                                extra[0] != "ConcurrentUseError"):
                tally.unexpected.append(f"{where}: a second thread's call gave "
                                        f"{extra and extra[0]}")
            tally.outcomes.append((step, fault, bad_rank, kind))

            if fault in _REMAKE:
                if fault != "closed":
                    ctx.close()
                ctxs[key] = (make(entry, transport, sizes), sizes)
        tally.late += late_errors(timeouts, work, clock_name)
    finally:
        planner.EXCHANGE_MIN_S = floor
        for ctx, _ in ctxs.values():
            try:
                ctx.close()
            except PortableOverlapError:
                pass
    return dataclasses.asdict(tally)


def _words(case: dict) -> dict:
    """A case as the report prints it: dims, dtype, layouts and options, not the sizes'
    tensors."""
    return {k: (str(v).replace("torch.", "") if k == "dtype" else v)
            for k, v in case.items() if k not in ("op", "transport")}


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
