"""What every fused op's context shares: a symmetric heap laid out once, the status board, the
error checks, the handle registry (for torch.library ops) and planning of compiled launches."""
from __future__ import annotations

import functools
import itertools
import math
import operator
import threading
from typing import Callable, Optional, Sequence

import torch

from ..errors import ContextBrokenError, ContextClosedError, ConcurrentUseError
from ..language.host import CTX_CLOCK, descriptor_words, fill_descriptor, name_offset_reports
from ..shmem.heap import SymmetricHeap, heap_bytes
from ..shmem.status import STATUS_TIMEOUT, StatusBoard
from ..world import collective_setup
# shape_tag: the ops import it from here
from .call_tags import (DESCRIBE_WAIT_S, explain_mismatch, publish, shape_tag,  # noqa: F401
                        tag_with)
from .launch import fewer_registers, PlannedLaunch, resident_programs

G_MAX = 1024  # most programs one launch may have (flag slots per peer)
#: the report kind of :meth:`OverlapContext.settle_late_stores`'s waits: past every op's own
#: kinds (1-6: its flags and device checks; the copy-engine transports' 1 and 2), which share
#: the name table (``FLAG_NAMES``) with it
KIND_SETTLED = 31
#: the longest timeout a context takes (the kernels get it in µs as an int32)
MAX_TIMEOUT_S = 1800.0
#: a call's start is kept in units of 2**20 ns: its deadline may come up to 1.05 ms early
#: (``shmem.device.call_deadline``): a timeout below 10 ms would give up at once or early
MIN_TIMEOUT_S = 0.01

_contexts: dict = {}
# handles are never reused: a stale one (captured in a compiled graph) must not reach a newer
# context
_handles = itertools.count(1)
_lock = threading.Lock()


def check_timeout(op: str, timeout_s) -> float:
    """``timeout_s`` as a float in [MIN_TIMEOUT_S, MAX_TIMEOUT_S], or a ValueError naming the
    op."""
    try:
        t = float(timeout_s)
    except (TypeError, ValueError):
        raise ValueError(f"{op}: timeout_s must be a number of seconds, got "
                         f"{timeout_s!r}") from None
    if not (math.isfinite(t) and MIN_TIMEOUT_S <= t <= MAX_TIMEOUT_S):
        raise ValueError(f"{op}: timeout_s must be in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}] "
                         f"seconds, got {timeout_s!r}")
    return t


