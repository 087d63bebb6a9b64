"""Contexts of the patterns that more than one transport implements (AllGather + GEMM,
GEMM + ReduceScatter, GEMM + AllReduce, GEMM + All-to-All): the user makes one context per
pattern and names the transport, or passes ``transport="auto"``; the context owns the
workspaces and forwards calls, checks and closing to them.

The transport is fixed when the context is made because each one's workspace (symmetric
buffers, flags, streams, process groups) is collective to create and cannot be made inside a
call. With ``"auto"`` the context makes every candidate's workspace and picks one per call key at
that key's first eager call, by timing them all on its inputs (``planner.py``)."""
from __future__ import annotations

import contextlib

from typing import Optional

import torch

from ..errors import BackendUnavailable
from .context import (check_sizes, check_timeout, refuse_call, refuse_grad,
                      refuse_grad_as_call, register_context, unregister_context,
                      wrap_collective_init)
from .planner import AUTO, PLANNER_OPTIONS, NamedAgreement, TransportPlanner


def transport_unavailable(world, transport: str, op: Optional[str] = None) -> Optional[str]:
    """Why ``transport`` of the public op ``op`` (None: of any op) cannot run on ``world``, None
    where it can: the one place that decides it from this rank alone. Only ``"torch_fused"``
    depends on more than the backend (``ops/torch_fused.py``: GPU worlds of one host, a torch
    with the op's torch ops). ``"shmem"`` is listed as able to run: whether a SHMEM library is
    usable is found by its constructor on every rank together (``shmem.providers.
    agreed_put_provider``: ``ShmemUnavailable`` on every rank), since a rank that decided alone
    could leave its peers in the library's collective allocation; ``"auto"`` of the ops that
    have it takes it only when named (``AUTO_CANDIDATES``)."""
    if transport == "torch_fused":
        from .torch_fused import unavailable_reason

        return unavailable_reason(world, op)
    return None


#: named transports whose calls agree as ``"auto"``'s do (``planner.NamedAgreement``) on a world
#: of more than one rank: their data moves only in the collective library's matched calls
#: (``"signal_collective"``: a rank that refused a call on the host would leave its peers'
#: collectives to pair with its next call's, a wrong result without an error), or their first
#: call of a shape agrees on its plan in a host collective (``"signal_copy_engine"``: a rank
#: refusing that call would leave its peers in it). The costs: an agreement per eager call of
#: ``"signal_collective"`` (host time only, none in a graph replay), and per new shape of
#: ``"signal_copy_engine"``
AGREED = ("signal_collective", "signal_copy_engine")
#: ``AGREED`` of the GEMM patterns (``MatmulPattern``, AllGather + GEMM): ``"sequential"`` as
#: well. Its collective matches calls by byte count alone: on 2 emulated ranks a rank that
#: refused a call left its peer in gloo until the process group's timeout, ranks whose operands
#: differed in size aborted in gloo, and ranks whose operands differed in shape with the same
#: element count (a [2, 6] shard beside a [3, 4] one) returned wrong results with no error on
#: every rank. The cost is the agreement's host time at each eager call (none in a graph
#: replay), as ``"auto"``'s decided ``"sequential"`` calls pay
GEMM_AGREED = AGREED + ("sequential",)


