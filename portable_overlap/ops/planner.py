"""``transport="auto"`` of the multi-transport pattern contexts (pattern.py): the context makes
the workspace of every candidate transport, times them all at the first eager call of each new
call key, keeps the fastest, and runs it at every later call with that key.

The call key: the op, each input's shape, dtype and strides (a size-1 dimension's stride left
out: it moves nothing), which optional inputs (bias, residual) are given, and the per-call
options with their values (tensors by shape, dtype and strides).

What the first call of a key does (collective; the same on every rank):

1. **The call's candidates**: the context's (``candidates=``, default: every transport of
   ``TRANSPORTS`` that can run on this world, ``PatternContext.unavailable``) that take each
   per-call option given, by name and type (the pattern's ``CALL_OPTIONS``; a transport not
   listed there takes none). One candidate runs at once, untimed; none is a ``ValueError``.
2. **The decision's key**: every rank's call key, exchanged through the process group's store
   with a deadline (one key on every rank, also where the shapes differ across ranks, as the
   reduction patterns' K shards may; a peer that never joins is below), then
   ``schedule.tuning.decide``: a decision every rank's cache holds is used as it is (no
   timing); otherwise every rank measures.
3. **Measuring**: each candidate in ``TRANSPORTS`` order runs once on the call's own inputs,
   into an output of its own (the user's ``out`` is written only by the chosen transport,
   after the decision), then ``schedule.tuning.time_call`` times ``warmup`` + ``iters`` more
   runs (the slowest rank's median; with ``graph=True`` CUDA-graph replays). A candidate that
   raises on any rank is left out on every rank (the ranks exchange their errors after each
   step) and a ``RuntimeWarning`` names it and its error; one whose workspace the failure left
   out of step with its peers (broken, e.g. by a peer timeout) is left out of every later
   decision too, and freed at ``close()``. When no candidate runs, the call raises: this rank's
   error if every candidate refused its input (``ValueError`` / ``TypeError``: the error the
   named transports give), else a ``RuntimeError`` naming each candidate's error.
4. **The pick**: the fastest candidate, except that ``"sequential"`` is kept when it is within
   :data:`TIE` of it. Rank 0's pick is every rank's (``decide`` broadcasts it), so later calls
   stay matched across ranks.

Decisions live in the context (``ctx.decisions``: cache key -> ``{"transport", "ms",
"failed"}``) and, only when a file is named, in that JSON file as well: ``cache_path=``, else
``$PORTABLE_OVERLAP_TUNING_CACHE`` (``schedule.tuning.TuningCache``: atomic replacement, symbolic
links refused). Without either nothing is written to disk. A file's key (``tuning.cache_key``)
holds the call key, the candidates and their options, the timing mode, the world size, the
device's name and the versions of torch, Triton and this library; ranks may share one file
(they write the same decisions) or each have its own.

A key is decided at its first call on every rank at once: the calls must come in the same
order on every rank (as for every context), and a call must be new on every rank or on none:
where a rank's call key differs from its peers' (its K shard, a transposed weight view, an
optional input only it passes) the keys must change together. A call new on some ranks only
finds its peers running their decided transport instead of joining the decision: the
decision's first exchange goes through the process group's store with a deadline (the
context's timeout, at least :data:`EXCHANGE_MIN_S`), so those ranks raise
:class:`PeerTimeoutError` naming the rule and the ranks that stayed away, and refuse every
later call (``ContextBrokenError``); the peers' call fails at its own bounded waits (a fused
transport's flags; ``"sequential"``'s collective at the process group's timeout).

Graph capture: timing needs host syncs, which capture forbids, so a call under capture whose key
is not decided yet raises ``RuntimeError``: make one eager call with those shapes first. A
decided key's call is a call of the chosen transport with nothing added (no host sync, no
allocation), captured as it would be under that transport's name.
"""
from __future__ import annotations

import datetime
import os
import pickle
import threading
import uuid
import warnings
from typing import Optional

import torch

from ..envvars import env_file_path
from ..errors import (BackendUnavailable, ContextBrokenError, ContextClosedError,
                      PeerTimeoutError)
from ..schedule import tuning
from .context import concurrent_use, stream_capturing