def stream_capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is being captured into a CUDA graph."""
    if device.type == "cpu":
        return False
    return bool(torch.get_device_module(device).is_current_stream_capturing())


def check_sizes(op: str, **sizes) -> None:
    """Each of ``sizes`` (a context's bounds: ``max_n=...``) must be an int >= 1, not a bool
    (``True`` would pass for 1): else a ``ValueError`` naming it."""
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{op}: {name} must be an int >= 1, got {v!r}")


def is_bool(v) -> bool:
    """Whether ``v`` is a boolean of any kind: a Python bool, a NumPy bool or a bool tensor
    (``operator.index`` takes a 0-d bool tensor as 0 or 1, so a mask passed for a size would
    pass as one)."""
    dtype = getattr(v, "dtype", None)
    return isinstance(v, bool) or dtype is torch.bool or getattr(dtype, "kind", None) == "b"


def exact_int(v):
    """``v`` as an integer: an int (a SymInt, the traced value of one, kept as it is: looking
    into it would fix a compiled graph to its value), a NumPy int or an integer tensor of one
    element; None for a bool of any kind (``True`` would pass for 1). A float raises
    ``TypeError``, as ``operator.index`` does: it is not rounded."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, torch.SymInt)):
        return v
    return None if is_bool(v) else operator.index(v)


def check_transport(op: str, transport, transports: Sequence[str]) -> str:
    """``transport`` if it is one of ``transports``, else a clear error."""
    if transport not in transports:
        raise ValueError(f"{op}: transport must be one of {tuple(transports)}, got "
                         f"{transport!r}")
    return transport


def mark_closed(owner, lock, timeout_s: float, op: str, rank: int) -> bool:
    """Set ``owner._closed`` under ``lock`` (the guard its calls hold), once a call another
    thread is making has ended: its kernels would otherwise run on a workspace that is gone
    (emulated ranks: every rank crashed); a call that starts after this finds it closed. Waits
    past the call's own deadline (``timeout_s``), with room for the interpreter's slower host
    work, then raises :class:`ConcurrentUseError`. Whether this call closed it (False: it was
    closed already)."""
    wait_s = max(120.0, 3 * timeout_s)
    if not lock.acquire(timeout=wait_s):
        raise ConcurrentUseError(
            f"{op}: close() on rank {rank} waited {wait_s:.0f} s for a call that another "
            f"thread is making on this context; close it once that thread's calls have ended")
    try:
        if owner._closed:
            return False
        owner._closed = True
        return True
    finally:
        lock.release()


#: under Triton's interpreter (CPU-emulated ranks), the thread whose call is under way in this
#: process and how many of its contexts' calls it holds (nested calls: a planner's, a layer's)
_TURN = {"thread": None, "depth": 0}
_TURN_LOCK = threading.Lock()


def take_interpreter_turn(op: str, rank: int) -> None:
    """The process's turn for a call of a context on CPU-emulated ranks. Triton's interpreter
    is not thread-safe (it patches ``triton.language`` for the length of a launch, and the grid
    index it hands programs is global): two threads' launches at once failed with an
    ``InterpreterError`` that broke the context, and could hand one launch's programs the
    other's indices. So one thread's calls at a time in a process, whatever their contexts;
    another thread's call meanwhile raises :class:`ConcurrentUseError` before it starts."""
    me = threading.get_ident()
    with _TURN_LOCK:
        if _TURN["thread"] not in (None, me):
            raise ConcurrentUseError(
                f"{op}: another thread of rank {rank} is making a call: on CPU-emulated ranks "
                f"Triton's interpreter runs one thread's calls at a time per process (any "
                f"context); make the calls from one thread there (on GPUs, a context per "
                f"thread is enough)")
        _TURN["thread"] = me
        _TURN["depth"] += 1


def end_interpreter_turn() -> None:
    with _TURN_LOCK:
        _TURN["depth"] -= 1
        if _TURN["depth"] == 0:
            _TURN["thread"] = None


def concurrent_use(op: str, rank: int) -> ConcurrentUseError:
    """The error of a call made while another thread's call on the same context runs."""
    return ConcurrentUseError(
        f"{op}: this context is already running a call in another thread on rank {rank}; a "
        f"context serves one thread at a time (calls from two threads would reach the ranks in "
        f"different orders): give each thread its own context")


def refuse_grad(op: str, *tensors) -> None:
    """Raise where autograd would record a call of an op that has no backward (a tensor input
    requires grad and grad mode is on): its result would carry no gradient at all, a silent
    error in training."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in tensors):
        raise RuntimeError(f"{op} has no backward, and an input requires grad: call it under "
                           f"torch.no_grad() (inference) or pass detached tensors")


def collective_call(method):
    """Wrap an op's call method (see :class:`OverlapContext`): refuse a closed or broken context
    and a second thread, and turn an exception raised before the call's first launch into a
    refusal its peers hear of (``OverlapContext._refuse``), so every rank fails the same call."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        # A workspace called in a function torch.compile traces (``ctx.kernel()(...)``, not
        # through its op): dynamo would trace into the guards and launches with fake tensors
        # (the lock's acquire is a graph break, the launch after it fails, the call counted
        # half done breaks the context). Run eagerly, as a graph break; ~30 ns per eager call
        if torch.compiler.is_dynamo_compiling():
            return torch.compiler.disable(call)(self, *args, **kwargs)
        if self.checking_only:  # a planner's input check before its agreement (``checking_only``):
            return method(self, *args, **kwargs)  # nothing launched, counted or told to peers
        # ``run_collective`` for one context, unrolled: the decode path calls it every step
        self._enter_call()
        try:
            out = method(self, *args, **kwargs)
        except BaseException as e:
            self._abandon_call(e)
            self._delivered = False
            raise
        finally:
            # (``_release_call`` inline: the decode path's host time)
            if self._interpreted:
                end_interpreter_turn()
            self._guard.release()
        if self._sync_errors:  # the interpreter ran the call already: raise with this call
            self.check()
        self._delivered = True
        return out

    return call


def run_collective(contexts: Sequence, fn: Callable, args: tuple = (),
                   kwargs: Optional[dict] = None):
    """``fn(*args, **kwargs)`` as one call of every context in ``contexts`` (``collective_call``
    for one; several where one op's launches use the workspaces of several contexts): their
    guards, then the call; an exception refuses the call on every one of them (or marks a
    context broken where its launches had begun). Under the interpreter, which has run the
    call when ``fn`` returns, each context's errors are raised after it, the first context's
    first: list the context whose faults cause the others' first."""
    entered = []
    try:
        for ctx in contexts:
            ctx._enter_call()
            entered.append(ctx)
    except BaseException:
        for ctx in entered:
            ctx._release_call()
        raise
    try:
        out = fn(*args, **(kwargs or {}))
    except BaseException as e:
        for ctx in contexts:
            ctx._abandon_call(e)
            ctx._delivered = False  # (after the refusal: it tells of the call before this one)
        raise
    finally:
        for ctx in contexts:
            ctx._release_call()
    errors = []
    for ctx in contexts:
        if ctx._sync_errors:  # the interpreter ran the call already: raise with this call
            try:
                ctx.check()
            except Exception as e:
                errors.append(e)
                continue
        ctx._delivered = True
    if errors:
        raise errors[0]
    return out


def refuse_call(contexts: Sequence, error: BaseException) -> None:
    """Raise ``error``, found by a check made before the call reached its contexts (an op's
    wrapper), as one refused call of each context in ``contexts``: their peers fail that same
    call instead of waiting for this rank (``run_collective``)."""
    if torch.compiler.is_dynamo_compiling():
        # an op's wrapper traced by torch.compile (an input that requires grad): traced, the
        # refusal's flag kernels ran on fake tensors (on emulated ranks, backend "aot_eager",
        # a segfault; backend "eager": the error, then a context broken for good). Eager, as
        # a graph break
        return torch.compiler.disable(refuse_call)(contexts, error)

    def fail():
        raise error

    run_collective(contexts, fail)


def refuse_grad_as_call(op: str, tensors, contexts: Sequence) -> None:
    """``refuse_grad(op, *tensors)`` made before the call reached its contexts, raised as a
    refused call of those of ``contexts`` that are contexts (``refuse_call``), so the peers fail
    this same call at once; with none (a context not settled yet) on this rank alone."""
    try:
        refuse_grad(op, *tensors)
    except RuntimeError as e:
        contexts = [c for c in contexts if isinstance(c, ContextBase)]
        if contexts:
            refuse_call(contexts, e)
        raise


def wrap_init_outside_inference(cls) -> None:
    """Make the ``__init__`` that ``cls`` defines (if any) run outside
    ``torch.inference_mode``. A context made under it (a serving process that builds its model
    in that mode) would otherwise hold inference tensors, which torch refuses to update in
    place outside the mode: the copy-engine and host-collective transports' buffers then
    raised at the first call made outside it, and a transport that reaches a collective first
    left its peers waiting there until the timeout."""
    init = cls.__dict__.get("__init__")
    if init is None or getattr(init, "outside_inference", False):
        return

    @functools.wraps(init)
    def outside(self, *args, **kwargs):
        with torch.inference_mode(False):
            init(self, *args, **kwargs)

    outside.outside_inference = True
    cls.__init__ = outside


def wrap_collective_init(cls) -> None:
    """Make the ``__init__`` that ``cls`` defines (if any) a
    :func:`~portable_overlap.world.collective_setup`: a check of its arguments that fails on
    one rank raises on every rank, not only there while the peers wait in the argument
    agreement (``World.check_same``) until the process group's timeout."""
    init = cls.__dict__.get("__init__")
    if init is not None and not getattr(init, "collective_setup", False):
        cls.__init__ = collective_setup(init)


class ContextBase:
    """What every context shares, whatever moves its data: the op name in its errors, a checked
    ``timeout_s``, the Triton interpreter on the CPU backend, a handle for the torch.library ops
    (never reused), and the guards of a call: a closed context raises
    :class:`ContextClosedError`, a broken one (out of step with its peers) raises
    :class:`ContextBrokenError`, and a call while another thread's call runs raises
    :class:`ConcurrentUseError` (calls from two threads would reach the ranks in different
    orders). A subclass calls ``super().__init__`` first and :meth:`register` last."""

    OP = "op"
    #: set by the planner (``transport="auto"``, ``planner.NamedAgreement``) around a call of a
    #: transport whose waits have no deadline (``planner.UNBOUNDED``), or of the first call of
    #: a shape that agrees on its plan (``planner.PLAN_CHECKED``): the call checks its input,
    #: raising as it would, and returns before its first collective (``collective_call`` takes
    #: no guard and tells the peers nothing), so this rank's refusal reaches its peers through
    #: the planner's agreement before any of them waits in the collective library
    checking_only = False
    #: whether a call can be captured in a CUDA graph: False for a transport that reads data on
    #: the host at every call, which ``transport="auto"`` then times in plain calls only
    capturable = True
    #: whether making the context meets the peers in a host collective on every rank (an
    #: argument agreement, the heap's allocation): each ``__init__`` of the class is then a
    #: ``collective_setup``, so that a check of its arguments that fails on one rank raises on
    #: every rank (a context that meets no collective, the plain path's, leaves it off: its
    #: refusal would have no collective of its peers to go to)
    collective_init = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.collective_init:
            wrap_collective_init(cls)
        wrap_init_outside_inference(cls)

    def __init__(self, world, timeout_s: float):
        self.timeout_s = check_timeout(self.OP, timeout_s)
        self.timeout_us = int(self.timeout_s * 1e6)
        if world.backend.name == "cpu":
            from ..backends.cpu import require_interpreter

            require_interpreter(self.OP)
        self.world = world
        self.rank = world.rank
        self._broken: Optional[str] = None
        self._closed = False
        self._guard = threading.Lock()
        self._interpreted = world.backend.name == "cpu"  # (Triton's interpreter runs it)
        self._sync_errors = False  # whether a call's errors are known when it returns
        # whether the last call returned without an error (a refusal's flag tag: refuse_kernel)
        self._delivered = True
        self._stream = None  # the stream of the last call (_follow_stream): (raw handle, stream)

    #: whether autograd records the module call the next calls are part of
    #: (``PatternContext.records_grad`` sets it): the fused transports' calls carry it in their
    #: flags' tag (``call_tag``)
    records_grad = False
    #: the layer's count of its path changes (``PatternContext.call_salt`` sets it): the fused
    #: transports' calls carry it in their flags' tag (``call_tag``); 0 outside a layer
    call_salt = 0

    def call_tag(self, tag: int) -> int:
        """The tag a call of a plan tagged ``tag`` carries: the plan's fields and, where
        autograd records the call, ``records_grad=True`` (``call_tags.tag_with``), so ranks
        that differ in it raise ``RankMismatchError`` in that call (the module's backward holds
        collectives on every rank: ranks that differ would wait there for ever); and where a
        layer set it, its ``call_salt`` (a layer that runs several ops by the input's rows
        counts its changes of op, so a rank whose call pairs with a peer's call of another
        step, which went to another op on one of them, is caught: ``RowParallelLinear``).
        ``tag`` itself otherwise, so the call costs two attribute reads."""
        grad, salt = self.records_grad, self.call_salt
        if not grad and not salt:
            return tag
        tags = self.__dict__.setdefault("_call_tags", {})
        got = tags.get((tag, grad, salt))
        if got is None:
            if len(tags) >= 4096:  # (a layer that changes op at every step: a new salt each)
                tags.clear()
            more = {"records_grad": True} if grad else {}
            if salt:
                more["op_changes"] = salt
            got = tags[(tag, grad, salt)] = tag_with(tag, **more)
        return got

    def register(self) -> None:
        """Give the context its handle (the torch.library ops' way to name it)."""
        self.handle = register_context(self)

    def capturing(self) -> bool:
        """Whether the caller's stream is being captured into a CUDA graph."""
        return stream_capturing(self.world.device)

    def check(self) -> None:
        """Raise if this context is closed or broken (out of step with its peers)."""
        self._check_open()
        self._check_broken()

    def synchronize(self) -> None:
        """Wait for this rank's queued calls, then :meth:`check`."""
        self._check_open()
        self.world.backend.synchronize(self.world.device)
        self.check()

    def _check_broken(self) -> None:
        if self._broken is not None:
            raise ContextBrokenError(f"{self.OP} context on rank {self.rank} failed before and is "
                                     f"out of step with its peers; close it and create a new "
                                     f"one. First error:\n{self._broken}")

    def close(self) -> None:
        """Collective (every rank). Closing twice does nothing; any call after it raises
        :class:`ContextClosedError`. Subclasses free their workspace after this."""
        if self._closed or not mark_closed(self, self._guard, self.timeout_s, self.OP,
                                           self.rank):
            return
        unregister_context(self.handle)
        # the calls queued on any stream end before the workspace goes back to the allocator
        # (kept tensors return to the default stream's cache: portable_overlap/kept.py)
        self.world.backend.synchronize(self.world.device)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()  # collective, as close() is: every rank leaves the block

    def _check_open(self) -> None:
        if self._closed:
            raise ContextClosedError(f"{self.OP}: this context was closed on rank {self.rank}; "
                                     f"create a new one")

    def _enter_call(self) -> None:
        """A call's guards (``collective_call``): open, one thread, not broken."""
        self._check_open()
        if self._interpreted:
            self._acquire_call()
        elif not self._guard.acquire(blocking=False):  # (inline: the decode path's host time)
            raise concurrent_use(self.OP, self.rank)
        try:
            self._check_open()  # (closed by another thread while this one took the guard)
            self._before_call()
            self._follow_stream()
        except BaseException:
            self._release_call()
            raise

    def _acquire_call(self) -> None:
        """This context's guard for one call (another thread's call under way: raise), and
        under the interpreter the process's turn (``interpreter_turn``)."""
        if not self._guard.acquire(blocking=False):
            raise concurrent_use(self.OP, self.rank)
        if self._interpreted:
            try:
                take_interpreter_turn(self.OP, self.rank)
            except BaseException:
                self._guard.release()
                raise

    def _release_call(self) -> None:
        if self._interpreted:
            end_interpreter_turn()
        self._guard.release()

    def _before_call(self) -> None:
        self.check()

    def _follow_stream(self) -> None:
        """Order this call after the last one where the caller changed streams.

        A context's calls share its workspace and its call counter, which its kernels read and
        advance on the device: two calls running at once (made on two streams with nothing
        ordering them) would both take the same call number and write the same buffers, and
        the peers could pair one rank's first call with another's second. So the calls run in
        the order the host makes them, whatever stream each is made on: where the stream
        changes, the new one waits for what the old one holds so far (the last call included).
        A call on the stream of the last one costs a handle compare. Not where either stream
        is being captured into a graph: a captured stream cannot wait for work outside its
        capture (the graph's replay is then ordered by the stream it is replayed on, as any
        captured work is), and a wait queued behind a capture would enter that graph."""
        device = self.world.device
        raw = self.world.backend.current_stream(device)
        last = self._stream
        if raw is None or (last is not None and last[0] == raw):
            return
        module = torch.get_device_module(device)
        stream = module.current_stream(device)
        self._stream = (raw, stream)
        if last is None or module.is_current_stream_capturing():
            return
        with module.stream(last[1]):
            if module.is_current_stream_capturing():
                return
        stream.wait_stream(last[1])

    def _abandon_call(self, error: BaseException) -> None:
        """The call raised (``collective_call``); what the peers must hear of it."""


class OverlapContext(ContextBase):
    """Base of the ops' contexts. ``layout`` lists the heap buffers ``(attribute, shape, dtype)``;
    they are allocated in that order, so every rank gets the same offsets. Collective to create
    and to :meth:`close`; calls must come in the same order on every rank (on any streams: each
    runs after the last one, ``ContextBase._follow_stream``).

    How calls stay matched across ranks:

    - every call is numbered (the epoch, kept in the heap) and its flags carry that number and
      a tag of its shapes, so a peer that called with other shapes is caught at the first flag;
    - a call that this rank refuses before launching anything (bad input) still counts: its
      number is used up and every peer's waits for it end with the failure tag, so the peers
      raise for that same call instead of pairing their next call with it;
    - every wait ends at the call's deadline (``timeout_s`` after the call's first wait that
      found its flag missing began, on this rank), reported as :class:`PeerTimeoutError`. A
      timeout leaves the ranks out of step (a rank skipped or lost a call): the context is then
      broken for good, on the device at once and on the host at its next check, and must be
      closed. Other failures (a peer gave up, shapes
      differ, bad routing, a refused call) raise for that call and leave the context usable;
    - a context is used by one thread at a time: a call while another thread's call is running
      raises :class:`ConcurrentUseError` (calls from two threads would reach the ranks in
      different orders);
    - on GPUs, errors found by a kernel are raised at the next check (the next call, or
      :meth:`synchronize`), naming the call; under the CPU interpreter, by the call itself.
    """

    OP = "op"
    collective_init = True  # the heap's allocation
    #: report kind -> flag name, for kernels that report ``(kind << 32) | index``
    FLAG_NAMES: dict = {}
    #: heap buffer -> flag name, for kernels of the device API (reports by heap offset; a
    #: buffer not listed is named by its attribute)
    FLAG_LABELS: dict = {}

    def __init__(self, world, layout: Sequence[tuple], timeout_s: float):
        super().__init__(world, timeout_s)
        # the device API's descriptor (portable_overlap.language): kernels written on that API
        # take ``self.ctx`` (its words 0-1 count calls); the others take ``call_clock``, its
        # words 2-3: [0] the current call's start (shared deadline), [1] the epoch of a
        # timed-out call
        layout = [("ctx", (descriptor_words(world.world_size),), torch.int64), *layout]
        self.heap = SymmetricHeap(world, heap_bytes([(s, d) for _, s, d in layout]),
                                  owner=f"{self.OP} context")
        self.heap.set_up(f"{self.OP} context", lambda: self._set_up_heap(layout))
        self._plans: dict = {}
        self._launched = False
        self._refusal: list = []  # (planned launch, arguments) per flag array: call_protocol
        self._late_plan = None  # the wait of settle_late_stores: late_stores_guard
        self._refuse_plans: dict = {}
        self._sync_errors = world.backend.name == "cpu"  # the interpreter runs synchronously
        self.register()

    def _set_up_heap(self, layout: Sequence[tuple]) -> None:
        """This rank's part of the set-up on the heap (``SymmetricHeap.set_up``): the buffers
        of ``layout``, the status board (host memory the device writes), the descriptor."""
        for name, shape, dtype in layout:
            setattr(self, name, self.heap.alloc(shape, dtype))
        self.call_clock = self.ctx[CTX_CLOCK:CTX_CLOCK + 2]
        self.status = StatusBoard(self.world.backend, G_MAX)
        fill_descriptor(self.ctx, self.heap, self.world.rank, self.timeout_us,
                        self.status.address)
        # the flag arrays a device-API kernel's reports name by heap offset
        self._flag_regions = [(self.heap.offset_of(getattr(self, n)), getattr(self, n).nbytes,
                               self.FLAG_LABELS.get(n, n)) for n, _, d in layout[1:]
                              if d == torch.int64 and getattr(self, n).numel()]

    def call_protocol(self, epoch: torch.Tensor, call_flags: Sequence[torch.Tensor] = (),
                      free_flags: Sequence[torch.Tensor] = ()) -> None:
        """Declare what a refused call must stand in for (``_refuse``): ``epoch`` is the heap
        word whose first element counts finished calls, ``call_flags`` the ``[world, slots]``
        flag arrays peers wait on for a call's results, ``free_flags`` the ``[world]`` arrays
        that tell peers this rank's buffers may be written again. The refusal's kernels are
        compiled and loaded here, not when a call is refused: a first launch may wait for the
        device, which a stream held by a value wait never releases (backends.base)."""
        from ..transports.flag_kernels import refuse_kernel

        W = self.world.world_size
        steps = [(t, i == 0, False) for i, t in enumerate(call_flags)]
        steps += [(t, not call_flags and i == 0, True) for i, t in enumerate(free_flags)]
        self._refusal = []
        for flags, advance, free in steps:
            args = (epoch, flags, flags.numel() // W, self.heap.bases, self.rank, W,
                    self.status.address, self.call_clock)
            plan = self._refuse_plans.get((advance, free))
            if plan is None:  # one compiled kernel per variant: no argument is specialized
                plan = self._refuse_plans[(advance, free)] = self._compile(
                    refuse_kernel, 1, dict(ADVANCE=advance, FREE=free, BLOCK=G_MAX, num_warps=4,
                                           num_stages=1), lambda g, a=args: (*a, 1))
            self._refusal.append((plan, args))

    def late_stores_guard(self, consumed: Optional[torch.Tensor], name: str,
                          epoch: Optional[torch.Tensor] = None) -> None:
        """Declare how a peer tells this rank that its stores of a call into this rank's heap
        have landed, for :meth:`settle_late_stores`; ``name`` names it in a timeout report.
        ``consumed``: the ``[world]`` words each peer sets in this rank's heap at the end of its
        last kernel of a call (its last program, after every store of that call into this
        rank's heap; ``pol.end_call_consumed``, ``shmem.device.end_call_free``); ``None``: the
        peers' call counters themselves, read through the heap (kernels that end with
        ``pol.end_call``, whose programs count out after their stores). ``epoch``: the heap
        word whose first element counts the calls, as given to :meth:`call_protocol` (default:
        the descriptor's, ``self.ctx``). The wait's kernel is compiled here, as the refusal's
        are."""
        from ..transports.flag_kernels import counter_wait_kernel, wait_kernel

        if KIND_SETTLED in self.FLAG_NAMES:  # a report of the op's own would be misnamed
            raise RuntimeError(f"{self.OP}: report kind {KIND_SETTLED} is taken by "
                               f"{self.FLAG_NAMES[KIND_SETTLED]!r}; move KIND_SETTLED")
        ctl = self.ctx if epoch is None else epoch
        self.FLAG_NAMES = {**self.FLAG_NAMES, KIND_SETTLED: name}
        if consumed is None:  # peer q's counter reached the call this rank's stands at
            kernel, consts = counter_wait_kernel, {}
            self._late_args = lambda q, what: (ctl, self.heap.bases, self.rank, q,
                                               self.call_clock, self.timeout_us,
                                               self.status.address, q, what)
        else:  # q's word holds the call the counter stands at: the undelivered one
            kernel, consts = wait_kernel, dict(CHECK_TAG=False)
            self._late_args = lambda q, what: (consumed[q:], q, ctl, 0, 0, self.call_clock,
                                               self.timeout_us, self.status.address, q, what)
        self._late_plan = self._compile(kernel, 1, dict(num_warps=1, num_stages=1, **consts),
                                        lambda g: self._late_args(0, 1 << 33))

    def settle_late_stores(self) -> None:
        """At the start of a call (``_before_call``, before anything of the call is queued)
        that follows one this rank did not deliver (refused on the host, or raised): hold the
        stream (bounded, one-program waits) until every peer is done with that call, its
        kernel ended or it refused the call too. A refusal frees
        this rank's buffers for the peers' next call at once, and a failed call stops waiting at
        its first failed flag, but a peer late to that call still stores its data into them;
        with other shapes it lands where the next call's data goes: a wrong result without an
        error. After a delivered call there is nothing to wait for (its waits saw every peer's
        stores of it). Needs :meth:`late_stores_guard` first. The waits store nothing and
        count no call: a call that raises after them is still refused, not half done."""
        if self._delivered:
            return
        for q in range(self.world.world_size):
            if q != self.rank:
                self._late_plan.run_untracked(self._late_args(q, (KIND_SETTLED << 32) | q))

    # -- errors ----------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise if a kernel of this context reported a failure (see the class docstring).
        Reads host-visible memory only while nothing failed; on a failure it waits for the
        device, so every program of the failed call has reported before the board is read."""
        self._check_broken()
        if not self.status.failed():
            return
        self.world.backend.synchronize(self.world.device)
        timed_out = self.status.has(STATUS_TIMEOUT)
        for tag in self.status.own_tags():  # for a peer that explains a mismatch of this call
            publish(self.world, tag, self.OP)
        names = {**self.FLAG_NAMES, **name_offset_reports(self.status, self._flag_regions)}
        try:
            self.status.raise_if_failed(self.OP, self.rank, names,
                                        explain=self._explain_mismatch)
        except Exception as e:
            self._delivered = False
            if timed_out:
                self._broken = str(e)
            else:  # the ranks are still in step: the next call may go on
                self.status.clear()
            raise

    def _explain_mismatch(self, pairs: dict) -> str:
        """Which ranks called with other shapes and what each passed (``call_tags``)."""
        return explain_mismatch(self.world, self.OP, self.rank, pairs,
                                min(self.timeout_s, DESCRIBE_WAIT_S))

    def close(self) -> None:
        """Collective (every rank): free the workspace once all ranks' calls have finished.
        Closing twice does nothing; any call after it raises :class:`ContextClosedError`."""
        if self._closed:
            return
        super().close()
        self.heap.close()

    # -- the call's guards -----------------------------------------------------------------------
    def _before_call(self) -> None:
        if self._broken is not None or self.status.failed():
            self.check()
        self._launched = False
        if self._late_plan is not None:  # the op stores into its peers (late_stores_guard)
            self.settle_late_stores()

    def _abandon_call(self, error: BaseException) -> None:
        """The call raised. Before its first launch: refuse it on the device too (``_refuse``),
        so the peers fail this call and stay in step. After a launch the call is half done and
        peers may wait for what never comes: the context is broken."""
        if self._launched or not self._refusal or self.capturing():
            # (a refusal captured into a CUDA graph would refuse at every replay)
            if self._launched:
                self._broken = (f"{self.OP}: rank {self.rank} raised in the middle of a call "
                                f"({type(error).__name__}: {error})")
            return
        try:
            self._refuse()
        except Exception as e:  # the device itself failed: nothing can be told to the peers
            self._broken = (f"{self.OP}: rank {self.rank} could not tell its peers it refused a "
                            f"call ({type(e).__name__}: {e})")

    def _refuse(self) -> None:
        """Count a call that never launched and end every peer's wait for it (see
        ``refuse_kernel``): one small launch per flag array, planned by ``call_protocol``."""
        for plan, args in self._refusal:
            plan.run_untracked((*args, int(self._delivered)))

    # -- planning --------------------------------------------------------------------------------
    def _compile(self, kernel, programs: int, consts: dict,
                 make_args: Callable[[int], tuple], more_resident: bool = False) -> PlannedLaunch:
        """Compile ``kernel`` for the launch's own arguments (``make_args(programs)``; the JIT
        specializes on values) and cap the grid at what is resident on the device. With
        ``more_resident``, registers are capped where that fits more programs per SM without a
        spill (``fewer_registers``)."""
        facts = self.world.facts
        if facts.vendor == "cpu":  # the interpreter has no compiled kernel to hold on to
            return PlannedLaunch(kernel, None, programs, consts, None, owner=self)
        k = kernel.warmup(*make_args(programs), grid=(programs,), **consts)
        if more_resident:
            k, cap = fewer_registers(
                lambda n: kernel.warmup(*make_args(programs), grid=(programs,), **consts,
                                        maxnreg=n), k, consts["num_warps"], facts)
            if cap is not None:
                consts = dict(consts, maxnreg=cap)
        fit = min(programs, resident_programs(k, consts["num_warps"], facts))
        if fit != programs:  # the grid size is an argument too: compile for the real one
            programs = fit
            k = kernel.warmup(*make_args(programs), grid=(programs,), **consts)
        backend, device = self.world.backend, self.world.device
        return PlannedLaunch(kernel, k, programs, consts, lambda: backend.current_stream(device),
                             owner=self)


def register_context(ctx) -> int:
    """A handle under which torch.library ops find ``ctx`` (``get_context``); never reused.
    The table holds ``ctx`` until its ``close()``: freed by garbage collection, which runs on
    each rank at its own moment, its heap would not be freed by every rank together."""
    with _lock:
        handle = next(_handles)
        _contexts[handle] = ctx
    return handle


def unregister_context(handle: int) -> None:
    with _lock:
        _contexts.pop(handle, None)


def get_context(handle: int) -> OverlapContext:
    try:
        return _contexts[handle]
    except KeyError:
        raise ContextClosedError(f"no open portable_overlap context with handle {handle} (closed, "
                                 f"or made in another process)") from None


def output_tensor(op: str, out: Optional[torch.Tensor], shape: Sequence[int],
                  like: torch.Tensor, inputs: Optional[dict] = None,
                  name: str = "out") -> torch.Tensor:
    """The op's result tensor: ``out`` (the tensor the op writes, called ``name``) after checking
    it is a contiguous tensor of ``shape`` with ``like``'s dtype and device that shares no memory
    with ``inputs`` (name -> tensor or None, ``check_no_overlap``) and, in grad mode, does not
    require grad; or a new one when ``out`` is None.

    Contiguous, not merely with contiguous rows: a tensor whose rows overlap (an expanded one,
    stride(0) < its row length) would have every row written into the same memory. Requiring
    grad is refused as torch refuses it for its own ``out=`` ops: the written tensor would carry
    no gradient, and an in-place epilogue on a leaf that requires grad would raise only after the
    call's first launch, leaving its peers waiting."""
    shape = tuple(shape)
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != shape or out.dtype != like.dtype or out.device != like.device \
            or not out.is_contiguous():
        raise ValueError(f"{op}: {name} must be a contiguous {like.dtype} {list(shape)} tensor "
                         f"on {like.device}; got {out.dtype} {list(out.shape)} on {out.device}"
                         + ("" if out.is_contiguous() else
                            f" (not contiguous: strides {tuple(out.stride())})"))
    if out.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{op} has no backward, and {name} requires grad: pass an {name} tensor "
                         f"that does not require grad, or call it under torch.no_grad()")
    check_no_overlap(op, out, inputs or {}, name=name)
    return out