class PatternContext:
    """Base of the multi-transport pattern contexts. A subclass sets ``OP`` (the public op
    name), ``TRANSPORTS`` (names; the first is the default on CPU-emulated ranks),
    ``CALL_OPTIONS`` and ``OUTPUT_OPTIONS``, and defines ``_make(world, transport, timeout_s,
    **options)`` returning the transport's workspace, ``_bind(*args, **kwargs)`` turning a
    call's arguments into ``(inputs, out, options)`` (``inputs``: the tensors by name, in the
    op schema's order) and ``_run(transport, workspace, inputs, out, options)`` running one
    call on a workspace.

    ``transport``: one of ``TRANSPORTS``, or ``"auto"``: the context makes the workspace of
    every candidate and, at the first eager call of each call key (shapes, dtypes, strides,
    which optional inputs are given, the per-call options), times every candidate on that
    call's inputs and keeps the fastest for every later call with that key; ``"sequential"`` is
    kept unless a fused transport beats it by more than 3 % (``planner.py`` says how).
    ``transport=None`` (the default) is :meth:`default_transport`: ``"auto"`` on a GPU world.
    Options of ``"auto"``:

    - ``candidates``: the transports it chooses from (default: those of ``AUTO_CANDIDATES``,
      else of ``TRANSPORTS``, that can run on this world);
    - ``options``: each candidate's own options, ``{transport: {option: value}}`` (e.g.
      ``options={"copy_engine": {"pieces": 8}}``); a candidate not named gets its defaults.
      A transport's options given directly (``pieces=8``) are refused with ``"auto"``, since
      the other candidates do not take them;
    - ``cache_path``: a JSON file that keeps the decisions across processes (default:
      ``$PORTABLE_OVERLAP_TUNING_CACHE`` if set, else the decisions stay in memory);
    - ``iters`` (10), ``warmup`` (2): timed and untimed runs per candidate; ``graph`` (None):
      time plain calls and CUDA-graph replays, the replays' pick running the calls made under
      graph capture and the plain calls' pick the others; ``True`` / ``False``: time replays
      only / plain calls only, one pick for every call.

    A transport that cannot run on the context's world (:meth:`unavailable`: ``"torch_fused"``
    on the CPU-emulated backend) raises :class:`~portable_overlap.errors.BackendUnavailable`
    when named, as ``transport=`` or in ``candidates=``, and is left out of ``"auto"``'s default
    candidates.

    Per-call options (``CALL_OPTIONS``: per transport, each option's name and type) restrict an
    ``"auto"`` call to the candidates that take them. ``ctx.transport`` stays ``"auto"``;
    :meth:`choice` and :attr:`decisions` show what was picked."""

    OP = "op"
    TRANSPORTS: tuple = ()
    #: transport -> {per-call option: the type(s) it takes}; a transport not listed takes none
    CALL_OPTIONS: dict = {}
    #: per-call options that are outputs (an ``"auto"`` timing writes a scratch tensor instead)
    OUTPUT_OPTIONS: tuple = ()
    #: what ``"auto"`` chooses from unless ``candidates=`` says otherwise (those of them that can
    #: run on the world); None: every transport that can
    AUTO_CANDIDATES: Optional[tuple] = None
    #: the op table's entry of this context's op (``registry.define`` sets it): what a call of
    #: the context traced by ``torch.compile`` runs (``_as_op``)
    op_spec = None
    #: the named transports whose calls agree first (``AGREED``, ``GEMM_AGREED``)
    AGREED_TRANSPORTS: tuple = AGREED
    #: whether a named transport's call refuses per-call options it does not take as a refused
    #: call (``check_options``), for contexts whose ``__call__`` passes any keyword on
    CHECKS_OPTIONS = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        wrap_collective_init(cls)

    def __init__(self, world, transport: Optional[str], timeout_s: Optional[float], options):
        if transport is None:
            transport = self.default_transport(world, options)
        if transport != AUTO and transport not in self.TRANSPORTS:
            raise ValueError(f"{self.OP}: transport must be one of {self.TRANSPORTS} or "
                             f"{AUTO!r}, got {transport!r}")
        if timeout_s is not None:
            check_timeout(self.OP, timeout_s)
        # the ranks' first host collective: the availability below may meet them in another
        # (where the ranks run, World.placement), which must not pair with this one
        world.check_same(f"{self.OP} transport", transport)
        self.world, self.rank, self.transport = world, world.rank, transport
        unavailable = self.unavailable(world)
        if transport == AUTO and "candidates" not in options \
                and self.AUTO_CANDIDATES is not None:
            options = {**options, "candidates": tuple(t for t in self.AUTO_CANDIDATES
                                                      if t not in unavailable)}
        if transport in unavailable:
            raise BackendUnavailable(f"{self.OP}: transport {transport!r} cannot run here: "
                                     f"{unavailable[transport]}")
        self.impl, self.planner = None, None
        self._records_grad = False
        self._call_salt = 0
        if transport == AUTO:
            self.planner = TransportPlanner(self, timeout_s, unavailable, **options)
        else:
            misplaced = sorted(set(options) & set(PLANNER_OPTIONS))
            if misplaced:
                what = "is an option" if len(misplaced) == 1 else "are options"
                raise ValueError(f"{self.OP}: {', '.join(misplaced)} {what} of "
                                 f"transport={AUTO!r}, not of transport={transport!r}")
            if transport in self.AGREED_TRANSPORTS and world.world_size > 1:
                self.planner = NamedAgreement(self, timeout_s, unavailable, transport, options)
                self.impl = self.planner.impls[transport]
            else:
                self.impl = self._make(world, transport, timeout_s, **options)
        self.handle = register_context(self)

    @classmethod
    def default_transport(cls, world, options=()) -> str:
        """What a context made without ``transport=`` runs: ``"auto"``, except on CPU-emulated
        ranks made without any of ``"auto"``'s options, where it is ``TRANSPORTS[0]``: there the
        Triton interpreter runs every kernel, its timings say nothing of a GPU's, and timing
        every candidate would multiply the cost of each new shape's first call by their number.
        A transport's own options (``pieces=``, ``direction=``, ``config=``) with no transport
        named are refused on every backend: they would bind the context to one transport on
        CPU ranks and have no transport to go to under ``"auto"`` on a GPU."""
        own = sorted(set(options) - set(PLANNER_OPTIONS))
        if own:
            what = "is an option" if len(own) == 1 else "are options"
            raise ValueError(
                f"{cls.OP}: {', '.join(own)} {what} of a named transport: name it "
                f"(transport= one of {cls.TRANSPORTS}), or give {AUTO!r} "
                f"options={{transport: {{option: value}}}}")
        if world.backend.name == "cpu" and not options:
            return cls.TRANSPORTS[0]
        return AUTO

    @classmethod
    def unavailable(cls, world) -> dict:
        """``{transport: why it cannot run on world}`` for the transports of ``TRANSPORTS`` that
        cannot (``transport_unavailable``); the others are the ones ``"auto"`` chooses from by
        default. On a GPU world the first question meets every rank in a host collective
        (where the ranks run, ``World.placement``): ask on every rank, or after a context was
        made."""
        why = {t: transport_unavailable(world, t, cls.OP) for t in cls.TRANSPORTS}
        return {t: w for t, w in why.items() if w is not None}

    @classmethod
    def available(cls, world) -> tuple:
        """The transports of ``TRANSPORTS`` that can run on ``world``, in that order."""
        unavailable = cls.unavailable(world)
        return tuple(t for t in cls.TRANSPORTS if t not in unavailable)

    def workspace(self, transport: str):
        """The workspace of ``transport`` that this context holds: the named transport's, or
        ``"auto"``'s candidate of that name; None where it has none."""
        if self.planner is None:
            return self.impl if self.transport == transport else None
        return self.planner.impls.get(transport)

    def _make(self, world, transport, timeout_s, **options):
        raise NotImplementedError

    def refuse_own_options(self, transport: str, options: dict, what: str, names: str) -> None:
        """For a pattern whose transports take no options of their own (``what``, set by the
        context's arguments ``names``, is every transport's): a ``ValueError`` for any."""
        if options:
            raise ValueError(f"{self.OP}: transport {transport!r} takes no options of its own; "
                             f"got {sorted(options)} ({what} is the context's: {names})")

    def _bind(self, *args, **kwargs) -> tuple:
        raise NotImplementedError

    def _run(self, transport: str, impl, inputs: dict, out, options: dict):
        raise NotImplementedError

    def _matched(self, inputs: dict) -> Optional[dict]:
        """What every rank's call must have in common for the collective to match, whatever
        may differ across ranks (a reduction's K shard): the sizes it moves, by name. None
        where the inputs are not what the op takes (its transports' checks say why)."""
        raise NotImplementedError

    def _matched_call(self, inputs: dict, options: dict) -> Optional[dict]:
        """``_matched`` of a call with its per-call options (a pattern whose collective moves
        sizes given as options, such as a batch split, reads them here)."""
        return self._matched(inputs)

    def _call_shares(self, inputs: dict, options: dict) -> Optional[dict]:
        """What ``"auto"``'s agreements compare across the ranks: ``_matched_call``, and
        ``records_grad`` where it is set (a call autograd records on some ranks only is
        refused on every rank)."""
        matched = self._matched_call(inputs, options)
        if matched is not None and self._records_grad:
            matched = {**matched, "records_grad": True}
        return matched

    @property
    def records_grad(self) -> bool:
        """Whether autograd records the module call the next calls are part of (the library's
        modules set it around their forward; False otherwise). The backward of such a call
        holds collectives on every rank, so ranks that differ in it would leave the recording
        ones waiting there for ever: the fused transports carry it in their flags' tag and
        ``"auto"`` in its agreements, and ranks that differ raise ``RankMismatchError`` in
        that call, on every rank, as do the named transports whose calls agree first
        (``AGREED_TRANSPORTS``: the GEMM patterns' ``"sequential"`` among them). The named
        ``"torch_fused"`` transport, and ``"sequential"`` of the other ops, make no agreement
        (``docs/reliability.md``)."""
        return self._records_grad

    @records_grad.setter
    def records_grad(self, value: bool) -> None:
        self._records_grad = bool(value)
        self._set_on_workspaces("records_grad", self._records_grad)

    @property
    def call_salt(self) -> int:
        """A number the fused transports' calls carry in their flags' tag (0: none), which a
        layer sets before each call: ``RowParallelLinear`` runs GEMV + AllReduce or a GEMM op
        by each rank's own rows and sets its count of changes between them, so that where
        ranks' rows fall on both sides of the GEMV's 64 rows, a rank's call that pairs with a
        peer's call of another step raises ``RankMismatchError`` instead of returning a sum
        over two steps (``ContextBase.call_tag``). Not in ``"auto"``'s call keys (no new
        timing per change); ``"sequential"`` and ``"torch_fused"`` carry no tag."""
        return self._call_salt

    @call_salt.setter
    def call_salt(self, value: int) -> None:
        self._call_salt = int(value)
        self._set_on_workspaces("call_salt", self._call_salt)

    def _set_on_workspaces(self, name: str, value) -> None:
        """``name = value`` on every transport's workspace of this context (the one named, or
        each candidate of ``"auto"``): what their calls' tags carry (``ContextBase.call_tag``)."""
        impls = self.planner.impls.values() if self.planner is not None else [self.impl]
        for impl in impls:
            setattr(impl, name, value)

    @contextlib.contextmanager
    def recording(self):
        """The calls inside carry ``records_grad=True`` (a module's forward that autograd
        records); False again after them, as before them, for the calls that follow."""
        self.records_grad = True
        try:
            yield
        finally:
            self.records_grad = False

    def _key_inputs(self, inputs: dict) -> dict:
        """The inputs as ``"auto"``'s call key sees them (``planner._call_key``): as they are,
        except where a pattern keys a jagged input by its dtype alone (``planner.Jagged``)."""
        return inputs

    def _dispatch(self, inputs: dict, out, options: dict):
        """One call: on the named transport's workspace with the options as given, or on the
        transport ``"auto"`` picked for the call's key. An input that requires grad is refused
        (``check_grad``): the ops of these patterns have no backward."""
        # Traced by dynamo (``ctx(a, b)`` inside a torch.compile'd function), the call would be
        # traced into: its host counters, cached plans and launches run on fake tensors (on
        # emulated ranks an InterpreterError that broke the context for good). The op's torch
        # op is one opaque node instead. is_dynamo_compiling, not is_compiling: dynamo folds
        # both to True, and this one costs an eager call ~30 ns (is_compiling ~80 ns; a
        # torch.compiler.disable wrapper ~400 ns), measured on CPU with a tight loop; a whole
        # eager call (GemvAllReduce "sequential", 1 emulated rank) took ~8 µs with or without
        # it, the difference within the noise
        if torch.compiler.is_dynamo_compiling():
            return self._as_op(inputs, out, options)
        self.check_grad(inputs, options)
        if options and self.planner is None and self.CHECKS_OPTIONS \
                and self.transport not in self.AGREED_TRANSPORTS:  # (those check their own)
            self.check_options(inputs, options)
        self.check_sizes(inputs, options)
        inputs = self._nonempty_k(inputs)
        if self.planner is None:
            return self._run(self.transport, self.impl, inputs, out, options)
        return self.planner(inputs, out, options)

    def _as_op(self, inputs: dict, out, options: dict):
        """The call of ``inputs`` (in the op schema's order, without the handle), ``out`` and
        ``options`` as the op's public function makes it (``OpSpec.__call__``): under
        ``torch.compile`` the torch op, or a graph break around the eager call where ``out`` or
        a per-call option is given."""
        if out is not None:
            options = {**options, "out": out}
        return self.op_spec(self, tuple(inputs.values()), **options)

    def check_options(self, inputs: dict, options: dict) -> None:
        """A named transport whose calls do not agree first (``AGREED_TRANSPORTS``) given a
        per-call option it does not take (``CALL_OPTIONS``: by name and type; an option given
        as None is not given), refused with a ValueError (as ``"auto"`` and ``"sequential"``
        refuse one) as this call's refusal on every rank (:meth:`refuse`).
        The transport's own method raised a TypeError on this rank alone, before the call
        reached its workspace: on 2 emulated ranks (``"stores"`` GEMM + AllReduce given
        ``config=`` on rank 0) the peer's call then paired with rank 0's next call and returned
        with that call's data, no error, and the peer's next call timed out."""
        takes = self.CALL_OPTIONS.get(self.transport, {})
        for name, value in options.items():
            if value is None:
                continue
            if name not in takes:
                known = ", ".join(sorted(takes)) or "none"
                error = ValueError(f"{self.OP}: the {self.transport!r} transport takes no "
                                   f"per-call option {name}={value!r} (its per-call options: "
                                   f"{known})")
            elif not isinstance(value, takes[name]):
                error = ValueError(f"{self.OP}: the per-call option {name} of the "
                                   f"{self.transport!r} transport must be "
                                   f"{_type_names(takes[name])}, got {type(value).__name__}")
            else:
                continue
            self._refuse(inputs, options, error)

    def check_sizes(self, inputs: dict, options: dict) -> None:
        """The context's own limits on a call, checked after :meth:`check_grad` and refused
        the same way (:meth:`refuse`); none here."""

    def _nonempty_k(self, inputs: dict) -> dict:
        """The inputs an eager call runs on: as given here (see ``MatmulPattern``)."""
        return inputs

    def check_grad(self, inputs: dict, options: dict) -> None:
        """``refuse_grad`` of the call's tensors (the result would carry no gradient: a silent
        error in training), raised as a refused call of the workspace that would run it
        (``refuse_grad_as_call``), so its peers fail this same call at once instead of waiting for
        this rank until their timeout; with ``"auto"``, where the call's key is not decided or its
        transport's waits have no deadline, through the call's agreement
        (``TransportPlanner.refuse``). A tensor option the op reads (an RMSNorm's
        ``rms_weight``, any option not in ``OUTPUT_OPTIONS``) is an input here too: its gradient
        would be lost the same way."""
        for t in inputs.values():  # (the common case first, building nothing: every call)
            if getattr(t, "requires_grad", False):
                break
        else:
            if not options:
                return
        tensors = [*inputs.values(), *(v for k, v in options.items()
                                       if k not in self.OUTPUT_OPTIONS
                                       and isinstance(v, torch.Tensor))]
        if not any(getattr(t, "requires_grad", False) for t in tensors):
            return  # (no workspace lookup)
        # traced, a refusal runs eagerly (refuse_call); under no_grad nothing is refused, and
        # a graph break there would fail a fullgraph compile of a module's inference call
        if torch.compiler.is_dynamo_compiling() and torch.is_grad_enabled():
            return torch.compiler.disable(self.check_grad)(inputs, options)
        planner = getattr(self, "planner", None)  # (none on a context not made in full)
        if planner is None:
            refuse_grad_as_call(self.OP, tensors, (getattr(self, "impl", None),))
            return
        try:
            refuse_grad(self.OP, *tensors)
        except RuntimeError as e:
            planner.refuse(inputs, options, e)

    def refuse(self, error: BaseException, *args, **kwargs) -> None:
        """Raise ``error``, found by a caller's own check of a call of this op with these
        arguments (a module checking its input before it calls the op), as that call's
        refusal, which the peers hear of: a refused call of the named transport's workspace
        (``refuse_call``), or ``"auto"``'s refusal (``TransportPlanner.refuse``). The peers
        then fail the same call at once instead of waiting for this rank until their timeout,
        which would break the context. Raises ``error``, or the context's own error where it
        is closed or broken."""
        inputs, _, options = self._bind(*args, **kwargs)
        self._refuse(inputs, options, error)

    def _refuse(self, inputs: dict, options: dict, error: BaseException) -> None:
        """:meth:`refuse` of a call's bound inputs and options."""
        if self.planner is None:
            refuse_call([self.impl], error)
        self.planner.refuse(inputs, options, error)
        raise error

    def choice(self, *args, **kwargs) -> Optional[str]:
        """The transport that runs a call with these arguments (the call's own) made now: the
        named one, or ``"auto"``'s pick (under graph capture, the pick for captured calls),
        None while that is not decided (before the key's first call). A named transport is
        its own choice, also where its calls agree first (``AGREED``)."""
        if self.transport != AUTO:
            return self.transport
        return self.planner.choice(*self._bind(*args, **kwargs))

    def choices(self, *args, **kwargs) -> Optional[dict]:
        """``{"plain": transport, "captured": transport}``: what runs a call with these
        arguments made eagerly and under graph capture (the named transport for both, or
        ``"auto"``'s two picks; None while they are not decided)."""
        if self.transport != AUTO:
            return {"plain": self.transport, "captured": self.transport}
        return self.planner.choices(*self._bind(*args, **kwargs))

    @property
    def decisions(self) -> dict:
        """``"auto"``'s measured decisions: cache key (JSON: the op, the call, the candidates,
        the device, the versions) -> ``{"transport": pick, "ms": {candidate: slowest rank's
        median}, "failed": {candidate: each rank's error}}``, with ``"captured": {"transport",
        "ms"}`` (the graph replays' pick and times) where both timing modes ran; empty with a
        named transport."""
        return {} if self.planner is None else dict(self.planner.decisions)

    @property
    def timeout_s(self) -> float:
        """How long the transport's waits last before a missing peer raises (seconds; with
        ``"auto"`` the longest of the candidates')."""
        return (self.planner or self.impl).timeout_s

    def check(self) -> None:
        """Raise an error a kernel of an earlier call recorded (see OverlapContext.check); with
        ``"auto"``, of every candidate's workspace."""
        (self.planner or self.impl).check()

    def synchronize(self) -> None:
        """Wait for this context's work on the device (every workspace's), then :meth:`check`."""
        (self.planner or self.impl).synchronize()

    def close(self) -> None:
        """Free the workspaces (collective: every rank closes)."""
        unregister_context(self.handle)
        (self.planner or self.impl).close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        more = f", candidates={self.planner.candidates}" if self.transport == AUTO else ""
        return (f"{type(self).__name__}(rank={self.rank}/{self.world.world_size}, "
                f"transport={self.transport!r}{more})")


