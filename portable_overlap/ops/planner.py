"""``transport="auto"`` of the multi-transport pattern contexts (pattern.py): the context makes
the workspace of every candidate transport, times them all at the first eager call of each new
call key, keeps the fastest, and runs it at every later call with that key.

The call key: the op, each input's shape, dtype and strides (a size-1 dimension's stride left
out: it moves nothing; a jagged input, the embedding op's indices, by its dtype alone:
:class:`Jagged`), which optional inputs (bias, residual) are given, and the per-call options
with their values (tensors by shape, dtype and strides).

What the first call of a key does (collective; the same on every rank):

1. **The call's candidates**: the context's (``candidates=``, default: every transport of
   ``TRANSPORTS`` that can run on this world, ``PatternContext.unavailable``) that take each
   per-call option given, by name and type (the pattern's ``CALL_OPTIONS``; a transport not
   listed there takes none). One candidate runs at once, untimed; none is a ``ValueError``.
2. **The agreement and the decision's key**: every rank's call (its key, its candidates, or
   the error it refused the call with) exchanged with a deadline (on the call board where
   every rank runs on one machine, else through the process group's store: ``_agree``; one
   key for every rank, also where the shapes differ across ranks, as the reduction patterns'
   K shards may), then ``schedule.tuning.decide``: a decision every
   rank's cache holds is used as it is (no timing); otherwise every rank measures. An entry
   that is not a decision among the call's candidates (a file edited by hand, a transport
   this build lacks), and entries that differ across the ranks' files, are made again with a
   ``RuntimeWarning``, and the new decision replaces them.
3. **Measuring**: each candidate in ``TRANSPORTS`` order runs once on the call's own inputs,
   into an output of its own (the user's ``out`` is written only by the chosen transport, after
   the decision; the timed runs fill that output where the call passes ``out``, else each makes
   its own result, as the call does), then ``schedule.tuning.time_call`` times ``warmup`` +
   ``iters`` more runs (the slowest rank's median; on a GPU in :data:`ROUNDS` rounds, the
   candidates' order rotated each round, and the median of the rounds kept) in each of the
   timing modes ``graph`` asks for: plain calls and CUDA-graph replays (the default,
   ``graph=None``; on a CPU device, where nothing is captured, plain calls only), plain calls
   only (``graph=False``) or replays only (``graph=True``); a candidate whose workspace is not
   ``capturable`` (it reads data on the host at every call: the MoE combine's
   ``"sequential"``) in plain calls only. A candidate that raises on any rank
   is left out on every rank (the ranks exchange their errors after each step) and a
   ``RuntimeWarning`` names it and its error; one whose workspace the failure left out of step
   with its peers (broken, e.g. by a peer timeout) is left out of every later decision too, and
   freed at ``close()``. When no candidate runs, the call raises on every rank: a rank whose
   every candidate refused its input raises that error (``ValueError`` / ``TypeError``: the
   error the named transports give; :class:`~portable_overlap.errors.InvalidInputError` for
   data a kernel found invalid), the others a
   :class:`~portable_overlap.errors.PortableOverlapError` naming each candidate's error on
   every rank.
4. **The picks**: per timing mode, the fastest candidate, except that ``"sequential"`` is kept
   when it is within :data:`TIE` of it. A call made under CUDA-graph capture runs the pick of
   the replays, any other call the pick of the plain calls (with one timing mode, both are
   its pick; where that pick is not capturable, the fastest capturable one runs the calls
   made under capture: ``_picks``). The two can differ, as the host's launch costs weigh on
   plain calls only: on 4 H100s, AllGather + GEMM at 8192³ picked the SM stores from plain
   calls, while in graph replays torch's fused op ran faster (0.465 against 0.485 ms). Rank
   0's picks are every rank's (``decide`` broadcasts them), so later calls stay matched across
   ranks.

Decisions live in the context (``ctx.decisions``: cache key -> ``{"transport", "ms",
"failed"}``, and ``"captured": {"transport", "ms"}`` for the replays' pick where both modes
were timed) and, only when a file is named, in that JSON file as well: ``cache_path=``, else
``$PORTABLE_OVERLAP_TUNING_CACHE`` (``schedule.tuning.TuningCache``: atomic replacement, symbolic
links refused, a file that cannot be read or written a warning, writers of one file taking
turns). Without either nothing is written to disk. A file's key (``tuning.cache_key``)
holds the call key, the candidates and their options, the timing mode, the world size, the
device's name and the versions of torch, Triton and this library; ranks may share one file
(they write the same decisions) or each have its own.

A key is decided at its first call on every rank at once: the calls must come in the same
order on every rank (as for every context), and a call must be new on every rank or on none:
where a rank's call key differs from its peers' (its K shard, a transposed weight view, an
optional input only it passes) the keys must change together. Calls that break this rule raise
on every rank in the same call, without a hang:

- **The agreement** (``_settle``): every call whose key is new on this rank, and every call of a
  decided key whose transport (for its capture mode) waits without a deadline (``UNBOUNDED``:
  ``"sequential"``'s NCCL / RCCL / gloo collective, torch's fused ops' barriers, and
  ``"signal_collective"``, whose data moves only in matched collectives), first posts a
  record to the store: new, decided (with the number of its decision), or refused on the host (a
  check before the call: an input that requires grad, per-call options no candidate takes,
  capture of an undecided key, or the input checks of an ``UNBOUNDED`` candidate, run with
  nothing launched (``_refusal``); the rank raises its own error). Where the records do not
  match (a key new on some ranks only, keys of different decisions, a refusal), every rank
  raises in this call, the refusing rank its error and the others :class:`RankMismatchError`
  naming each rank and its call; nothing ran, so the context stays usable. Ranks of one decision
  whose calls run different transports (one captures the call, its peers do not) mismatch too,
  and so do the first calls of a key that differ in the sizes the collective moves
  (``PatternContext._matched_call``: the product's rows, columns and dtype, AllGather + GEMM's
  whole shard, a GEMM pattern's per-call ``config``), which a candidate without a deadline
  would wait on for ever.
- **Decided keys of the fused transports** skip the agreement (no host round trip): a peer not
  in the same call never signals, and their waits end at the context's timeout with
  :class:`PeerTimeoutError`. The peer that waits in the agreement meanwhile gives up at its
  deadline (the context's timeout, at least :data:`EXCHANGE_MIN_S`), claims the slots of the
  ranks that stayed away (a late rank finds the claim instead of joining) and raises
  :class:`PeerTimeoutError` naming the rule and those ranks; its planner is out of step and
  refuses every later call (``ContextBrokenError``), telling a peer that waits in a later
  agreement at once.

The trade-off: an eager call of a decided ``"sequential"`` or ``"torch_fused"`` key makes the
agreement, which a call of the named transport does not: on the call board 0.115-0.194 ms of
host time per call over the named transport on 2-8 emulated ranks of 16 idle cores, against
0.197-0.389 ms through the store's four round trips (``docs/scaling.md``); a CUDA-graph
replay runs none of it (the check ran when the call was captured). The plain calls' timing
counts it, and the host's time to issue a call where that is longer than the device's
(``_measure``), so eager calls pick a fused transport, whose waits have deadlines and need no
agreement, wherever the agreement costs more than the fused transport loses. Where even that
matters, name the transport, or capture the calls.

Graph capture: timing needs host syncs, which capture forbids, so a call under capture whose key
is not decided yet raises ``RuntimeError`` (on every rank: the refusal goes through the
agreement): make one eager call with those shapes first. A decided key's call adds no device
sync and no allocation to the chosen transport's (an ``UNBOUNDED`` one's agreement runs on the
host only, at capture), captured as it would be under that transport's name.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import pickle
import statistics
import threading
import time
import uuid
import warnings
from typing import Optional

import torch

from ..envvars import env_file_path, is_folder_path
from ..errors import (BackendUnavailable, ContextBrokenError, ContextClosedError,
                      PeerTimeoutError, PortableOverlapError, RankMismatchError)
from ..schedule import tuning
from .call_board import CallBoard
from .context import concurrent_use, mark_closed, refuse_call, stream_capturing

AUTO = "auto"
SEQUENTIAL = "sequential"
#: a fused transport is picked over ``"sequential"`` only when it is faster by more than this
#: fraction: the medians of a few timed runs differ by a few percent from run to run, and a
#: pick that is really slower would be the one way ``"auto"`` could lose to the plain path
TIE = 0.03
#: timing rounds per candidate and mode on a GPU, in a rotated order: a GPU's clock falls as it
#: heats, and a fixed order favoured the candidates timed first (on one H100 the same kernel
#: timed 9-13% slower after two others than before them, ``schedule.tuning.time_paths``; on
#: 4 H200s ``"auto"`` kept the SM stores of AllGather + GEMM at 8192³, timed before torch's
#: fused op, at 0.466 ms against torch's 0.439)
ROUNDS = 3
#: the least time a rank waits for its peers to join a call's agreement
#: (``TransportPlanner._agree``): at a key's first call the peers may still compile their kernels
#: for the call before
EXCHANGE_MIN_S = 60.0
#: transports whose waits have no deadline (the collective library's, torch's barriers), or
#: whose data moves only in the collective library's matched calls (``signal_collective``: a
#: rank that refused a call on the host runs none of its collectives, and its peers' calls
#: pair with its next call's, a wrong result before any timeout): a decided call of one of
#: them first agrees with its peers (``TransportPlanner._agree``), since a peer in another
#: call would leave it waiting for ever or pair with the wrong call; the other transports'
#: waits are bounded and raise ``PeerTimeoutError`` where a peer stays away
UNBOUNDED = (SEQUENTIAL, "torch_fused", "signal_collective")
#: transports whose first call of a shape checks that the ranks agree on its plan in a host
#: collective before any of its bounded waits (``signal_copy_engine``): a rank whose input they
#: refuse before that check would leave its peers there, paired with its next call. As the one
#: candidate (``NamedAgreement``) their input checks run before a key's first agreement
PLAN_CHECKED = ("signal_copy_engine",)
#: the keyword arguments ``transport="auto"`` takes (besides ``timeout_s``)
PLANNER_OPTIONS = ("candidates", "options", "cache_path", "iters", "warmup", "graph")


def check_candidates(op: str, transports: tuple, candidates,
                     unavailable: Optional[dict] = None) -> tuple:
    """``candidates`` (None: every transport of ``transports`` not in ``unavailable``; torch's
    fused ops too, whose barriers have no deadline: their calls agree first, as
    ``sequential``'s do, ``UNBOUNDED``) as a tuple in ``transports`` order. ``unavailable``:
    ``{transport: why it cannot run on this world}`` (``PatternContext.unavailable``); naming
    one of them raises :class:`BackendUnavailable` with the reason."""
    unavailable = unavailable or {}
    if candidates is None:
        return tuple(t for t in transports if t not in unavailable)
    bad = isinstance(candidates, (str, bytes)) or not hasattr(candidates, "__iter__")
    names = [] if bad else list(candidates)
    if bad or not names or len(set(names)) != len(names) \
            or any(not isinstance(t, str) or t not in transports for t in names):
        raise ValueError(f"{op}: candidates must be a non-empty collection of distinct transports "
                         f"among {transports}, got {candidates!r}")
    for t in names:
        if t in unavailable:
            raise BackendUnavailable(f"{op}: candidates names {t!r}, which cannot run here: "
                                     f"{unavailable[t]}")
    return tuple(t for t in transports if t in names)


def check_options(op: str, transports: tuple, candidates: tuple, options) -> dict:
    """``options`` (None: none) as {candidate: {its constructor option: value}}."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ValueError(f"{op}: options must be a dict of transport name -> that transport's "
                         f"options, e.g. {{{candidates[0]!r}: {{...}}}}, got {options!r}")
    for name, opts in options.items():
        if name not in candidates:
            what = "not a candidate" if name in transports else "not a transport"
            raise ValueError(f"{op}: options names {name!r}, {what} of this context (candidates "
                             f"{candidates})")
        if not isinstance(opts, dict) or not all(isinstance(k, str) for k in opts):
            raise ValueError(f"{op}: options[{name!r}] must be a dict of keyword arguments, got "
                             f"{opts!r}")
    return {name: dict(opts) for name, opts in options.items()}