def _byte_span(t: torch.Tensor) -> Optional[tuple]:
    """``[first, last + 1)`` byte addresses ``t``'s elements can occupy (None when empty)."""
    if t.numel() == 0:
        return None
    lo = hi = t.data_ptr()
    for n, s in zip(t.shape, t.stride()):
        step = (n - 1) * s * t.element_size()
        lo, hi = (lo, hi + step) if s >= 0 else (lo + step, hi)
    return lo, hi + t.element_size()


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges of ``a`` and ``b`` intersect (counted high: two strided views that
    interleave without touching the same element count too)."""
    if a.device != b.device:
        return False
    sa, sb = _byte_span(a), _byte_span(b)
    return sa is not None and sb is not None and sa[0] < sb[1] and sb[0] < sa[1]


def check_no_overlap(op: str, out: torch.Tensor, inputs: dict, name: str = "out") -> None:
    """A ValueError when ``out`` (the tensor the op writes, called ``name``) shares memory with
    one of ``inputs`` (name -> tensor or None). Every transport writes its result while inputs
    are still being read: tiles of the result while other programs read the same operand rows
    (a persistent GEMM or GEMV), peers' partial rows staged in ``out`` before the residual is
    added (the copy-engine GEMM + AllReduce), an in-place epilogue ``out += residual`` after
    the product landed in ``out`` (GEMM + All-to-All); an aliased input then yields wrong
    numbers with no error (measured on emulated ranks: relative errors of 0.3 to 18). Checked
    on the host from addresses only: no device work, no sync."""
    for what, t in inputs.items():
        if isinstance(t, torch.Tensor) and shares_memory(out, t):
            raise ValueError(f"{op}: {name} shares memory with the input {what}; pass a separate "
                             f"{name} tensor (the op reads its inputs while it writes {name})")


def align_key(*tensors: torch.Tensor) -> tuple:
    """What a compiled kernel assumes about its pointers (16-byte alignment): part of plan keys."""
    return tuple(t.data_ptr() % 16 for t in tensors)