class MatmulPattern(PatternContext):
    """A GEMM pattern's context: sized by the largest result, ``max_m`` x ``max_n`` (the full
    product's rows and columns), from which each transport sizes its own buffers."""

    AGREED_TRANSPORTS = GEMM_AGREED
    CHECKS_OPTIONS = True

    def __init__(self, world, max_m: int, max_n: int, *, transport: Optional[str] = None,
                 timeout_s: Optional[float] = None, **options):
        check_sizes(self.OP, max_m=max_m, max_n=max_n)
        self.max_m, self.max_n = max_m, max_n
        super().__init__(world, transport, timeout_s, options)

    def check_sizes(self, inputs: dict, options: dict) -> None:
        """A result larger than ``max_m`` x ``max_n`` in either dimension is refused before
        any transport sees it, as this call's refusal on every rank (:meth:`refuse`): each
        transport sizes its buffers its own way (some by element count), and the context's
        limit must not depend on which one runs."""
        sizes = self._matched(inputs)
        if sizes is not None and (sizes["M"] > self.max_m or sizes["N"] > self.max_n):
            self._refuse(inputs, options, ValueError(
                f"{self.OP}: an [{sizes['M']}, {sizes['N']}] result exceeds this context's "
                f"max_m x max_n = {self.max_m} x {self.max_n}"))

    def _nonempty_k(self, inputs: dict) -> dict:
        """An empty K shard (``a`` [M, 0], ``b`` [0, N], N >= 1, one dtype and device) as
        zeros [M, 1] and [1, N]: torch's ``[M, 0] @ [0, N]`` is zeros, and each rank's K is its
        own in these patterns (only the products move, keyed by M, N and the dtype), so the
        call stays matched with peers whose K shards are not empty: a rank with no K columns
        adds zeros to the reduction (a row-parallel layer's K split unevenly), or sends zero
        rows. Every transport then runs it unchanged (the tilings take K >= 1). The cost:
        M + N zeros made, only in such a call. Anything else passes as given, for the
        transports' checks."""
        a, b = inputs.get("a"), inputs.get("b")
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dim() == 2 and b.dim() == 2 and a.shape[1] == 0 and b.shape[0] == 0
                and b.shape[1] > 0 and a.dtype == b.dtype and a.device == b.device):
            return inputs
        return {**inputs, "a": a.new_zeros((a.shape[0], 1)), "b": b.new_zeros((1, b.shape[1]))}

    def _matched(self, inputs: dict) -> Optional[dict]:
        """The product's rows and columns and the dtype: what the collective moves (each
        rank's K may differ)."""
        return matrix_sizes(
            lambda a, b: {"M": a.shape[0], "N": b.shape[1], "dtype": str(a.dtype)},
            inputs["a"], inputs["b"])

    def _matched_call(self, inputs: dict, options: dict) -> Optional[dict]:
        """``_matched``, and the per-call ``config`` where one is given: the signal transports
        plan their collectives from it (the wave groups, or ``partition="tune"``'s tuning) in
        host collectives without a deadline. Ranks whose configs differed there waited for
        ever (2 emulated ranks: a rank tuning while its peer ran the call), or kept decisions
        of different keys that no later call could match."""
        sizes = self._matched(inputs)
        if sizes is None or options.get("config") is None:
            return sizes
        return {**sizes, "config": repr(options["config"])}


def _type_names(types) -> str:
    """``int``, or ``int or float`` for a tuple of types: an option's types in words."""
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join(t.__name__ for t in types)


def matrix_sizes(read, *tensors) -> Optional[dict]:
    """``read(*tensors)``, or None where they are not matrices (tensors of two dimensions)."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in tensors):
        return None
    return read(*tensors)


def timeout_kw(timeout_s: Optional[float]) -> dict:
    """``timeout_s`` as a keyword for a transport's workspace, or nothing (its own default)."""
    return {} if timeout_s is None else {"timeout_s": timeout_s}