def _check_int(op: str, name: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{op}: {name} must be an int >= {lo}, got {value!r}")
    return value


def _check_path(op: str, path) -> Optional[str]:
    if path is None:
        return None
    try:
        path = os.path.expanduser(os.fspath(path))
    except TypeError:
        raise ValueError(f"{op}: cache_path must be the path of a file, got {path!r}") from None
    if not isinstance(path, str) or not path or is_folder_path(path):
        raise ValueError(f"{op}: cache_path must be the path of a file, not a directory, got "
                         f"{path!r}")
    return path


@dataclasses.dataclass(frozen=True)
class Jagged:
    """How a call key sees a jagged input, whose length changes from call to call and from rank
    to rank (the indices of a pooled lookup): by its dtype alone. A key that held the length,
    even rounded, would be new on one rank and decided on its peers whenever one rank's count
    crossed a boundary, which the agreement refuses (keyed by the length rounded up to a power
    of two, the DLRM example on 4 H200s stopped at a step where one rank's count crossed one and
    its peers' did not); the decision of a key is kept for every length
    (``PatternContext._key_inputs``)."""
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> "Jagged":
        return cls(t.dtype)


def _layout(t) -> tuple:
    """What a tensor brings to the call key: shape, dtype, strides (0 for size-1 dimensions).
    Every decided call computes its key: this runs per input per call, so the common case (a
    tensor with no size-1 dimension) builds nothing it does not need."""
    if isinstance(t, torch.Tensor):
        shape, stride = t.shape, t.stride()
        if 1 in shape:
            stride = tuple([0 if n == 1 else s for n, s in zip(shape, stride)])
        return (tuple(shape), t.dtype, stride)
    if isinstance(t, Jagged):
        return ("jagged", t.dtype)
    return (type(t).__name__,)  # refused by every transport: it still needs a key


def _call_key(inputs: dict, given: dict) -> tuple:
    """The call key of a call (module docstring), as a tuple: the per-call lookup's key."""
    key = tuple([None if v is None else _layout(v) for v in inputs.values()])
    if not given:
        return (key, ())
    return (key, tuple(sorted((k, _layout(v) if isinstance(v, torch.Tensor) else repr(v))
                              for k, v in given.items())))


def _describe(v):
    """One value of ``_call_key`` as JSON, for the decision's key (``tuning.cache_key``)."""
    if v is None:
        return None
    if isinstance(v, Jagged):
        return {"shape": "jagged", "dtype": str(v.dtype)}
    if isinstance(v, torch.Tensor):
        shape, dtype, stride = _layout(v)
        return {"shape": list(shape), "dtype": str(dtype), "stride": list(stride)}
    return repr(v)


def _text(call: dict) -> str:
    """The call's inputs in a line, for warnings and errors."""
    parts = [f"{k} {v['shape']} {v['dtype'][6:]}" if isinstance(v, dict) else f"{k} {v}"
             for k, v in call["inputs"].items() if v is not None]
    parts += [f"{k}={v}" for k, v in call["options"].items()]
    return ", ".join(parts)


def _text_of(record: dict) -> str:
    call = record["call"]
    return _text(call) if isinstance(call, dict) else call


def _what(record: dict) -> str:
    """A rank's record of a call's agreement (``TransportPlanner._settle``), in words."""
    kind = record["kind"]
    if kind == "new":
        return f"a call new there ({_text_of(record)})"
    if kind == "decided":
        return (f"a call decided there as {record['transport']!r} (decision "
                f"{record['decision']}: {_text_of(record)}; shared: {record.get('matched')})")
    if kind == "refused":
        return f"a call it refused ({_text_of(record)}): {record['why']}"
    return record.get("why", kind)


def _can_capture(device) -> bool:
    """Whether calls on ``device`` can be captured in a graph: a GPU's can, a CPU's cannot (the
    emulated ranks time plain calls only)."""
    return device.type != "cpu"


def _fastest(ms: dict) -> str:
    """The pick of one timing mode's ``{candidate: ms}``: the fastest, or ``"sequential"`` where
    it is within :data:`TIE` of that."""
    best = min(ms, key=ms.get)
    if SEQUENTIAL in ms and ms[SEQUENTIAL] <= ms[best] * (1 + TIE):
        best = SEQUENTIAL
    return best


def _picks(ms: dict, modes: tuple, capturable) -> dict:
    """A decision's picks from its times, ``ms`` ``{mode: {candidate: ms}}`` for ``modes`` in
    timing order (False: plain calls, True: graph replays): ``{"transport", "ms"}`` of the first
    mode, and ``"captured": {"transport", "ms"}``, the pick of the calls made under graph
    capture, where it is another: the replays' pick where replays were timed, else, where the
    plain calls' pick is not ``capturable`` (it reads data on the host), the fastest of those
    that are. Without a capturable candidate the plain calls' pick stands, and raises its own
    error under capture."""
    first = ms[modes[0]]
    record = {"transport": _fastest(first), "ms": first}
    replays = ms[modes[1]] if len(modes) > 1 else None
    if replays is None and record["transport"] not in capturable:
        replays = {t: v for t, v in first.items() if t in capturable}
    if replays:
        record["captured"] = {"transport": _fastest(replays), "ms": replays}
    return record


def _picked(record, cands: tuple) -> Optional[tuple]:
    """``(plain calls' pick, captured calls' pick)`` of a decision ``record`` (``_picks``), or
    None where it is not a decision among ``cands``: an entry of a cache file edited by hand,
    or naming a transport this build lacks, is made again (``tuning.decide``)."""
    pick = record.get("transport") if isinstance(record, dict) else None
    captured = record.get("captured", {"transport": pick}) if pick in cands else None
    captured = captured.get("transport") if isinstance(captured, dict) else None
    return (pick, captured) if captured in cands else None


def _attempt(fn):
    """``(fn(), None)``, or ``(None, the exception)`` if it raised one."""
    try:
        return fn(), None
    except Exception as e:
        return None, e


def _is_broken(impl) -> bool:
    """Whether a workspace is out of step with its peers (a later call could never match)."""
    try:
        impl.check()  # also clears an error a kernel recorded that left the ranks in step
    except ContextBrokenError:
        return True
    except Exception:
        pass
    return False


class TransportPlanner:
    """The workspaces and decisions of a pattern context ``ctx`` made with ``transport="auto"``
    (module docstring). ``ctx`` provides ``OP``, ``TRANSPORTS``, ``CALL_OPTIONS``,
    ``OUTPUT_OPTIONS``, ``world``, ``_make(world, transport, timeout_s, **options)`` and
    ``_run(transport, workspace, inputs, out, options)``; ``unavailable`` is
    ``{transport: why it cannot run on this world}`` (``PatternContext.unavailable``)."""

    #: whether it chooses by timing (a tuning cache file); the errors name it by ``_label``
    TIMES = True
    _label = f"transport={AUTO!r}"

    def __init__(self, ctx, timeout_s: Optional[float], unavailable: dict, *, candidates=None,
                 options=None, cache_path=None, iters: int = 10, warmup: int = 2,
                 graph: Optional[bool] = None, **rest):
        op, world = ctx.OP, ctx.world
        if rest:
            raise ValueError(
                f"{op}: transport='auto' takes {', '.join(PLANNER_OPTIONS)} and timeout_s; a "
                f"transport's own options go in options={{name: {{...}}}} (e.g. options="
                f"{{{ctx.TRANSPORTS[0]!r}: {{...}}}}), got {', '.join(sorted(rest))}")
        self.ctx = ctx
        self.candidates = check_candidates(op, ctx.TRANSPORTS, candidates, unavailable)
        self.options = check_options(op, ctx.TRANSPORTS, self.candidates, options)
        self.iters = _check_int(op, "iters", iters, 1)
        self.warmup = _check_int(op, "warmup", warmup, 0)
        if graph is not None and not isinstance(graph, bool):
            raise ValueError(f"{op}: graph must be None (time plain calls and graph replays, "
                             f"each picking for its own calls), True or False, got {graph!r}")
        self.graph = graph
        # a cache refused on some ranks only (a folder there, a per-rank variable) is raised
        # after the ranks compared their settings, not before while the peers wait in the
        # comparison; its file is read here, before anything is allocated
        try:
            path = (_check_path(op, cache_path) or env_file_path(tuning.CACHE_VAR)
                    if self.TIMES else None)
            cache = tuning.TuningCache(path) if path else None
            path_error = None
        except Exception as e:
            cache, path_error = None, e
        world.check_same(f"{op} transport='auto' settings (candidates, iters, warmup, graph; "
                         f"the tuning cache path's error)",
                         (self.candidates, self.iters, self.warmup, self.graph,
                          None if path_error is None else str(path_error)))
        if path_error is not None:
            raise path_error
        # the name of this planner's decisions in the process group's store, the same on every
        # rank (_agree), and how many agreements this rank has begun
        self._sync_id = world.broadcast_object(uuid.uuid4().hex if world.rank == 0 else None)
        self._begun = 0
        # where the agreements go: shared host memory where every rank runs on one machine
        # (microseconds), else the store (four round trips to its server: 0.275 ms on 4 H200s)
        self._board = CallBoard.make(world, self._store_key)
        self._broken: Optional[str] = None
        #: cache key -> decision, for the keys this context measured or found in its file
        self.decisions: dict = {}
        self.cache = cache if cache is not None else tuning.MemoryCache(self.decisions)
        #: call key (tuple) -> (transport, its decision's agreement number, the call in words): the
        #: per-call lookup
        self._chosen: dict = {}
        self._lock = threading.Lock()
        self._closed = False
        self.retired: list = []  # broken candidates' workspaces, freed at close()
        self.impls: dict = {}
        try:
            for t in self.candidates:
                self.impls[t] = ctx._make(world, t, timeout_s, **self.options.get(t, {}))
        except BaseException:
            self._close_all()
            raise

    # -- the call --------------------------------------------------------------------------------
    def __call__(self, inputs: dict, out, options: dict):
        """Run the call (``inputs`` by name in the op's schema order, ``out``, the per-call
        ``options``, None meaning not given) on its key's transport, deciding it first."""
        # (the body of ``_call`` inline: a decided call's own cost on the host is what an eager
        # decode step waits for, and the generator of a context manager adds a few µs to it)
        given, fast = self._open_call(inputs, options)
        try:
            chosen = self._chosen.get(fast)
            if chosen is None:
                transport = self._decide(fast, inputs, out, given)
            else:
                transport = self._now(chosen)
                if transport in UNBOUNDED and self.ctx.world.world_size > 1:
                    self._settle_decided(transport, chosen[1], chosen[2], inputs, out, given)
            return self.ctx._run(transport, self.impls[transport], inputs, out, given)
        finally:
            self._lock.release()

    def _settle_decided(self, transport: str, decision: int, text: str, inputs: dict, out,
                        given: dict) -> None:
        """What a decided call of an ``UNBOUNDED`` transport does before it runs: this rank's
        input checks with nothing run (``_refusal``), then the call's agreement (``_settle``)."""
        refusal = self._refusal((transport,), inputs, out, given)
        # with what every rank's call must share (``_matched_call``), as a key's first call
        # agrees on it: a decision's key leaves out what may differ across ranks but must
        # not (whether autograd records the call: ``_call_shares``)
        self._settle({"kind": "decided", "decision": decision, "transport": transport,
                      "call": text, "matched": self.ctx._call_shares(inputs, given)}
                     if refusal is None
                     else {"kind": "refused",  # (the refused call's own words)
                           "call": _text(self._describe_call(inputs, given)),
                           "why": f"{type(refusal).__name__}: {refusal}"}, refusal)

    def refuse(self, inputs: dict, options: dict, error: BaseException) -> None:
        """Raise ``error``, found by a check made before the call reached the planner
        (``PatternContext.check_grad``), as this call's refusal, which its peers hear of: as a
        refused call of the decided transport's workspace where that transport's waits are
        bounded (``refuse_call``), else through the call's agreement (``_settle``), so every
        rank raises in this same call."""
        with self._call(inputs, options) as (given, fast):
            chosen = self._chosen.get(fast)
            if chosen is not None and self._now(chosen) not in UNBOUNDED:
                refuse_call([self.impls[self._now(chosen)]], error)
            text = _text(self._describe_call(inputs, given))  # (this call, not its key's first)
            self._settle({"kind": "refused", "why": f"{type(error).__name__}: {error}",
                          "call": text}, error)

    def _refusal(self, transports: tuple, inputs: dict, out, given: dict, first: bool = False):
        """The error this rank's input meets in the first of ``transports`` whose waits have no
        deadline (``UNBOUNDED``; at a key's ``first`` call also the one candidate of
        ``PLAN_CHECKED``), found by that transport's own checks with nothing run
        (``ContextBase.checking_only``), or None. Found before the call's agreement, it is this
        rank's refusal there: the peers raise in the same call instead of waiting in the
        collective library for a rank that never comes (timing those candidates at a key's
        first call would wait so too)."""
        checked = UNBOUNDED + (PLAN_CHECKED if first and len(transports) == 1 else ())
        # ``signal_collective``'s checks last: they are its GEMM's (a K stride that fits its
        # tiles), stricter than the library's or torch's own, and would refuse for every
        # candidate a call only it cannot take
        for t in sorted(transports, key=lambda t: t == "signal_collective"):
            if t in checked:
                impl = self.impls[t]
                impl.checking_only = True
                try:
                    self.ctx._run(t, impl, inputs, out, given)
                except (ValueError, TypeError) as e:  # what every transport's checks raise
                    return e
                except Exception:  # not the input's fault: the call itself meets it again
                    return None
                finally:
                    impl.checking_only = False
                return None
        return None

    def _open_call(self, inputs: dict, options: dict) -> tuple:
        """The start of one call of the planner: its given options and call key, with the
        planner's lock taken (a second thread's concurrent call raises) on an open, unbroken
        planner. The caller releases the lock."""
        given = {k: v for k, v in options.items() if v is not None} if options else {}
        fast = self._key(inputs, given)
        if not self._lock.acquire(blocking=False):
            raise concurrent_use(self.ctx.OP, self.ctx.rank)
        try:
            self._check_call()
        except BaseException:
            self._lock.release()
            raise
        return given, fast

    @contextlib.contextmanager
    def _call(self, inputs: dict, options: dict):
        """:meth:`_open_call` as a context manager: ``(given, fast)``, the lock released at
        the end."""
        given, fast = self._open_call(inputs, options)
        try:
            yield given, fast
        finally:
            self._lock.release()

    def choice(self, inputs: dict, out, options: dict) -> Optional[str]:
        """The transport that runs calls like this one made now (under graph capture, the
        replays' pick); None while it is not decided."""
        chosen = self._lookup(inputs, options)
        return None if chosen is None else self._now(chosen)

    def choices(self, inputs: dict, out, options: dict) -> Optional[dict]:
        """``{"plain": pick for plain calls, "captured": pick for calls under graph capture}``
        of calls like this one; None while they are not decided."""
        chosen = self._lookup(inputs, options)
        return None if chosen is None else {"plain": chosen[0], "captured": chosen[3]}

    def _lookup(self, inputs: dict, options: dict) -> Optional[tuple]:
        return self._chosen.get(self._key(inputs, {k: v for k, v in options.items()
                                                   if v is not None}))

    def _key(self, inputs: dict, given: dict) -> tuple:
        """The per-call lookup's key of a call with these inputs and given options."""
        return _call_key(self.ctx._key_inputs(inputs), given)

    def _now(self, chosen: tuple) -> str:
        """The transport of a decided call made now: ``chosen`` is (plain calls' pick, decision,
        call in words, captured calls' pick); the capture query only where the picks differ."""
        if chosen[0] == chosen[3] or not stream_capturing(self.ctx.world.device):
            return chosen[0]
        return chosen[3]

    def _takes(self, transport: str, given: dict) -> bool:
        accepted = self.ctx.CALL_OPTIONS.get(transport, {})
        return all(k in accepted and isinstance(v, accepted[k]) for k, v in given.items())

    def _describe_call(self, inputs: dict, given: dict) -> dict:
        return {"inputs": {k: _describe(v) for k, v in self.ctx._key_inputs(inputs).items()},
                "options": {k: _describe(v) for k, v in sorted(given.items())}}

    def _candidates_for(self, given: dict) -> tuple:
        """The candidates that take the call's per-call options; raises where none can run it."""
        ctx, op = self.ctx, self.ctx.OP
        if not self.candidates:
            raise ContextBrokenError(f"{op}: every candidate transport of this context failed "
                                     f"out of step with its peers; close it and create a new "
                                     f"one")
        cands = tuple(t for t in self.candidates if self._takes(t, given))
        if not cands:
            takes = "; ".join(f"{t}: {', '.join(sorted(ctx.CALL_OPTIONS.get(t, {}))) or 'none'}"
                              for t in self.candidates)
            raise ValueError(f"{op}: no candidate transport takes the per-call options "
                             f"{', '.join(f'{k}={v!r}' for k, v in sorted(given.items()))} "
                             f"(per-call options each candidate takes: {takes})")
        if len(cands) > 1 and stream_capturing(self.ctx.world.device):
            raise RuntimeError(
                f"{op}: transport='auto' has not decided the transport for this call's shapes "
                f"yet, and deciding times every candidate, which graph capture does not allow: "
                f"make one eager call with these shapes before capturing")
        return cands

    def _decide(self, fast: tuple, inputs: dict, out, given: dict) -> str:
        world, op = self.ctx.world, self.ctx.OP
        call = self._describe_call(inputs, given)
        cands, refusal = _attempt(lambda: self._candidates_for(given))
        if refusal is None:  # what would refuse it inside a candidate without a deadline
            refusal = self._refusal(cands, inputs, out, given, first=True)
        mine = ({"kind": "refused", "why": f"{type(refusal).__name__}: {refusal}",
                 "call": _text(call)} if refusal is not None
                else {"kind": "new", "call": call, "candidates": cands,
                      "matched": self.ctx._call_shares(inputs, given)})
        decision, records = self._settle(mine, refusal)
        if any(r["candidates"] != cands for r in records):
            raise RankMismatchError(
                f"{op}: the ranks' calls leave different candidate transports (their per-call "
                f"options differ): " + "; ".join(
                    f"rank {q}: {r['candidates']} ({_text(r['call'])})"
                    for q, r in enumerate(records)) + " (nothing ran; the context stays usable)")
        # the sizes the collective moves must be every rank's (a rank whose input is not the
        # op's, None here, meets its transports' own checks next): where they differ, the
        # candidates without a deadline would wait in the collective library for ever, or
        # move another rank's sizes
        matched = [r["matched"] for r in records if r["matched"] is not None]
        if any(m != matched[0] for m in matched):
            raise RankMismatchError(
                f"{op}: the ranks' calls differ in what every rank's must share: " + "; ".join(
                    f"rank {q}: {r['matched']}" for q, r in enumerate(records))
                + f" (this rank's call: {_text(call)}; nothing ran; the context stays usable)")
        text = _text(call)
        if len(cands) == 1:  # nothing to choose: no timing, nothing cached
            self._chosen[fast] = (cands[0], decision, text, cands[0])
            return cands[0]
        # one key for every rank, from every rank's call: the reduction patterns' K shards may
        # differ across ranks, and ranks sharing a cache file then write the same entries
        calls = [r["call"] for r in records]
        shape = {"call": call if all(c == call for c in calls) else calls, "graph": self.graph,
                 "candidates": {t: repr(sorted(self.options.get(t, {}).items())) for t in cands}}
        dtype = next((v.dtype for v in inputs.values() if isinstance(v, torch.Tensor)), None)
        key = tuning.cache_key(op, shape, dtype, world.world_size, world.facts.name,
                               world.host_layout())
        record = tuning.decide(world, key,
                               lambda: self._measure(cands, inputs, given, call, out is not None,
                                                     decision),
                               self.cache, valid=lambda r: _picked(r, cands) is not None)
        pick, captured = _picked(record, cands)
        self.decisions[key] = record
        self._chosen[fast] = (pick, decision, text, captured)
        return pick  # (not under capture: an undecided call is refused there)

    def _settle(self, mine: dict, error: Optional[BaseException] = None) -> tuple:
        """This call's agreement (``_agree``) on ``mine``: ``{"kind": "new"}`` (a call key this
        rank has not decided), ``{"kind": "decided", "decision": n}`` (a key of the n-th
        agreement's decision, run by an ``UNBOUNDED`` transport) or ``{"kind": "refused"}``
        (this rank raises ``error``), each with ``"call"`` (the call, for the errors). Returns
        the agreement's number and every rank's record when the calls match: new on every rank,
        or of the same decision on every rank. Otherwise every rank raises in this same call,
        the refusing ranks their own error, the others :class:`RankMismatchError` naming each
        rank's call; nothing ran, so the ranks stay in step and the context usable."""
        op = self.ctx.OP
        n, records = self._agree(mine, error)
        if error is not None:
            raise error
        broken = [(q, r) for q, r in enumerate(records) if r["kind"] == "broken"]
        if broken:
            self._broken = (f"{op}: {self._label} is out of step with its peers: rank(s) "
                            f"{[q for q, _ in broken]} refused this call, being out of step "
                            f"already (" + "; ".join(r["why"] for _, r in broken) + ")")
            raise ContextBrokenError(self._broken + "; close it and create a new one")
        refused = [(q, r) for q, r in enumerate(records) if r["kind"] == "refused"]
        if refused:
            raise RankMismatchError(f"{op}: " + "; ".join(
                f"rank {q} refused this call ({_text_of(r)}): {r['why']}" for q, r in refused)
                + " (nothing ran; the context stays usable)")
        if len({(r["kind"], r.get("decision"), r.get("transport"),
                 repr(r.get("matched")) if r["kind"] == "decided" else None)
                for r in records}) > 1:
            calls = "; ".join(f"rank {q}: {_what(r)}" for q, r in enumerate(records))
            raise RankMismatchError(
                f"{op}: the ranks' calls of {self._label} do not match: {calls}. A call key "
                f"(shapes, dtypes, strides, optional inputs, per-call options) must be new on "
                f"every rank or on none, and a decided one must come with its peers' keys of "
                f"the same decision (nothing ran; the context stays usable)")
        return n, records

    def _agree(self, mine: dict, error: Optional[BaseException] = None) -> tuple:
        """Every rank's ``mine`` for this call, posted to the call board where every rank runs
        on one machine (``call_board.CallBoard``: shared host memory), else to the process
        group's store, with a deadline (the context's timeout, at least
        :data:`EXCHANGE_MIN_S`) rather than a collective: a peer that is not in this step (it
        runs a decided transport whose waits are bounded, or it refused the call without
        telling) would leave a collective waiting for ever. Returns the step's number (the
        same on every rank) and the records. A rank posts its record only where its slot is
        empty; a rank whose wait ends claims the empty slots of the peers that stayed away, so
        a late peer finds the claim instead of joining a step its peers gave up: both sides
        raise :class:`PeerTimeoutError` and the planner is out of step (every later call
        raises)."""
        world, op = self.ctx.world, self.ctx.OP
        n, self._begun = self._begun, self._begun + 1
        if world.world_size == 1:
            return n, [mine]
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        payload = pickle.dumps(mine)
        here = _what(mine) + (f"; this rank refused it: {type(error).__name__}: {error}"
                              if error is not None else "")
        got = self._post(store, n, world.rank, payload)
        if got != payload:
            late = pickle.loads(got)
            if late.get("kind") != "gave up":  # (the board: this slot went past this call)
                self._broken = f"{op}: {self._label} is out of step with its peers"
                raise ContextBrokenError(f"{self._broken} ({late.get('why')}); close it and "
                                         f"create a new one")
            self._broken = (f"{op}: {self._label} is out of step with its peers: rank "
                            f"{late['by']} stopped waiting for this rank at a call")
            raise PeerTimeoutError(
                f"{op}: rank {world.rank}: rank {late['by']} stopped waiting for this rank to "
                f"agree on this call ({here}) after {late['waited']:.0f} s: the ranks' calls "
                f"were not matched (a call key must be new on every rank or on none). Close the "
                f"context and make a new one.")
        wait_s = max(EXCHANGE_MIN_S, self.timeout_s)
        values, missing, why = self._collect(store, n, wait_s)
        if missing:
            self._broken = (
                f"{op}: {self._label} is out of step with its peers: rank(s) {missing} "
                f"did not join the agreement of a call on rank {world.rank}")
            raise PeerTimeoutError(
                f"{op}: rank {world.rank}: rank(s) {missing} did not join this call's "
                f"agreement within {wait_s:.0f} s (this rank's call: {here}): a call must "
                f"be new on every rank or on none, so a call key that differs across ranks "
                f"(shapes, dtypes, strides, optional inputs, per-call options) must change "
                f"on every rank together; the missing ranks may run a decided transport "
                f"(which then raises at its own bounded waits). Close the context and make "
                f"a new one. ({why})")
        # (a peer's record that reads as this rank's own is this rank's record: matched calls,
        # the common case, unpickle nothing)
        records = [mine if v == payload else pickle.loads(v) for v in values]
        gave_up = [r["by"] for r in records if r["kind"] == "gave up"]
        if gave_up:
            self._broken = (f"{op}: {self._label} is out of step with its peers: rank(s) "
                            f"{sorted(set(gave_up))} stopped waiting at a call")
            raise PeerTimeoutError(
                f"{op}: rank {world.rank}: rank(s) {sorted(set(gave_up))} stopped waiting for a "
                f"peer to agree on this call ({here}): the ranks' calls were not matched. Close "
                f"the context and make a new one.")
        # every peer posted step n, so it has read step n - 1: this rank's key is free
        if self._board is None:
            if n:
                store.delete_key(self._store_key(n - 1, world.rank))
        else:
            self._board.release(n, store)
        return n, records

    def _store_key(self, n: int, q: int) -> str:
        """Rank ``q``'s record of agreement ``n`` in the process group's store."""
        return f"portable_overlap/auto/{self._sync_id}/{n}/{q}"

    def _post(self, store, n: int, q: int, record: bytes) -> bytes:
        """Post ``record`` as rank ``q``'s record of agreement ``n`` unless one is there (a
        peer's claim, or the rank's own); returns the record there afterwards."""
        if self._board is None:
            return store.compare_set(self._store_key(n, q), "", record)
        state, held = self._board.compare_set(q, n, record, store)
        return held if state == "here" else self._went_past(q, held)

    def _went_past(self, q: int, record: bytes) -> bytes:
        """What the board's record of a later agreement in rank ``q``'s slot says about this
        one: ``q`` went on without it, so it is out of step (it posted ``"broken"`` at its
        later calls, or gave up on a peer)."""
        later = pickle.loads(record)
        why = later.get("why") if later.get("kind") == "broken" else None
        return pickle.dumps({"kind": "broken", "why": why or f"rank {q} went on to a later "
                                                             f"call without this one"})

    def _collect(self, store, n: int, wait_s: float) -> tuple:
        """Every rank's record of agreement ``n``, waiting for them up to ``wait_s``; past it,
        the empty slots are claimed. Returns ``(records, the ranks whose slot this rank
        claimed, why the wait ended)``."""
        W = self.ctx.world.world_size
        claim = pickle.dumps({"kind": "gave up", "by": self.ctx.world.rank, "waited": wait_s})
        if self._board is None:
            keys = [self._store_key(n, q) for q in range(W)]
            try:
                store.wait(keys, datetime.timedelta(seconds=wait_s))
            except Exception as e:  # the store's timeout error (its type varies by torch version)
                missing = [q for q, k in enumerate(keys)
                           if store.compare_set(k, "", claim) == claim]
                if missing:
                    return None, missing, f"{type(e).__name__}: {e}"
            getter = getattr(store, "multi_get", None)
            return (getter(keys) if getter else [store.get(k) for k in keys]), [], ""
        board = self._board
        values = [None] * W
        start = time.monotonic()
        while True:
            for q in range(W):
                if values[q] is None:
                    state, record = board.get(q, n, store)
                    if state != "none":
                        values[q] = record if state == "here" else self._went_past(q, record)
            if all(v is not None for v in values):
                return values, [], ""
            waited = time.monotonic() - start
            if waited > wait_s:
                break
            # only yield the core for the first 2 ms (the peers of a matched call post within
            # tens of microseconds of each other), then sleep up to a millisecond at a time (a
            # peer compiling for its first call)
            time.sleep(0 if waited < 2e-3 else min(1e-3, waited / 16))
        missing = []
        for q in range(W):
            if values[q] is None:
                held = self._post(store, n, q, claim)
                if held == claim:
                    missing.append(q)
                values[q] = held
        return values, missing, f"no record on the call board within {wait_s:.0f} s"

    def _measure(self, cands: tuple, inputs: dict, given: dict, call: dict,
                 into_out: bool, decision: int) -> dict:
        """Collective: every candidate run and timed on this call's inputs (module docstring),
        each timed run into an output of its own where the call passes ``out`` (``into_out``),
        else making its result as the call will: a transport may return a result of its own
        faster than it fills a given tensor (torch's fused ops copy theirs into ``out``). A
        plain call of an ``UNBOUNDED`` candidate is timed with what its decided calls will do
        before they run (``_settle_decided``: the input checks and the agreement), which its
        graph replays do not: on 4 H200s the agreement through the store added 0.275 ms to an
        eager ``"sequential"`` GEMV + AllReduce call of 0.081 ms, and without it eager decode
        picked torch's path and ran at 0.57× the unfused layer (``docs/scaling.md``). Plain
        calls are timed host-bound (``tuning.time_call(host_bound=True)``): the stream's hold
        before every ten runs would hide that host time from the device's events."""
        ctx, world, op = self.ctx, self.ctx.world, self.ctx.OP
        # outputs passed as options get scratch tensors too: timing writes nothing of the user's
        opts = {k: torch.empty_like(v) if k in ctx.OUTPUT_OPTIONS and isinstance(v, torch.Tensor)
                else v for k, v in given.items()}
        # the timing modes: plain calls (False), graph replays (True); on a GPU, ROUNDS rounds
        # in a rotated order (tuning.rotated_rounds)
        gpu = _can_capture(world.device)
        modes = ((False, True) if gpu else (False,)) if self.graph is None else (self.graph,)
        rounds = ROUNDS if gpu else 1
        runs, failed, mine, text = {}, {}, {}, _text(call)
        # (a candidate that reads data on the host at every call is timed in plain calls only)
        capturable = {t for t in cands if getattr(self.impls[t], "capturable", True)}
        for t in cands:
            impl = self.impls[t]

            def run(out, t=t, impl=impl):
                return ctx._run(t, impl, inputs, out, opts)

            def probe(impl=impl, run=run):  # loads kernels, plans; its result is the scratch
                res = run(None)
                impl.synchronize()
                return res if isinstance(res, torch.Tensor) else res[0]

            scratch = self._agreed(t, probe, failed, mine)
            if t not in failed:
                runs[t] = (impl, run, scratch)
        ms = {m: {t: [] for t in runs} for m in modes}
        for mode in modes:
            for order in tuning.rotated_rounds(list(runs), rounds):
                for t in order:
                    # (one that failed in a mode is picked in none)
                    if t in failed or (mode and t not in capturable):
                        continue
                    impl, run, scratch = runs[t]

                    def one(t=t, run=run, scratch=scratch, mode=mode):
                        res = scratch if into_out else None
                        if t in UNBOUNDED and not mode:
                            self._settle_decided(t, decision, text, inputs, res, opts)
                        return run(res)

                    def timed(impl=impl, one=one, mode=mode):
                        ms_ = tuning.time_call(one, world, iters=self.iters,
                                               warmup=self.warmup, graph=mode, host_bound=True)
                        impl.synchronize()
                        return ms_

                    value = self._agreed(t, timed, failed, mine)
                    if t not in failed:
                        ms[mode][t].append(value)
        # each candidate's median over its rounds (the same on every rank: each round's value
        # is the slowest rank's)
        ms = {m: {t: statistics.median(v) for t, v in per.items() if t not in failed and v}
              for m, per in ms.items()}
        broken = {t for t in failed if _is_broken(self.impls[t])}
        broken = [t for t in cands if any(t in b for b in world.all_gather_object(broken))]
        for t in broken:
            self._retire(t)
        if not ms[modes[0]]:
            errs = [mine[t] for t in cands if t in mine]
            if errs and all(isinstance(e, (ValueError, TypeError)) for e in errs):
                raise errs[0]  # this rank's input was refused: a named transport's error
            # (a PortableOverlapError: on a rank whose own runs passed, what failed was a peer's,
            # e.g. the routing data a peer's kernel found invalid)
            raise PortableOverlapError(
                f"{op}: no candidate transport could run this call ({_text(call)}): "
                + "; ".join(f"{t}: {failed[t]}" for t in failed)) from (errs[0] if errs else None)
        for t, why in failed.items():
            later = (" and from every later one (its workspace is out of step with its peers)"
                     if t in broken else "")
            warnings.warn(f"{op}: transport {t!r} raised while transport='auto' timed it for "
                          f"this call ({_text(call)}); it is left out of this decision{later}: "
                          f"{why}", RuntimeWarning, stacklevel=2)
        return {**_picks(ms, modes, capturable), "failed": failed}

    def _agreed(self, transport: str, step, failed: dict, mine: dict):
        """``step()`` on every rank; its value, or the failure recorded (``failed``: every rank's
        error text, ``mine``: this rank's exception) when it raised on any rank."""
        value, err = _attempt(step)
        errors = self.ctx.world.all_gather_object(
            None if err is None else f"{type(err).__name__}: {err}")
        if any(errors):
            failed[transport] = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
            if err is not None:
                mine[transport] = err
        return value

    def _retire(self, transport: str) -> None:
        """Leave a broken candidate out from now on (every rank retires the same ones)."""
        self.retired.append(self.impls.pop(transport))
        self.candidates = tuple(t for t in self.candidates if t != transport)
        self._chosen = {k: c for k, c in self._chosen.items() if transport not in (c[0], c[3])}

    # -- the workspaces --------------------------------------------------------------------------
    @property
    def timeout_s(self) -> float:
        """The longest of the candidates' timeouts: how long a call waits at most before a
        missing peer raises."""
        return max(impl.timeout_s for impl in [*self.impls.values(), *self.retired])

    def _check_call(self) -> None:
        """``_check_open`` at a call. A broken planner first posts its state at the call's
        agreement (``_settle``), so a peer waiting there raises at once, not at its deadline."""
        if self._broken is not None and not self._closed and self.ctx.world.world_size > 1:
            import torch.distributed as dist

            n, self._begun = self._begun, self._begun + 1
            try:
                self._post(dist.distributed_c10d._get_default_store(), n,
                           self.ctx.world.rank, pickle.dumps({"kind": "broken",
                                                              "why": self._broken}))
            except Exception:  # (the store gone: the peers wait until their deadline)
                pass
        self._check_open()

    def _check_open(self) -> None:
        if self._closed:
            raise ContextClosedError(f"{self.ctx.OP}: this context was closed on rank "
                                     f"{self.ctx.rank}; create a new one")
        if self._broken is not None:
            raise ContextBrokenError(self._broken + "; close it and create a new one")

    def check(self) -> None:
        """Every candidate's check (an error a kernel of an earlier call recorded)."""
        self._check_open()
        for impl in self.impls.values():
            impl.check()

    def synchronize(self) -> None:
        """Every candidate's synchronize: its work on the device, then its check."""
        self._check_open()
        for impl in self.impls.values():
            impl.synchronize()

    def close(self) -> None:
        """Collective: free every workspace, the candidates' in ``TRANSPORTS`` order, then the
        retired ones (the same order on every rank). Closing twice does nothing."""
        # (after a call another thread is making: ``mark_closed``)
        if self._closed or not mark_closed(self, self._lock,
                                           max(self.timeout_s, EXCHANGE_MIN_S),
                                           self.ctx.OP, self.ctx.rank):
            return
        self._close_all()

    def _close_all(self) -> None:
        first = None
        if self._board is not None:
            self._board.close()
            self._board = None
        for impl in [*self.impls.values(), *self.retired]:
            try:
                impl.close()
            except Exception as e:  # the others are still freed
                first = first or e
        if first is not None:
            raise first


class NamedAgreement(TransportPlanner):
    """The calls of one named transport made through the agreement of ``"auto"``'s calls
    (``PatternContext.AGREED``), with that transport as the one candidate: nothing is timed or
    cached. A key's first call agrees (a refusal on the host, this transport's input checks
    included, raises on every rank in that call), and so does every call where the transport
    waits without a deadline (``UNBOUNDED``)."""

    TIMES = False

    def __init__(self, ctx, timeout_s: Optional[float], unavailable: dict, transport: str,
                 options: dict):
        self._label = f"transport={transport!r}"
        super().__init__(ctx, timeout_s, unavailable, candidates=(transport,),
                         options={transport: options} if options else None)

    def _key(self, inputs: dict, given: dict) -> tuple:
        """Calls are keyed as the transports' plans are: by the sizes every rank's call shares
        (``_matched_call``: not a reduction's K shard, which may differ across ranks) and the
        per-call options. A call is then new where its plan is, on every rank at once, also
        where one rank's input is refused by a check of its own (an empty K, a bad ``out``):
        that rank agrees where its peers do (the plan's first call, and every call of an
        ``UNBOUNDED`` transport) and refuses on the device where they run a planned call of a
        transport with bounded waits. An input that is not the op's (no sizes to key by) takes
        the key decided last, so its refusal goes the same way: at a planned shape its peers'
        calls fail at once (at a shape's first call of ``PLAN_CHECKED`` transport, they wait
        in the agreement while it refuses on the device, and both sides time out:
        ``docs/reliability.md``)."""
        # a per-call option the transport does not take (by name or type) is keyed as if not
        # given: the call is refused (``__call__``) as its peers' call of that key
        named = self.candidates[0] if self.candidates else None
        taken = {k: v for k, v in given.items() if self._takes(named, {k: v})}
        matched = self.ctx._call_shares(inputs, taken)
        if matched is None and self._chosen:
            return next(reversed(self._chosen))
        return (None if matched is None else tuple(sorted(matched.items())),
                _call_key({}, taken)[1])

    def __call__(self, inputs: dict, out, options: dict):
        """The call; one with a per-call option the transport does not take is refused as a
        call of the key its peers' call has (``refuse``): on the device where the transport's
        waits are bounded and the key is planned, else through the agreement. Keyed by that
        option, it was new on this rank alone while its peers ran a planned call of
        ``signal_copy_engine`` without an agreement: both sides timed out and broke."""
        given = {k: v for k, v in options.items() if v is not None} if options else {}
        if given and self.candidates and not self._takes(self.candidates[0], given):
            named = self.candidates[0]
            # a transport without per-call options (``"sequential"``) refuses them in its own
            # words, as it does where its calls do not agree first
            error = (None if named in self.ctx.CALL_OPTIONS
                     else self._refusal((named,), inputs, out, given))
            if error is None:
                _, error = _attempt(lambda: self._candidates_for(given))
            self.refuse(inputs, options, error)
        return super().__call__(inputs, out, options)