AUTO = "auto"
SEQUENTIAL = "sequential"
#: a fused transport is picked over ``"sequential"`` only when it is faster by more than this
#: fraction: the medians of a few timed runs differ by a few percent from run to run, and a
#: pick that is really slower would be the one way ``"auto"`` could lose to the plain path
TIE = 0.03
#: the least time a rank waits for its peers to join a decision (``TransportPlanner._exchange``):
#: at a key's first call the peers may still compile their kernels for the call before
EXCHANGE_MIN_S = 60.0
#: the keyword arguments ``transport="auto"`` takes (besides ``timeout_s``)
PLANNER_OPTIONS = ("candidates", "options", "cache_path", "iters", "warmup", "graph")


class MemoryCache:
    """``tuning.decide``'s cache when no file is named: the decisions in ``entries``."""

    path = None

    def __init__(self, entries: dict):
        self.entries = entries

    def get(self, key: str):
        return self.entries.get(key)

    def put(self, key: str, value) -> None:
        self.entries[key] = value


#: transports ``"auto"`` times only when ``candidates=`` names them: torch's fused ops wait in
#: barriers without a deadline, so a rank that refuses or skips a call leaves its peers waiting
#: for ever instead of raising ``PeerTimeoutError`` (docs/scaling.md)
OPT_IN = ("torch_fused",)


def check_candidates(op: str, transports: tuple, candidates,
                     unavailable: Optional[dict] = None) -> tuple:
    """``candidates`` (None: every transport of ``transports`` not in ``unavailable`` nor in
    ``OPT_IN``) as a tuple in ``transports`` order. ``unavailable``: ``{transport: why it cannot
    run on this world}`` (``PatternContext.unavailable``); naming one of them raises
    :class:`BackendUnavailable` with the reason."""
    unavailable = unavailable or {}
    if candidates is None:
        return tuple(t for t in transports if t not in unavailable and t not in OPT_IN)
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
    if not isinstance(path, str) or not path or os.path.isdir(path):
        raise ValueError(f"{op}: cache_path must be the path of a file, not a directory, got "
                         f"{path!r}")
    return path


def _layout(t) -> tuple:
    """What a tensor brings to the call key: shape, dtype, strides (0 for size-1 dimensions)."""
    if not isinstance(t, torch.Tensor):
        return (type(t).__name__,)  # refused by every transport: it still needs a key
    return (tuple(t.shape), t.dtype,
            tuple(0 if n == 1 else s for n, s in zip(t.shape, t.stride())))


def _call_key(inputs: dict, given: dict) -> tuple:
    """The call key of a call (module docstring), as a tuple: the per-call lookup's key."""
    return (tuple(None if v is None else _layout(v) for v in inputs.values()),
            tuple(sorted((k, _layout(v) if isinstance(v, torch.Tensor) else repr(v))
                         for k, v in given.items())))


def _describe(v):
    """One value of ``_call_key`` as JSON, for the decision's key (``tuning.cache_key``)."""
    if v is None:
        return None
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

    def __init__(self, ctx, timeout_s: Optional[float], unavailable: dict, *, candidates=None,
                 options=None, cache_path=None, iters: int = 10, warmup: int = 2,
                 graph: bool = False, **rest):
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
        if not isinstance(graph, bool):
            raise ValueError(f"{op}: graph must be True or False, got {graph!r}")
        self.graph = graph
        path = _check_path(op, cache_path) or env_file_path(tuning.CACHE_VAR)
        world.check_same(f"{op} transport='auto' settings (candidates, iters, warmup, graph)",
                         (self.candidates, self.iters, self.warmup, self.graph))
        # the name of this planner's decisions in the process group's store, the same on every
        # rank (_exchange), and how many decisions this rank has begun
        self._sync_id = world.broadcast_object(uuid.uuid4().hex if world.rank == 0 else None)
        self._begun = 0
        self._broken: Optional[str] = None
        #: cache key -> decision, for the keys this context measured or found in its file
        self.decisions: dict = {}
        self.cache = tuning.TuningCache(path) if path else MemoryCache(self.decisions)
        self._chosen: dict = {}  # call key (tuple) -> transport: the per-call lookup
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
        given = {k: v for k, v in options.items() if v is not None}
        fast = _call_key(inputs, given)
        if not self._lock.acquire(blocking=False):
            raise concurrent_use(self.ctx.OP, self.ctx.rank)
        try:
            self._check_open()
            transport = self._chosen.get(fast)
            if transport is None:
                transport = self._decide(fast, inputs, given)
            return self.ctx._run(transport, self.impls[transport], inputs, out, given)
        finally:
            self._lock.release()

    def choice(self, inputs: dict, out, options: dict) -> Optional[str]:
        """The transport that runs calls like this one; None while it is not decided."""
        return self._chosen.get(_call_key(inputs, {k: v for k, v in options.items()
                                                   if v is not None}))

    def _takes(self, transport: str, given: dict) -> bool:
        accepted = self.ctx.CALL_OPTIONS.get(transport, {})
        return all(k in accepted and isinstance(v, accepted[k]) for k, v in given.items())

    def _decide(self, fast: tuple, inputs: dict, given: dict) -> str:
        ctx, world, op = self.ctx, self.ctx.world, self.ctx.OP
        if not self.candidates:
            raise RuntimeError(f"{op}: every candidate transport of this context failed out of "
                               f"step with its peers; close it and create a new one")
        cands = tuple(t for t in self.candidates if self._takes(t, given))
        if not cands:
            takes = "; ".join(f"{t}: {', '.join(sorted(ctx.CALL_OPTIONS.get(t, {}))) or 'none'}"
                              for t in self.candidates)
            raise ValueError(f"{op}: no candidate transport takes the per-call options "
                             f"{', '.join(f'{k}={v!r}' for k, v in sorted(given.items()))} "
                             f"(per-call options each candidate takes: {takes})")
        if len(cands) == 1:  # nothing to choose: no timing, nothing cached
            self._chosen[fast] = cands[0]
            return cands[0]
        if stream_capturing(world.device):
            raise RuntimeError(
                f"{op}: transport='auto' has not decided the transport for this call's shapes "
                f"yet, and deciding times every candidate, which graph capture does not allow: "
                f"make one eager call with these shapes before capturing")
        call = {"inputs": {k: _describe(v) for k, v in inputs.items()},
                "options": {k: _describe(v) for k, v in sorted(given.items())}}
        # one key for every rank, from every rank's call: the reduction patterns' K shards may
        # differ across ranks, and ranks sharing a cache file then write the same entries
        calls = self._exchange(call)
        shape = {"call": call if all(c == call for c in calls) else calls, "graph": self.graph,
                 "candidates": {t: repr(sorted(self.options.get(t, {}).items())) for t in cands}}
        dtype = next((v.dtype for v in inputs.values() if isinstance(v, torch.Tensor)), None)
        key = tuning.cache_key(op, shape, dtype, world.world_size, world.facts.name)
        record = tuning.decide(world, key, lambda: self._measure(cands, inputs, given, call),
                               self.cache)
        pick = record.get("transport") if isinstance(record, dict) else None
        if pick not in cands:
            raise RuntimeError(f"{op}: the tuning cache {self.cache.path} holds {record!r} for "
                               f"this call, not one of its candidates {cands}: remove that entry")
        self.decisions[key] = record
        self._chosen[fast] = pick
        return pick

    def _exchange(self, call: dict) -> list:
        """Every rank's ``call`` (the first step of a decision), through the process group's
        store with a deadline rather than a collective: a call new on this rank only (its key
        differs from the one its peers decided: another stride, an optional input only it
        passes) finds its peers running their decided transport instead of joining, and a
        collective would wait for them for ever. This rank then raises
        :class:`PeerTimeoutError` and the planner is out of step (every later call raises);
        the peers' call fails at its own bounded waits."""
        world = self.ctx.world
        if world.world_size == 1:
            return [call]
        import torch.distributed as dist

        n, self._begun = self._begun, self._begun + 1
        prefix = f"portable_overlap/auto/{self._sync_id}/{n}/"
        keys = [prefix + str(q) for q in range(world.world_size)]
        store = dist.distributed_c10d._get_default_store()
        store.set(keys[world.rank], pickle.dumps(call))
        wait_s = max(EXCHANGE_MIN_S, self.timeout_s)
        try:
            store.wait(keys, datetime.timedelta(seconds=wait_s))
        except Exception as e:  # the store's timeout error (its type varies by torch version)
            missing = [q for q, k in enumerate(keys) if not store.check([k])]
            self._broken = (
                f"{self.ctx.OP}: transport='auto' is out of step with its peers: rank(s) "
                f"{missing} did not join the decision of a call new on rank {world.rank}")
            raise PeerTimeoutError(
                f"{self.ctx.OP}: rank {world.rank}: this call's transport is not decided here, "
                f"and rank(s) {missing} did not join its decision within {wait_s:.0f} s: a call "
                f"must be new on every rank or on none, so a call key that differs across ranks "
                f"(shapes, dtypes, strides, optional inputs, per-call options) must change on "
                f"every rank together. This rank's call: {call}. Close the context and make a "
                f"new one. ({type(e).__name__}: {e})") from None
        return [pickle.loads(store.get(k)) for k in keys]

    def _measure(self, cands: tuple, inputs: dict, given: dict, call: dict) -> dict:
        """Collective: every candidate run and timed on this call's inputs (module docstring)."""
        ctx, world, op = self.ctx, self.ctx.world, self.ctx.OP
        # outputs passed as options get scratch tensors too: timing writes nothing of the user's
        opts = {k: torch.empty_like(v) if k in ctx.OUTPUT_OPTIONS and isinstance(v, torch.Tensor)
                else v for k, v in given.items()}
        ms, failed, mine = {}, {}, {}
        for t in cands:
            impl = self.impls[t]

            def run(out, t=t, impl=impl):
                return ctx._run(t, impl, inputs, out, opts)

            def probe(impl=impl, run=run):  # loads kernels, plans; its result is the scratch
                res = run(None)
                impl.synchronize()
                return res if isinstance(res, torch.Tensor) else res[0]

            scratch = self._agreed(t, probe, failed, mine)
            if t in failed:
                continue

            def timed(impl=impl, run=run, scratch=scratch):
                ms_ = tuning.time_call(lambda: run(scratch), world, iters=self.iters,
                                       warmup=self.warmup, graph=self.graph)
                impl.synchronize()
                return ms_

            value = self._agreed(t, timed, failed, mine)
            if t not in failed:
                ms[t] = value
        broken = {t for t in failed if _is_broken(self.impls[t])}
        broken = [t for t in cands if any(t in b for b in world.all_gather_object(broken))]
        for t in broken:
            self._retire(t)
        if not ms:
            errs = [mine[t] for t in cands if t in mine]
            if errs and all(isinstance(e, (ValueError, TypeError)) for e in errs):
                raise errs[0]  # this rank's input was refused: a named transport's error
            raise RuntimeError(f"{op}: no candidate transport could run this call "
                               f"({_text(call)}): " + "; ".join(f"{t}: {failed[t]}" for t in failed)
                               ) from (errs[0] if errs else None)
        for t, why in failed.items():
            later = (" and from every later one (its workspace is out of step with its peers)"
                     if t in broken else "")
            warnings.warn(f"{op}: transport {t!r} raised while transport='auto' timed it for "
                          f"this call ({_text(call)}); it is left out of this decision{later}: "
                          f"{why}", RuntimeWarning, stacklevel=2)
        best = min(ms, key=ms.get)
        if SEQUENTIAL in ms and ms[SEQUENTIAL] <= ms[best] * (1 + TIE):
            best = SEQUENTIAL
        return {"transport": best, "ms": ms, "failed": failed}

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
        self._chosen = {k: t for k, t in self._chosen.items() if t != transport}

    # -- the workspaces --------------------------------------------------------------------------
    @property
    def timeout_s(self) -> float:
        """The longest of the candidates' timeouts: how long a call waits at most before a
        missing peer raises."""
        return max(impl.timeout_s for impl in [*self.impls.values(), *self.retired])

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
        if self._closed:
            return
        self._closed = True
        self._close_all()

    def _close_all(self) -> None:
        first = None
        for impl in [*self.impls.values(), *self.retired]:
            try:
                impl.close()
            except Exception as e:  # the others are still freed
                first = first or e
        if first is not None:
            raise first
